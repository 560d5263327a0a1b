"""Kept rank processes (``--mesh-spawn=pool``): reused across tests, put back after each, or replaced.

The bodies below run in the pool's rank processes; each writes what the test checks
(its pid, what it saw) to a file in ``tmp_path``, named by the body's rank.
"""

from __future__ import annotations

import ast
import gc
import hashlib
import os
import re
import sys
import threading
import time
import types
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from meshsim import RankError
from meshsim._modes.spawn import TestTarget as Target
from meshsim._modes.spawn_pool import RankPools

pytestmark = pytest.mark.slow  # rank processes that import torch (once per module)


def _note(folder: str, what: str, value: object) -> None:
    Path(folder, f"{what}-{dist.get_rank()}").write_text(repr(value))


def _notes(folder: Path, what: str, world_size: int) -> list[object]:
    return [ast.literal_eval(Path(folder, f"{what}-{rank}").read_text()) for rank in range(world_size)]


def note_pid(folder: str) -> None:
    _note(folder, "pid", os.getpid())
    dist.barrier()


def _rng_digest() -> str:
    return hashlib.sha256(torch.get_rng_state().numpy().tobytes()).hexdigest()


def change_process_state(folder: str) -> None:
    _note(folder, "rng", _rng_digest())  # torch seeds each process afresh: its state as the test starts
    torch.set_default_dtype(torch.float64)
    torch.manual_seed(1234)
    torch.set_grad_enabled(False)
    os.environ["MESHSIM_TEST_LEFT_BEHIND"] = "1"
    os.chdir(folder)
    dist.new_group([0, 1])  # destroyed with the default group when the test ends
    _note(folder, "pid", os.getpid())


def note_process_state(folder: str) -> None:
    state = (
        str(torch.get_default_dtype()),
        _rng_digest(),
        torch.is_grad_enabled(),
        os.environ.get("MESHSIM_TEST_LEFT_BEHIND"),
        os.environ.get("MESHSIM_TEST_FROM_PARENT"),
        os.getcwd() == folder,
    )
    _note(folder, "state", state)
    _note(folder, "pid", os.getpid())


def patch_with_monkeypatch(folder: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch, "meshsim_test_patched", True, raising=False)
    _note(folder, "pid", os.getpid())


def note_patched(folder: str) -> None:
    _note(folder, "patched", hasattr(torch, "meshsim_test_patched"))


def exit_on_rank_1(folder: str) -> None:
    _note(folder, "pid", os.getpid())
    if dist.get_rank() == 1:
        os._exit(3)


def hang_on_rank_1(folder: str) -> None:
    _note(folder, "pid", os.getpid())
    if dist.get_rank() == 1:
        time.sleep(600)


def leave_a_thread_on_rank_0(folder: str) -> None:
    _note(folder, "pid", os.getpid())
    if dist.get_rank() == 0:
        threading.Thread(target=threading.Event().wait, name="left-behind", daemon=True).start()


