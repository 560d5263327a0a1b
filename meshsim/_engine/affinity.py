"""Where rank threads run: one CPU for a serialized world's ranks and its caller.

Serialized ranks never run at once, so one CPU loses nothing, and keeping them
(and the caller, which hands over to them at a world's start and end) on one CPU
avoids cross-CPU wake-ups at every hand-over and keeps torch's per-thread state
warm in one cache. ``sched_getcpu`` (libc, through ctypes) says which CPU the
caller is on; where the platform cannot tell or set affinities, nothing is pinned.
``benchmarks/bench_tricks.py`` measures pinned worlds against unpinned ones.

One CPU is a bet that nothing else wants it. Two pinned worlds (two pytest-xdist
workers, two test processes) that chose the same CPU, or a busy process already
on it, would share it for as long as the worlds last and each run several times
slower, while other CPUs idle. :class:`Starvation` notices: a world whose process
got well under one CPU over a second gives up its pinning and lets the OS place it.

The pinning is meshsim's, not the rank's: a process forked from a rank thread (a
``DataLoader``'s workers, multiprocessing's ``fork``) starts on the CPUs the world's
caller had (the rank context's ``child_cpus``), as it would from a rank in its own
process; so does a child multiprocessing spawns under CUDA emulation, whose command
line meshsim writes. Other processes started by ``exec`` (``subprocess``, plain
multiprocessing ``spawn``) inherit the rank's one CPU: Python runs no hook in them.
"""

from __future__ import annotations

import ctypes
import functools
import os
import time
from collections.abc import Callable
from typing import cast

from meshsim._base.context import current

__all__ = ["Starvation", "affinity", "current_cpu", "may_run_on", "move", "pin", "unpin"]

STARVED_SHARE = 0.6  # of one CPU: a serialized world that computes gets nearly all of one
WINDOW = 1.0  # seconds of wall time each share is measured over


def pin(cpu: int | None, allowed: frozenset[int] | None) -> bool:
    """Run the calling thread on ``cpu`` until :func:`unpin`; whether it was moved.

    Threads it starts inherit the pinning. ``allowed``: the thread's CPUs now. One
    system call each way: a few microseconds.
    """
    if cpu is None or allowed is None:
        return False
    os.sched_setaffinity(0, {cpu})
    return True


def unpin(allowed: frozenset[int] | None) -> None:
    """Let the calling thread run on ``allowed`` again."""
    if allowed is not None:
        os.sched_setaffinity(0, allowed)


def move(native_id: int | None, cpus: frozenset[int]) -> None:
    """Let another thread (by its native id) run on ``cpus``; a thread that ended is left alone."""
    if native_id is None:
        return
    try:
        os.sched_setaffinity(native_id, cpus)
    except (ProcessLookupError, PermissionError):
        pass


class Starvation:
    """Whether this process got its CPU: the CPU time all its threads used over each :data:`WINDOW`.

    A pinned world computes on one CPU, so its process uses nearly all of that CPU;
    under :data:`STARVED_SHARE` something else runs there (or the ranks sleep or
    wait on I/O, where unpinning costs nothing either).
    """

    def __init__(self) -> None:
        self.restart()

    def restart(self) -> None:
        """Measure afresh from the next :meth:`starved` (a call starts: earlier time is not counted)."""
        # The process's CPU time sums every thread's: a world that ends before its first
        # check never reads it.
        self._wall = 0.0
        self._cpu: float | None = None

    def starved(self) -> bool:
        """Whether the window that ended now (at least :data:`WINDOW` long) got under the share.

        The first check after :meth:`restart` starts the window.
        """
        wall = time.monotonic()
        if self._cpu is None:
            self._wall, self._cpu = wall, time.process_time()
            return False
        span = wall - self._wall
        if span < WINDOW:
            return False
        cpu = time.process_time()
        share = (cpu - self._cpu) / span
        self._wall, self._cpu = wall, cpu
        return share < STARVED_SHARE


def affinity() -> frozenset[int] | None:
    """The CPUs the calling thread may run on, where the platform can tell and set them."""
    if not hasattr(os, "sched_getaffinity") or not hasattr(os, "sched_setaffinity"):
        return None
    return frozenset(os.sched_getaffinity(0))


@functools.cache
def _sched_getcpu() -> Callable[[], int] | None:
    """libc's ``sched_getcpu``, looked up once (loading the library costs ~100 us)."""
    try:
        return cast(Callable[[], int], ctypes.CDLL(None).sched_getcpu)
    except (AttributeError, OSError):
        return None


def current_cpu(allowed: frozenset[int] | None) -> int | None:
    """The CPU the calling thread runs on, where the platform can tell."""
    getcpu = _sched_getcpu()
    if getcpu is None:
        return None
    cpu = int(getcpu())
    return cpu if may_run_on(cpu, allowed) else None


def may_run_on(cpu: int, allowed: frozenset[int] | None) -> bool:
    """Whether the calling thread, which may run on ``allowed``, may be pinned to ``cpu``."""
    return cpu >= 0 and allowed is not None and cpu in allowed


def _child_runs_where_the_caller_could() -> None:
    """In a process just forked from a pinned rank thread: run on the world caller's CPUs."""
    here = current()  # the forking thread's record, which the child's one thread inherits
    cpus, here.child_cpus = here.child_cpus, None
    if cpus is not None:
        try:
            os.sched_setaffinity(0, cpus)
        except OSError:
            pass  # the child keeps the rank's CPU: slower, not wrong


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_child_runs_where_the_caller_could)
