"""What a rank blocks on: a :class:`Waitable` that whoever completes it marks done.

The scheduler (:mod:`meshsim._baton.scheduler`) blocks and wakes ranks; the
backend's meeting points (collectives, receives, store waits) and a session's
board between calls are Waitables, so the layer that blocks ranks needs nothing
of the layers that make them wait.
"""

from __future__ import annotations

import threading
from typing import Protocol

__all__ = ["Blocking", "Waitable"]


class Waitable:
    """Something ranks block on; whoever completes it calls :meth:`Scheduler.wake`.

    Attributes:
        done: set once the wait is over (successfully or with ``error``).
        error: raised in every waiter when set.
        idle: a rank waiting here has nothing to do until its world gives it more
            (a session's next job): not a deadlock, and not subject to the timeout.
    """

    idle = False

    def __init__(self) -> None:
        self.done = False
        self.error: BaseException | None = None
        self.waiters: list[int] = []

    def describe(self, rank: int) -> str:
        """What global ``rank``, blocked here, is waiting in, for error messages."""
        raise NotImplementedError

    def missing(self) -> tuple[int, ...]:
        """The global ranks this wait is waiting for."""
        raise NotImplementedError

    def stalled(self) -> BaseException | None:
        """A better diagnosis than 'deadlock' when the world stalls here (e.g. a mismatch)."""
        return None


class Blocking(Protocol):
    """What the backend asks of the world's scheduler to block and wake ranks.

    :class:`meshsim._baton.scheduler.Scheduler` is one; the backend is handed it
    and names only this, so it needs nothing of the layer above it. ``with
    scheduler:`` holds ``lock`` and sends the wake-ups made meanwhile as it ends.
    """

    lock: threading.Lock
    error: BaseException | None

    def __enter__(self) -> Blocking: ...

    def __exit__(self, *exc_info: object) -> None: ...

    def wait(self, rank: int, waitable: Waitable) -> None: ...

    def wait_locked(self, rank: int, waitable: Waitable) -> None: ...

    def wake(self, waitable: Waitable) -> None: ...

    def raise_if_aborted(self) -> None: ...
