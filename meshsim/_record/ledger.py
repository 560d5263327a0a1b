"""The collective ledger: one immutable record per collective a rank puts on the wire."""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field, fields
from typing import TYPE_CHECKING, Any, Protocol

import torch

from meshsim._base.context import current

if TYPE_CHECKING:
    from meshsim._observe.topology import Topology

__all__ = [
    "Collective",
    "Ledger",
    "Pricing",
    "append",
    "install_pricing",
    "is_recording",
    "record",
    "recording_into",
]

OPS = (
    "all_gather",
    "all_reduce",
    "reduce_scatter",
    "all_to_all",
    "broadcast",
    "scatter",
    "gather",
    "reduce",
    "barrier",
    "send",
    "recv",
)


class Pricing(Protocol):
    """What the cost model (:mod:`meshsim._observe.cost`, a layer above) gives the ledger."""

    def estimate(self, call: Collective, topology: Topology | str, /, *, rank: int | None = None) -> Any:
        """One call's estimate (with ``.seconds``)."""

    def total(
        self, calls: list[Collective], topology: Topology | str, /, *, rank: int | None = None
    ) -> float:
        """Seconds for calls one after another."""

    def table_column(
        self, calls: list[Collective], topology: Topology | str, /, *, rank: int | None = None
    ) -> tuple[list[str], str]:
        """Each call's estimate as text, and the clause the table's total line ends with."""


# The cost model prices ledgers and sits above them: it hands itself down when it is
# imported (``meshsim`` imports it), so the ledger prices itself without importing it.
_pricing: list[Pricing] = []


def install_pricing(pricing: Pricing) -> None:
    """Make ``pricing`` the one the ledger's ``estimated_time`` and ``table(topology)`` use."""
    _pricing[:] = [pricing]


def _priced() -> Pricing:
    if not _pricing:
        raise RuntimeError("no cost model installed: import meshsim (its cost model prices ledgers)")
    return _pricing[0]


@dataclass(frozen=True)
class Collective:
    """One collective call as it reached the wire, seen from the calling rank.

    Attributes:
        op: the normalized operation, one of ``all_gather``, ``all_reduce``,
            ``reduce_scatter``, ``all_to_all``, ``broadcast``, ``scatter``,
            ``gather``, ``reduce``, ``barrier``, ``send``, ``recv``.
        api: the exact call, e.g. ``all_gather_into_tensor`` or ``all_gather``
            (list form); ``*_coalesced`` when several tensors travel together.
        group: the global ranks of the process group, in group-rank order.
        dtype: the element type (None for barrier, or when coalesced tensors differ).
        bytes_in: bytes this rank contributes.
        bytes_out: bytes this rank receives.
        reduce_op: ``SUM``, ``AVG``, ... for reducing collectives, else None.
        seq: position of the call in this group's sequence of collectives (for
            send and recv: in the sequence of messages between this pair of ranks).
        site: ``file.py:LINE in function`` of the user's line that issued the call: the
            first caller outside torch, meshsim, shardtensor, the standard library and
            the folders declared library code (:func:`meshsim.library_code`).
        peer: the global rank at the other end of a send, recv or rooted collective.
        redundant: why the call could not have told any rank anything new (every rank
            contributed the same bytes, ...), or None. Only the ``sim`` backend looks
            (gloo and NCCL ranks cannot see each other's data); equality ignores it,
            so ledgers compare equal across backends.
        via: where a library made the call for the user (``ShardTensor.from_local``
            gathering shapes), the library's own line (``shardtensor/_collectives.py:63 in
            all_gather_shapes``), else None. Equality ignores it.
    """

    op: str
    api: str
    group: tuple[int, ...]
    dtype: torch.dtype | None
    bytes_in: int
    bytes_out: int
    reduce_op: str | None
    seq: int
    site: str
    peer: int | None = None
    redundant: str | None = field(default=None, compare=False)
    via: str | None = field(default=None, compare=False)

    def estimated_time(self, topology: Topology | str, *, rank: int | None = None) -> float:
        """Seconds this call would take on ``topology``, by its cost model.

        Args:
            topology: a :class:`~meshsim.Topology` or a preset name (``"dgx-h100"``, ...).

        Keyword args:
            rank: the global rank that recorded the call; only a send or recv in a group
                of more than two ranks needs it (without it, the slowest hop it could take).

        Raises:
            ValueError: an unknown preset name, or a rank the topology's mapping does not cover.
        """
        return float(_priced().estimate(self, topology, rank=rank).seconds)

    def __str__(self) -> str:
        dtype = str(self.dtype).removeprefix("torch.") if self.dtype is not None else "-"
        extra = f" {self.reduce_op}" if self.reduce_op else ""
        peer = f" peer={self.peer}" if self.peer is not None else ""
        wasted = f" [redundant: {self.redundant}]" if self.redundant else ""
        return (
            f"{self.api}{extra} {dtype} group={list(self.group)}{peer} "
            f"in={_human(self.bytes_in)} out={_human(self.bytes_out)} #{self.seq} at {self.site}{wasted}"
        )


