"""Ledger snapshots: pin every rank's collectives to a reviewable file, and compare later runs with it.

A snapshot file is JSON, one per test module in the pytest plugin
(``__snapshots__/test_x.ledger.json`` beside it). Under ``"tests"`` it holds one
entry per key (a test id), and in it one list per rank, named ``"rank R of N"``,
of one line per collective::

    "all_gather all_gather_into_tensor [0,1] float32 in=64 out=128"
    "all_reduce all_reduce [0,1] float32 in=32 out=32 SUM"
    "send send [0,1] float32 in=16 out=0 peer=1"

that is: op, api, group (global ranks), dtype, bytes in and out, then the reduce
op and the peer (the other end of a send or recv, or a rooted collective's root)
where the call has them. ``seq`` is implied by the order, and the call site is left
out so that edits elsewhere in the test's file do not change the snapshot. Each
world size has its own ranks, so a ``multigpu_static`` test run on 2 and on 4
ranks keeps both. Test ids (in natural order) and ranks are sorted, and nothing
is aligned: a changed call is a one-line change in review.

Given a topology, an entry also carries ``"estimate of N on TOPOLOGY": "18.4 us"``:
the critical path of the N ranks' calls on that topology
(:func:`meshsim._observe.cost.critical_path`), so that a change which multiplies
what a test would cost on GPUs shows in the file's diff even when its lines look
alike. Later runs on that topology check it: more than 10% apart either way
(:data:`ESTIMATE_TOLERANCE`) is a mismatch, less is not (the stored figure is
rounded, and a small recalibration of the model should not rewrite every file).
An entry without an estimate for the run's topology has nothing to check (and
gets one only when it is written: created, or ``update``); rewriting a world
size's lines drops its estimates on other topologies, which priced the old lines.

Writers lock the folder (``flock``, where the platform has it) and replace the file
atomically, so ``pytest -n auto`` workers may write different keys of one file at
once and readers never see half a file.

Non-goals: entries of tests that no longer exist are kept (delete them by hand, or
delete the file and rerun); the file is not a ledger (no ``seq``, ``site``, and
bytes are exact integers, not the table's rounded units).
"""

from __future__ import annotations

import difflib
import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

from meshsim._observe import cost
from meshsim._observe.snapshot_file import ESTIMATE, entry_of, load, shown, store
from meshsim._observe.topology import resolve
from meshsim._record.ledger import Collective, Ledger

if TYPE_CHECKING:
    from meshsim._observe.topology import Topology

__all__ = ["ESTIMATE_TOLERANCE", "SnapshotMismatchError", "check_snapshot", "snapshot_lines"]

ESTIMATE_TOLERANCE = 0.10  # a stored estimate matches a run's within 10% either way

Outcome = Literal["created", "matched", "updated"]


class SnapshotMismatchError(AssertionError):
    """The collectives of a run differ from the stored snapshot; the message has a diff per rank.

    Attributes:
        path: the snapshot file.
        key: the entry that differs (a test id).
        ranks: the ranks whose collectives differ, in order (none when only the
            estimate differs).
    """

    def __init__(
        self, path: Path, key: str, world_size: int, diffs: Mapping[int, str], estimate: str | None = None
    ) -> None:
        self.path = path
        self.key = key
        self.ranks = tuple(sorted(diffs))
        super().__init__(_mismatch_message(path, key, world_size, diffs, estimate))


def snapshot_line(call: Collective) -> str:
    """One call as its snapshot stores it: ``op api [group] dtype in=N out=N [REDUCE] [peer=R]``."""
    parts = [call.op, call.api, f"[{','.join(map(str, call.group))}]"]
    if call.dtype is not None:
        parts.append(str(call.dtype).removeprefix("torch."))
    parts += [f"in={call.bytes_in}", f"out={call.bytes_out}"]
    if call.reduce_op is not None:
        parts.append(call.reduce_op)
    if call.peer is not None:
        parts.append(f"peer={call.peer}")
    return " ".join(parts)


def snapshot_lines(ledger: Ledger) -> list[str]:
    """A ledger as its snapshot stores it: one line per call (see :func:`snapshot_line`)."""
    return [snapshot_line(call) for call in ledger.calls]


