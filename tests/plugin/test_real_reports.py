"""On gloo thread ranks, spawned ranks and torchrun ranks, ranks that disagree are reported as on sim.

The rank the others wait for is named, with every rank's state (issue 39); under
torchrun a hang ends by ``--mesh-timeout``, a job whose size runs no test fails, and
meshsim's own calls raise no deprecation warning.
"""

from __future__ import annotations

import socket

import pytest

from .launch import torchrun_pytest

pytestmark = pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")

CASES = """
import pytest, torch, torch.distributed as dist

@pytest.mark.world(2)
def test_skips(rank):
    if rank != 1:
        dist.all_reduce(torch.ones(4))

@pytest.mark.world(2)
def test_raises(rank):
    if rank == 1:
        raise ValueError("rank 1 broke")
    dist.all_reduce(torch.ones(4))

@pytest.mark.world(2)
def test_returns_early(rank):
    dist.all_reduce(torch.ones(4))
    if rank == 1:
        return
    dist.broadcast(torch.ones(2), src=0)

@pytest.mark.world(2)
def test_different(rank):
    if rank == 1:
        dist.all_gather([torch.empty(4), torch.empty(4)], torch.ones(4))
    else:
        dist.all_reduce(torch.ones(4))
"""

# What each case reports, on every backend: the rank the others wait for, and the table.
EXPECTED = {
    "skips": [
        "DeadlockError: deadlock: no rank of the 2-rank world can make progress.",
        "  rank 0: waiting in all_reduce(float32[[]4[]], SUM), call #0 of group [[]0, 1[]] at "
        "test_cases.py:6 "
        "in test_skips; waiting for rank 1",
        "  rank 1: finished: its function returned",
        "Ranks wait for rank 1, which finished.",
    ],
    "raises": [
        "rank 1 of 2 raised; its traceback:",
        "ValueError: rank 1 broke",
        "where every rank stood:",
        "  rank 1: failed: ValueError: rank 1 broke",
    ],
    "returns_early": [
        "DeadlockError: deadlock: no rank of the 2-rank world can make progress.",
        "  rank 0: waiting in broadcast(float32[[]2[]], root=0), call #1 of group [[]0, 1[]] at "
        "test_cases.py:19 in test_returns_early; waiting for rank 1",
        "  rank 1: finished: its function returned",
        "Ranks wait for rank 1, which finished.",
    ],
    "different": [
        "CollectiveMismatchError: ranks entered different collectives in call #0 of group [[]0, 1[]]:",
        "  rank 0: all_reduce(float32[[]4[]], SUM)  at test_cases.py:26 in test_different",
        "  rank 1: all_gather(float32[[]4[]])       at test_cases.py:24 in test_different   <- differs",
        "Rank 1 differs from the others.*",
    ],
}


def _expected(*names: str) -> list[str]:
    return [line for name in names for line in [f"*_ test_{name} _*", *EXPECTED[name]]]


@pytest.mark.slow  # gloo ranks; the mismatch ends by the groups' timeout
@pytest.mark.parametrize("backend", ["gloo", "spawn"])
def test_thread_and_spawned_ranks_name_the_culprit_with_the_table(
    pytester: pytest.Pytester, backend: str
) -> None:
    pytester.makepyfile(test_cases=CASES)
    # 15 s: a spawned rank's process starts before its collectives count it (slow on a loaded machine)
    result = pytester.runpytest_subprocess("--mesh-backend", backend, "--mesh-timeout", "15", timeout=400)
    result.assert_outcomes(failed=4)
    result.stdout.fnmatch_lines(_expected("skips", "raises", "returns_early", "different"))
    result.stdout.fnmatch_lines([f"(seen on {backend}) rank 0's call ended with *"])
    result.stdout.no_fnmatch_line("rank 0 of 2 raised*")  # the victim is not the report


# A distributed manager's own group, made with a timeout of ten minutes: --mesh-timeout bounds it.
MANAGER = """
import datetime, torch.distributed as dist

def pytest_configure(config):
    dist.init_process_group("gloo", timeout=datetime.timedelta(minutes=10))
"""


@pytest.mark.slow  # one torchrun job per case: a disagreement stops the job's session
@pytest.mark.parametrize("case", ["skips", "raises", "returns_early", "different"])
def test_torchrun_ranks_name_the_culprit_with_the_table(pytester: pytest.Pytester, case: str) -> None:
    pytester.makepyfile(test_cases=CASES)
    pytester.makeconftest(MANAGER)
    result = torchrun_pytest(pytester, "--mesh-timeout", "5", "-k", case)
    assert result.ret != 0
    result.stdout.fnmatch_lines(
        [
            *_expected(case),
            "*Interrupted: meshsim: test_cases.py::test_* left the ranks' collectives out of step*",
        ]
    )
    result.stdout.no_fnmatch_line("*_modes/torchrun.py*")  # no traceback through meshsim


