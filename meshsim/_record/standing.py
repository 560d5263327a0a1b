"""Where each rank of a real-backend world stood when its test ended, and who made the others wait.

On gloo thread ranks, spawned ranks and torchrun ranks a rank whose peer finished,
raised or went elsewhere sees only its own collective fail ("Connection closed by
peer", a timeout). Each rank's dispatch recorder knows the call it is in and how many
it issued on each group; from every rank's :class:`Standing`, :func:`verdict` names
the rank the others wait for and builds the same per-rank table the simulated
backend prints (:mod:`meshsim._base.tables`).

Non-goals: it reads only what the recorders saw. A rank that never reported (killed,
stuck in its own code) is shown as such, not guessed at.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from meshsim._base.errors import CollectiveMismatchError, DeadlockError, MeshError
from meshsim._base.tables import deadlock_text, mismatch_text, waiting_text, why_text
from meshsim._record.recorder import DispatchRecorder, Entered

__all__ = [
    "FAILED",
    "FINISHED",
    "RUNNING",
    "SILENT",
    "WAITING",
    "Standing",
    "Verdict",
    "standing_of",
    "verdict",
    "verdict_error",
]

FINISHED, FAILED, WAITING, RUNNING, SILENT = "finished", "failed", "waiting", "running", "silent"


@dataclass(frozen=True)
class Standing:
    """One rank's state when the report was built (picklable: spawned and torchrun ranks send it).

    Attributes:
        rank: the global rank.
        state: ``finished`` (its body ended on its own: returned, or skipped), ``failed``
            (its own code raised), ``waiting`` (in a collective, or its collective failed
            under it), ``running`` (its own code), ``silent`` (it never reported).
        detail: what ended it: ``its function returned``, the exception's first line, or
            why it is silent.
        pending: the collective it is in (waiting), or None.
        last: the last collective it completed, or None.
        counts: each group's name: its global ranks and the collectives the rank completed on it.
    """

    rank: int
    state: str
    detail: str = ""
    pending: Entered | None = None
    last: Entered | None = None
    counts: Mapping[str, tuple[tuple[int, ...], int]] = field(default_factory=dict)

    def done(self, group: str) -> int:
        """The collectives this rank completed on ``group``."""
        entry = self.counts.get(group)
        return entry[1] if entry is not None else 0


def first_line(error: BaseException) -> str:
    """``RuntimeError: boom``: an exception's type and the first line of its message."""
    return f"{type(error).__name__}: {error}".splitlines()[0]


def standing_of(
    rank: int,
    recorder: DispatchRecorder | None,
    *,
    ended: bool,
    error: BaseException | None = None,
    blocked: bool = False,
) -> Standing:
    """``rank``'s standing from its recorder.

    Args:
        rank: the global rank.
        recorder: the rank's dispatch recorder (None: it recorded nothing).

    Keyword args:
        ended: its body ended (returned or raised); False: it is still running it.
        error: what it raised, if it did. Raised out of a collective, the rank counts as
            waiting in that call: its peers' state, not its own code, is the cause.
        blocked: a rank still running is blocked in torch.distributed: waiting on its
            last call's Work (c10d's ops return one at once; the wait happens after).
    """
    pending = recorder.pending if recorder is not None else None
    last = recorder.last if recorder is not None else None
    counts = recorder.counts() if recorder is not None else {}
    if pending is None and ((error is not None and _from_backend(error)) or (not ended and blocked)):
        # c10d's op returned a Work at once; waiting on it raised (or blocks): the call is its last one
        pending = last
    if pending is not None:
        detail = first_line(error) if error is not None else ""
        return Standing(rank, WAITING, detail, pending, last, counts)
    if not ended:
        return Standing(rank, RUNNING, "", None, last, counts)
    if error is None:
        return Standing(rank, FINISHED, "its function returned", None, last, counts)
    if _ends_on_purpose(error):
        return Standing(rank, FINISHED, f"it skipped: {first_line(error)}", None, last, counts)
    return Standing(rank, FAILED, first_line(error), None, last, counts)


