"""pytest.skip, pytest.xfail and pytest.importorskip inside rank bodies give pytest's own outcomes."""

from __future__ import annotations

import pytest

pytestmark = pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")

OUTCOMES = """
import pytest, torch, torch.distributed as dist

@pytest.mark.world(4)
def test_every_rank_skips(rank):
    pytest.skip("no accelerator here")

@pytest.mark.world(4)
def test_one_rank_skips_while_the_others_wait(rank):
    if rank == 2:
        pytest.skip("rank 2 has nothing to do")
    dist.barrier()

@pytest.mark.world(2)
def test_importorskip(rank):
    pytest.importorskip("no_such_module_for_meshsim")

@pytest.mark.world(2)
def test_xfail(rank):
    dist.barrier()
    pytest.xfail("known gap")

@pytest.mark.world(2)
def test_a_failure_wins_over_a_skip(rank):
    if rank == 0:
        assert False, "rank 0 is wrong"
    pytest.skip("rank 1 would rather skip")
"""


SKIPS = [
    "SKIPPED [[]1[]] test_outcomes.py:5: no accelerator here",
    "SKIPPED [[]1[]] test_outcomes.py:10: rank 2 has nothing to do",
    "SKIPPED [[]1[]] test_outcomes.py:15: could not import 'no_such_module_for_meshsim'*",
    "XFAIL test_outcomes.py::test_xfail - known gap",
]


def test_outcomes_on_simulated_ranks(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(test_outcomes=OUTCOMES)
    result = pytester.runpytest_subprocess("-rsx")
    result.assert_outcomes(skipped=3, xfailed=1, failed=1)
    result.stdout.fnmatch_lines_random(SKIPS)
    result.stdout.fnmatch_lines(["*rank 0 of 2 raised*", "*AssertionError: rank 0 is wrong*"])
    result.stdout.no_fnmatch_line("*deadlock*")


@pytest.mark.slow  # gloo ranks, released by the group timeout (5 s)
def test_outcomes_on_gloo_thread_ranks(pytester: pytest.Pytester) -> None:
    # gloo ranks run at once: whether rank 0 fails or rank 1 skips first is a race,
    # so the last case is left out. Ranks left in the barrier by rank 2 are released
    # by their group's timeout (gloo does not see the skip), not reported as a deadlock.
    pytester.makepyfile(test_outcomes=OUTCOMES)
    result = pytester.runpytest_subprocess(
        "--mesh-backend", "gloo", "-rsx", "--mesh-timeout", "5", "-k", "not failure_wins"
    )
    result.assert_outcomes(skipped=3, xfailed=1)
    result.stdout.fnmatch_lines_random(SKIPS)
    result.stdout.no_fnmatch_line("*deadlock*")


@pytest.mark.slow  # a process per rank per test
def test_outcomes_on_spawned_ranks(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(test_outcomes=OUTCOMES)
    # a process per rank per test costs seconds: the two cases that need the most
    result = pytester.runpytest_subprocess("--mesh-backend", "spawn", "-rsx", "-k", "one_rank_skips or xfail")
    result.assert_outcomes(skipped=1, xfailed=1)
    result.stdout.fnmatch_lines_random(
        [
            "SKIPPED [[]1[]] test_outcomes.py:*: rank 2 has nothing to do (rank 2)",
            "XFAIL test_outcomes.py::test_xfail - known gap (rank *)",
        ]
    )
