"""Rank threads, kept for the next world while they are as good as new.

Starting and joining four threads costs ~0.5 ms of system time on a small VM,
half of a 4-rank world's set-up. So a rank thread whose world ended cleanly does
not exit: it waits, idle, for a rank of a later world. It is reused only while
it is as good as new:

- its world ended without an error (a failed world's threads all exit and are
  joined before :func:`meshsim.run` returns);
- torch's per-thread state (grad and inference modes, autocast, the mode stacks,
  dispatch key sets, DeviceMesh's mesh stack) is what it was when the thread was
  new (:func:`thread_fingerprint`);
- at most :data:`MAX_IDLE` threads wait at a time, and each exits after
  :data:`IDLE_LIFETIME` seconds without work.

An idle thread waits in one blocking read of its doorbell (see
:mod:`meshsim._baton.doorbell`: a timed wait costs a system call more, on the first
wake-up of each rank of every world). While some wait, one more thread, ``meshsim-reaper``, wakes every
second to end the threads idle for too long; it ends when none is left.

Each job starts as a new thread would: in an empty ``contextvars`` context, with
``threading``'s trace and profile hooks. ``threading.local`` values that user code
leaves in a rank thread do carry over to the next world, as module globals do.
``MESHSIM_REUSE_THREADS=0`` in the environment turns reuse off
(``benchmarks/bench_tricks.py`` measures worlds with and without it).

A worker's doorbell is also its rank's doorbell in the world it serves
(:class:`meshsim._baton.scheduler.Scheduler`): a rank not yet started sleeps at it, so
the first hand-over to a rank starts it, with no extra thread switch.
"""

from __future__ import annotations

import contextvars
import functools
import os
import sys
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch

from meshsim._baton.doorbell import Doorbell, EventBell, LockBell, eventfd_budget
from meshsim._engine import affinity

__all__ = [
    "Countdown",
    "Worker",
    "end_idle_threads",
    "give_back",
    "idle_count",
    "idle_cpus",
    "take",
    "thread_fingerprint",
]

MAX_IDLE = 64  # idle threads kept at most; the rest of a bigger world's exit
IDLE_LIFETIME = 10.0  # seconds an idle thread waits for work before it exits
_POLL = 1.0  # seconds between the reaper's rounds
_IDLE_NAME = "meshsim-idle"
_GRAIN = 32768  # torch.internal::GRAIN_SIZE: below it an op runs on one thread (torch 2.11-2.14)


class Countdown:
    """Wait until ``count`` jobs have ended.

    Args:
        count: how many jobs.
        also: an event to set too when the last job ends.
    """

    def __init__(self, count: int, also: threading.Event | None = None) -> None:
        self._lock = threading.Lock()
        self._left = count
        self._zero = threading.Event()
        self._also = also
        if count == 0:
            self._set()

    def count_down(self) -> None:
        with self._lock:
            self._left -= 1
            if self._left == 0:
                self._set()

    def _set(self) -> None:
        self._zero.set()
        if self._also is not None:
            self._also.set()

    def wait(self, timeout: float) -> bool:
        """Whether every job has ended (waits at most ``timeout`` s)."""
        return self._zero.wait(timeout)


