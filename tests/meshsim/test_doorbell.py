"""Doorbells, the way a parked rank thread is woken: eventfds where possible, locks elsewhere.

Every test here is ordered by what it waits for, never by sleeping: a wait that
should end is bounded by a long timeout whose expiry fails the test, and a wait that
should not end is a zero-timeout ``wait`` that returns False.
"""

from __future__ import annotations

import gc
import os
import threading
import time
from collections.abc import Callable, Iterator

import pytest
import torch
import torch.distributed as dist

import meshsim
from meshsim._baton import doorbell as _doorbell
from meshsim._baton.doorbell import Doorbell, EventBell, LockBell
from meshsim._baton.scheduler import Scheduler
from meshsim._engine import threads as _threads
from meshsim._engine import world as _world
from meshsim._sim.collectives import Barrier
from meshsim._sim.rendezvous import Call, Rendezvous
from meshsim._sim.store import SimStore

KINDS = [pytest.param(LockBell, id="lock")]
if hasattr(os, "eventfd"):
    KINDS.append(pytest.param(EventBell, id="eventfd"))

LONG = 30.0  # a wait that should end: if it runs out, the test fails


@pytest.fixture(params=KINDS)
def bell(request: pytest.FixtureRequest) -> Iterator[Doorbell]:
    made: Doorbell = request.param()
    yield made
    made.close()


def test_a_wait_without_a_ring_times_out(bell: Doorbell) -> None:
    assert bell.wait(0.0) is False
    assert bell.wait(0.01) is False


def test_a_ring_before_the_wait_is_kept_for_it(bell: Doorbell) -> None:
    bell.ring()
    assert bell.wait(LONG) is True
    assert bell.wait(0.0) is False  # used up


def test_rings_before_a_wait_count_once(bell: Doorbell) -> None:
    bell.ring()
    bell.ring()
    assert bell.wait(LONG) is True
    assert bell.wait(0.0) is False


def test_a_ring_from_another_thread_ends_a_wait(bell: Doorbell) -> None:
    results: list[bool] = []
    waiter = threading.Thread(target=lambda: results.append(bell.wait(LONG)))
    waiter.start()
    bell.ring()  # before or during the wait: either way it ends it
    waiter.join(LONG)
    assert results == [True]


def test_a_park_uses_up_the_rings_before_it_and_ends_on_a_ring(bell: Doorbell) -> None:
    bell.ring()
    bell.ring()
    bell.park()  # rung before: returns
    assert bell.wait(0.0) is False  # both rings went to the park

    parked = threading.Thread(target=bell.park, daemon=True)  # never keeps the process up
    parked.start()
    bell.ring()
    parked.join(LONG)
    assert not parked.is_alive()


def _ring_all_reduce() -> list[float]:
    x = torch.full((3,), float(dist.get_rank()))
    for _ in range(20):
        dist.all_reduce(x)
        dist.barrier()
    return x.tolist()