_COLUMNS = ("#", "op", "api", "group", "dtype", "in", "out", "reduce", "site")


class Ledger:
    """The collectives one rank issued inside a :func:`record` block, in order.

    Attributes:
        calls: the :class:`Collective` records, oldest first.
    """

    def __init__(self) -> None:
        self.calls: list[Collective] = []

    def counts(self) -> dict[str, int]:
        """Number of calls per ``op``."""
        return dict(Counter(call.op for call in self.calls))

    def count(self, op: str | None = None) -> int:
        """Number of calls of ``op`` (all calls when ``op`` is None).

        Raises:
            ValueError: ``op`` is not one of the normalized op names.
        """
        if op is None:
            return len(self.calls)
        _check_op(op)
        return sum(1 for call in self.calls if call.op == op)

    def bytes(self, op: str | None = None, *, direction: str = "out") -> int:
        """Total bytes received (``direction="out"``) or sent (``"in"``) by this rank.

        Args:
            op: count only this op; all ops when None.

        Keyword args:
            direction: ``"out"`` (bytes received, the default) or ``"in"`` (bytes contributed).

        Raises:
            ValueError: an unknown ``op`` or ``direction``.
        """
        if direction not in ("in", "out"):
            raise ValueError(f"direction must be 'in' or 'out', got {direction!r}")
        if op is not None:
            _check_op(op)
        attr = "bytes_out" if direction == "out" else "bytes_in"
        return sum(getattr(c, attr) for c in self.calls if op is None or c.op == op)

    def redundant(self) -> list[Collective]:
        """The calls found wasted (``redundant`` set), oldest first: none on gloo and NCCL."""
        return [call for call in self.calls if call.redundant]

    def project(self, *names: str) -> list[tuple[object, ...]]:
        """The calls reduced to the named fields, for exact comparisons in tests.

        ``ledger.project("op", "group")`` gives ``[("all_gather", (0, 1)), ...]``.

        Raises:
            ValueError: a name is not a field of :class:`Collective`.
        """
        known = [f.name for f in fields(Collective)]
        unknown = [n for n in names if n not in known]
        if unknown or not names:
            raise ValueError(f"project() takes field names from {known}, got {list(names)}")
        return [tuple(getattr(call, n) for n in names) for call in self.calls]

    def __len__(self) -> int:
        return len(self.calls)

    def __iter__(self) -> Iterator[Collective]:
        return iter(self.calls)

    def __repr__(self) -> str:
        return f"Ledger(calls={self.calls!r})"

    def __str__(self) -> str:
        return self.table()

    def estimated_time(self, topology: Topology | str, *, rank: int | None = None) -> float:
        """Seconds this rank's calls would take on ``topology``, one after another.

        The sum of :meth:`Collective.estimated_time` over the calls: no compute, and no
        waiting for other ranks (:func:`meshsim.critical_path` adds that).

        Args:
            topology: a :class:`~meshsim.Topology` or a preset name (``"dgx-h100"``, ...).

        Keyword args:
            rank: the global rank that recorded the ledger (see :meth:`Collective.estimated_time`).

        Raises:
            ValueError: an unknown preset name, or a rank the topology's mapping does not cover.
        """
        return _priced().total(self.calls, topology, rank=rank)

    def table(self, topology: Topology | str | None = None, *, rank: int | None = None) -> str:
        """The calls as a text table; ``str(ledger)`` is ``ledger.table()``.

        Args:
            topology: where given (a :class:`~meshsim.Topology` or a preset name), an
                ``estimate`` column and the total estimated time on it.

        Keyword args:
            rank: the global rank that recorded the ledger (see :meth:`Collective.estimated_time`).

        Raises:
            ValueError: an unknown preset name, or a rank the topology's mapping does not cover.
        """
        if not self.calls:
            return "0 collectives"
        estimates, clause = None, ""
        if topology is not None:
            estimates, clause = _priced().table_column(self.calls, topology, rank=rank)
        columns = _COLUMNS if estimates is None else (*_COLUMNS[:-1], "estimate", _COLUMNS[-1])
        via = any(c.via for c in self.calls)  # a library's own line, beside the user's
        if via:
            columns = (*columns, "via")
        rows = [columns] + [_row(i, c, estimates, via) for i, c in enumerate(self.calls)]
        widths = [max(len(row[i]) for row in rows) for i in range(len(columns))]
        lines = ["  ".join(v.ljust(w) for v, w in zip(row, widths)).rstrip() for row in rows]
        wasted = [(i, c) for i, c in enumerate(self.calls) if c.redundant]
        for k, (i, _) in enumerate(wasted):  # a mark after the row, the reason below the table
            lines[i + 1] += f"  [redundant {k + 1}]"
        total = f"{len(self.calls)} collectives, {_human(self.bytes())} received{clause}"
        if wasted:
            total += f", {len(wasted)} redundant"
        notes = [f"[redundant {k + 1}] #{i}: {c.redundant}" for k, (i, c) in enumerate(wasted)]
        return "\n".join([*lines, total, *notes])


