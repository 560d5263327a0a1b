"""The ledger_snapshot fixture and --mesh-snapshot-update, driven from outside with pytester."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from .launch import torchrun_pytest

pytestmark = pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")

PROGRAM = """
import pytest, torch, torch.distributed as dist

OP = dist.ReduceOp.SUM

@pytest.mark.world(1, 2)
def test_gather(rank, world_size, ledger_snapshot, ledger):
    assert ledger_snapshot is ledger
    dist.all_gather_into_tensor(torch.empty(4 * world_size), torch.ones(4))
    dist.all_reduce(torch.ones(2), op=OP)

@pytest.mark.world(2)
@pytest.mark.usefixtures("ledger_snapshot")
def test_send(rank):
    if rank == 0:
        dist.send(torch.ones(3), 1)
    else:
        dist.recv(torch.ones(3), 0)

@pytest.mark.world(2)
def test_fails(rank, ledger_snapshot):
    dist.barrier()
    assert rank == 0, "rank 1 fails"

def test_not_distributed(ledger_snapshot):
    pass
"""

SNAPSHOT = {
    "test_gather[world1]": {
        "rank 0 of 1": [
            "all_gather all_gather_into_tensor [0] float32 in=16 out=16",
            "all_reduce all_reduce [0] float32 in=8 out=8 SUM",
        ]
    },
    "test_gather[world2]": {
        f"rank {r} of 2": [
            "all_gather all_gather_into_tensor [0,1] float32 in=16 out=32",
            "all_reduce all_reduce [0,1] float32 in=8 out=8 SUM",
        ]
        for r in range(2)
    },
    "test_send": {
        "rank 0 of 2": ["send send [0,1] float32 in=12 out=0 peer=1"],
        "rank 1 of 2": ["recv recv [0,1] float32 in=0 out=12 peer=0"],
    },
}

WORLD_2 = "test_program.py::test_gather[world2]"
SEND = "test_program.py::test_send"
GATHER = "all_gather all_gather_into_tensor [0,1] float32 in=16 out=32"
MAX = "all_reduce all_reduce [0,1] float32 in=8 out=8 MAX"


def _file(pytester: pytest.Pytester, module: str = "test_program") -> Path:
    return pytester.path / "__snapshots__" / f"{module}.ledger.json"


def _stored(pytester: pytest.Pytester, module: str = "test_program") -> dict[str, object]:
    tests: dict[str, object] = json.loads(_file(pytester, module).read_text())["tests"]
    return tests


def _use_max(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(test_program=PROGRAM.replace("OP = dist.ReduceOp.SUM", "OP = dist.ReduceOp.MAX"))


def test_create_then_unchanged_on_rerun(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(test_program=PROGRAM)
    first = pytester.runpytest_subprocess()
    first.assert_outcomes(passed=3, failed=1, errors=1)
    first.stdout.fnmatch_lines(
        [
            "*fixture 'ledger_snapshot' is per rank; mark the test with @pytest.mark.world(n)*",
            "*rank 1 of 2 raised*",
            "meshsim: ledger snapshots: 3 written",
        ],
        consecutive=False,
    )
    assert _stored(pytester) == SNAPSHOT  # a test that failed stores nothing
    before = _file(pytester).stat()

    again = pytester.runpytest_subprocess("-k", "not fails")
    again.assert_outcomes(passed=3, errors=1)
    again.stdout.fnmatch_lines(["meshsim: ledger snapshots: 3 unchanged"])
    after = _file(pytester).stat()
    assert (after.st_ino, after.st_size) == (before.st_ino, before.st_size)  # not rewritten


def test_a_changed_program_fails_with_a_diff_per_rank_until_updated(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(test_program=PROGRAM)
    pytester.runpytest_subprocess("-k", "gather").assert_outcomes(passed=2)
    _use_max(pytester)

    changed = pytester.runpytest_subprocess("-k", "gather")
    changed.assert_outcomes(failed=2)
    changed.stdout.fnmatch_lines(
        [
            "*_ test_gather[[]world2[]] _*",
            "the collectives of test_gather[[]world2[]] on ranks 0, 1 (of 2) differ from its ledger "
            "snapshot in __snapshots__/test_program.ledger.json:",
            "rank 0:",
            "  --- stored",
            "  +++ this run",
            "  @@ -1,2 +1,2 @@",
            "   all_gather all_gather_into_tensor [[]0,1[]] float32 in=16 out=32",
            "  -all_reduce all_reduce [[]0,1[]] float32 in=8 out=8 SUM",
            f"  +{MAX.replace('[0,1]', '[[]0,1[]]')}",
            "rank 1: the same difference as rank 0",
            "If the change is intended, rerun with --mesh-snapshot-update to rewrite the snapshot, "
            "and review the file's diff.",
        ]
    )
    assert _stored(pytester) == {k: v for k, v in SNAPSHOT.items() if k.startswith("test_gather")}

    updated = pytester.runpytest_subprocess("-k", "gather", "--mesh-snapshot-update")
    updated.assert_outcomes(passed=2)
    updated.stdout.fnmatch_lines(["meshsim: ledger snapshots: 2 rewritten"])
    assert _stored(pytester)["test_gather[world2]"] == {f"rank {r} of 2": [GATHER, MAX] for r in range(2)}
    pytester.runpytest_subprocess("-k", "gather").assert_outcomes(passed=2)


def test_a_file_written_with_the_old_world_ids_still_matches(pytester: pytest.Pytester) -> None:
    """Snapshots stored under ``test_gather[world=2]`` (ids before ``-k world2`` could select them)."""
    pytester.makepyfile(test_program=PROGRAM)
    legacy = {key.replace("[world", "[world="): entry for key, entry in SNAPSHOT.items()}
    _file(pytester).parent.mkdir()
    _file(pytester).write_text(json.dumps({"version": 1, "tests": legacy}))
    result = pytester.runpytest_subprocess("-k", "world2")  # selects by the new id
    result.assert_outcomes(passed=1)
    result.stdout.fnmatch_lines(["meshsim: ledger snapshots: 1 unchanged"])
    _use_max(pytester)
    pytester.runpytest_subprocess("-k", "world2").assert_outcomes(failed=1)  # the old entry is compared
    assert _stored(pytester) == legacy


@pytest.mark.slow  # gloo and spawned ranks, three inner sessions
@pytest.mark.parametrize("backend", ["gloo", "spawn"])
def test_other_backends_compare_against_the_same_file(pytester: pytest.Pytester, backend: str) -> None:
    pytester.makepyfile(test_program=PROGRAM)
    pytester.runpytest_subprocess(WORLD_2, SEND).assert_outcomes(passed=2)
    stored = _file(pytester).read_text()

    # spawn costs seconds per test: one test there, both on gloo
    chosen = (WORLD_2, SEND) if backend == "gloo" else (SEND,)
    result = pytester.runpytest_subprocess("--mesh-backend", backend, *chosen)
    result.assert_outcomes(passed=2 if backend == "gloo" else 1)
    result.stdout.fnmatch_lines([f"meshsim: ledger snapshots: {2 if backend == 'gloo' else 1} unchanged"])
    if backend == "gloo":
        _use_max(pytester)
        changed = pytester.runpytest_subprocess("--mesh-backend", backend, WORLD_2)
        changed.assert_outcomes(failed=1)
        changed.stdout.fnmatch_lines(["*on ranks 0, 1 (of 2) differ from its ledger snapshot*"])
    assert _file(pytester).read_text() == stored


STATIC = """
import pytest, torch, torch.distributed as dist

