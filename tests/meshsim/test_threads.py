"""Rank threads are reused by later worlds only while they are as good as new."""

from __future__ import annotations

import contextvars
import os
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest
import torch
import torch.distributed as dist

import meshsim
from meshsim._engine import affinity as _affinity
from meshsim._engine import threads as _threads
from meshsim._process import patches as _patches

VAR: contextvars.ContextVar[str] = contextvars.ContextVar("VAR", default="unset")


@pytest.fixture(autouse=True)
def no_idle_threads() -> Iterator[None]:
    """Each test starts and ends with no idle rank thread, and starts with none that a failed
    world left stuck in C code (an earlier test's, still in its job: they end when it returns)."""
    meshsim.end_idle_threads()
    for thread in threading.enumerate():
        if thread.name.startswith(("meshsim-rank-", "meshsim-idle")):
            thread.join(30.0)
            assert not thread.is_alive(), f"a rank thread an earlier world left is still running: {thread}"
    yield
    meshsim.end_idle_threads()


def this_thread() -> threading.Thread:
    return threading.current_thread()


def test_a_clean_worlds_threads_serve_the_next_world() -> None:
    first = meshsim.run(this_thread, 4)
    assert _threads.idle_count() == 4
    assert all(t.name == "meshsim-idle" for t in first)
    second = meshsim.run(this_thread, 4)
    assert set(second) == set(first)
    assert meshsim.run(lambda: threading.current_thread().name, 4) == [f"meshsim-rank-{r}" for r in range(4)]


def test_a_failed_worlds_threads_end_with_it() -> None:
    first = meshsim.run(this_thread, 3)
    kept: list[threading.Thread] = []

    def body() -> None:
        kept.append(threading.current_thread())
        if dist.get_rank() == 2:
            raise ValueError("rank 2 fails")
        dist.barrier()

    with pytest.raises(meshsim.RankError, match="rank 2 fails"):
        meshsim.run(body, 3)
    assert set(kept) == set(first)  # the failed world ran on the idle threads...
    assert _threads.idle_count() == 0
    assert not any(t.is_alive() for t in kept)  # ...which ended before run() returned


def test_a_thread_whose_torch_state_changed_is_not_reused() -> None:
    def body() -> threading.Thread:
        if dist.get_rank() == 1:
            torch.set_grad_enabled(False)  # left off when the rank returns
        return threading.current_thread()

    first = meshsim.run(body, 3)
    assert _threads.idle_count() == 2
    assert not first[1].is_alive()
    second = meshsim.run(lambda: (threading.current_thread(), torch.is_grad_enabled()), 3)
    assert [grad for _, grad in second] == [True] * 3
    assert first[1] not in {t for t, _ in second}


@pytest.mark.parametrize(
    "leave",
    [
        pytest.param(torch.inference_mode, id="inference_mode"),
        pytest.param(lambda: torch.autocast("cpu"), id="autocast"),
        pytest.param(lambda: torch.autograd.graph.saved_tensors_hooks(id, id), id="saved_hooks"),
        pytest.param(lambda: torch.device("meta"), id="default_device"),
    ],
)
def test_any_torch_thread_state_left_behind_retires_the_thread(leave: Any) -> None:
    entered: list[Any] = []  # kept: some of these undo themselves when collected

    def body() -> None:
        if dist.get_rank() == 0:
            manager = leave()
            manager.__enter__()
            entered.append(manager)

    meshsim.run(body, 2)
    assert _threads.idle_count() == 1


def test_each_rank_starts_in_an_empty_context_as_a_new_thread_does() -> None:
    def body() -> str:
        seen = VAR.get()
        VAR.set(f"rank {dist.get_rank()}")
        return seen

    assert meshsim.run(body, 2) == ["unset", "unset"]
    assert _threads.idle_count() == 2
    assert meshsim.run(body, 2) == ["unset", "unset"]


def test_reused_threads_get_threadings_trace_hook_as_new_ones_do() -> None:
    def hook(frame: Any, event: str, arg: Any) -> None:
        return None

    meshsim.run(this_thread, 2)  # idle threads made before the hook was set
    threading.settrace(hook)
    try:
        seen = meshsim.run(lambda: sys.gettrace() is hook, 3)  # two reused, one new
    finally:
        threading.settrace(None)  # type: ignore[arg-type]
    assert seen == [True] * 3
    assert meshsim.run(lambda: sys.gettrace(), 3) == [None] * 3


def test_num_threads_none_gives_a_reused_thread_what_a_new_one_gets() -> None:
    meshsim.run(this_thread, 2, num_threads=2)
    caller = torch.get_num_threads()
    assert meshsim.run(torch.get_num_threads, 2, num_threads=None) == [caller] * 2


@pytest.mark.skipif(not hasattr(os, "sched_getaffinity"), reason="needs sched_getaffinity")
def test_free_running_ranks_on_reused_threads_run_where_the_caller_may() -> None:
    meshsim.run(this_thread, 2)  # serialized: its threads are pinned to one CPU
    caller = os.sched_getaffinity(0)
    assert meshsim.run(lambda: os.sched_getaffinity(0), 2, serialize=False) == [caller] * 2