def _from_backend(error: BaseException) -> bool:
    """Whether the process group raised ``error`` (a peer closed its connection, a timeout).

    NCCL's and the store's errors are ``DistError``s; gloo's transport raises a plain
    RuntimeError whose text names gloo's source (torch 2.11-2.15).
    """
    import torch.distributed as dist

    if isinstance(error, dist.DistError):
        return True
    return isinstance(error, RuntimeError) and "gloo" in str(error)


def _ends_on_purpose(error: BaseException) -> bool:
    """A skip or xfail (pytest's, unittest's): the rank's body ended on its own."""
    import sys
    import unittest

    if isinstance(error, unittest.SkipTest):
        return True
    outcomes = sys.modules.get("_pytest.outcomes")
    return outcomes is not None and isinstance(error, (outcomes.Skipped, outcomes.XFailed))


@dataclass(frozen=True)
class Verdict:
    """What the standings say.

    Attributes:
        kind: ``deadlock`` (ranks wait for ranks that finished, failed, run their own code or
            wait elsewhere), ``mismatch`` (ranks in different collectives at one call of a
            group), or ``failed`` (ranks wait for a rank that raised: its own error is the
            report, the table its note).
        culprits: the ranks the others wait for (mismatch: those whose call differs).
        message: the per-rank table, with its headline.
        group, seq, calls: for a mismatch, the group's global ranks, the call's position
            and each rank's call text.
    """

    kind: str
    culprits: tuple[int, ...]
    message: str
    states: Mapping[int, str] = field(default_factory=dict)
    group: tuple[int, ...] = ()
    seq: int = -1
    calls: Mapping[int, str] = field(default_factory=dict)


def verdict(standings: Sequence[Standing], world_size: int) -> Verdict | None:
    """Who the others wait for, and the table, from every rank's standing; None when they agree.

    ``standings`` holds one per rank, in rank order.
    """
    # A rank that raised its own exception is the culprit, as on sim: real ranks run at
    # once, so where the others stood when it raised is a race (one may be a call ahead),
    # not a mismatch or a deadlock of their own.
    raised_own = {s.rank for s in standings if s.state == FAILED}
    mismatch = None if raised_own else _mismatch(standings)
    if mismatch is not None:
        return mismatch
    states: dict[int, str] = {}
    culprits: set[int] = set()
    for s in standings:
        if s.state == WAITING and s.pending is not None:
            missing = _missing(s, standings)
            culprits.update(missing)
            states[s.rank] = waiting_text(s.pending.text, s.pending.where(), s.pending.site, missing)
        else:
            states[s.rank] = _describe(s)
    if raised_own:
        culprits = raised_own
    elif not culprits:
        behind = _behind(standings, states)
        silent = {s.rank for s in standings if s.state == SILENT}
        raised = {s.rank for s in standings if s.state == FAILED}
        if behind is None and not silent and not raised:
            return None
        culprits = (behind or set()) | silent or raised
    ordered = tuple(sorted(culprits))
    by_rank = {s.rank: s for s in standings}
    failed = [r for r in ordered if by_rank[r].state == FAILED]
    if failed:
        return Verdict("failed", tuple(failed), "where every rank stood:\n" + _rows(states), states)
    finished = [r for r in ordered if by_rank[r].state == FINISHED]
    elsewhere = [r for r in ordered if by_rank[r].state == WAITING]
    other = [r for r in ordered if by_rank[r].state in (RUNNING, SILENT)]
    why = why_text(finished, elsewhere)
    if other:
        named = ", ".join(f"rank {r}, which {_doing(by_rank[r])}" for r in other)
        why = f"{why} Ranks wait for {named}." if why else f"Ranks wait for {named}."
    return Verdict("deadlock", ordered, deadlock_text(world_size, states, why) + _seen(standings), states)


def verdict_error(found: Verdict, backend: str) -> MeshError:
    """The error a deadlock or mismatch verdict raises, as the simulated backend raises it."""
    message = found.message.replace("(seen on)", f"(seen on {backend})")
    if found.kind == "mismatch":
        return CollectiveMismatchError(
            message, group=found.group, seq=found.seq, ranks=found.culprits, calls=found.calls
        )
    return DeadlockError(message, states=found.states, ranks=found.culprits)


_SOURCE = re.compile(r"\[[^\]]*\.(?:cc|cpp|h):\d+\] ")


