"""torch's device-type tests (instantiate_device_type_tests) on meshsim.testing's bases: every rank
sees the precision and tolerances torch keeps per thread, with their overrides."""

from __future__ import annotations

import threading
import unittest

import pytest
from torch.testing._internal.common_utils import TestCase

from . import device_type_cases as cases

DEFAULT = (TestCase._precision, TestCase._rel_tol)


@pytest.mark.parametrize("base", ["OnThreadedBaseCPU", "OnDTensorOpBaseCPU"])
@pytest.mark.parametrize(
    ("test", "key", "expected"),
    [
        ("test_default_cpu", "default", DEFAULT),
        ("test_precision_override_cpu_float32", "precision", (0.125, TestCase._rel_tol)),
        ("test_tolerance_override_cpu_float32", "tolerance", (0.25, 0.5)),
    ],
    ids=["default", "precisionOverride", "toleranceOverride"],
)
def test_every_rank_reads_the_precision_torch_keeps_per_thread(
    base: str, test: str, key: str, expected: tuple[float, float]
) -> None:
    case = getattr(cases, base)(test)
    result = unittest.TestResult()
    case.run(result)
    assert (result.errors, result.failures) == ([], [])
    seen = sorted(cases.SEEN.pop(f"{base}.{key}"))
    assert [(rank, precision, rel_tol) for rank, precision, rel_tol, _ in seen] == [
        (0, *expected),
        (1, *expected),
    ]
    assert all(thread != threading.main_thread().name for *_, thread in seen)  # in the rank threads
