"""meshsim.check_snapshot: ledger snapshot files, without pytest's plugin."""

from __future__ import annotations

import json
import threading
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

import meshsim
from meshsim import Collective, Ledger


def _program(op: dist.ReduceOp.RedOpType = dist.ReduceOp.SUM) -> Ledger:
    with meshsim.record() as ledger:
        rank, size = dist.get_rank(), dist.get_world_size()
        dist.all_gather_into_tensor(torch.empty(4 * size), torch.ones(4))
        dist.all_reduce(torch.ones(2), op=op)
        if rank == 0:
            dist.send(torch.ones(3), 1)
        elif rank == 1:
            dist.recv(torch.ones(3), 0)
        dist.broadcast(torch.ones(2, dtype=torch.int64), src=size - 1)
        dist.barrier()
    return ledger


def _ledgers(world_size: int = 2, op: dist.ReduceOp.RedOpType = dist.ReduceOp.SUM) -> list[Ledger]:
    ledgers: list[Ledger] = meshsim.run(_program, world_size, args=(op,))
    return ledgers


def _ledger(*calls: Collective) -> Ledger:
    ledger = Ledger()
    ledger.calls.extend(calls)
    return ledger


def _all_reduce(numel: int, site: str = "a.py:1 in f", seq: int = 0) -> Collective:
    return Collective(
        "all_reduce", "all_reduce", (0, 1), torch.float32, 4 * numel, 4 * numel, "SUM", seq, site
    )


def test_the_first_check_stores_one_line_per_call_and_no_call_sites(tmp_path: Path) -> None:
    path = tmp_path / "__snapshots__" / "test_x.ledger.json"
    assert meshsim.check_snapshot(path, "test_program", _ledgers()) == "created"
    document = json.loads(path.read_text())
    assert document["version"] == 1
    assert document["tests"] == {
        "test_program": {
            "rank 0 of 2": [
                "all_gather all_gather_into_tensor [0,1] float32 in=16 out=32",
                "all_reduce all_reduce [0,1] float32 in=8 out=8 SUM",
                "send send [0,1] float32 in=12 out=0 peer=1",
                "broadcast broadcast [0,1] int64 in=0 out=16 peer=1",
                "barrier barrier [0,1] in=0 out=0",
            ],
            "rank 1 of 2": [
                "all_gather all_gather_into_tensor [0,1] float32 in=16 out=32",
                "all_reduce all_reduce [0,1] float32 in=8 out=8 SUM",
                "recv recv [0,1] float32 in=0 out=12 peer=0",
                "broadcast broadcast [0,1] int64 in=16 out=0 peer=1",
                "barrier barrier [0,1] in=0 out=0",
            ],
        }
    }


def test_the_same_collectives_match_and_leave_the_file_alone(tmp_path: Path) -> None:
    path = tmp_path / "x.ledger.json"
    meshsim.check_snapshot(path, "k", [_ledger(_all_reduce(2, site="a.py:1 in f"))])
    before = path.stat()
    # a different call site and sequence number: not stored, so not a change
    moved = _ledger(_all_reduce(2, site="a.py:99 in g", seq=7))
    for update in (False, True):
        assert meshsim.check_snapshot(path, "k", [moved], update=update) == "matched"
    after = path.stat()
    assert (after.st_ino, after.st_size) == (before.st_ino, before.st_size)  # never replaced


MISMATCH = """\
the collectives of test_program on ranks 0, 1 (of 2) differ from its ledger snapshot in {path}:
rank 0:
  --- stored
  +++ this run
  @@ -1,5 +1,5 @@
   all_gather all_gather_into_tensor [0,1] float32 in=16 out=32
  -all_reduce all_reduce [0,1] float32 in=8 out=8 SUM
  +all_reduce all_reduce [0,1] float32 in=8 out=8 MAX
   send send [0,1] float32 in=12 out=0 peer=1
   broadcast broadcast [0,1] int64 in=0 out=16 peer=1
   barrier barrier [0,1] in=0 out=0
rank 1:
  --- stored
  +++ this run
  @@ -1,5 +1,5 @@
   all_gather all_gather_into_tensor [0,1] float32 in=16 out=32
  -all_reduce all_reduce [0,1] float32 in=8 out=8 SUM
  +all_reduce all_reduce [0,1] float32 in=8 out=8 MAX
   recv recv [0,1] float32 in=0 out=12 peer=0
   broadcast broadcast [0,1] int64 in=16 out=0 peer=1
   barrier barrier [0,1] in=0 out=0"""