def _seen(standings: Sequence[Standing]) -> str:
    """How the real backend showed it: the first waiting rank's own error, shortened."""
    for s in standings:
        if s.state == WAITING and s.detail:
            text = _SOURCE.sub("", s.detail)  # gloo's "[.../pair.cc:553] " before its message
            text = text if len(text) <= 120 else text[:117] + "..."
            return f"\n(seen on) rank {s.rank}'s call ended with {text}"
    return ""


def _rows(states: Mapping[int, str]) -> str:
    return "\n".join(f"  rank {r}: {text}" for r, text in states.items())


def _describe(s: Standing) -> str:
    if s.state == FINISHED:
        return f"finished: {s.detail}"
    if s.state == FAILED:
        return f"failed: {s.detail}"
    if s.state == RUNNING:
        return "running its own code" + (
            f" (its last call: {s.last.text} at {s.last.site})" if s.last else ""
        )
    if s.state == SILENT:
        return f"did not report: {s.detail}" if s.detail else "did not report"
    return s.state


def _doing(s: Standing) -> str:
    return "is still running its own code" if s.state == RUNNING else "did not report"


def _in_same_call(s: Standing, pending: Entered) -> bool:
    p = s.pending
    return s.state == WAITING and p is not None and p.group == pending.group and p.seq == pending.seq


def _missing(s: Standing, standings: Sequence[Standing]) -> tuple[int, ...]:
    """The ranks of ``s``'s call's group that are not in that call."""
    assert s.pending is not None
    pending = s.pending
    by_rank = {o.rank: o for o in standings}
    return tuple(
        r for r in pending.ranks if r != s.rank and r in by_rank and not _in_same_call(by_rank[r], pending)
    )


def _mismatch(standings: Sequence[Standing]) -> Verdict | None:
    """Ranks waiting in the same call of a group with different calls."""
    slots: dict[tuple[str, int], list[Standing]] = {}
    for s in standings:
        if s.state == WAITING and s.pending is not None:
            slots.setdefault((s.pending.group, s.pending.seq), []).append(s)
    for members in slots.values():
        texts = {s.rank: s.pending.text for s in members if s.pending is not None}
        if len(set(texts.values())) <= 1:
            continue
        first = members[0].pending
        assert first is not None
        odd = _odd_ones(texts)
        here = {s.rank: s.pending for s in members}
        rows: list[tuple[int, str, str] | tuple[int, None, None]] = []
        for r in first.ranks:
            call = here.get(r)
            rows.append((r, call.text, call.site) if call is not None else (r, None, None))
        message = mismatch_text("ranks entered different collectives", first.where(), rows, odd)
        message += _seen(standings)
        return Verdict("mismatch", odd, message, {}, first.ranks, first.seq, texts)
    return None


def _odd_ones(texts: Mapping[int, str]) -> tuple[int, ...]:
    """The ranks whose call differs from the most common one (ties: the lowest rank's), as on sim."""
    groups: dict[str, list[int]] = {}
    for rank in sorted(texts):
        groups.setdefault(texts[rank], []).append(rank)
    majority = max(groups.values(), key=lambda members: (len(members), -members[0]))
    return tuple(sorted(r for members in groups.values() if members is not majority for r in members))


def _behind(standings: Sequence[Standing], states: dict[int, str]) -> set[int] | None:
    """Ranks that ended with fewer calls on a group than another rank of it (NCCL returns at once).

    The ranks ahead are shown waiting in the call the others never issued, when that
    call is their last; ``states`` is updated in place.
    """
    groups: dict[str, tuple[int, ...]] = {}
    for s in standings:
        for name, (ranks, _) in s.counts.items():
            groups[name] = ranks
    by_rank = {s.rank: s for s in standings}
    behind: set[int] = set()
    for name, ranks in groups.items():
        present = [by_rank[r] for r in ranks if r in by_rank and by_rank[r].state in (FINISHED, FAILED)]
        if len(present) < 2:
            continue
        most = max(s.done(name) for s in present)
        late = tuple(s.rank for s in present if s.done(name) < most)
        if not late:
            continue
        behind.update(late)
        for s in present:
            last = s.last
            if s.done(name) == most and last is not None and last.group == name and last.seq == most - 1:
                text = waiting_text(last.text, last.where(), last.site, late)
                states[s.rank] = f"{text} (its body ended; the call did not complete on the others)"
    return behind or None
