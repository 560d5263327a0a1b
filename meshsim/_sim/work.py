"""The Work objects simulated process groups return.

A collective completes when every rank has issued it, so its Work is already
done: a synchronous ``dist.*`` call (``async_op=False``) gets one shared
:data:`DONE`, an asynchronous one a completed Work whose future holds the output
tensors (:func:`completed`). A receive is the exception: its
:class:`ReceiveWork` is pending until the message arrives, and ``wait()`` blocks
cooperatively (the scheduler knows the rank waits, so nothing hangs).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

__all__ = ["DONE", "ReceiveWork", "completed"]

Tensor = torch.Tensor


def completed(result: object) -> dist.Work:
    """A completed Work whose future holds ``result`` (an asynchronous call's, a functional collective's)."""
    return _ResultWork(result)


class _CompleteWork(dist.Work):
    """A Work that is done and succeeded: what every collective's Work answers but its result."""

    def wait(self, timeout: object = None) -> bool:
        return True

    def is_completed(self) -> bool:
        return True

    def is_success(self) -> bool:
        return True

    def exception(self) -> BaseException | None:
        return None

    def synchronize(self) -> None:
        """Nothing to wait for."""


class _ResultWork(_CompleteWork):
    """A completed Work holding a collective's result; its future is made only when asked for.

    Every asynchronous call gets one, and DTensor's functional collectives make every
    call asynchronous: one Python object costs less than a future and the Work that
    ``_create_work_from_future`` wraps around it. C++ (a functional collective's
    ``wait_tensor``, DDP) reaches only ``wait()`` and ``get_future()``, through torch's
    trampoline; Python callers get the answers torch's future-wrapping Work gives.
    """

    def __init__(self, result: object) -> None:
        super().__init__()
        self._result = result
        self._future: torch.futures.Future[object] | None = None

    def result(self) -> Any:
        return self._result

    def get_future(self) -> torch.futures.Future[object]:
        future = self._future
        if future is None:
            future = self._future = torch.futures.Future()
            future.set_result(self._result)
        return future

    def _source_rank(self) -> int:
        raise RuntimeError("FutureWrappingWork::sourceRank() not implemented")

    source_rank = _source_rank


class _DoneWork(_CompleteWork):
    """The Work a synchronous ``dist.*`` call gets: complete, shared by every call.

    ``dist.*(async_op=False)`` calls ``wait()`` on it and drops it. A Python Work
    answers that ``wait()`` without a trip through C++ (which lets go of the GIL and
    takes it back). C++ reaches its methods through torch's trampoline, as it
    reaches :class:`ReceiveWork`'s.
    """

    def result(self) -> list[Tensor]:
        return []

    def get_future(self) -> torch.futures.Future[list[Tensor]]:
        fut: torch.futures.Future[list[Tensor]] = torch.futures.Future()
        fut.set_result([])
        return fut


DONE = _DoneWork()  # shared by every synchronous call of the process


class ReceiveWork(dist.Work):
    """A pending receive; ``wait()`` blocks cooperatively until its message arrives.

    Args:
        scheduler: the world's scheduler.
        rank: the receiving rank (global).
        recv: the posted receive (a :class:`meshsim._sim.p2p.PostedRecv`).
    """

    def __init__(self, scheduler: Any, rank: int, recv: Any) -> None:
        super().__init__()
        self._scheduler = scheduler
        self._rank = rank
        self._recv = recv

    def wait(self, timeout: object = None) -> bool:
        self._scheduler.wait(self._rank, self._recv)
        return True

    def is_completed(self) -> bool:
        done: bool = self._recv.done
        return done

    def is_success(self) -> bool:
        return bool(self._recv.done and self._recv.error is None)

    def exception(self) -> BaseException | None:
        error: BaseException | None = self._recv.error
        return error

    def result(self) -> list[Tensor]:
        tensors: list[Tensor] = self._recv.tensors
        return tensors

    def synchronize(self) -> None:
        self.wait()

    def get_future(self) -> torch.futures.Future[list[Tensor]]:
        self.wait()
        fut: torch.futures.Future[list[Tensor]] = torch.futures.Future()
        fut.set_result(self._recv.tensors)
        return fut

    def _source_rank(self) -> int:
        self.wait()
        source: int | None = self._recv.source
        assert source is not None  # set when the message was delivered
        return source

    source_rank = _source_rank