def test_changed_collectives_raise_with_a_diff_per_rank(tmp_path: Path) -> None:
    path = tmp_path / "x.ledger.json"
    meshsim.check_snapshot(path, "test_program", _ledgers())
    stored = path.read_text()
    with pytest.raises(meshsim.SnapshotMismatchError) as caught:
        meshsim.check_snapshot(path, "test_program", _ledgers(op=dist.ReduceOp.MAX))
    assert str(caught.value) == MISMATCH.format(path=path)
    assert (caught.value.path, caught.value.key, caught.value.ranks) == (path, "test_program", (0, 1))
    assert isinstance(caught.value, AssertionError)
    assert path.read_text() == stored


def test_ranks_with_the_same_difference_are_shown_once(tmp_path: Path) -> None:
    path = tmp_path / "x.ledger.json"
    meshsim.check_snapshot(path, "k", [_ledger(_all_reduce(1))] * 3)
    with pytest.raises(meshsim.SnapshotMismatchError) as caught:
        meshsim.check_snapshot(
            path, "k", [_ledger(_all_reduce(1))] + [_ledger(_all_reduce(1), _all_reduce(2))] * 2
        )
    assert caught.value.ranks == (1, 2)
    assert str(caught.value).splitlines()[-2:] == [
        "  +all_reduce all_reduce [0,1] float32 in=8 out=8 SUM",
        "rank 2: the same difference as rank 1",
    ]


def test_a_rank_missing_from_the_entry_is_a_difference(tmp_path: Path) -> None:
    path = tmp_path / "x.ledger.json"
    meshsim.check_snapshot(path, "k", [_ledger(_all_reduce(1))] * 2)
    document = json.loads(path.read_text())
    del document["tests"]["k"]["rank 1 of 2"]
    path.write_text(json.dumps(document))
    with pytest.raises(meshsim.SnapshotMismatchError, match=r"on rank 1 \(of 2\)") as caught:
        meshsim.check_snapshot(path, "k", [_ledger(_all_reduce(1))] * 2)
    assert "--- stored (no entry for this rank)" in str(caught.value)


def test_update_rewrites_the_entry_and_keeps_other_world_sizes_and_tests(tmp_path: Path) -> None:
    path = tmp_path / "x.ledger.json"
    meshsim.check_snapshot(path, "test_b[10]", [_ledger()])
    meshsim.check_snapshot(path, "test_b[2]", [_ledger()])
    meshsim.check_snapshot(path, "k", [_ledger(_all_reduce(1))] * 4)
    assert meshsim.check_snapshot(path, "k", [_ledger(_all_reduce(1))] * 2) == "created"  # another size
    assert meshsim.check_snapshot(path, "k", [_ledger(_all_reduce(3))] * 2, update=True) == "updated"
    tests = json.loads(path.read_text())["tests"]
    assert list(tests) == ["k", "test_b[2]", "test_b[10]"]  # natural order
    assert list(tests["k"]) == [f"rank {r} of {n}" for n in (2, 4) for r in range(n)]
    assert tests["k"]["rank 0 of 2"] == ["all_reduce all_reduce [0,1] float32 in=12 out=12 SUM"]
    assert tests["k"]["rank 0 of 4"] == ["all_reduce all_reduce [0,1] float32 in=4 out=4 SUM"]


def test_write_false_compares_but_never_writes(tmp_path: Path) -> None:
    path = tmp_path / "x.ledger.json"
    assert meshsim.check_snapshot(path, "k", [_ledger()], write=False) == "created"
    assert not path.exists()


def test_concurrent_writers_of_one_file_lose_no_entry(tmp_path: Path) -> None:
    path = tmp_path / "x.ledger.json"
    start = threading.Barrier(8)

    def write(n: int) -> None:
        start.wait(timeout=30)
        meshsim.check_snapshot(path, f"test_{n}", [_ledger(_all_reduce(n + 1))])

    threads = [threading.Thread(target=write, args=(n,)) for n in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=30)
    assert list(json.loads(path.read_text())["tests"]) == [f"test_{n}" for n in range(8)]
    assert [p.name for p in tmp_path.iterdir()] == ["x.ledger.json"]  # no lock or temporary file left


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ('{\n<<<<<<< HEAD\n"tests": {}\n', r"x.ledger.json is not a ledger snapshot file: not JSON"),
        ('{"version": 2, "tests": {}}', r"x.ledger.json is not a ledger snapshot file of version 1"),
        (
            '{"version": 1, "tests": {"k": ["a"]}}',
            r"x.ledger.json is not a ledger snapshot file of version 1",
        ),
        (
            '{"version": 1, "tests": {"k": {"estimate of 1 on pcie": "fast"}}}',
            r"x.ledger.json is not a ledger snapshot file of version 1",
        ),
    ],
    ids=["merge-conflict", "other-version", "wrong-shape", "bad-estimate"],
)
def test_a_file_that_is_not_a_snapshot_is_an_error_naming_it(tmp_path: Path, text: str, message: str) -> None:
    path = tmp_path / "x.ledger.json"
    path.write_text(text)
    with pytest.raises(ValueError, match=message):
        meshsim.check_snapshot(path, "k", [_ledger()], update=True)
    assert path.read_text() == text


