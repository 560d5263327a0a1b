"""Wasted collectives: calls that could not have told any rank anything new.

A simulated world sees every rank's payload when the last rank arrives at a
collective, before any data moves; there it asks the call's description
(:mod:`meshsim._sim.collectives`, ``wasted``) and compares small calls with the group's
earlier ones (:class:`Repeats`). A call found wasted carries the reason in every
rank's ledger entry (``Collective.redundant``) and is reported to whoever collects
findings (:func:`collecting`; the pytest plugin, per test).

A world looks only where a finding can be seen: at calls some rank records in a
ledger (:func:`meshsim.record`), or while a collector is open. A repeat of a call made
while nobody looked is not found (the rule misses it; it never flags wrongly).

Only the ``sim`` backend finds them: gloo and NCCL ranks do not see each other's
data. A group of one rank is never reported (its collectives are local copies on
NCCL too). ``MESHSIM_REDUNDANT=0`` in the environment, or ``meshsim.run(...,
redundant=False)``, turns the checks off.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch

from meshsim._sim import movement as mv
from meshsim._sim.collectives import nbytes

__all__ = ["Finding", "Repeats", "collecting", "enabled_by_default", "report", "wanted"]

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
    """

    op: str
    api: str
    group: tuple[int, ...]
    seq: int
    site: str
    reason: str

    def __str__(self) -> str:
        return f"{self.api} on group {list(self.group)} (call #{self.seq}) at {self.site}: {self.reason}"


def enabled_by_default() -> bool:
    """Whether worlds look for wasted calls unless told otherwise (``MESHSIM_REDUNDANT``, default on)."""
    value = os.environ.get("MESHSIM_REDUNDANT", "1").strip().lower()
    return value not in ("0", "false", "no", "off")


_sinks: list[list[Finding]] = []
_lock = threading.Lock()


@contextmanager
def collecting() -> Iterator[list[Finding]]:
    """Collect the findings of every world while the block runs (any thread's), in order."""
    found: list[Finding] = []
    with _lock:
        _sinks.append(found)
    try:
        yield found
    finally:
        with _lock:
            _sinks.remove(found)


def wanted() -> bool:
    """Whether any :func:`collecting` block is open (a finding's call site is looked up only then)."""
    return bool(_sinks)


def report(finding: Finding) -> None:
    """Hand ``finding`` to every open :func:`collecting` block."""
    with _lock:
        for sink in _sinks:
            sink.append(finding)


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
