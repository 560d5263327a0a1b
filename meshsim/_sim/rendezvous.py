"""Where ranks meet: one slot per (group, sequence number), and each group's mailbox.

Each rank numbers its collectives on a group 0, 1, 2, ...; the calls with the
same number meet in one :class:`Slot`. The last rank to arrive compares every
rank's call (the same kind of collective, equal signatures), runs the
description's cross-rank compatibility check, and carries the collective out for
everyone (:mod:`meshsim._sim.collectives`). Point-to-point messages meet in each
group's :class:`meshsim._sim.p2p.Mailbox`.

This module knows calls' kinds and signatures but not their meaning.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass, field
from types import FrameType
from typing import TYPE_CHECKING, Any

from meshsim._base.errors import CollectiveMismatchError, WorldAborted
from meshsim._base.waits import Waitable
from meshsim._observe import findings as _findings
from meshsim._observe.sites import site_of
from meshsim._sim.collectives import Description, nbytes
from meshsim._sim.movement import Problem, culprits, surely_differ
from meshsim._sim.p2p import Mailbox

if TYPE_CHECKING:
    from meshsim._engine.scheduler import Scheduler
    from meshsim._observe.trace import Tracer

__all__ = ["Call", "GroupState", "Rendezvous", "Slot"]

_ADVICE = (
    "Every rank of a group must issue the same collectives on it, in the same order, "
    "with matching dtypes, shapes, reduce ops and roots."
)


@dataclass(eq=False, slots=True)
class Call:
    """One rank's side of a collective.

    Attributes:
        group_rank: the caller's rank in the group.
        payload: the collective as this rank issued it (a typed description).
        signature: what must be equal on every rank (``payload.signature()``, taken once).
        where: ``file.py:LINE in function`` of the user's call, or the frame of the call, read
            only when needed (the rank is still inside its call whenever an error is built).
        recording: whether the rank records the call in a ledger (which then shows its findings).
        arrived: when the rank arrived, in a traced world (:mod:`meshsim._observe.trace`).
    """

    group_rank: int
    payload: Description
    signature: tuple[Any, ...]
    where: str | FrameType
    recording: bool = False
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


def _label(ranks: tuple[int, ...]) -> str:
    return f"group {list(ranks)}"


class GroupState:
    """A process group as the whole world sees it: its ranks, open slots and mailbox.

    ``findings``: whether its calls are checked for waste (see :mod:`meshsim._observe.findings`).
    """

    def __init__(self, name: str, ranks: tuple[int, ...], findings: bool = False) -> None:
        self.name = name
        self.ranks = ranks
        self.size = len(ranks)
        self.slots: dict[int, Slot] = {}
        self.mailbox = Mailbox(ranks)  # not the group: no reference cycle
        self.repeats: _findings.Repeats | None = _findings.Repeats() if findings and len(ranks) > 1 else None

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
        self.wasted: str | None = None  # why the call told no rank anything new, when it did not
        self.last: Call | None = None  # the last rank's call: the one the others waited for
        self._first: Call | None = None

    def add(self, call: Call) -> None:
        self.calls[call.group_rank] = call
        self.arrived += 1
        first = self._first
        if first is None:
            self._first = call
        elif type(first.payload) is not type(call.payload) or first.signature != call.signature:
            self.mismatch = True

    def complete(self, looking: bool = False) -> None:
        """Check every rank's call, then move the data. All ranks have arrived.

        ``looking``: someone sees this call's findings even if no rank records it (a trace).
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
        repeats = self.group.repeats
        # before the data moves (in-place calls overwrite their inputs), and only where a finding
        # can be seen: a rank's ledger, or a collector (the pytest plugin's, per test)
        if repeats is not None and (looking or _findings.wanted() or any(c.recording for c in calls)):
            self._find_waste(kind, calls, payloads, repeats)
        try:
            kind.execute(payloads)
        except Exception as exc:  # a bug in meshsim, or an input torch would reject
            self.error = RuntimeError(
                f"meshsim could not carry out {self._where()} ({calls[0].text}): {exc!r}"
            )
            self.error.__cause__ = exc

    def _find_waste(
        self,
        kind: type[Description],
        calls: list[Call],
        payloads: list[Description],
        repeats: _findings.Repeats,
    ) -> None:
        first = calls[0]
        mine = payloads[0].contributed()
        rule = kind.wasted
        # every rule needs the same bytes from every rank: two ranks that differ rule them all out
        reason = None
        if rule is not None and not surely_differ(mine, payloads[1].contributed()):
            reason = rule(payloads)
        if reason is None:
            # (a call the rule above flags needs no memory: the same bytes again meet the same rule)
            if not mine or nbytes(mine) > _findings.REPEAT_LIMIT:
                return  # only small calls are remembered (rank 0's size rules out most; check() sees all)
            key = (kind, first.payload.api, first.signature)
            reason = repeats.check(key, self.seq, [p.contributed() for p in payloads])
            if reason is None:
                return
        self.wasted = reason
        if _findings.wanted():
            _findings.report(
                _findings.Finding(first.op, first.payload.api, self.group.ranks, self.seq, first.site, reason)
            )

    def describe(self, rank: int) -> str:
        call = self.calls[self.group.ranks.index(rank)]
        site = f" at {call.site}" if call is not None else ""
        missing = self.missing()
        waits = f"; waiting for rank{'s' if len(missing) > 1 else ''} {_ranks(missing)}" if missing else ""
        text = call.text if call is not None else "?"
        return f"waiting in {text}, {self._where()}{site}{waits}"

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
        width = max((len(t) for t in texts.values()), default=0)
        rows = []
        for i, call in enumerate(self.calls):
            rank = ranks[i]
            if call is None:
                rows.append(f"  rank {rank}: (has not reached this call)")
                continue
            mark = "   <- differs" if rank in odd else ""
            rows.append(f"  rank {rank}: {call.text.ljust(width)}  at {call.site}{mark}")
        details = "".join(f"\n  - {_global(p.text, ranks)}" for p in problems)
        if odd:
            plural = len(odd) > 1
            differs = (
                f"Rank{'s' if plural else ''} {_ranks(odd)} differ{'' if plural else 's'} from the others. "
            )
        else:
            differs = ""
        message = (
            f"{headline} in {self._where()}:\n"
            + "\n".join(rows)
            + (f"\nWhat does not fit:{details}" if details else "")
            + f"\n{differs}{_ADVICE}"
        )
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


