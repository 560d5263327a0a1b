"""meshsim.testing: torch's distributed unittest bases on simulated ranks, seen through unittest's API."""

from __future__ import annotations

import subprocess
import sys
import unittest
from pathlib import Path

import pytest
import torch
from torch.testing._internal.distributed._tensor import common_dtensor

import meshsim.testing

from . import testing_cases as cases

LINE_RAISE = next(
    number
    for number, line in enumerate(Path(cases.__file__).read_text().splitlines(), 1)
    if 'raise KeyError("only rank 2")' in line
)


def run(case: type[unittest.TestCase], name: str) -> tuple[unittest.TestCase, unittest.TestResult]:
    test = case(name)
    result = unittest.TestResult()
    test.run(result)
    return test, result


def outcome(result: unittest.TestResult) -> tuple[int, int, int, int]:
    """(failures, errors, skipped, expected failures) of a result."""
    return len(result.failures), len(result.errors), len(result.skipped), len(result.expectedFailures)


def test_exports() -> None:
    assert sorted(meshsim.testing.__all__) == meshsim.testing.__all__
    torchs = {"requires_gloo", "skip_if_lt_x_gpu", "skip_if_no_gpu", "skip_unless_torch_gpu"}  # re-exported
    for name in meshsim.testing.__all__:
        module = getattr(meshsim.testing, name).__module__
        expected = "torch.testing._internal." if name in torchs else "meshsim._"
        assert module.startswith(expected), (name, module)
    assert "testing" not in meshsim.__all__


def test_the_bases_derive_from_torchs_test_case() -> None:
    from torch.testing._internal.common_utils import TestCase

    for base in (meshsim.testing.MultiThreadedTestCase, meshsim.testing.DTensorTestBase):
        assert issubclass(base, TestCase)


def test_each_rank_has_its_own_rank_and_set_up_runs_once_in_the_caller() -> None:
    test, result = run(cases.Ranks, "test_rank_and_world_size")
    assert result.wasSuccessful(), result.errors + result.failures
    expected = [(r, r, 4) for r in range(4)] + [(r, -1, -1) for r in range(4)]  # body, then perThreadTearDown
    assert sorted(test.seen, key=lambda s: (s[1] == -1, s[0])) == expected  # type: ignore[attr-defined]
    assert test.main_rank == -1 and test.rank == -1  # type: ignore[attr-defined]


@pytest.mark.parametrize(
    ("case", "name"),
    [
        (cases.Ranks, "test_all_gather"),
        (cases.Ranks, "test_per_thread_hooks"),
        (cases.Failures, "test_assert_raises_on_ranks"),
        (cases.Failures, "test_cleanup_runs_on_the_rank"),
        (cases.DTensors, "test_collectives_and_dtensor"),
        (cases.DTensors, "test_with_comms_called"),
        (cases.DTensors, "test_without_with_comms"),
        (cases.OpBase, "test_mesh"),
    ],
    ids=lambda v: v if isinstance(v, str) else v.__name__,
)
def test_passes(case: type[unittest.TestCase], name: str) -> None:
    _, result = run(case, name)
    assert result.wasSuccessful(), result.errors + result.failures
    assert result.testsRun == 1 and outcome(result) == (0, 0, 0, 0)


def test_a_failing_ranks_exception_is_reported_as_itself() -> None:
    _, result = run(cases.Failures, "test_rank_2_raises")
    assert outcome(result) == (0, 1, 0, 0)
    (report,) = [text for _, text in result.errors]
    assert "KeyError: 'only rank 2" in report
    assert f'testing_cases.py", line {LINE_RAISE}, in test_rank_2_raises' in report  # the rank's traceback
    assert "meshsim/_" not in report  # without meshsim's own frames
    assert "raised on rank 2 of a 3-rank meshsim world" in report


def test_an_assertion_on_a_rank_is_a_failure() -> None:
    _, result = run(cases.Failures, "test_assertion_fails_on_rank_1")
    assert outcome(result) == (1, 0, 0, 0)
    assert "raised on rank 1 of a 3-rank meshsim world" in result.failures[0][1]


def test_an_outer_assert_raises_sees_the_ranks_exception_type() -> None:
    with pytest.raises(KeyError, match="only rank 2"):
        cases.Failures("test_rank_2_raises").debug()


def test_expected_failure() -> None:
    _, result = run(cases.Failures, "test_expected_failure")
    assert outcome(result) == (0, 0, 0, 1)


def test_subtests_on_ranks_are_reported_per_rank_and_the_ranks_go_on() -> None:
    _, result = run(cases.Subtests, "test_subtests")
    assert [str(test) for test, _ in result.failures] == [
        "test_subtests (tests.meshsim.testing_cases.Subtests.test_subtests) (i=1, rank=1)"
    ]
    assert "rank 1 fails i=1" in result.failures[0][1]
    assert [(str(test), reason) for test, reason in result.skipped] == [
        (
            "test_subtests (tests.meshsim.testing_cases.Subtests.test_subtests) [message] (j=0, rank=0)",
            "rank 0 skips j=0",
        )
    ]
    assert result.errors == []