@pytest.mark.multigpu_static
def test_static(world_size, ledger_snapshot):
    dist.all_reduce(torch.ones(world_size))
"""


@pytest.mark.slow  # three inner static jobs
def test_the_simulated_static_job_keeps_one_entry_per_world_size(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(test_static=STATIC)
    for size in (2, 3):
        result = pytester.runpytest_subprocess("--multigpu-static", "--world-size", str(size))
        result.assert_outcomes(passed=1)
        result.stdout.fnmatch_lines(["meshsim: ledger snapshots: 1 written"])
    entry = _stored(pytester, "test_static")["test_static"]
    assert entry == {
        **{f"rank {r} of 2": ["all_reduce all_reduce [0,1] float32 in=8 out=8 SUM"] for r in range(2)},
        **{f"rank {r} of 3": ["all_reduce all_reduce [0,1,2] float32 in=12 out=12 SUM"] for r in range(3)},
    }
    pytester.runpytest_subprocess("--multigpu-static", "--world-size", "2").stdout.fnmatch_lines(
        ["meshsim: ledger snapshots: 1 unchanged"]
    )


@pytest.mark.slow  # an inner session with two xdist workers
def test_xdist_workers_write_one_module_s_entries_at_once(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(
        test_many="""
        import pytest, torch, torch.distributed as dist

        @pytest.mark.parametrize("n", range(8))
        @pytest.mark.world(2)
        def test_n(n, ledger_snapshot):
            dist.all_reduce(torch.ones(n + 1))
        """
    )
    result = pytester.runpytest_subprocess("-n", "2")
    result.assert_outcomes(passed=8)
    result.stdout.fnmatch_lines(["meshsim: ledger snapshots: 8 written"])  # counted by xdist's controller
    assert list(_stored(pytester, "test_many")) == [f"test_n[{n}]" for n in range(8)]


@pytest.mark.slow  # torchrun
def test_torchrun_ranks_gather_their_ledgers_and_rank_0_writes(pytester: pytest.Pytester) -> None:
    """Two torchrun processes against a file written on simulated ranks: matched, created, changed."""
    pytester.makepyfile(test_program=PROGRAM)
    pytester.runpytest_subprocess(WORLD_2).assert_outcomes(passed=1)
    tests = _stored(pytester)
    # hand-edit the stored entry of one rank only: rank 1 must see its own difference
    tests["test_gather[world2]"]["rank 1 of 2"][1] = MAX  # type: ignore[index]
    _file(pytester).write_text(json.dumps({"version": 1, "tests": tests}))

    result = torchrun_pytest(pytester, WORLD_2, SEND, timeout=300)
    result.stdout.fnmatch_lines(
        [
            "meshsim: --multigpu-static, rank 0 of 2",
            "*on rank 1 (of 2) differ from its ledger snapshot in __snapshots__/test_program.ledger.json:",
            "rank 1:",
            "*-all_reduce all_reduce [[]0,1[]] float32 in=8 out=8 MAX",
            "*+all_reduce all_reduce [[]0,1[]] float32 in=8 out=8 SUM",
            "meshsim: ledger snapshots: 1 written",
            "*1 failed, 1 passed*",
        ],
        consecutive=False,
    )
    assert _stored(pytester)["test_send"] == SNAPSHOT["test_send"]  # rank 0 wrote both ranks' ledgers


def test_the_fixture_and_the_option_are_documented(pytester: pytest.Pytester) -> None:
    pytester.runpytest("--fixtures").stdout.fnmatch_lines(
        ["ledger_snapshot*", "*Pin the test's per-rank ledgers to a snapshot file beside its module*"]
    )
    pytester.runpytest("--help").stdout.fnmatch_lines(
        ["  --mesh-snapshot-update", "*rewrite the ledger snapshots of tests that use the*"]
    )