def _ranks(ranks: Sequence[int]) -> str:
    return ", ".join(map(str, ranks))


@dataclass
class Rendezvous:
    """Every group of one world, by name."""

    scheduler: Scheduler
    findings: bool = False  # check calls for waste (meshsim._observe.findings)
    tracer: Tracer | None = None  # draws the world (meshsim._observe.trace)
    groups: dict[str, GroupState] = field(default_factory=dict)

    def group(self, name: str, ranks: tuple[int, ...], caller: int) -> GroupState:
        """The world's record of group ``name``, created by its first member to arrive.

        Raises:
            ValueError: another rank created a group of this name with other ranks.
        """
        with self.scheduler:
            group = self.groups.get(name)
            if group is None:
                group = self.groups[name] = GroupState(name, ranks, self.findings)
            elif group.ranks != ranks:
                raise ValueError(
                    f"rank {caller} created process group {name!r} with ranks {list(ranks)}, "
                    f"but another rank created it with ranks {list(group.ranks)}: every rank "
                    "must call new_group() (and build device meshes) with the same ranks "
                    "in the same order"
                )
            return group

    def meet(self, group: GroupState, seq: int, call: Call, rank: int) -> str | None:
        """Join call ``seq`` on ``group`` as global ``rank``, and return once every rank has arrived.

        The last rank to arrive completes the call. One hold of the scheduler's lock
        covers the arrival and the wait, and the wake-ups go out as it is released.

        Returns:
            why the call told no rank anything new, when the group checks for that.

        Raises:
            CollectiveMismatchError: the ranks' calls do not fit together.
            WorldAborted: the world failed.
        """
        tracer = self.tracer
        if tracer is None:
            return self._meet(group, seq, call, rank).wasted
        call.arrived = tracer.now()
        try:
            slot = self._meet(group, seq, call, rank)
        except BaseException as exc:
            tracer.collective(rank, group, call, None, exc)
            raise
        tracer.collective(rank, group, call, slot)
        return slot.wasted

    def _meet(self, group: GroupState, seq: int, call: Call, rank: int) -> Slot:
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
                slot.complete(self.tracer is not None)
                scheduler.wake(slot)
        except BaseException:
            scheduler.lock.release()
            raise
        scheduler.wait_locked(rank, slot)
        return slot
