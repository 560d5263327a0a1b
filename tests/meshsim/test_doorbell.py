"""Doorbells, the way a parked rank thread is woken: eventfds where possible, locks elsewhere."""

from __future__ import annotations

import gc
import os
import threading
import time
from collections.abc import Callable, Sequence

import pytest
import torch
import torch.distributed as dist

import meshsim
from meshsim import _doorbell, _threads, _world
from meshsim import _scheduler as _scheduler_module
from meshsim._collectives import Barrier
from meshsim._doorbell import Doorbell, EventBell, LockBell
from meshsim._rendezvous import Call, Rendezvous
from meshsim._scheduler import Scheduler
from meshsim._store import SimStore

KINDS = [pytest.param(LockBell, id="lock")]
if hasattr(os, "eventfd"):
    KINDS.append(pytest.param(EventBell, id="eventfd"))


@pytest.fixture(params=KINDS)
def bell(request: pytest.FixtureRequest) -> Doorbell:
    made: Doorbell = request.param()
    yield made
    made.close()


def test_a_ring_before_the_wait_lets_it_return_at_once(bell: Doorbell) -> None:
    bell.ring()
    start = time.monotonic()
    bell.wait(5.0)
    assert time.monotonic() - start < 1.0


def test_rings_before_a_wait_count_once(bell: Doorbell) -> None:
    bell.ring()
    bell.ring()
    bell.wait(5.0)
    start = time.monotonic()
    bell.wait(0.05)  # nothing pending: this one times out
    assert time.monotonic() - start >= 0.04


def test_a_ring_wakes_a_waiting_thread(bell: Doorbell) -> None:
    woke = threading.Event()

    def waiter() -> None:
        bell.wait(5.0)
        woke.set()

    thread = threading.Thread(target=waiter)
    thread.start()
    time.sleep(0.05)
    assert not woke.is_set()
    bell.ring()
    assert woke.wait(2.0)
    thread.join(2.0)


def test_a_park_returns_when_rung_and_rings_before_it_count_once(bell: Doorbell) -> None:
    bell.ring()
    bell.ring()
    start = time.monotonic()
    bell.park()  # rung before: returns at once
    assert time.monotonic() - start < 1.0
    bell.wait(0.05)  # both rings were used up by the park
    assert time.monotonic() - start >= 0.04

    parked = threading.Thread(target=bell.park, daemon=True)  # never keeps the process up
    parked.start()
    time.sleep(0.05)
    assert parked.is_alive()
    bell.ring()
    parked.join(2.0)
    assert not parked.is_alive()


def _nothing() -> None:
    pass


def _scheduler(world_size: int) -> tuple[Scheduler, list[Doorbell]]:
    bells: list[Doorbell] = [_threads._new_bell() for _ in range(world_size)]
    nothing = [_nothing] * world_size
    sched = Scheduler(world_size, bells, serialize=True, switch_out=nothing, switch_in=nothing)
    return sched, bells


def test_a_nudge_wakes_a_parked_rank_whose_wake_up_was_lost() -> None:
    sched, bells = _scheduler(1)
    started = threading.Event()
    thread = threading.Thread(target=lambda: (sched.start(0), started.set()), daemon=True)
    thread.start()
    try:
        time.sleep(0.1)
        assert not started.is_set()  # parked: not its turn yet
        sched._holder = 0  # its turn, as a hand-over would make it, but with no ring
        time.sleep(0.1)
        assert not started.is_set()
        sched.nudge()
        assert started.wait(2.0)
    finally:
        sched.abort(RuntimeError("test over"))
        thread.join(2.0)
        for bell in bells:
            bell.close()


