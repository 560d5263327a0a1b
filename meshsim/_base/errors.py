"""The errors a simulated world reports: every one names the ranks involved and where they stand."""

from __future__ import annotations

import pickle
import traceback
import types
from collections.abc import Mapping, Sequence

from meshsim._base import MESHSIM_DIR

__all__ = [
    "CollectiveMismatchError",
    "format_user_traceback",
    "DeadlockError",
    "MeshError",
    "RankError",
    "StateLeakWarning",
    "WorldAborted",
]


class MeshError(Exception):
    """Base class of every error meshsim reports about a world of ranks."""


class RankError(MeshError):
    """A rank's own code raised; the original exception is the ``__cause__``.

    Attributes:
        rank: the global rank whose code raised first.
        world_size: the number of ranks in the world.
        failures: every rank that raised on its own, in the order they raised,
            as ``(rank, exception)`` pairs (``failures[0]`` is ``rank``).
    """

    def __init__(
        self,
        rank: int,
        world_size: int,
        rank_traceback: str,
        failures: Sequence[tuple[int, BaseException]] = (),
    ) -> None:
        self.rank = rank
        self.world_size = world_size
        self.rank_traceback = rank_traceback
        self.failures = tuple(failures)
        others = [r for r, _ in self.failures if r != rank]
        also = f" (ranks {', '.join(map(str, others))} raised too)" if others else ""
        super().__init__(
            f"rank {rank} of {world_size} raised{also}; its traceback:\n{rank_traceback.rstrip()}"
        )

    def __reduce__(self) -> tuple[object, ...]:
        failures = tuple((rank, _portable(exc)) for rank, exc in self.failures)
        return (
            _rebuild_rank_error,
            (type(self), self.rank, self.world_size, self.rank_traceback, failures),
            _notes(self),
        )


def _rebuild_rank_error(
    cls: type[RankError],
    rank: int,
    world_size: int,
    rank_traceback: str,
    failures: tuple[tuple[int, BaseException], ...],
) -> RankError:
    error = cls(rank, world_size, rank_traceback, failures)
    first = dict(failures).get(rank)
    if first is not None:
        error.__cause__ = first
    return error


def _portable(exc: BaseException) -> BaseException:
    """``exc`` if it survives pickling, else a RuntimeError that names its type and message."""
    try:
        pickle.loads(pickle.dumps(exc))
    except Exception as why:  # anything an exception's own pickling raises
        return RuntimeError(
            f"{type(exc).__module__}.{type(exc).__qualname__}: {exc} (the original could not be "
            f"pickled: {type(why).__name__}: {why})"
        )
    return exc


def _notes(exc: BaseException) -> dict[str, object]:
    """What pickling an exception keeps besides its arguments: its notes (``add_note``)."""
    notes = getattr(exc, "__notes__", None)
    return {"__notes__": list(notes)} if notes else {}


class CollectiveMismatchError(MeshError):
    """Ranks entered different collectives at the same point of a group's sequence.

    Attributes:
        group: the global ranks of the group.
        seq: the position of the call in that group's sequence (0 is the first).
        ranks: the ranks whose call differs from the others'.
        calls: each rank's call, as text, by global rank (ranks that had not
            arrived are absent).
    """

    def __init__(
        self,
        message: str,
        *,
        group: tuple[int, ...] = (),
        seq: int = -1,
        ranks: tuple[int, ...] = (),
        calls: Mapping[int, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.group = group
        self.seq = seq
        self.ranks = ranks
        self.calls = dict(calls or {})

    def __reduce__(self) -> tuple[object, ...]:
        return (_rebuild_mismatch, (str(self), self.group, self.seq, self.ranks, self.calls), _notes(self))


def _rebuild_mismatch(
    message: str,
    group: tuple[int, ...],
    seq: int,
    ranks: tuple[int, ...],
    calls: Mapping[int, str],
) -> CollectiveMismatchError:
    return CollectiveMismatchError(message, group=group, seq=seq, ranks=ranks, calls=calls)


class DeadlockError(MeshError):
    """No rank can make progress, or a rank ran past the world's timeout.

    Attributes:
        states: what each global rank was doing, as text.
        timed_out: True when raised by the timeout rather than by detection.
        ranks: the ranks the others wait for (those that finished, wait
            elsewhere, or, on timeout, are still running).
    """

    def __init__(
        self,
        message: str,
        *,
        states: Mapping[int, str] | None = None,
        timed_out: bool = False,
        ranks: tuple[int, ...] = (),
    ) -> None:
        super().__init__(message)
        self.states = dict(states or {})
        self.timed_out = timed_out
        self.ranks = ranks

    def __reduce__(self) -> tuple[object, ...]:
        return (_rebuild_deadlock, (str(self), self.states, self.timed_out, self.ranks), _notes(self))


def _rebuild_deadlock(
    message: str, states: Mapping[int, str], timed_out: bool, ranks: tuple[int, ...]
) -> DeadlockError:
    return DeadlockError(message, states=states, timed_out=timed_out, ranks=ranks)


class ForeignGroupError(RuntimeError):
    """A rank issued a collective on a process group that another rank made (raised by the sim backend).

    torch's c10d logger, catching it, fails to look the foreign group up and raises
    its own error from the handler; the world reports this one, the cause
    (:func:`diagnosis`).
    """


def diagnosis(exc: BaseException) -> BaseException:
    """The :class:`ForeignGroupError` behind ``exc`` (in its context chain), else ``exc`` itself.

    Its traceback is given the frames of ``exc``'s that led to the handler that caught it
    (the user's line that issued the collective).
    """
    seen: BaseException | None = exc
    for _ in range(8):  # a few handlers deep at most: torch's logger wraps once
        if seen is None:
            return exc
        if isinstance(seen, ForeignGroupError):
            break
        seen = seen.__context__
    if seen is None or seen is exc or not isinstance(seen, ForeignGroupError):
        return exc
    inner = seen.__traceback__
    outer: list[types.TracebackType] = []
    tb = exc.__traceback__
    while tb is not None and inner is not None and tb.tb_frame is not inner.tb_frame:
        outer.append(tb)
        tb = tb.tb_next
    if tb is not None:  # found the handler's frame: the outer frames lead to it
        for entry in reversed(outer):
            inner = types.TracebackType(inner, entry.tb_frame, entry.tb_lasti, entry.tb_lineno)
        seen.__traceback__ = inner
    seen.__suppress_context__ = True
    return seen


class StateLeakWarning(UserWarning):
    """A world left process-wide state changed that each rank's own process would have kept to itself."""


class WorldAborted(BaseException):
    """Raised inside a rank to unwind it once its world has failed.

    A ``BaseException``, like ``SystemExit``, so that user code's ``except
    Exception`` cannot swallow it and carry on against a dead world. It never
    escapes :func:`meshsim.run`.
    """


def format_user_traceback(exc: BaseException) -> str:
    """A rank's traceback, starting at the user's code rather than at meshsim's frames."""
    tb = exc.__traceback__
    while tb is not None and tb.tb_frame.f_code.co_filename.startswith(MESHSIM_DIR):
        tb = tb.tb_next
    return "".join(traceback.format_exception(type(exc), exc, tb))