def test_the_world_nudges_parked_ranks_so_a_lost_wake_up_is_not_a_hang(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Rank 0's first wake-up of rank 1 is lost; the world's nudges start rank 1 anyway.

    Without nudges the world would make no progress and fail at its timeout, long
    before the test's own.
    """
    dropped: list[str] = []
    for kind in (LockBell, EventBell):
        real = kind.ring

        def lossy(self: Doorbell, real: Callable[[Doorbell], None] = real) -> None:
            if not dropped and threading.current_thread().name == "meshsim-rank-0":
                dropped.append(type(self).__name__)
                return
            real(self)

        monkeypatch.setattr(kind, "ring", lossy)
    monkeypatch.setattr(_world, "SAFETY_POLL", 0.05)  # the nudges' period
    assert meshsim.run(_ring_all_reduce, 2, timeout=5.0) == [[2.0**19] * 3] * 2
    assert len(dropped) == 1


# -- an unserialized scheduler: a woken rank runs at once ----------------------------------
# Without serialization a rank must run as soon as what it waits for is done. A wake-up
# left pending until the waker's next call into the scheduler would keep it parked while
# the waker went on; here the waker goes on to wait for the woken rank, outside meshsim.


def _until(condition: Callable[[], bool]) -> None:
    deadline = time.monotonic() + LONG
    while not condition():
        assert time.monotonic() < deadline, "the condition never held"
        time.sleep(0)


def _woken_while_the_waker_waits(
    make: Callable[[Scheduler], tuple[Callable[[], None], Callable[[], None]]],
) -> bool:
    """Rank 0 (a thread) runs ``wait``; once it is blocked there, rank 1 (this thread) runs
    ``wake`` and then waits, outside the scheduler, for rank 0 to get through."""
    bells = [LockBell(), LockBell()]
    sched = Scheduler(2, bells, serialize=False)
    wait, wake = make(sched)
    started, through = threading.Event(), threading.Event()

    def rank_0() -> None:
        sched.start(0)
        started.set()
        wait()
        through.set()

    thread = threading.Thread(target=rank_0, daemon=True)
    thread.start()
    try:
        sched.begin()
        sched.start(1)
        assert started.wait(LONG)
        _until(lambda: sched.running_idents() == [threading.get_ident()])  # rank 0 blocked in `wait`
        wake()
        return through.wait(LONG)
    finally:
        sched.abort(RuntimeError("test over"))
        thread.join(LONG)


def test_the_last_rank_to_arrive_lets_the_others_run_before_it_goes_on() -> None:
    def make(sched: Scheduler) -> tuple[Callable[[], None], Callable[[], None]]:
        rendezvous = Rendezvous(sched)
        group = rendezvous.group("g", (0, 1), 0)
        return (
            lambda: rendezvous.meet(group, 0, Call(0, Barrier(), (), "here"), 0),
            lambda: rendezvous.meet(group, 0, Call(1, Barrier(), (), "here"), 1),
        )

    assert _woken_while_the_waker_waits(make)


def test_a_store_write_lets_the_ranks_waiting_for_its_key_run_before_it_returns() -> None:
    def make(sched: Scheduler) -> tuple[Callable[[], None], Callable[[], None]]:
        store = SimStore(sched, lambda: 1 if threading.current_thread() is threading.main_thread() else 0)
        return lambda: store.wait(["key"]), lambda: store.set("key", b"value")

    assert _woken_while_the_waker_waits(make)


# -- which doorbell a rank thread gets ------------------------------------------------------


def _no_rank_threads_left() -> None:
    """End the idle rank threads, and wait for the ones failed worlds left behind.

    A rank thread that an earlier world could not stop (stuck in C code: an earlier
    test's rank in ``Event.wait(5)``) keeps its doorbell, an eventfd that counts
    against the budget, until its job returns; the tests below count rank threads
    and eventfds, so they start without any.
    """
    meshsim.end_idle_threads()  # idle threads' eventfds count against the budget
    for thread in threading.enumerate():
        if thread.name.startswith(("meshsim-rank-", "meshsim-idle")):
            thread.join(LONG)
            assert not thread.is_alive(), f"a rank thread an earlier world left is still running: {thread}"


def _new_threads_bells(count: int) -> list[type]:
    """The doorbell kinds of ``count`` new rank threads (never started, then retired)."""
    _no_rank_threads_left()
    workers, fresh = _threads.take(count)
    assert fresh == workers
    kinds = [type(w.bell) for w in workers]
    for worker in workers:
        assert worker.retire(LONG)
    return kinds


@pytest.mark.skipif(not hasattr(os, "eventfd"), reason="eventfd is Linux-only")
def test_rank_threads_past_the_descriptor_share_use_locks(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(_doorbell, "_fd_limit", lambda: 64)  # 64 // 16 = 4 eventfds at most
    assert _new_threads_bells(6) == [EventBell] * 4 + [LockBell] * 2
    assert _new_threads_bells(6) == [EventBell] * 4 + [LockBell] * 2  # closed ones were given back


@pytest.mark.skipif(not hasattr(os, "eventfd"), reason="eventfd is Linux-only")
def test_running_out_of_descriptors_falls_back_to_locks(monkeypatch: pytest.MonkeyPatch) -> None:
    made: list[int] = []
    real = os.eventfd

    def scarce(initval: int, flags: int = os.EFD_CLOEXEC) -> int:
        if len(made) == 2:
            raise OSError(24, "Too many open files")
        fd = real(initval, flags)
        made.append(fd)
        return fd

    monkeypatch.setattr(os, "eventfd", scarce)
    assert _new_threads_bells(4) == [EventBell] * 2 + [LockBell] * 2
    for fd in made:  # retiring a thread closes its doorbell
        with pytest.raises(OSError):
            os.fstat(fd)


@pytest.mark.skipif(not hasattr(os, "eventfd"), reason="eventfd is Linux-only")
def test_a_rank_thread_that_outlives_its_retire_timeout_closes_its_doorbell_when_it_ends(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A failed world retires its finished rank threads with a short grace (1 s); one that a
    loaded machine kept from ending in time must still close its eventfd when it does end,
    or the descriptor and its place in the budget were lost for good."""
    made: list[int] = []
    real = os.eventfd

    def recorded(initval: int, flags: int = os.EFD_CLOEXEC) -> int:
        made.append(real(initval, flags))
        return made[-1]

    _no_rank_threads_left()
    monkeypatch.setattr(os, "eventfd", recorded)
    monkeypatch.setattr(_doorbell, "_fd_limit", lambda: 1 << 16)
    (worker,), fresh = _threads.take(1)
    assert fresh == [worker] and isinstance(worker.bell, EventBell) and len(made) == 1
    started, release = threading.Event(), threading.Event()
    worker.assign(lambda: (started.set(), release.wait(LONG)), _threads.Countdown(1), "meshsim-rank-0")
    worker.thread.start()
    assert started.wait(LONG)
    assert worker.retire(0.01) is False  # still in its job: the grace ran out
    os.fstat(made[0])  # open while the thread runs
    release.set()
    worker.thread.join(LONG)
    assert not worker.thread.is_alive()
    with pytest.raises(OSError):
        os.fstat(made[0])
    assert _threads._EVENTFDS[0] == 0  # its place in the budget is free again


@pytest.mark.parametrize(("fd_limit", "kind"), [(1 << 16, EventBell), (0, LockBell)], ids=["eventfd", "lock"])
def test_worlds_run_the_same_on_either_doorbell(
    monkeypatch: pytest.MonkeyPatch, fd_limit: int, kind: type
) -> None:
    if kind is EventBell and not hasattr(os, "eventfd"):
        pytest.skip("eventfd is Linux-only")
    monkeypatch.setattr(_doorbell, "_fd_limit", lambda: fd_limit)
    meshsim.end_idle_threads()  # new rank threads, with doorbells made under this limit
    assert meshsim.run(_ring_all_reduce, 4) == [[6.0 * 4.0**19] * 3] * 4
    idle, fresh = _threads.take(4)  # the world's threads, idle again
    assert fresh == []
    assert [type(w.bell) for w in idle] == [kind] * 4
    for worker in idle:
        assert worker.retire(LONG)


@pytest.mark.skipif(not os.path.isdir("/proc/self/fd"), reason="counts descriptors through /proc")
def test_a_rank_left_stuck_in_c_code_keeps_its_doorbells_until_it_ends() -> None:
    release = threading.Event()

    def body() -> None:
        if dist.get_rank() == 1:
            release.wait(LONG)  # in C: the stop cannot interrupt it
        dist.barrier()

    def eventfds() -> int:
        links = []
        for fd in os.listdir("/proc/self/fd"):
            try:
                links.append(os.readlink(f"/proc/self/fd/{fd}"))
            except OSError:
                pass  # the listing's own descriptor
        return links.count("anon_inode:[eventfd]")

    _no_rank_threads_left()  # they keep their doorbells
    gc.collect()
    before = eventfds()
    with pytest.raises(meshsim.DeadlockError) as info:
        meshsim.run(body, 2, timeout=0.3)
    notes = "\n".join(getattr(info.value, "__notes__", []))
    assert "could not stop rank thread(s) [1]" in notes and "left as daemon threads" in notes
    del info  # the error's traceback holds the world
    stuck = [t for t in threading.enumerate() if t.name == "meshsim-rank-1"]
    assert len(stuck) == 1
    assert eventfds() > before  # the stuck thread still holds its doorbell
    release.set()
    stuck[0].join(LONG)
    gc.collect()
    assert eventfds() == before