def test_the_world_nudges_parked_ranks_so_a_lost_wake_up_costs_a_nudge_period(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    real = _scheduler_module._ring
    dropped: list[int] = []

    def lossy(bells: list[Doorbell], ranks: Sequence[int]) -> None:
        if 1 in ranks and not dropped and threading.current_thread().name == "meshsim-rank-0":
            dropped.append(1)  # the first wake-up rank 0 sends rank 1 is lost
            ranks = [r for r in ranks if r != 1]
        real(bells, ranks)

    monkeypatch.setattr(_scheduler_module, "_ring", lossy)
    monkeypatch.setattr(_world, "SAFETY_POLL", 0.2)  # the nudges' period
    start = time.monotonic()
    assert meshsim.run(_ring_all_reduce, 2, timeout=30.0) == [[2.0**19] * 3] * 2
    assert dropped == [1]
    assert time.monotonic() - start < 10.0  # not the 30 s timeout


class _CountingBell:
    """A lock doorbell that counts its rings."""

    def __init__(self) -> None:
        self.rings = 0
        self._bell = LockBell()

    def ring(self) -> None:
        self.rings += 1
        self._bell.ring()

    def wait(self, timeout: float) -> None:
        self._bell.wait(timeout)

    def park(self) -> None:
        self._bell.park()

    def close(self) -> None:
        self._bell.close()


def _parked_in_a_wait(sched: Scheduler, rank: int) -> bool:
    """Whether ``rank`` waits and sleeps at its doorbell, so that only a ring wakes it."""
    with sched.lock:
        return sched._state[rank] == "blocked" and sched._parked[rank]


_Actions = tuple[Callable[[], None], Callable[[], None]]


def _rings_while(make: Callable[[Scheduler], _Actions]) -> int:
    """How often rank 0's doorbell rang while this thread ran a wake-up, counted as it returned.

    ``make(scheduler)`` gives ``(wait, wake)``. Rank 0 runs ``wait`` in a thread of its
    own and sleeps in it; then this thread, as rank 1, runs ``wake``. The world is
    not serialized, so nothing but that wake-up rings rank 0 meanwhile.
    """
    bells = [_CountingBell(), _CountingBell()]
    nothing = [_nothing] * 2
    sched = Scheduler(2, bells, serialize=False, switch_out=nothing, switch_in=nothing)
    wait, wake = make(sched)

    def rank_0() -> None:
        sched.start(0)
        wait()

    thread = threading.Thread(target=rank_0, daemon=True)
    thread.start()
    try:
        sched.begin()
        sched.start(1)  # rank 1 is this thread
        deadline = time.monotonic() + 5.0
        while not _parked_in_a_wait(sched, 0):
            assert time.monotonic() < deadline
            time.sleep(0.001)
        rings = bells[0].rings
        wake()
        rung = bells[0].rings - rings
        thread.join(2.0)
        assert not thread.is_alive()
        return rung
    finally:
        sched.abort(RuntimeError("test over"))
        thread.join(2.0)


# Without serialization a rank runs as soon as it is woken: a wake-up left pending
# until the next release of the lock kept it parked while the waker ran on.


def test_the_last_rank_to_arrive_wakes_the_others_before_it_goes_on() -> None:
    def make(sched: Scheduler) -> _Actions:
        rendezvous = Rendezvous(sched)
        group = rendezvous.group("g", (0, 1), 0)

        def barrier(rank: int) -> Call:
            return Call(rank, Barrier(), (), "here")

        return (
            lambda: rendezvous.meet(group, 0, barrier(0), 0),
            lambda: rendezvous.meet(group, 0, barrier(1), 1),
        )

    assert _rings_while(make) == 1


def test_a_store_write_wakes_the_ranks_waiting_for_its_key_before_it_returns() -> None:
    def make(sched: Scheduler) -> _Actions:
        store = SimStore(sched, lambda: 1 if threading.current_thread() is threading.main_thread() else 0)
        return lambda: store.wait(["key"]), lambda: store.set("key", b"value")

    assert _rings_while(make) == 1


def _take_and_retire(count: int) -> list[type]:
    """The doorbell kinds of ``count`` new rank threads (never started, then retired)."""
    meshsim.end_idle_threads()  # idle threads' eventfds count against the budget
    workers, fresh = _threads.take(count)
    assert fresh == workers
    kinds = [type(w.bell) for w in workers]
    for worker in workers:
        assert worker.retire(1.0)
    return kinds


@pytest.mark.skipif(not hasattr(os, "eventfd"), reason="eventfd is Linux-only")
def test_rank_threads_past_the_descriptor_share_use_locks(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(_doorbell, "_fd_limit", lambda: 64)  # 64 // 16 = 4 eventfds at most
    assert _take_and_retire(6) == [EventBell] * 4 + [LockBell] * 2
    assert _take_and_retire(6) == [EventBell] * 4 + [LockBell] * 2  # closed ones were given back


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
    assert _take_and_retire(4) == [EventBell] * 2 + [LockBell] * 2
    for fd in made:  # retiring a thread closes its doorbell
        with pytest.raises(OSError):
            os.fstat(fd)


def _ring_all_reduce() -> list[float]:
    x = torch.full((3,), float(dist.get_rank()))
    for _ in range(20):
        dist.all_reduce(x)
        dist.barrier()
    return x.tolist()


@pytest.mark.parametrize(
    ("fd_limit", "kind"), [(1 << 16, "EventBell"), (0, "LockBell")], ids=["eventfd", "lock"]
)
def test_worlds_run_the_same_on_either_doorbell(
    monkeypatch: pytest.MonkeyPatch, fd_limit: int, kind: str
) -> None:
    if kind == "EventBell" and not hasattr(os, "eventfd"):
        pytest.skip("eventfd is Linux-only")
    monkeypatch.setattr(_doorbell, "_fd_limit", lambda: fd_limit)
    meshsim.end_idle_threads()  # new rank threads, with doorbells made under this limit
    results = meshsim.run(_ring_all_reduce, 4)
    expected = [6.0 * 4.0**19] * 3
    assert results == [expected] * 4
    idle = _threads._POOL.take_all()
    for worker in idle:
        assert worker.retire(5.0)
    assert [type(w.bell).__name__ for w in idle] == [kind] * 4


@pytest.mark.skipif(not os.path.isdir("/proc/self/fd"), reason="counts descriptors through /proc")
def test_a_rank_left_stuck_in_c_code_keeps_its_doorbells_until_it_ends() -> None:
    def body() -> None:
        if dist.get_rank() == 1:
            time.sleep(2.5)  # in C: the stop cannot interrupt it
        dist.barrier()

    def eventfds() -> int:
        links = []
        for fd in os.listdir("/proc/self/fd"):
            try:
                links.append(os.readlink(f"/proc/self/fd/{fd}"))
            except OSError:
                pass  # the listing's own descriptor
        return links.count("anon_inode:[eventfd]")

    meshsim.end_idle_threads()  # they keep their doorbells
    gc.collect()
    before = eventfds()
    with pytest.raises(meshsim.DeadlockError) as info:
        meshsim.run(body, 2, timeout=0.3)
    notes = "\n".join(getattr(info.value, "__notes__", []))
    assert "could not stop rank thread(s) [1]" in notes and "left as daemon threads" in notes
    del info  # the error's traceback holds the world
    stuck = [t for t in threading.enumerate() if t.name == "meshsim-rank-1"]
    assert len(stuck) == 1
    stuck[0].join(10.0)
    gc.collect()
    assert eventfds() == before
