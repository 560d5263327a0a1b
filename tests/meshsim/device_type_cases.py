"""torch device-type test classes on meshsim.testing's bases, read by test_device_type_tests.py.

``instantiate_device_type_tests`` wraps every test in a function that reads ``self.precision``
and ``self.rel_tol`` first: values torch keeps in a class-level ``threading.local``, set in the
thread that imported the class. Each rank thread must see them, and the overrides, as torch's
own threaded bases give them.
"""

from __future__ import annotations

import threading

import torch
import torch.distributed as dist
from torch.testing._internal.common_device_type import (
    dtypes,
    instantiate_device_type_tests,
    precisionOverride,
    tol,
    toleranceOverride,
)
from torch.testing._internal.common_utils import TestCase

from meshsim.testing import DTensorOpTestBase, MultiThreadedTestCase

SEEN: dict[str, list[tuple[int, float, float, str]]] = {}  # test -> (rank, precision, rel_tol, thread)
_LOCK = threading.Lock()


def _note(test: TestCase, name: str) -> None:
    with _LOCK:
        SEEN.setdefault(name, []).append(
            (dist.get_rank(), test.precision, test.rel_tol, threading.current_thread().name)
        )


class OnThreadedBase(MultiThreadedTestCase):
    """The default precision, and both overrides (torch instantiates a class's own tests only)."""

    @property
    def world_size(self) -> int:
        return 2

    def setUp(self) -> None:
        super().setUp()
        self._spawn_threads()

    def test_default(self, device: str) -> None:
        _note(self, f"{type(self).__name__}.default")  # type: ignore[arg-type]

    @precisionOverride({torch.float32: 0.125})
    @dtypes(torch.float32)
    def test_precision_override(self, device: str, dtype: torch.dtype) -> None:
        _note(self, f"{type(self).__name__}.precision")  # type: ignore[arg-type]

    @toleranceOverride({torch.float32: tol(atol=0.25, rtol=0.5)})
    @dtypes(torch.float32)
    def test_tolerance_override(self, device: str, dtype: torch.dtype) -> None:
        _note(self, f"{type(self).__name__}.tolerance")  # type: ignore[arg-type]


class OnDTensorOpBase(DTensorOpTestBase):
    @property
    def world_size(self) -> int:
        return 2

    test_default = OnThreadedBase.__dict__["test_default"]
    test_precision_override = OnThreadedBase.__dict__["test_precision_override"]
    test_tolerance_override = OnThreadedBase.__dict__["test_tolerance_override"]


instantiate_device_type_tests(OnThreadedBase, globals(), only_for="cpu")
instantiate_device_type_tests(OnDTensorOpBase, globals(), only_for="cpu")
