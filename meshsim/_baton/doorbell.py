"""How a parked rank thread is woken: a doorbell per rank.

A serialized rank hands the turn on by ringing the next rank's doorbell and
waiting at its own. With a ``threading.Lock`` as the doorbell, each hand-over
costs about three context switches: the woken thread runs at once, finds the GIL
still held by the ringer, and sleeps again until the ringer blocks. Python lets
go of the GIL around an ``eventfd``'s system calls, so a rank woken through one
finds it free, and a collective takes fewer context switches
(``benchmarks/bench_tricks.py`` measures eventfds against locks).

A parked rank waits at its doorbell with :meth:`Doorbell.park`: on an eventfd, one
blocking read, where a timed wait needs a ``poll`` and then the read. The extra
system call let the ringer take the GIL back in between, and made collectives
slower. A park has no timeout of its own; something else bounds
it: a world's supervisor rings its parked ranks every second
(:meth:`meshsim._baton.scheduler.Scheduler.nudge`), and the pool's reaper rings each
idle thread when its idle lifetime is up (:mod:`meshsim._engine.threads`).

An eventfd is a file descriptor per rank thread: past a small share of the
process's limit, and on platforms without ``os.eventfd``, rank threads get locks.
A doorbell belongs to its rank thread (:mod:`meshsim._engine.threads`) and is closed
when that thread exits.
"""

from __future__ import annotations

import os
import select
import threading
from collections.abc import Callable
from typing import Protocol

__all__ = ["Doorbell", "EventBell", "LockBell", "eventfd_budget"]

# Use at most 1/16 of the soft descriptor limit (64 rank threads under the common 1024).
_FD_SHARE = 16
# A lock's timed acquire costs no more than an untimed one; what rings parks bounds them anyway.
_PARK_LIMIT = 60.0


class Doorbell(Protocol):
    def ring(self) -> None:
        """Wake the waiter, or let its next wait return at once; rings before a wait add up to one."""

    def wait(self, timeout: float) -> bool:
        """Return True when rung (at once if rung since the last wait), False after ``timeout`` s."""

    def park(self) -> None:
        """:meth:`wait` without a timeout of its own: only where something else is sure to ring it."""

    def close(self) -> None:
        """Release what the doorbell holds; call once nobody waits or rings."""


class LockBell:
    """A binary semaphore made of a ``threading.Lock`` (portable)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._lock.acquire()

    def ring(self) -> None:
        try:
            self._lock.release()
        except RuntimeError:
            pass  # already rung: a wake-up is pending, which is all a ring means

    def wait(self, timeout: float) -> bool:
        return self._lock.acquire(timeout=timeout)

    def park(self) -> None:
        self._lock.acquire(timeout=_PARK_LIMIT)  # costs nothing more than an unbounded acquire

    def close(self) -> None:
        """Nothing to release."""


class EventBell:
    """A Linux eventfd: waits and rings run without the GIL.

    Args:
        on_close: called once the descriptor is closed (for keeping count).
    """

    def __init__(self, on_close: Callable[[], None] | None = None) -> None:
        self._fd = os.eventfd(0)  # close-on-exec
        self._poll = select.poll()
        self._poll.register(self._fd, select.POLLIN)
        self._on_close = on_close

    def ring(self) -> None:
        os.eventfd_write(self._fd, 1)

    def wait(self, timeout: float) -> bool:
        if not self._poll.poll(timeout * 1000):
            return False
        os.eventfd_read(self._fd)  # resets the count: rings before this wait count once
        return True

    def park(self) -> None:
        os.eventfd_read(self._fd)  # blocks until rung; resets the count

    def close(self) -> None:
        os.close(self._fd)
        if self._on_close is not None:
            self._on_close()


def eventfd_budget() -> int:
    """How many eventfd doorbells the process may hold: a small share of its descriptor limit."""
    if not hasattr(os, "eventfd"):
        return 0
    return _fd_limit() // _FD_SHARE


def _fd_limit() -> int:
    try:
        import resource
    except ImportError:  # not a Unix
        return 0
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    return soft if soft != resource.RLIM_INFINITY else 1 << 16