class Worker:
    """A thread that runs rank jobs, one world at a time, and its doorbell."""

    def __init__(self, bell: Doorbell) -> None:
        self.bell = bell
        self.busy = False  # between assign() and the end of the job
        self.usable = True  # as good as new after its last job
        self.cpus: frozenset[int] | None = None  # its affinity, where it was set
        self.team = 1  # the intra-op threads started while it ran unpinned (see start_team)
        self.idle_since = 0.0  # when it last went back to the pool
        self._job: Callable[[], None] | None = None
        self._countdown: Countdown | None = None
        self._retire = False  # exit; whoever set it joins the thread
        self._abandon = False  # exit when the job ends (nobody waits)
        # A started thread closes its own bell on its way out, whoever made it exit: a
        # retire() whose join timed out (a loaded machine) must not lose the descriptor.
        self._bell_lock = threading.Lock()
        self._bell_closed = False
        self.thread = threading.Thread(target=self._loop, name=_IDLE_NAME, daemon=True)

    def assign(self, job: Callable[[], None], countdown: Countdown, name: str) -> None:
        """Give the worker a job; it starts when its doorbell rings."""
        self.busy = True
        self.thread.name = name
        self._countdown = countdown
        self._job = job

    def pin(self, cpus: frozenset[int] | None) -> None:
        """Run on ``cpus`` (call from the worker's own thread)."""
        if cpus is not None and cpus != self.cpus:
            os.sched_setaffinity(0, cpus)
            self.cpus = cpus

    def start_team(self, threads: int, cpus: frozenset[int] | None) -> None:
        """Start the intra-op team of ``threads`` threads on ``cpus`` (call from the worker's own thread).

        A pinned rank keeps its hand-overs on one CPU; the threads its kernels fan out to
        should not share that CPU. torch's OpenMP team is made once per thread, by the
        first parallel region that needs it, and its threads take the affinity the thread
        has then: started here, unpinned, they run on ``cpus`` while the rank thread is
        pinned again. A team already this large is reused (libgomp keeps a thread's team;
        checked with torch 2.11-2.14's CPU builds).
        """
        if threads <= self.team or cpus is None:
            return
        self.pin(cpus)
        # one chunk per thread of at least torch's grain size (32768 elements): every thread runs
        torch.empty(threads * _GRAIN).fill_(0.0)
        self.team = threads

    def move(self, cpus: frozenset[int]) -> None:
        """Run on ``cpus`` from now on (call from another thread: the world's supervisor)."""
        affinity.move(self.thread.native_id, cpus)
        self.cpus = cpus

    def retire(self, timeout: float) -> bool:
        """Make an idle (or finished) worker exit; whether its thread ended within ``timeout``.

        Its doorbell is closed by then; if the thread ends later, it closes it then.
        """
        self._retire = True
        if self.thread.ident is None:  # never started (its world failed to start)
            self.close_bell()
            return True
        self._ring()
        self.thread.join(timeout)
        return not self.thread.is_alive()

    def expire(self) -> None:
        """Make an idle worker, already out of the pool, exit and close its doorbell."""
        self._abandon = True
        self._ring()

    def abandon(self) -> None:
        """Leave a worker stuck in its job: it exits, closing its doorbell, if the job ever ends."""
        self._abandon = True
        if self.thread.ident is None:  # never started: nothing will close it
            self.close_bell()

    def close_bell(self) -> None:
        """Close the doorbell, once (the thread's exit and a forked child's pool both may)."""
        with self._bell_lock:
            if self._bell_closed:
                return
            self._bell_closed = True
        self.bell.close()

    def _ring(self) -> None:
        """Ring the doorbell unless the thread closed it already (an eventfd's number may be reused)."""
        with self._bell_lock:
            if not self._bell_closed:
                self.bell.ring()

    def _loop(self) -> None:
        new = thread_fingerprint()
        while True:
            if self._retire or self._abandon:
                break
            job = self._job
            if job is None:
                # rung by its world's scheduler, retire(), or the reaper (expire): in the
                # pool, the reaper runs; out of it, whoever took it out rings it
                self.bell.park()
                continue
            self._run(job, new)
        self.close_bell()

    def _run(self, job: Callable[[], None], new: tuple[object, ...]) -> None:
        countdown = self._countdown
        self._job = self._countdown = None
        try:
            # as threading starts a thread: its trace and profile hooks, an empty context
            _set_hooks(threading.gettrace(), threading.getprofile())
            contextvars.Context().run(job)
            self.usable = thread_fingerprint() == new
        except BaseException:  # the job catches what user code raises: this is an interrupt
            self.usable = False
        finally:
            _set_hooks(None, None)
            self.thread.name = _IDLE_NAME
            self.busy = False
            if countdown is not None:
                countdown.count_down()


