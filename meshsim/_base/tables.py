"""The per-rank tables of a stalled world and of a mismatch, as every backend prints them.

The simulated backend builds them from its scheduler and rendezvous; gloo, spawned and
torchrun ranks from what each rank's dispatch recorder saw (:mod:`meshsim._record.standing`).
One text for both, so a failure reads the same whichever backend found it.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

__all__ = ["ADVICE", "deadlock_text", "mismatch_text", "ranks_text", "waiting_text", "why_text"]

ADVICE = (
    "Every rank of a group must issue the same collectives on it, in the same order, "
    "with matching dtypes, shapes, reduce ops and roots."
)


def ranks_text(ranks: Sequence[int]) -> str:
    """``1`` or ``1, 3``."""
    return ", ".join(map(str, ranks))


def _plural(ranks: Sequence[int]) -> str:
    return "s" if len(ranks) > 1 else ""


def waiting_text(call: str, where: str, site: str | None, missing: Sequence[int]) -> str:
    """A waiting rank's state: ``waiting in all_reduce(float32[4], SUM), call #0 of group [0, 1] at ...``."""
    at = f" at {site}" if site is not None else ""
    waits = f"; waiting for rank{_plural(missing)} {ranks_text(missing)}" if missing else ""
    return f"waiting in {call}, {where}{at}{waits}"


def why_text(finished: Sequence[int], elsewhere: Sequence[int]) -> str:
    """The line naming the ranks the others wait for: those that finished, those in another call."""
    parts = []
    if finished:
        parts.append(f"rank{_plural(finished)} {ranks_text(finished)}, which finished")
    if elsewhere:
        parts.append(
            f"rank{_plural(elsewhere)} {ranks_text(elsewhere)}, which wait in another call (see above)"
        )
    return "Ranks wait for " + " and for ".join(parts) + "." if parts else ""


def deadlock_text(world_size: int, states: Mapping[int, str], why: str) -> str:
    """The stalled world's message: a headline, one line per rank's state, the culprits' line."""
    lines = [f"  rank {r}: {text}" for r, text in states.items()]
    return (
        f"deadlock: no rank of the {world_size}-rank world can make progress.\n"
        + "\n".join(lines)
        + (f"\n{why}" if why else "")
    )


def mismatch_text(
    headline: str,
    where: str,
    calls: Sequence[tuple[int, str, str] | tuple[int, None, None]],
    odd: Sequence[int],
    details: Sequence[str] = (),
) -> str:
    """Ranks in different collectives at one call of a group: each rank's call and site, the odd ones marked.

    Args:
        headline: what went wrong, e.g. ``"ranks entered different collectives"``.
        where: the call, e.g. ``"call #0 of group [0, 1]"``.
        calls: ``(global rank, call text, site)`` per rank of the group; text None: not there yet.
        odd: the ranks whose call differs.
        details: what does not fit, one line each.
    """
    width = max((len(text) for _, text, _ in calls if text is not None), default=0)
    rows = []
    for rank, text, site in calls:
        if text is None:
            rows.append(f"  rank {rank}: (has not reached this call)")
            continue
        mark = "   <- differs" if rank in odd else ""
        rows.append(f"  rank {rank}: {text.ljust(width)}  at {site}{mark}")
    lines = "".join(f"\n  - {line}" for line in details)
    differs = ""
    if odd:
        many = len(odd) > 1
        differs = f"Rank{'s' if many else ''} {ranks_text(odd)} differ{'' if many else 's'} from the others. "
    return (
        f"{headline} in {where}:\n"
        + "\n".join(rows)
        + (f"\nWhat does not fit:{lines}" if lines else "")
        + f"\n{differs}{ADVICE}"
    )