def _row(index: int, c: Collective, estimates: list[str] | None = None, via: bool = False) -> tuple[str, ...]:
    dtype = str(c.dtype).removeprefix("torch.") if c.dtype is not None else "-"
    group = ",".join(map(str, c.group))
    if c.peer is not None:
        group += f" peer {c.peer}"
    row = (
        str(index),
        c.op,
        c.api,
        f"[{group}]",
        dtype,
        _human(c.bytes_in),
        _human(c.bytes_out),
        c.reduce_op or "-",
    )
    estimate = () if estimates is None else (estimates[index],)
    return (*row, *estimate, c.site, *((c.via or "-",) if via else ()))


def _human(n: int) -> str:
    if n < 1024:
        return f"{n} B"
    if n < 1024 * 1024:
        return f"{n / 1024:.1f} KiB"
    return f"{n / (1024 * 1024):.1f} MiB"


def _check_op(op: str) -> None:
    if op not in OPS:
        raise ValueError(f"unknown collective op {op!r}; expected one of {', '.join(OPS)}")


@contextmanager
def record() -> Iterator[Ledger]:
    """Record the collectives the calling rank issues inside the block.

    Recording is per thread (per rank) and nests: an outer block sees
    everything an inner one does. Works on every meshsim backend and under
    ``--multigpu-static``.

    Returns:
        a :class:`Ledger` that fills while the block runs.
    """
    with recording_into(Ledger()) as ledger:
        yield ledger


@contextmanager
def recording_into(ledger: Ledger) -> Iterator[Ledger]:
    """Like :func:`record`, appending to an existing ``ledger``."""
    stack = current().ledgers
    stack.append(ledger)
    try:
        yield ledger
    finally:
        stack.remove(ledger)


def is_recording() -> bool:
    """Whether the calling thread is inside a :func:`record` block."""
    return bool(current().ledgers)


def append(call: Collective) -> None:
    """Add ``call`` to every ledger open in the calling thread."""
    for ledger in current().ledgers:
        ledger.calls.append(call)
