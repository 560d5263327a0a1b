"""Where rank threads run: one CPU for a serialized world's ranks and its caller.

Serialized ranks never run at once, so one CPU loses nothing, and keeping them
(and the caller, which hands over to them at a world's start and end) on one CPU
avoids cross-CPU wake-ups at every hand-over and keeps torch's per-thread state
warm in one cache. ``sched_getcpu`` (libc, through ctypes) says which CPU the
caller is on; where the platform cannot tell or set affinities, nothing is pinned.
``benchmarks/bench_tricks.py`` measures pinned worlds against unpinned ones.
"""

from __future__ import annotations

import ctypes
import functools
import os
from collections.abc import Callable
from typing import cast

__all__ = ["affinity", "current_cpu", "may_run_on", "pin", "unpin"]


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