def check_snapshot(
    path: str | os.PathLike[str],
    key: str,
    ledgers: Sequence[Ledger],
    *,
    update: bool = False,
    write: bool = True,
    topology: Topology | str | None = None,
) -> Outcome:
    """Compare every rank's ledger with the snapshot stored under ``key``; store it if there is none.

    Args:
        path: the snapshot file; it and its folder are created when missing.
        key: the entry's name in the file, e.g. a test id.
        ledgers: every rank's ledger, rank 0's first (what :func:`meshsim.run` returns
            when each rank returns its :func:`meshsim.record` ledger).

    Keyword args:
        update: store these ledgers in place of the entry instead of comparing.
        write: False to never write the file (the ranks of a job that share one
            file, but one); outcomes are then what writing would have done.
        topology: where given (a :class:`~meshsim.Topology` or a preset name), the
            entry also holds the ranks' estimated communication time on it (the
            critical path across them), and a stored one is checked within
            :data:`ESTIMATE_TOLERANCE` (see the module's docstring).

    Returns:
        ``"created"`` when the file had no entry for this key and number of ranks (now
        stored), ``"updated"`` when ``update`` replaced an entry that differed, else
        ``"matched"``. The file is only written when it changes.

    Raises:
        SnapshotMismatchError: without ``update``, some rank's collectives differ from
            the entry, or the estimate from the stored one; the message has a unified
            diff per rank and both estimates.
        ValueError: ``ledgers`` is empty, or ``path`` is not a snapshot file (a merge
            conflict, say); the message names it. An unknown preset name, or ledgers
            that do not line up across ranks (:func:`~meshsim._observe.cost.critical_path`).
        TimeoutError: another writer held the file for a minute.
    """
    if not ledgers:
        raise ValueError(f"check_snapshot({key!r}) needs one ledger per rank, got none")
    path = Path(path)
    n = len(ledgers)
    runs: dict[str, Any] = {_rank_key(rank, n): snapshot_lines(ledger) for rank, ledger in enumerate(ledgers)}
    stored = entry_of(load(path), key)
    mine = {name: stored[name] for name in runs if name in stored}
    estimate = _estimate(ledgers, topology)  # (its name, this run's figure) or None
    if not mine:
        if write:
            store(path, key, dict([estimate]) if estimate else {}, runs, stale=_estimates_of(stored, n))
        return "created"
    diffs = {rank: _diff(mine.get(name), lines) for rank, (name, lines) in enumerate(runs.items())}
    diffs = {r: d for r, d in diffs.items() if d}
    moved = _estimate_moved(stored, estimate)
    unpriced = estimate is not None and estimate[0] not in stored
    if not diffs and moved is None and not (update and unpriced):
        return "matched"
    if not update:
        raise SnapshotMismatchError(path, key, n, diffs, moved)
    if write:
        stale = _estimates_of(stored, n) if diffs else []  # they priced the old lines
        store(path, key, dict([estimate]) if estimate else {}, runs, stale=stale)
    return "updated"


def _estimate(ledgers: Sequence[Ledger], topology: Topology | str | None) -> tuple[str, str] | None:
    """The entry's estimate on ``topology``: its name and this run's critical path, or None."""
    if topology is None:
        return None
    topo = resolve(topology)
    seconds = cost.critical_path(ledgers, topo).total
    return f"{ESTIMATE}{len(ledgers)} on {topo.name}", cost.format_seconds(seconds)


def _estimate_moved(stored: dict[str, Any], estimate: tuple[str, str] | None) -> str | None:
    """What the message says when the stored estimate and this run's are over the tolerance apart."""
    if estimate is None or estimate[0] not in stored:
        return None  # an entry written without the estimate (or on another topology): no check
    from meshsim._observe.cost import parse_seconds

    name, text = estimate
    before, now = parse_seconds(stored[name]), parse_seconds(text)
    low, high = sorted((before, now))
    if high <= low * (1 + ESTIMATE_TOLERANCE):
        return None
    factor = f"{now / before:.3g}x" if before > 0 else "up from nothing"
    return (
        f"{name}: stored {stored[name]}, this run {text} ({factor}; "
        f"the tolerance is {ESTIMATE_TOLERANCE:.0%} either way)"
    )


def _estimates_of(stored: dict[str, Any], world_size: int) -> list[str]:
    """The names of the entry's estimates for ``world_size`` ranks, on any topology."""
    prefix = f"{ESTIMATE}{world_size} on "
    return [name for name in stored if name.startswith(prefix)]


def _rank_key(rank: int, world_size: int) -> str:
    return f"rank {rank} of {world_size}"


def _diff(stored: list[str] | None, lines: list[str]) -> str:
    """A unified diff from the stored lines to this run's, or "" when they are equal."""
    if stored == lines:
        return ""
    before = "stored" if stored is not None else "stored (no entry for this rank)"
    diff = difflib.unified_diff(stored or [], lines, before, "this run", lineterm="")
    return "\n".join(diff)


def _mismatch_message(
    path: Path, key: str, world_size: int, diffs: Mapping[int, str], estimate: str | None
) -> str:
    ranks = sorted(diffs)
    if not ranks:
        return (
            f"the estimated communication time of {key} on {world_size} ranks differs from its "
            f"ledger snapshot in {shown(path)} (the collectives are the same):\n{estimate}"
        )
    which = f"rank {ranks[0]}" if len(ranks) == 1 else f"ranks {', '.join(map(str, ranks))}"
    lines = [
        f"the collectives of {key} on {which} (of {world_size}) differ from its ledger snapshot "
        f"in {shown(path)}:"
    ]
    first_with: dict[str, int] = {}
    for rank in ranks:
        same = first_with.setdefault(diffs[rank], rank)
        if same != rank:
            lines.append(f"rank {rank}: the same difference as rank {same}")
            continue
        lines.append(f"rank {rank}:")
        lines += [f"  {line}" for line in diffs[rank].splitlines()]
    if estimate is not None:
        lines.append(estimate)
    return "\n".join(lines)
