"""meshsim.run raises a skip or xfail its ranks give, as the plugin reports them (issue 24, item 3).

When no rank failed and one skipped (``pytest.skip``, ``pytest.importorskip``,
``unittest.SkipTest``) or xfailed (``pytest.xfail``), ``run`` raises that rank's own
exception, so a plain test calling it is reported as skipped or xfailed, as the same
body is under ``@pytest.mark.world``; a failure on any rank wins.
"""

from __future__ import annotations

import textwrap
import unittest
from collections.abc import Callable

import pytest
import torch.distributed as dist

import meshsim

pytestmark = pytest.mark.filterwarnings("ignore::FutureWarning")


def _every_rank_skips() -> None:
    pytest.skip("needs 8 GPUs")


def _every_rank_raises_skiptest() -> None:
    raise unittest.SkipTest("needs 8 GPUs")


def _importorskip() -> None:
    pytest.importorskip("no_such_module_for_meshsim")


def _xfail_after_a_barrier() -> None:
    dist.barrier()
    pytest.xfail("known gap")


CASES: dict[str, tuple[Callable[[], None], type[BaseException], str]] = {
    "pytest.skip": (_every_rank_skips, pytest.skip.Exception, "needs 8 GPUs"),
    "unittest.SkipTest": (_every_rank_raises_skiptest, unittest.SkipTest, "needs 8 GPUs"),
    "importorskip": (_importorskip, pytest.skip.Exception, "could not import 'no_such_module_for_meshsim'"),
    "xfail": (_xfail_after_a_barrier, pytest.xfail.Exception, "known gap"),
}


@pytest.mark.parametrize("backend", ["sim", "gloo"])
@pytest.mark.parametrize("case", list(CASES))
def test_run_raises_the_ranks_skip_or_xfail(case: str, backend: str) -> None:
    body, expected, reason = CASES[case]
    with pytest.raises(expected, match=reason):
        meshsim.run(body, 2, backend=backend)


def _rank_2_skips_while_the_others_wait() -> None:
    if dist.get_rank() == 2:
        pytest.skip("rank 2 has nothing to do")
    dist.barrier()


def test_one_rank_that_skips_releases_the_others() -> None:
    with pytest.raises(pytest.skip.Exception, match="rank 2 has nothing to do"):
        meshsim.run(_rank_2_skips_while_the_others_wait, 4)


def _rank_0_fails_and_rank_1_skips() -> None:
    if dist.get_rank() == 0:
        raise AssertionError("rank 0 is wrong")
    pytest.skip("rank 1 would rather skip")


def test_a_failure_wins_over_a_skip() -> None:
    # sim only: on gloo ranks run at once, and which ends first is a race
    with pytest.raises(meshsim.RankError, match="rank 0 of 2 raised") as caught:
        meshsim.run(_rank_0_fails_and_rank_1_skips, 2)
    assert isinstance(caught.value.__cause__, AssertionError)


PLAIN_TESTS = """
import unittest
import pytest, torch.distributed as dist
import meshsim

def _skip():
    pytest.skip("needs 8 GPUs")

def _xfail():
    dist.barrier()
    pytest.xfail("known gap")

def _fail():
    assert dist.get_rank() == 1, "rank 0 is wrong"

def test_skips():
    meshsim.run(_skip, 4)

def test_xfails():
    meshsim.run(_xfail, 2)

def test_fails():
    meshsim.run(_fail, 2)

@pytest.mark.world(4)
def test_skips_under_the_marker(rank):
    _skip()

@pytest.mark.world(2)
def test_xfails_under_the_marker(rank):
    _xfail()

@pytest.mark.world(2, backend="spawn")
def test_skips_on_one_process_per_rank(rank):
    _skip()

class Plain(unittest.TestCase):
    def test_skiptest(self):
        meshsim.run(lambda: self.skipTest("no accelerator"), 2)
"""


def test_pytest_reports_a_plain_tests_skip_as_under_the_marker(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(test_plain=PLAIN_TESTS)
    result = pytester.runpytest_subprocess("-rsx", "-p", "no:randomly")
    result.assert_outcomes(skipped=4, xfailed=2, failed=1)
    result.stdout.fnmatch_lines(["*rank 0 of 2 raised*", "*AssertionError: rank 0 is wrong*"])


def test_unittest_reports_a_skip_in_ranks_as_a_skip(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(
        test_unit=textwrap.dedent(
            """
            import unittest
            import meshsim

            class Plain(unittest.TestCase):
                def test_skiptest(self):
                    meshsim.run(lambda: self.skipTest("no accelerator"), 2)

            if __name__ == "__main__":
                unittest.main()
            """
        )
    )
    result = pytester.runpython("test_unit.py")
    assert result.ret == 0
    result.stderr.fnmatch_lines(["OK (skipped=1)"])