@pytest.mark.skipif(
    not hasattr(os, "sched_getaffinity") or len(os.sched_getaffinity(0)) < 2,
    reason="needs two CPUs to choose from",
)
def test_a_world_runs_where_the_idle_threads_it_reuses_are_pinned(monkeypatch: pytest.MonkeyPatch) -> None:
    # Moving a rank thread to another CPU costs more than a world's set-up: meshsim.run keeps
    # its idle threads' CPU, wherever the caller happens to run when the world starts.
    meshsim.end_idle_threads()
    first = meshsim.run(lambda: os.sched_getaffinity(0), 2)  # new threads, pinned to one CPU
    assert len(first[0]) == 1 and first[0] == first[1], first
    (cpu,) = first[0]
    elsewhere = min(os.sched_getaffinity(0) - {cpu})
    monkeypatch.setattr(_affinity, "current_cpu", lambda allowed: elsewhere)  # the caller moved
    assert meshsim.run(lambda: os.sched_getaffinity(0), 2) == [{cpu}, {cpu}]


def _threads_of_the_process() -> dict[int, set[int]]:
    """Every thread of this process (Python's and native ones) and the CPUs it may run on."""
    found = {}
    for tid in os.listdir("/proc/self/task"):
        try:
            found[int(tid)] = os.sched_getaffinity(int(tid))
        except OSError:  # ended meanwhile
            pass
    return found


def _a_rank_with_two_intra_op_threads() -> tuple[set[int], int]:
    torch.ones(1 << 17).add_(1)  # a kernel large enough to fan out
    return os.sched_getaffinity(0), torch.get_num_threads()


@pytest.mark.skipif(
    not os.path.isdir("/proc/self/task") or len(os.sched_getaffinity(0)) < 2,
    reason="needs Linux's per-thread affinities and two CPUs",
)
def test_a_pinned_ranks_intra_op_threads_run_on_the_callers_cpus() -> None:
    # The rank stays on one CPU (cheap hand-overs); the threads its kernels fan out to must
    # not share it, or num_threads > 1 buys nothing.
    meshsim.end_idle_threads()
    caller = os.sched_getaffinity(0)
    before = _threads_of_the_process()
    ranks = meshsim.run(_a_rank_with_two_intra_op_threads, 2, num_threads=2)
    assert all(len(cpus) == 1 and threads == 2 for cpus, threads in ranks), ranks
    python_threads = {thread.native_id for thread in threading.enumerate()}
    native = {tid: cpus for tid, cpus in _threads_of_the_process().items() if tid not in before}
    native = {tid: cpus for tid, cpus in native.items() if tid not in python_threads}
    assert sum(cpus == caller for cpus in native.values()) >= 2, (native, caller)


def _affinity_of_a_forked_child() -> tuple[set[int], set[int]]:
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: report and leave at once
        os.write(write, ",".join(map(str, sorted(os.sched_getaffinity(0)))).encode())
        os._exit(0)
    os.close(write)
    with os.fdopen(read) as pipe:
        child = {int(cpu) for cpu in pipe.read().split(",")}
    os.waitpid(pid, 0)
    return os.sched_getaffinity(0), child


@pytest.mark.skipif(
    not hasattr(os, "sched_getaffinity") or not hasattr(os, "fork") or len(os.sched_getaffinity(0)) < 2,
    reason="needs fork and two CPUs to choose from",
)
def test_a_process_forked_from_a_pinned_rank_runs_where_the_caller_may() -> None:
    # A DataLoader's workers, forked from a rank, run as they would from a rank in its own process.
    caller = os.sched_getaffinity(0)
    (rank, child), _ = meshsim.run(_affinity_of_a_forked_child, 2)
    assert len(rank) == 1 and child == caller, (rank, child, caller)
    assert _affinity_of_a_forked_child() == (caller, caller)  # outside a world nothing changes