def _set_hooks(trace: object, profile: object) -> None:
    if sys.gettrace() is not trace:
        sys.settrace(trace)  # type: ignore[arg-type]
    if sys.getprofile() is not profile:
        sys.setprofile(profile)  # type: ignore[arg-type]


class _Pool:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._idle: list[Worker] = []
        # runs while some worker is idle (started by give_back, ends when none is)
        self._reaper: threading.Thread | None = None
        self._reaper_stop = threading.Event()
        self._last_reaper: threading.Thread | None = None  # may still be on its way out

    def take(self, count: int) -> tuple[list[Worker], list[Worker]]:
        """``count`` workers, idle ones first; the new ones (the second list, the tail of the first)."""
        with self._lock:
            reused = self._idle[-count:] if count else []
            del self._idle[len(self._idle) - len(reused) :]
        fresh = [Worker(_new_bell()) for _ in range(count - len(reused))]
        return reused + fresh, fresh

    def idle_cpus(self, count: int) -> set[frozenset[int] | None]:
        """The affinities of the idle workers that :meth:`take` would give a world of ``count`` ranks."""
        with self._lock:
            return {w.cpus for w in (self._idle[-count:] if count else [])}

    def give_back(self, workers: Sequence[Worker]) -> list[Worker]:
        """Keep what may idle; return the workers that must be retired."""
        keep = _reuse_enabled()
        start = None
        with self._lock:
            room = MAX_IDLE - len(self._idle) if keep else 0
            kept = [w for w in workers if w.usable][: max(room, 0)]
            now = time.monotonic()
            for worker in kept:
                worker.idle_since = now
            self._idle.extend(kept)
            if self._idle and self._reaper is None:
                self._reaper_stop = threading.Event()
                start = self._reaper = self._last_reaper = threading.Thread(
                    target=self._reap, args=(self._reaper_stop,), name="meshsim-reaper", daemon=True
                )
        if start is not None:
            start.start()
        return [w for w in workers if w not in kept]

    def _reap(self, stop: threading.Event) -> None:
        """End the workers idle for longer than IDLE_LIFETIME, every _POLL s, until none is idle."""
        me = threading.current_thread()
        try:
            while not stop.wait(_POLL):
                with self._lock:
                    if self._reaper is not me:
                        return
                    now = time.monotonic()
                    expired = [w for w in self._idle if now - w.idle_since > IDLE_LIFETIME]
                    self._idle = [w for w in self._idle if w not in expired]
                    if not self._idle:
                        self._reaper = None
                for worker in expired:
                    worker.expire()
                if self._reaper is not me:
                    return
        finally:
            with self._lock:  # however it ends, the next give_back starts a new one
                if self._reaper is me:
                    self._reaper = None

    def stop_reaper(self, timeout: float) -> None:
        """End the reaper thread now (the idle workers were taken), and wait for it."""
        with self._lock:
            reaper, self._reaper = self._reaper, None
            stop = self._reaper_stop
            last = self._last_reaper
        if reaper is not None:
            stop.set()
        # A reaper that found no idle worker has let go of its place but may still be
        # ending the last ones it took: wait for it too.
        if last is not None and last is not threading.current_thread():
            last.join(timeout)

    def take_all(self) -> list[Worker]:
        with self._lock:
            idle, self._idle = self._idle, []
        return idle

    def count(self) -> int:
        return len(self._idle)

    def forget(self) -> None:
        """In a forked child: the idle threads did not survive the fork; close their doorbells."""
        self._lock = threading.Lock()
        self._reaper = None  # it did not survive the fork either
        idle, self._idle = self._idle, []
        for worker in idle:
            worker.close_bell()


