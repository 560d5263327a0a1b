"""Wasted collectives: calls that could not have told any rank anything new.

A simulated world sees every rank's payload when the last rank arrives at a
collective, before any data moves; there it asks the call's description
(:mod:`meshsim._sim.collectives`, ``wasted``) and compares small calls with the group's
earlier ones (:class:`Repeats`): the :class:`Findings` instrument. A call found
wasted carries the reason in every rank's ledger entry (``Collective.redundant``) and
is reported to whoever collects findings (a :class:`meshsim._observe.watch.Watch`:
:func:`collecting`, or the pytest plugin, per test).

A world looks only where a finding can be seen: at calls some rank records in a
ledger (:func:`meshsim.record`), or while a collector is open or a trace is drawn. A repeat of a call made
while nobody looked is not found (the rule misses it; it never flags wrongly).

Only the ``sim`` backend finds them: gloo and NCCL ranks do not see each other's
data. A group of one rank is never reported (its collectives are local copies on
NCCL too). ``MESHSIM_REDUNDANT=0`` in the environment, or ``meshsim.run(...,
redundant=False)``, turns the checks off.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from meshsim._observe.watch import Watch, watching
from meshsim._record.sites import made_by_torch
from meshsim._sim import movement as mv
from meshsim._sim.collectives import nbytes
from meshsim._sim.rendezvous import Instrument

if TYPE_CHECKING:
    from meshsim._sim.rendezvous import Slot

__all__ = ["Finding", "Findings", "Repeats", "collecting", "enabled_by_default"]

# Calls are compared with the group's earlier calls only when every rank contributes at
# most this many bytes: shape and metadata exchanges, which meshsim copies to compare.
REPEAT_LIMIT = 256


@dataclass(frozen=True)
class Finding:
    """One wasted collective, as the world saw it.

    Attributes:
        op, api: as in the ledger (``all_gather``, ``all_gather_into_tensor``).
        group: the global ranks of the group.
        seq: the call's position in the group's sequence.
        site: where the group's first rank issued it.
        reason: why no rank learned anything new from it.
        made_by: the torch module that made the call by design (``torch.nn.parallel.distributed``
            for DDP's parameter sync), or None: the user's own call.
    """

    op: str
    api: str
    group: tuple[int, ...]
    seq: int
    site: str
    reason: str
    made_by: str | None = None

    def __str__(self) -> str:
        by = f" (made by {self.made_by})" if self.made_by else ""
        return f"{self.api} on group {list(self.group)} (call #{self.seq}) at {self.site}{by}: {self.reason}"


def enabled_by_default() -> bool:
    """Whether worlds look for wasted calls unless told otherwise (``MESHSIM_REDUNDANT``, default on)."""
    value = os.environ.get("MESHSIM_REDUNDANT", "1").strip().lower()
    return value not in ("0", "false", "no", "off")


class collecting:  # a context manager, named as contextlib's are
    """Collect the findings of every world's calls while the block runs (any thread's), in order.

    ``with collecting() as found:`` gives the list the findings go into.
    """

    def __init__(self) -> None:
        self.found: list[Finding] = []
        self._watching = watching(Watch(findings=self.found))

    def __enter__(self) -> list[Finding]:
        self._watching.__enter__()
        return self.found

    def __exit__(self, *exc_info: object) -> None:
        self._watching.__exit__(*exc_info)


class Findings(Instrument):
    """The instrument that finds wasted calls, as the last rank arrives and before the data moves.

    It looks only where a finding can be seen: at calls some rank records in a ledger,
    while a trace draws the world (``looking``), or while a :class:`Watch` collects
    (``sinks``, set by the world for each of its calls). A found call's reason goes
    into every recording rank's ledger entry (``Collective.redundant``), into the slot
    (a trace shows it) and to the sinks.
    """

    def __init__(self) -> None:
        self.looking = False
        self.sinks: list[list[Finding]] = []
        self._repeats: dict[str, Repeats] = {}  # per group, for the world's life

    def completed(self, slot: Slot) -> None:
        group = slot.group
        if group.size < 2:  # a group of one rank: its collectives are local copies on NCCL too
            return
        if not (self.looking or self.sinks):  # then only a recording rank's call is looked at
            for call in slot.calls:
                if call is not None and call.entry is not None:
                    break
            else:
                return
        repeats = self._repeats.get(group.name)
        if repeats is None:
            repeats = self._repeats[group.name] = Repeats()
        reason = _waste(slot, repeats)
        if reason is None:
            return
        slot.wasted = reason
        calls = slot.arrivals
        for call in calls:
            call.mark(reason)
        if self.sinks:
            first = calls[0]
            # the last rank to arrive completes the call, inside it: its stack is the call's
            made_by = made_by_torch(sys._getframe(1))
            finding = Finding(first.op, first.payload.api, group.ranks, slot.seq, first.site, reason, made_by)
            for sink in self.sinks:
                sink.append(finding)


def _waste(slot: Slot, repeats: Repeats) -> str | None:
    """Why the slot's call tells no rank anything new, or None."""
    payloads = slot.payloads
    kind = type(payloads[0])
    mine = payloads[0].contributed()
    rule = kind.wasted
    # every rule needs the same bytes from every rank: two ranks that differ rule them all out
    if rule is not None and not mv.surely_differ(mine, payloads[1].contributed()):
        reason = rule(payloads)
        if reason is not None:
            return reason
    # (a call the rule above flags needs no memory: the same bytes again meet the same rule)
    if not mine or nbytes(mine) > REPEAT_LIMIT:
        return None  # only small calls are remembered (rank 0's size rules out most; check() sees all)
    key = (kind, payloads[0].api, slot.arrivals[0].signature)
    return repeats.check(key, slot.seq, [p.contributed() for p in payloads])


class Repeats:
    """A group's earlier small calls, to find one repeated with the same bytes from every rank."""

    def __init__(self) -> None:
        self._seen: dict[tuple[Any, ...], tuple[int, list[list[torch.Tensor]]]] = {}

    def check(self, key: tuple[Any, ...], seq: int, per_rank: Sequence[Sequence[torch.Tensor]]) -> str | None:
        """Why call ``seq`` repeats an earlier one (None if it does not); remembers it otherwise.

        ``key``: what must be equal for two calls to be the same (kind, api, signature);
        ``per_rank``: each rank's contributed tensors, before the call moves any data.
        """
        if not per_rank[0] or any(nbytes(tensors) > REPEAT_LIMIT for tensors in per_rank):
            return None
        earlier = self._seen.get(key)
        if earlier is not None:
            first, copies = earlier
            if all(
                len(mine) == len(theirs) and all(mv.same_bytes(a, b) for a, b in zip(mine, theirs))
                for mine, theirs in zip(per_rank, copies)
            ):
                return (
                    f"the same call as #{first} on this group, with the same bytes from every rank: "
                    "each rank could reuse that call's result"
                )
        self._seen[key] = (seq, [[t.detach().clone() for t in tensors] for tensors in per_rank])
        return None
