"""Where ranks meet: one slot per (group, sequence number), and each group's mailbox.

Each rank numbers its collectives on a group 0, 1, 2, ...; the calls with the
same number meet in one :class:`Slot`. The last rank to arrive compares every
rank's call (the same kind of collective, equal signatures), runs the
description's cross-rank compatibility check, and carries the collective out for
everyone (:mod:`meshsim._sim.collectives`). Point-to-point messages meet in each
group's :class:`meshsim._sim.p2p.Mailbox`.

This module knows calls' kinds and signatures but not their meaning.

An observer of a world (:mod:`meshsim._observe`: the findings, a trace, next the
cost estimate) is an :class:`Instrument`: it overrides the hooks it needs and is
handed to the world. The rendezvous calls them at three moments of each collective:

- :meth:`Instrument.arrived`: a rank reaches the call, in its thread, before it may block;
- :meth:`Instrument.completed`: the last rank arrived and the calls fit together, before
  any data moves (in-place calls still hold their inputs), in the last rank's thread,
  with the scheduler's lock held;
- :meth:`Instrument.released`: a rank leaves the call, in its thread (``error`` set when
  the call failed for it).

and the world at the start and end of each rank's share of a call, and when it fails.
:class:`Instruments` keeps, per hook, only the instruments that override it, so a
world with none pays one truth test per moment (as trio's ``Instruments`` do).
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from types import FrameType
from typing import TYPE_CHECKING, Any

from meshsim._base.errors import CollectiveMismatchError, WorldAborted
from meshsim._base.tables import mismatch_text, waiting_text
from meshsim._base.waits import Blocking, Waitable
from meshsim._record.sites import site_of
from meshsim._sim.collectives import Description
from meshsim._sim.movement import Problem, culprits
from meshsim._sim.p2p import Mailbox

if TYPE_CHECKING:
    from meshsim._record.ledger import Collective, Ledger

__all__ = ["NONE", "Call", "GroupState", "Instrument", "Instruments", "Rendezvous", "Slot"]


@dataclass(eq=False, slots=True)
class Call:
    """One rank's side of a collective.

    Attributes:
        group_rank: the caller's rank in the group.
        payload: the collective as this rank issued it (a typed description).
        signature: what must be equal on every rank (``payload.signature()``, taken once).
        where: ``file.py:LINE in function`` of the user's call, or the frame of the call, read
            only when needed (the rank is still inside its call whenever an error is built).
        entry: the rank's ledger entry for the call, when it records one (an observer may
            mark it: :meth:`mark`), and ``ledgers``, the rank's open ledgers that hold it.
        arrived: when the rank arrived, in a traced world (:mod:`meshsim._observe.trace`).
    """

    group_rank: int
    payload: Description
    signature: tuple[Any, ...]
    where: str | FrameType
    entry: Collective | None = None
    ledgers: list[Ledger] | None = None
    arrived: float = 0.0

    @property
    def op(self) -> str:
        return self.payload.op

    @property
    def text(self) -> str:
        """The call for error tables, e.g. ``all_reduce(float32[4], SUM)`` (built only when needed)."""
        return self.payload.describe()

    @property
    def site(self) -> str:
        if not isinstance(self.where, str):
            self.where = site_of(self.where)
        return self.where

    def mark(self, wasted: str) -> None:
        """Give the rank's ledger entry the reason the call was wasted, in every ledger that holds it.

        Called while the rank waits in the call: it appended nothing since the entry.
        """
        entry = self.entry
        if entry is None:
            return
        marked = dataclasses.replace(entry, redundant=wasted)
        for ledger in self.ledgers or ():
            calls = ledger.calls
            if calls and calls[-1] is entry:
                calls[-1] = marked
        self.entry = marked


def _label(ranks: tuple[int, ...]) -> str:
    return f"group {list(ranks)}"


class GroupState:
    """A process group as the whole world sees it: its ranks, open slots and mailbox."""

    def __init__(self, name: str, ranks: tuple[int, ...]) -> None:
        self.name = name
        self.ranks = ranks
        self.size = len(ranks)
        self.slots: dict[int, Slot] = {}
        self.mailbox = Mailbox(ranks)  # not the group: no reference cycle

    def label(self) -> str:
        return _label(self.ranks)


class Slot(Waitable):
    """The meeting point of call number ``seq`` on ``group``."""

    def __init__(self, group: GroupState, seq: int) -> None:
        super().__init__()
        self.group = group
        self.seq = seq
        self.calls: list[Call | None] = [None] * group.size
        self.arrived = 0
        self.mismatch = False
        self.wasted: str | None = None  # why the call told no rank anything new (set by an instrument)
        self.last: Call | None = None  # the last rank's call: the one the others waited for
        self._first: Call | None = None
        # set as the call completes, for the instruments told then: every rank's call and payload
        self.arrivals: list[Call] = []
        self.payloads: list[Description] = []

    def add(self, call: Call) -> None:
        self.calls[call.group_rank] = call
        self.arrived += 1
        first = self._first
        if first is None:
            self._first = call
        elif type(first.payload) is not type(call.payload) or first.signature != call.signature:
            self.mismatch = True

    def complete(self, completions: Sequence[Callable[[Slot], None]] = ()) -> None:
        """Check every rank's call, then move the data. All ranks have arrived.

        ``completions``: the instruments' hooks, told before the data moves (in-place calls
        overwrite their inputs).
        """
        calls = [c for c in self.calls if c is not None]
        if self.mismatch:
            self.error = self._mismatch_error("ranks entered different collectives")
            return
        kind = type(calls[0].payload)
        payloads = [c.payload for c in calls]
        problems = kind.compat(payloads) if kind.compat is not None else []
        if problems:
            self.error = self._mismatch_error(
                f"the ranks' {calls[0].op} arguments do not fit together", problems
            )
            return
        if completions:
            self.arrivals, self.payloads = calls, payloads
            for completed in completions:
                completed(self)
        try:
            kind.execute(payloads)
        except Exception as exc:  # a bug in meshsim, or an input torch would reject
            self.error = RuntimeError(
                f"meshsim could not carry out {self._where()} ({calls[0].text}): {exc!r}"
            )
            self.error.__cause__ = exc

    def describe(self, rank: int) -> str:
        call = self.calls[self.group.ranks.index(rank)]
        if call is None:
            return waiting_text("?", self._where(), None, self.missing())
        return waiting_text(call.text, self._where(), call.site, self.missing())

    def missing(self) -> tuple[int, ...]:
        return tuple(r for r, c in zip(self.group.ranks, self.calls) if c is None)

    def stalled(self) -> BaseException | None:
        if self.mismatch:
            return self._mismatch_error("ranks entered different collectives")
        return None

    def _where(self) -> str:
        return f"call #{self.seq} of {self.group.label()}"

    def _mismatch_error(self, headline: str, problems: Sequence[Problem] = ()) -> CollectiveMismatchError:
        ranks = self.group.ranks
        texts = {ranks[i]: c.text for i, c in enumerate(self.calls) if c is not None}
        if problems:
            odd = tuple(ranks[r] for r in culprits(problems))
        else:
            odd = _odd_ones(self.calls, ranks)
        calls = [
            (ranks[i], c.text, c.site) if c is not None else (ranks[i], None, None)
            for i, c in enumerate(self.calls)
        ]
        details = [_global(p.text, ranks) for p in problems]
        message = mismatch_text(headline, self._where(), calls, odd, details)
        return CollectiveMismatchError(message, group=ranks, seq=self.seq, ranks=odd, calls=texts)


def _global(text: str, ranks: tuple[int, ...]) -> str:
    """Problems name group ranks; show global ranks (they differ in sub-groups)."""
    return re.sub(r"rank (\d+)", lambda m: f"rank {ranks[int(m.group(1))]}", text)


def _odd_ones(calls: Sequence[Call | None], ranks: tuple[int, ...]) -> tuple[int, ...]:
    """The ranks whose call differs from the most common one (ties: the lowest rank's)."""
    groups: dict[tuple[Any, ...], list[int]] = {}
    for i, call in enumerate(calls):
        if call is not None:
            groups.setdefault((call.op, call.signature), []).append(ranks[i])
    if len(groups) <= 1:
        return ()
    majority = max(groups.values(), key=lambda members: (len(members), -members[0]))
    return tuple(r for members in groups.values() if members is not majority for r in members)


# -- instruments: what the rendezvous tells its observers -----------------------------------

HOOKS = ("arrived", "completed", "released", "rank_started", "rank_finished", "failed", "ended")


class Instrument:
    """An observer of one world; every hook is optional (the base class's do nothing)."""

    def arrived(self, rank: int, group: GroupState, call: Call) -> None:
        """Global ``rank`` arrived at ``call`` on ``group``."""

    def completed(self, slot: Slot) -> None:
        """Every rank arrived at ``slot`` and the calls fit; the data has not moved yet."""

    def released(
        self, rank: int, group: GroupState, call: Call, slot: Slot | None, error: BaseException | None
    ) -> None:
        """Global ``rank`` leaves ``call``: completed (``slot``) or failed (``error``)."""

    def rank_started(self, rank: int, name: str) -> None:
        """``rank`` starts its part of the world's call ``name``."""

    def rank_finished(self, rank: int, name: str, outcome: str) -> None:
        """``rank`` is done with the call ``name``; ``outcome`` says how."""

    def failed(self, rank: int | None, error: BaseException) -> None:
        """``rank`` raised ``error``; ``None``: the world failed otherwise (a timeout, a deadlock)."""

    def ended(self) -> None:
        """The world's call is over (the instrument's last hook for it)."""


class Instruments:
    """The instruments of a world, as one bound-method tuple per hook (empty when none overrides it)."""

    # the hooks no instrument overrides stay these class-level empty tuples
    arrived: tuple[Callable[..., Any], ...] = ()
    completed: tuple[Callable[..., Any], ...] = ()
    released: tuple[Callable[..., Any], ...] = ()
    rank_started: tuple[Callable[..., Any], ...] = ()
    rank_finished: tuple[Callable[..., Any], ...] = ()
    failed: tuple[Callable[..., Any], ...] = ()
    ended: tuple[Callable[..., Any], ...] = ()

    def __init__(self, instruments: Sequence[Instrument] = ()) -> None:
        self.all = tuple(instruments)
        for instrument in self.all:  # a world makes these at every call: only the hooks it overrides
            for hook in _overridden(type(instrument)):
                setattr(self, hook, (*getattr(self, hook), getattr(instrument, hook)))

    def __bool__(self) -> bool:
        return bool(self.all)


NONE = Instruments()


_OVERRIDDEN: dict[type, tuple[str, ...]] = {}


def _overridden(kind: type) -> tuple[str, ...]:
    """The hooks an instrument class overrides (the others are not called), found once per class."""
    hooks = _OVERRIDDEN.get(kind)
    if hooks is None:
        hooks = _OVERRIDDEN[kind] = tuple(h for h in HOOKS if getattr(kind, h) is not getattr(Instrument, h))
    return hooks


def _mismatch_cause(ranks: tuple[int, ...], other: tuple[int, ...], caller: int) -> str:
    """The likely cause of a new_group() whose ranks differ between ranks, for its error."""
    shared = (
        "Where every rank runs the same code, the likely cause is state the rank threads share "
        "that each torchrun process has its own of (a parallel-state module's globals, set by the "
        "rank before): declare its module per rank with meshsim.per_rank_module(...) (pytest: "
        "--mesh-per-rank-modules)"
    )
    if caller in ranks and not set(ranks) & set(other):
        # Each rank passed its own subgroup's ranks (Megatron-core 0.19's
        # test_expert_all_gather_group: new_group(ranks=<this rank's expert-dp ranks>)).
        return (
            "Here the two lists do not overlap and each holds the rank that passed it: the code may "
            "pass each rank its own subgroup's ranks, which torch does not allow (every rank makes "
            "every subgroup: call new_group() once per subgroup on every rank, or use "
            "dist.new_subgroups_by_enumeration); NCCL lets it pass only while the group is never "
            "used, since it makes its communicators lazily, and gloo waits out its timeout. "
            "Otherwise: " + shared
        )
    return shared


@dataclass
class Rendezvous:
    """Every group of one world, by name, and the world's instruments (told at every call)."""

    scheduler: Blocking
    instruments: Instruments = NONE
    groups: dict[str, GroupState] = field(default_factory=dict)

    def group(self, name: str, ranks: tuple[int, ...], caller: int) -> GroupState:
        """The world's record of group ``name``, created by its first member to arrive.

        Raises:
            ValueError: another rank created a group of this name with other ranks.
        """
        with self.scheduler:
            group = self.groups.get(name)
            if group is None:
                group = self.groups[name] = GroupState(name, ranks)
            elif group.ranks != ranks:
                raise ValueError(
                    f"rank {caller} created process group {name!r} with ranks {list(ranks)}, "
                    f"but another rank created it with ranks {list(group.ranks)}: every rank "
                    "must call new_group() (and build device meshes) with the same ranks "
                    "in the same order. " + _mismatch_cause(ranks, group.ranks, caller)
                )
            return group

    def meet(self, group: GroupState, seq: int, call: Call, rank: int) -> None:
        """Join call ``seq`` on ``group`` as global ``rank``, and return once every rank has arrived.

        The last rank to arrive completes the call. One hold of the scheduler's lock
        covers the arrival and the wait, and the wake-ups go out as it is released.

        Raises:
            CollectiveMismatchError: the ranks' calls do not fit together.
            WorldAborted: the world failed.
        """
        instruments = self.instruments
        if not instruments.arrived and not instruments.released:
            self._meet(group, seq, call, rank, instruments.completed)
            return
        for arrived in instruments.arrived:
            arrived(rank, group, call)
        try:
            slot = self._meet(group, seq, call, rank, instruments.completed)
        except BaseException as exc:
            for released in instruments.released:
                released(rank, group, call, None, exc)
            raise
        for released in instruments.released:
            released(rank, group, call, slot, None)

    def _meet(
        self,
        group: GroupState,
        seq: int,
        call: Call,
        rank: int,
        completions: Sequence[Callable[[Slot], None]],
    ) -> Slot:
        scheduler = self.scheduler
        scheduler.lock.acquire()
        try:
            if scheduler.error is not None:  # raise_if_aborted, inlined: once per rank per collective
                raise WorldAborted()
            slot = group.slots.get(seq)
            if slot is None:
                slot = group.slots[seq] = Slot(group, seq)
            slot.add(call)
            if slot.arrived == group.size:
                del group.slots[seq]
                slot.last = call
                slot.complete(completions)
                scheduler.wake(slot)
        except BaseException:
            scheduler.lock.release()
            raise
        scheduler.wait_locked(rank, slot)
        return slot