def test_a_world_that_cannot_install_itself_leaves_the_idle_threads_it_would_have_reused(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    meshsim.run(this_thread, 2)  # two idle threads for the next world
    idle = _threads.idle_count()

    def refuse(*args: object, **kwargs: object) -> None:
        raise RuntimeError("install refused")

    monkeypatch.setattr(_patches, "install", refuse)
    with pytest.raises(RuntimeError, match="install refused"):
        meshsim.run(this_thread, 2)
    assert _threads.idle_count() == idle


def test_idle_threads_are_capped(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(_threads, "MAX_IDLE", 3)
    threads = meshsim.run(this_thread, 5)
    assert _threads.idle_count() == 3
    assert sum(t.is_alive() for t in threads) == 3


def test_idle_threads_end_by_themselves(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(_threads, "IDLE_LIFETIME", 0.05)
    monkeypatch.setattr(_threads, "_POLL", 0.02)
    threads = meshsim.run(this_thread, 2)
    for thread in threads:
        thread.join(5.0)
    assert not any(t.is_alive() for t in threads)
    assert _threads.idle_count() == 0


def _reapers() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name == "meshsim-reaper"]


def test_the_reaper_runs_only_while_threads_are_idle(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(_threads, "IDLE_LIFETIME", 0.3)  # long enough to see it running
    monkeypatch.setattr(_threads, "_POLL", 0.02)
    meshsim.end_idle_threads()  # an earlier test's idle threads (and their reaper) may still wait
    assert _reapers() == []
    meshsim.run(this_thread, 2)
    reapers = _reapers()
    assert len(reapers) == 1  # idle threads park with no timeout: it ends them
    reapers[0].join(5.0)
    assert not reapers[0].is_alive() and _threads.idle_count() == 0


def test_end_idle_threads_ends_the_reaper_too() -> None:
    meshsim.run(this_thread, 3)
    assert len(_reapers()) == 1
    assert meshsim.end_idle_threads() == 3
    assert _reapers() == []


def test_reuse_can_be_turned_off(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MESHSIM_REUSE_THREADS", "0")
    threads = meshsim.run(this_thread, 2)
    assert _threads.idle_count() == 0
    assert not any(t.is_alive() for t in threads)


def test_end_idle_threads_rejects_a_bad_timeout() -> None:
    with pytest.raises(ValueError, match="timeout must be a positive number of seconds, got -1"):
        meshsim.end_idle_threads(timeout=-1)


def test_a_rank_blocked_in_c_code_is_left_and_its_thread_never_reused() -> None:
    def body() -> threading.Thread:
        if dist.get_rank() == 1:
            time.sleep(3.0)  # in C: the stop cannot interrupt it (reported after timeout + probe)
        dist.barrier()
        return threading.current_thread()

    with pytest.raises(meshsim.DeadlockError):
        meshsim.run(body, 2, timeout=0.2)
    stuck = [t for t in threading.enumerate() if t.name == "meshsim-rank-1"]
    assert len(stuck) == 1
    stuck[0].join(10.0)
    assert not stuck[0].is_alive()  # it ended once its job did
    assert _threads.idle_count() == 0


_FORK_CHILD = """
import os
import torch.distributed as dist
import meshsim
from meshsim._engine import threads as _threads

meshsim.run(lambda: None, 2)
assert _threads.idle_count() == 2
pid = os.fork()
if pid == 0:  # the child: its idle threads did not survive the fork; worlds still run
    ok = _threads.idle_count() == 0 and meshsim.run(dist.get_rank, 2, timeout=10) == [0, 1]
    os._exit(0 if ok else 1)
_, status = os.waitpid(pid, 0)
print("child exit code", os.waitstatus_to_exitcode(status))
"""


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs fork")
def test_a_forked_child_starts_with_no_idle_threads() -> None:
    # in a fresh interpreter: forking the test process itself (xdist's threads) could deadlock
    result = subprocess.run(
        [sys.executable, "-c", _FORK_CHILD], capture_output=True, text=True, timeout=120, check=False
    )
    assert result.returncode == 0, result.stderr
    assert "child exit code 0" in result.stdout


_FAKE_MODE_AFTER_ENDED_THREADS = """
import torch
import torch.distributed as dist
from torch._subclasses.fake_tensor import FakeTensorMode

import meshsim

def enter_fake_mode_then_fail() -> None:
    with FakeTensorMode():
        pass
    if dist.get_rank() == 1:
        raise ValueError("rank 1 fails")

try:
    meshsim.run(enter_fake_mode_then_fail, 2)
except meshsim.RankError:
    pass

def enter_fake_mode() -> tuple[int, ...]:
    with FakeTensorMode():
        return tuple(torch.empty(3, 2).shape)

print(meshsim.run(enter_fake_mode, 2))
"""


def test_fake_tensor_mode_works_after_the_threads_that_first_entered_it_ended() -> None:
    # torch 2.11 keeps the no-op CUDA guard FakeTensorMode registers (without a GPU)
    # in the first entering thread's thread_local: a later entry segfaulted once that
    # rank thread had ended. A fresh interpreter: the first entry must be a rank's.
    result = subprocess.run(
        [sys.executable, "-c", _FAKE_MODE_AFTER_ENDED_THREADS],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.strip() == "[(3, 2), (3, 2)]"


@pytest.mark.skipif(
    not hasattr(os, "sched_getaffinity") or len(os.sched_getaffinity(0)) < 2,
    reason="needs two CPUs to choose from",
)
def test_a_pinned_world_whose_process_gets_too_little_cpu_lets_the_os_place_its_threads() -> None:
    # A serialized world runs on one CPU. If its process then gets well under one CPU over a
    # second (another process pinned there, or, as here, a rank that does not compute), the
    # world gives the pinning up: every rank thread may run on the caller's CPUs again.
    caller = os.sched_getaffinity(0)

    def body() -> tuple[set[int], set[int]]:
        pinned = os.sched_getaffinity(0)
        dist.barrier()  # every rank has looked before rank 0 sleeps
        if dist.get_rank() == 0:
            time.sleep(2.5)  # no CPU for longer than the world's one-second window
        dist.barrier()
        return pinned, os.sched_getaffinity(0)

    results = meshsim.run(body, 2)
    assert [len(pinned) for pinned, _ in results] == [1, 1]
    assert [after for _, after in results] == [caller, caller]
