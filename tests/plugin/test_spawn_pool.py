"""``--mesh-backend=spawn`` keeps its rank processes for the session; ``--mesh-spawn=fresh`` does not.

Each inner test writes the pid each rank ran in to ``pids/<test>-<rank>``; a conftest
hook that runs after meshsim's own end of session writes the pids still running.
"""

from __future__ import annotations

from pathlib import Path

import pytest

pytestmark = pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")

TESTS = """
import os
from pathlib import Path

import pytest
import torch.distributed as dist


def _note(name, rank):
    Path("pids", f"{name}-{rank}").write_text(str(os.getpid()))


@pytest.mark.world(2)
def test_first(rank):
    _note("first", rank)
    dist.barrier()


@pytest.mark.world(2)
def test_second(rank):
    _note("second", rank)
    dist.barrier()


@pytest.mark.world(2)
def test_crash(rank):
    _note("crash", rank)
    if rank == 1:
        os._exit(3)


@pytest.mark.world(2)
def test_after_the_crash(rank):
    _note("after", rank)
    dist.barrier()
"""

# Runs after meshsim's pytest_unconfigure (trylast): which rank processes still run then.
CONFTEST = """
import os
from pathlib import Path

import pytest


@pytest.hookimpl(trylast=True)
def pytest_unconfigure(config):
    pids = sorted({int(p.read_text()) for p in Path("pids").iterdir()})
    alive = [pid for pid in pids if Path(f"/proc/{pid}").exists()]
    Path("alive-after-session").write_text(repr(alive))
"""


def _pids(folder: Path, name: str) -> list[int]:
    return [int(Path(folder, "pids", f"{name}-{rank}").read_text()) for rank in range(2)]


def _setup(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(test_kept=TESTS)
    pytester.makeconftest(CONFTEST)
    pytester.mkdir("pids")


@pytest.mark.slow  # a pytest that spawns two rank processes
@pytest.mark.skipif(not Path("/proc").is_dir(), reason="finds processes in /proc")
def test_the_session_keeps_its_rank_processes_and_replaces_one_that_crashed(
    pytester: pytest.Pytester,
) -> None:
    _setup(pytester)
    result = pytester.runpytest_subprocess("--mesh-backend=spawn")
    result.assert_outcomes(passed=3, failed=1)
    result.stdout.fnmatch_lines(
        [
            "*rank 1 of 2 raised*",
            "*the process exited with code 3 before reporting*",
            "meshsim: spawned ranks: 4 test(s) on 3 rank process(es), 1 replaced after a test left it *",
            "  1 x the process exited with code 3 before reporting",
        ]
    )
    first, second, crash, after = (
        _pids(pytester.path, name) for name in ("first", "second", "crash", "after")
    )
    assert second == first == crash  # one process per rank, for every test
    assert after[0] == first[0] and after[1] != first[1]  # the crashed rank's process is new
    assert (pytester.path / "alive-after-session").read_text() == "[]"


@pytest.mark.slow  # a pytest that spawns two rank processes per test
@pytest.mark.parametrize("how", [["--mesh-spawn=fresh"], ["-o", "mesh_spawn=fresh"]], ids=["option", "ini"])
def test_fresh_starts_new_processes_for_every_test(pytester: pytest.Pytester, how: list[str]) -> None:
    _setup(pytester)
    result = pytester.runpytest_subprocess("--mesh-backend=spawn", *how, "-k", "first or second")
    result.assert_outcomes(passed=2)
    first, second = _pids(pytester.path, "first"), _pids(pytester.path, "second")
    assert not set(first) & set(second)
    result.stdout.no_fnmatch_line("meshsim: spawned ranks:*")
    assert (pytester.path / "alive-after-session").read_text() == "[]"


def test_a_bad_mesh_spawn_ini_value_is_a_usage_error(pytester: pytest.Pytester) -> None:
    pytester.makeini("[pytest]\nmesh_spawn = sometimes\n")
    result = pytester.runpytest()
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines(["*mesh_spawn (ini) must be one of ('pool', 'fresh'), got 'sometimes'*"])


def test_a_bad_mesh_spawn_option_is_refused(pytester: pytest.Pytester) -> None:
    result = pytester.runpytest("--mesh-spawn=sometimes")
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines(["*--mesh-spawn: invalid choice: 'sometimes'*"])