def test_no_ledgers_is_an_error(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=r"check_snapshot\('k'\) needs one ledger per rank, got none"):
        meshsim.check_snapshot(tmp_path / "x.ledger.json", "k", [])


# -- the estimate an entry carries with a topology ------------------------------------------


def _estimate(ledgers: list[Ledger], topology: str) -> str:
    from meshsim._observe.cost import critical_path, format_seconds

    return format_seconds(critical_path(ledgers, topology).total)


def test_an_entry_carries_the_estimate_beside_its_world_size_s_ranks(tmp_path: Path) -> None:
    path = tmp_path / "x.ledger.json"
    two = [_ledger(_all_reduce(4))] * 2
    moved = [_ledger(_all_reduce(4, site="b.py:9 in g"))] * 2  # the same calls from another line
    assert meshsim.check_snapshot(path, "k", two, topology="dgx-h100") == "created"
    assert meshsim.check_snapshot(path, "k", [_ledger()], topology="pcie") == "created"
    entry = json.loads(path.read_text())["tests"]["k"]
    assert list(entry) == ["rank 0 of 1", "estimate of 1 on pcie", "rank 0 of 2", "rank 1 of 2",
                           "estimate of 2 on dgx-h100"]  # fmt: skip
    assert entry["estimate of 2 on dgx-h100"] == _estimate(two, "dgx-h100")
    assert entry["estimate of 1 on pcie"] == "0.0 us"  # no calls, nothing to wait for
    assert meshsim.check_snapshot(path, "k", moved, topology="dgx-h100") == "matched"
    assert meshsim.check_snapshot(path, "k", moved) == "matched"  # no topology: nothing to check


def test_rewritten_lines_drop_the_estimates_that_priced_the_old_ones(tmp_path: Path) -> None:
    path = tmp_path / "x.ledger.json"
    small, big = [_ledger(_all_reduce(4))] * 2, [_ledger(_all_reduce(1 << 20))] * 2
    meshsim.check_snapshot(path, "k", small, topology="dgx-h100")
    meshsim.check_snapshot(path, "k", small, topology="pcie", update=True)  # adds pcie's, keeps h100's
    assert {"estimate of 2 on dgx-h100", "estimate of 2 on pcie"} <= set(
        json.loads(path.read_text())["tests"]["k"]
    )
    with pytest.raises(meshsim.SnapshotMismatchError, match=r"estimate of 2 on pcie: stored .* this run"):
        meshsim.check_snapshot(path, "k", big, topology="pcie")
    assert meshsim.check_snapshot(path, "k", big, update=True) == "updated"
    entry = json.loads(path.read_text())["tests"]["k"]
    assert [name for name in entry if name.startswith("estimate")] == []
    assert meshsim.check_snapshot(path, "k", big, topology="pcie", update=True) == "updated"
    assert json.loads(path.read_text())["tests"]["k"]["estimate of 2 on pcie"] == _estimate(big, "pcie")


def test_only_the_estimate_moving_is_a_mismatch_with_no_ranks(tmp_path: Path) -> None:
    path = tmp_path / "x.ledger.json"
    ledgers = [_ledger(_all_reduce(1 << 20))] * 2
    meshsim.check_snapshot(path, "k", ledgers, topology="dgx-a100")
    document = json.loads(path.read_text())
    document["tests"]["k"]["estimate of 2 on dgx-a100"] = "1.000 s"
    path.write_text(json.dumps(document))
    with pytest.raises(meshsim.SnapshotMismatchError, match=r"the collectives are the same") as caught:
        meshsim.check_snapshot(path, "k", ledgers, topology="dgx-a100")
    assert caught.value.ranks == ()
    assert "stored 1.000 s, this run " in str(caught.value)