@pytest.mark.slow  # torchrun
def test_a_torchrun_hang_ends_by_the_mesh_timeout_with_the_report(pytester: pytest.Pytester) -> None:
    """The manager's group waits ten minutes; --mesh-timeout=5 ends rank 0's wait after 5 s."""
    pytester.makepyfile(test_cases=CASES)
    pytester.makeconftest(MANAGER)
    result = torchrun_pytest(pytester, "--mesh-timeout", "5", "-k", "skips", timeout=120)
    result.stdout.fnmatch_lines(
        [*EXPECTED["skips"], "(seen on torchrun) rank 0's call ended with *Timed out waiting 5000ms*"]
    )


def _torchrun_env(monkeypatch: pytest.MonkeyPatch, *, world_size: int) -> None:
    """This process as rank 0 of a torchrun job of ``world_size`` (1: a job of its own)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    for key, value in {
        "RANK": "0",
        "LOCAL_RANK": "0",
        "WORLD_SIZE": str(world_size),
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(port),
    }.items():
        monkeypatch.setenv(key, value)


NEEDS_FOUR = """
import pytest, torch, torch.distributed as dist

@pytest.mark.world(4)
@pytest.mark.parametrize("n", [1, 2, 3])
def test_four(n):
    dist.all_reduce(torch.ones(n))

def test_plain():
    pass
"""


@pytest.mark.slow  # a pytest process as rank 0 of a 1-process torchrun job
def test_a_torchrun_job_that_ran_no_distributed_test_says_so_and_fails(
    pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch
) -> None:
    _torchrun_env(monkeypatch, world_size=1)
    pytester.makepyfile(test_sizes=NEEDS_FOUR)
    result = pytester.runpytest_subprocess("--multigpu-static")
    result.assert_outcomes(skipped=4)
    assert result.ret == pytest.ExitCode.TESTS_FAILED
    result.stdout.fnmatch_lines(
        [
            "meshsim: 3 tests need world 4; this job has 1 rank: torchrun --nproc-per-node=4; "
            "no distributed test ran"
        ]
    )


@pytest.mark.slow  # a pytest process as rank 0 of a 1-process torchrun job
def test_mesh_allow_unrun_keeps_exit_status_0(
    pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch
) -> None:
    _torchrun_env(monkeypatch, world_size=1)
    pytester.makepyfile(test_sizes=NEEDS_FOUR)
    result = pytester.runpytest_subprocess("--multigpu-static", "--mesh-allow-unrun")
    assert result.ret == pytest.ExitCode.OK
    result.stdout.fnmatch_lines(
        ["meshsim: 3 tests need world 4; this job has 1 rank: *(--mesh-allow-unrun: exit status 0)"]
    )


@pytest.mark.slow  # a pytest process as rank 0 of a 1-process torchrun job
def test_a_job_that_ran_some_tests_names_the_others_sizes_and_passes(
    pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch
) -> None:
    _torchrun_env(monkeypatch, world_size=1)
    pytester.makepyfile(
        test_sizes="""
        import pytest, torch, torch.distributed as dist

        @pytest.mark.world(1, 2, 8)
        def test_sizes():
            dist.all_reduce(torch.ones(1))
        """
    )
    result = pytester.runpytest_subprocess("--multigpu-static")
    result.assert_outcomes(passed=1, skipped=2)
    assert result.ret == pytest.ExitCode.OK
    result.stdout.fnmatch_lines(
        [
            "meshsim: 1 test needs world 2, 1 test needs world 8; this job has 1 rank: "
            "torchrun --nproc-per-node=2 or torchrun --nproc-per-node=8"
        ]
    )


@pytest.mark.slow  # a pytest process as rank 0 of a 1-process torchrun job
def test_meshsim_raises_no_deprecation_warning_under_torchrun(
    pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch
) -> None:
    """torch 2.13 deprecates all_gather_into_tensor (FutureWarning); meshsim's own calls avoid such names."""
    _torchrun_env(monkeypatch, world_size=1)
    pytester.makepyfile(
        test_passes="""
        import pytest, torch, torch.distributed as dist

        @pytest.mark.world(1)
        def test_passes(ledger_snapshot):
            dist.all_reduce(torch.ones(1))

        @pytest.mark.world(1)
        def test_skips():
            pytest.skip("on purpose")
        """
    )
    result = pytester.runpytest_subprocess("--multigpu-static", "-W", "error::FutureWarning")
    result.assert_outcomes(passed=1, skipped=1)
    result.stdout.no_fnmatch_line("*Warning*")  # no warnings summary at all