_POOL = _Pool()
if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_POOL.forget)


def take(count: int) -> tuple[list[Worker], list[Worker]]:
    """Workers for a world of ``count`` ranks, and which of them are new (not started yet)."""
    return _POOL.take(count)


def idle_cpus(count: int) -> set[frozenset[int] | None]:
    """Where the idle threads :func:`take` would reuse for ``count`` ranks are pinned (None: unpinned)."""
    return _POOL.idle_cpus(count)


def give_back(workers: Sequence[Worker]) -> list[Worker]:
    """Return a cleanly ended world's workers; the ones that may not idle are returned for retiring."""
    return _POOL.give_back(workers)


def end_idle_threads(timeout: float = 10.0) -> int:
    """End the idle rank threads meshsim keeps for later worlds, and wait for them.

    Rank threads of a world that ended cleanly wait, idle (named ``meshsim-idle``),
    for the next world, and end by themselves after 10 s without one (a thread
    named ``meshsim-reaper`` ends them; it runs while some wait, and this ends it
    too). Call this where idle threads would be in the way: before counting
    threads or file descriptors in a leak check, or before forking.

    Keyword args:
        timeout: seconds to wait for each thread to end.

    Returns:
        how many threads ended.

    Raises:
        ValueError: ``timeout`` is not a positive number of seconds.
    """
    if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or not timeout > 0:
        raise ValueError(f"timeout must be a positive number of seconds, got {timeout!r}")
    ended = sum(worker.retire(timeout) for worker in _POOL.take_all())
    _POOL.stop_reaper(timeout)
    return ended


def idle_count() -> int:
    """How many rank threads wait, idle, for a world."""
    return _POOL.count()


def _reuse_enabled() -> bool:
    return os.environ.get("MESHSIM_REUSE_THREADS", "1").strip().lower() not in ("0", "false", "no", "off")


_EVENTFDS = [0]  # eventfd doorbells held by live workers
_EVENTFDS_LOCK = threading.Lock()


def _new_bell() -> Doorbell:
    """An eventfd doorbell while they are within budget, else a lock."""
    with _EVENTFDS_LOCK:
        if _EVENTFDS[0] < eventfd_budget():
            try:
                bell = EventBell(on_close=_eventfd_closed)
            except OSError:  # out of descriptors after all
                return LockBell()
            _EVENTFDS[0] += 1
            return bell
    return LockBell()


def _eventfd_closed() -> None:
    with _EVENTFDS_LOCK:
        _EVENTFDS[0] -= 1


def thread_fingerprint() -> tuple[Any, ...]:
    """torch's per-thread state, to tell whether a finished rank thread is as good as new.

    Grad, forward-grad and inference modes, the torch-function and dispatch mode
    stacks (``set_default_device`` and ``autocast`` live there or in the dispatch
    key sets), saved-tensor hooks and DeviceMesh's per-thread mesh stack: a rank
    thread whose fingerprint differs from the one it had when new is not reused.
    The ``torch._C`` getters are private (checked in torch 2.11-2.15).
    """
    C: Any = torch._C
    mesh_env = _mesh_env()
    return (
        torch.is_grad_enabled(),
        C._is_fwd_grad_enabled(),
        torch.is_inference_mode_enabled(),
        C._len_torch_function_stack(),
        C._len_torch_dispatch_stack(),
        C._dispatch_tls_local_include_set(),
        C._dispatch_tls_local_exclude_set(),
        C._autograd._saved_tensors_hooks_is_enabled(),
        C._autograd._top_saved_tensors_default_hooks(True) is None,
        len(getattr(mesh_env, "mesh_stack", ())),
    )


@functools.cache
def _mesh_env() -> Any:
    """DeviceMesh's per-thread mesh stack holder (a threading.local), None where torch has none."""
    import torch.distributed.device_mesh as device_mesh

    return getattr(device_mesh, "_mesh_resources", None)