def make_groups_and_count_threads(folder: str) -> None:
    """Groups in reference cycles (a 2-D mesh, DTensor): freed, with their threads, when the test ends."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (2, 2))
    distribute_tensor(torch.ones(4, 4), mesh, [Shard(0), Shard(1)]).full_tensor()
    cycle: list[object] = [mesh]
    cycle.append(cycle)
    gc.collect()  # the cycle, alive, moves to the oldest generation: rarely collected on its own
    _note(folder, "threads", len(os.listdir("/proc/self/task")))


_KEPT: list[object] = []


def keep_a_group_alive(folder: str) -> None:
    """A group (and its threads) a module keeps past the test: destroyed, but never freed."""
    group = dist.new_group([0, 1])
    dist.barrier(group=group)
    _KEPT.append(group)
    _note(folder, "pid", os.getpid())


def _target(body: object) -> Target:
    return Target(__name__, __file__, body.__qualname__)  # type: ignore[attr-defined]


@pytest.fixture(scope="module")
def pools() -> Iterator[RankPools]:
    pools = RankPools()
    yield pools
    pools.close()


def _run(pools: RankPools, body: object, folder: Path, world_size: int = 2, **kwargs: object) -> list[int]:
    """Run ``body`` on ``world_size`` kept ranks; returns the pids its ranks ran in."""
    pools.run(_target(body), {"folder": str(folder), **kwargs}, world_size, timeout=30.0)
    return _notes(folder, "pid", world_size)  # type: ignore[return-value]


def _alive(pid: int) -> bool:
    return Path(f"/proc/{pid}").exists() if Path("/proc").is_dir() else _signalable(pid)


def _signalable(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def test_tests_run_on_the_same_processes_whatever_their_world_size(pools: RankPools, tmp_path: Path) -> None:
    first = _run(pools, note_pid, tmp_path)
    again = _run(pools, note_pid, tmp_path)
    wider = _run(pools, note_pid, tmp_path, world_size=3)
    assert again == first
    assert wider[:2] == first  # a wider test takes the processes it shares and adds one
    assert len(set(wider)) == 3


def test_what_a_test_changes_in_its_process_is_put_back(
    pools: RankPools, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    changed = _run(pools, change_process_state, tmp_path)
    monkeypatch.setenv("MESHSIM_TEST_FROM_PARENT", "yes")  # this process's environment reaches the ranks
    after = _run(pools, note_process_state, tmp_path)
    assert after == changed
    rngs = _notes(tmp_path, "rng", 2)
    expected = [("torch.float32", rng, True, None, "yes", False) for rng in rngs]
    assert _notes(tmp_path, "state", 2) == expected


def test_what_a_rank_patched_with_monkeypatch_is_undone(pools: RankPools, tmp_path: Path) -> None:
    _run(pools, patch_with_monkeypatch, tmp_path, monkeypatch=pytest.MonkeyPatch())
    _run(pools, note_patched, tmp_path)
    assert _notes(tmp_path, "patched", 2) == [False, False]


def test_a_rank_whose_process_exits_fails_the_test_and_the_next_test_gets_a_new_process(
    pools: RankPools, tmp_path: Path
) -> None:
    before = _run(pools, note_pid, tmp_path)
    with pytest.raises(RankError, match=r"rank 1 of 2 raised(.|\n)*exited with code 3"):
        _run(pools, exit_on_rank_1, tmp_path)
    after = _run(pools, note_pid, tmp_path)
    assert after[0] == before[0]
    assert after[1] != before[1]
    assert not _alive(before[1])


def test_a_hanging_rank_is_ended_by_the_timeout_and_replaced(pools: RankPools, tmp_path: Path) -> None:
    before = _run(pools, note_pid, tmp_path)
    with pytest.raises(RankError, match=r"rank 1 of 2 raised(.|\n)*did not finish within 3 s"):
        pools.run(_target(hang_on_rank_1), {"folder": str(tmp_path)}, 2, timeout=3.0)
    assert not _alive(before[1])
    after = _run(pools, note_pid, tmp_path)
    assert (after[0], after[1] != before[1]) == (before[0], True)


def test_a_process_a_test_left_a_thread_running_in_is_replaced(pools: RankPools, tmp_path: Path) -> None:
    before = _run(pools, leave_a_thread_on_rank_0, tmp_path)  # the test itself passes
    after = _run(pools, note_pid, tmp_path)
    assert (after[0] != before[0], after[1]) == (True, before[1])
    rank, why = pools.statistics().replaced[-1]
    assert (rank, why) == (0, "the test left thread(s) running in it: left-behind")


def test_an_argument_a_rank_cannot_unpickle_fails_the_test_and_keeps_the_processes(
    pools: RankPools, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    parent_only = types.ModuleType("meshsim_test_parent_only")  # no rank process can import it
    exec("class Thing:\n    pass", parent_only.__dict__)
    monkeypatch.setitem(sys.modules, parent_only.__name__, parent_only)
    before = _run(pools, note_pid, tmp_path)
    with pytest.raises(
        RankError, match=r"could not be received(.|\n)*No module named 'meshsim_test_parent_only'"
    ):
        _run(pools, note_pid, tmp_path, thing=parent_only.Thing())
    assert _run(pools, note_pid, tmp_path) == before


@pytest.mark.skipif(not Path("/proc/self/task").is_dir(), reason="counts threads in /proc")
def test_a_kept_process_does_not_gather_threads_test_after_test(pools: RankPools, tmp_path: Path) -> None:
    counts = []
    for _ in range(4):
        pools.run(_target(make_groups_and_count_threads), {"folder": str(tmp_path)}, 4, timeout=30.0)
        counts.append(_notes(tmp_path, "threads", 4))
    assert counts[3] == counts[1], counts  # the first test may start torch's own pools


@pytest.mark.skipif(not Path("/proc/self/task").is_dir(), reason="counts threads in /proc")
def test_a_process_that_holds_threads_past_the_bound_is_replaced(tmp_path: Path) -> None:
    pools = RankPools(spare_threads=2)  # a gloo group has more than 2 threads of its own
    try:
        first = _run(pools, note_pid, tmp_path)  # torch starts its own threads in a process's first test
        kept = _run(pools, keep_a_group_alive, tmp_path)
        after = _run(pools, note_pid, tmp_path)
        reasons = [why for _, why in pools.statistics().replaced]
    finally:
        pools.close()
    assert kept == first and not set(kept) & set(after)
    assert len(reasons) == 2, reasons  # both ranks' processes
    assert all(
        re.fullmatch(r"it held \d+ threads more than it started with \(process groups .*\)", why)
        for why in reasons
    )


def test_closing_ends_every_process(tmp_path: Path) -> None:
    pools = RankPools()
    try:
        pids = _run(pools, note_pid, tmp_path)
        assert all(_alive(pid) for pid in pids)
    finally:
        pools.close()
    assert not any(_alive(pid) for pid in pids)
    assert pools.pids() == []