def test_nested_subtests_merge_their_parameters() -> None:
    _, result = run(cases.Subtests, "test_nested")
    assert [str(test).split(") ", 1)[1] for test, _ in result.failures] == ["(outer=1, inner=2, rank=1)"]


@pytest.mark.parametrize(
    ("name", "reason"),
    [
        ("test_unittest_skip_on_rank_1", "rank 1 has nothing to do (rank 1)"),
        ("test_pytest_skip", "skipped with pytest (rank 0)"),
        ("test_needs_gpus", "{multi-gpu-2} (rank 0)"),  # torch's own text for that skip
    ],
)
def test_a_skip_on_a_rank_skips_the_test(name: str, reason: str) -> None:
    if name == "test_needs_gpus" and torch.cuda.device_count() >= 2:
        pytest.skip("this machine has the GPUs the test asks for")
    if reason.startswith("{multi-gpu-2}"):
        from torch.testing._internal.common_distributed import TEST_SKIPS

        key = "multi-device-2" if "multi-device-2" in TEST_SKIPS else "multi-gpu-2"  # renamed in 2.15
        reason = reason.replace("{multi-gpu-2}", TEST_SKIPS[key].message)
    _, result = run(cases.Skips, name)
    assert outcome(result) == (0, 0, 1, 0)
    assert result.skipped[0][1] == reason


def test_dtensor_bases_answer_as_torchs() -> None:
    test = cases.DTensors("test_without_with_comms")
    assert (test.world_size, test.rank) == (common_dtensor.NUM_DEVICES, -1)
    accelerator = torch.accelerator.current_accelerator()
    per_rank = accelerator is not None and torch.accelerator.device_count() >= test.world_size
    assert test.device_type == (accelerator.type if per_rank and accelerator else "cpu")
    assert test.backend == torch.distributed.get_default_backend_for_device(test.device_type)
    assert test.is_local_tensor_enabled is False
    op = cases.OpBase("test_mesh")
    assert (op.world_size, op.device_type) == (common_dtensor.NUM_DEVICES, common_dtensor.DEVICE_TYPE)
    assert cases.Ranks("test_all_gather").world_size == 4


def test_run_subtests_reports_each_combination_per_rank() -> None:
    _, result = run(cases.DTensors, "test_run_subtests")
    assert result.wasSuccessful(), result.errors + result.failures


def test_init_pg_refuses_a_backend_torch_refuses() -> None:
    class Case(meshsim.testing.DTensorTestBase):
        world_size = 2

        def test_it(self) -> None:
            self.init_pg(eager_init=False, backend="no-such-backend")

    with pytest.raises(RuntimeError, match="Backend no-such-backend not supported!"):
        Case("test_it").debug()


def test_a_bad_world_size_is_named() -> None:
    with pytest.raises(ValueError, match=r"BadWorldSize.world_size must be a positive int, got 0"):
        cases.BadWorldSize("test_nothing").debug()


MODULE = """
import unittest
import torch.distributed as dist
from meshsim.testing import MultiThreadedTestCase

class Case(MultiThreadedTestCase):
    world_size = 2

    def test_passes(self):
        dist.barrier()

    def test_fails(self):
        self.assertEqual(self.rank, 0)

    def test_skips(self):
        self.skipTest("not here")

    def test_subtests(self):
        for i in range(2):
            with self.subTest(i=i):
                self.assertEqual(i, 0)
"""


def test_plain_unittest_runner(tmp_path: Path) -> None:
    (tmp_path / "torch_style.py").write_text(MODULE)
    done = subprocess.run(
        [sys.executable, "-m", "unittest", "-v", "torch_style"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert "FAILED (failures=3, skipped=1)" in done.stderr, done.stderr
    assert "test_subtests (torch_style.Case.test_subtests) (i=1, rank=0)" in done.stderr
    assert "test_subtests (torch_style.Case.test_subtests) (i=1, rank=1)" in done.stderr
    assert "raised on rank 1 of a 2-rank meshsim world" in done.stderr


def test_under_pytest(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(torch_style=MODULE)
    result = pytester.runpytest_subprocess("torch_style.py", "-p", "no:cacheprovider", "-rs")
    result.assert_outcomes(passed=2, failed=3, skipped=1)  # pytest counts failed subtests as failed
    result.stdout.fnmatch_lines(
        [
            "*_ Case.test_subtests (i=1, rank=0) _*",
            "*_ Case.test_subtests (i=1, rank=1) _*",
            "SKIPPED * not here (rank 0)",
        ]
    )
