"""--multigpu-static / --multigpu-dynamic, whoever defines them, and the simulated static job."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

pytestmark = pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")

TREE = Path(__file__).parents[2] / "examples" / "physicsnemo_like"


@pytest.fixture
def tree(pytester: pytest.Pytester) -> pytest.Pytester:
    """The PhysicsNeMo-shaped tree (examples/physicsnemo_like) in pytester's directory."""
    shutil.copytree(TREE, pytester.path, dirs_exist_ok=True, ignore=shutil.ignore_patterns("__pycache__"))
    return pytester


def test_a_conftest_that_defines_the_options_runs_on_simulated_ranks(tree: pytest.Pytester) -> None:
    result = tree.runpytest_subprocess("--multigpu-static", "-v", "-rs")
    result.assert_outcomes(passed=3, skipped=2)
    result.stdout.fnmatch_lines(
        [
            "meshsim: --multigpu-static on 4 simulated ranks (--mesh-backend=sim): one job for the "
            "session, set up as torchrun would",
            "*test_the_manager_answers_for_this_rank PASSED*",
            "*test_the_plugins_configure_ran_once_on_this_rank PASSED*",
            "*test_session_meshes_are_built_once_per_rank PASSED*",
            "*test_a_rank_may_skip SKIPPED (rank 1 has no data)*",
        ]
    )


@pytest.mark.slow  # a process per rank
def test_with_spawn_the_tree_runs_as_a_torchrun_job_would(tree: pytest.Pytester) -> None:
    result = tree.runpytest_subprocess("--multigpu-static", "--mesh-backend=spawn", "--world-size=2", "-rs")
    assert result.ret == 0
    result.assert_outcomes(passed=3, skipped=2)  # rank 0's report
    result.stdout.fnmatch_lines(
        [
            "meshsim: --multigpu-static --mesh-backend=spawn: 2 pytest processes, one per rank*",
            "meshsim: --multigpu-static, rank 0 of 2",
            "*rank 1 has no data (rank 1)",
        ]
    )


def test_without_the_flag_the_conftest_skips_its_static_tests(tree: pytest.Pytester) -> None:
    result = tree.runpytest_subprocess("-rs")
    result.assert_outcomes(passed=1, skipped=4)
    result.stdout.fnmatch_lines(["*needs --multigpu-static*"])


def test_the_world_size_and_a_failed_test_start_the_job_again(tree: pytest.Pytester) -> None:
    tree.makepyfile(
        test_restart="""
        import pytest, torch.distributed as dist
        from manager import Manager

        @pytest.mark.multigpu_static
        def test_a_fails_on_rank_1(distributed_mesh):
            assert Manager().rank != 1, "rank 1 fails"

        @pytest.mark.multigpu_static
        def test_b_the_next_test_has_a_new_job(distributed_mesh):
            manager = Manager()
            assert (manager.rank, manager.world_size) == (dist.get_rank(), 6)
            assert manager.configured == 1 and manager.meshes_built == 1
        """
    )
    result = tree.runpytest_subprocess("--multigpu-static", "--world-size", "6", "-v", "test_restart.py")
    result.assert_outcomes(passed=1, failed=1)
    result.stdout.fnmatch_lines(["*rank 1 of 6 raised*", "*AssertionError: rank 1 fails*"])


MESHSIM_ONLY = """
import pytest, torch, torch.distributed as dist

@pytest.mark.multigpu_static
def test_static(ledger, rank, distributed_mesh):
    dist.all_reduce(torch.ones(1))
    assert ledger.counts() == {"all_reduce": 1} and [c.seq for c in ledger.calls] == [0]

@pytest.mark.multigpu_static
def test_static_again(ledger):
    dist.barrier()
    assert [c.seq for c in ledger.calls] == [0]  # each test's ledger counts from 0

@pytest.mark.world(2)
def test_world():
    assert dist.get_world_size() == 2

@pytest.mark.multigpu_dynamic
def test_dynamic():
    pass

def test_plain():
    pass
"""


@pytest.mark.parametrize(
    ("args", "outcomes", "reason"),
    [
        ((), {"passed": 4, "skipped": 1}, "*a multigpu_dynamic test starts its own processes*"),
        (("--multigpu-static",), {"passed": 3, "skipped": 2}, "*runs only distributed tests*"),
        (("--multigpu-dynamic",), {"passed": 1, "skipped": 4}, "*runs only multigpu_dynamic tests*"),
    ],
    ids=["no-flag", "static", "dynamic"],
)
def test_meshsim_defines_the_options_when_no_conftest_does(
    pytester: pytest.Pytester, args: tuple[str, ...], outcomes: dict[str, int], reason: str
) -> None:
    pytester.makepyfile(test_meshsim_only=MESHSIM_ONLY)
    result = pytester.runpytest_subprocess(*args, "-rs")
    result.assert_outcomes(**outcomes)
    result.stdout.fnmatch_lines([reason])


def test_both_suites_at_once_is_a_usage_error(pytester: pytest.Pytester) -> None:
    pytester.makepyfile("def test_x():\n    pass\n")
    result = pytester.runpytest_subprocess("--multigpu-static", "--multigpu-dynamic")
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines(["*--multigpu-static and --multigpu-dynamic select different suites*"])


def test_the_options_are_documented(pytester: pytest.Pytester) -> None:
    result = pytester.runpytest_subprocess("--help")
    result.stdout.fnmatch_lines(["*--multigpu-static*the multi-GPU static suite*", "*--multigpu-dynamic*"])


def test_a_static_suite_whose_last_test_skips_on_its_ranks_exits_cleanly(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(
        test_last_skips="""
        import pytest, torch.distributed as dist

        @pytest.mark.multigpu_static
        def test_collective():
            dist.barrier()

        @pytest.mark.multigpu_static
        def test_skips_last():
            pytest.skip("needs symmetric memory")
        """
    )
    result = pytester.runpytest_subprocess("--multigpu-static", "-p", "no:cacheprovider")
    result.assert_outcomes(passed=1, skipped=1)
    assert result.ret == pytest.ExitCode.OK
    assert "Traceback" not in result.stderr.str()
