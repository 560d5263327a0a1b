"""What a distributed test's ranks add up to: passed, failed, skipped or xfailed.

Each rank ends its part of a test one way: it returns (passed), calls
``pytest.skip`` / ``pytest.importorskip`` or raises ``unittest.SkipTest``
(skipped), calls ``pytest.xfail`` (xfailed), or raises anything else (failed).
The first rank to end early stops the world (sim, gloo) or closes its groups
(spawn): ranks released that way, out of a collective the first one left, have
no say. Of the ranks that ended on their own, the test:

- fails when any failed: a skip must never hide a failure; the report names the
  ranks that skipped;
- else has the outcome of the first rank that skipped or xfailed, with that
  rank's reason, shown once: the test's author asked for it on that rank;
- else passes.

The same rule decides what :func:`meshsim.run` and the plugin raise for a world
whose ranks raised (:func:`decided`).

Spawned ranks cannot tell their own failures from those a closed group caused,
so there the first rank to end decides. Under ``--multigpu-static`` every rank
runs to its end (or its group's timeout) and the ranks agree on the outcome.
"""

from __future__ import annotations

import sys
import unittest
from collections.abc import Sequence

from meshsim._base.errors import RankError

__all__ = [
    "CODES",
    "FAILED",
    "PASSED",
    "SKIPPED",
    "XFAILED",
    "combine",
    "decided",
    "kind_of",
    "outcome_exception",
    "reason_of",
]

PASSED, FAILED, SKIPPED, XFAILED = "passed", "failed", "skipped", "xfailed"


def kind_of(error: BaseException | None) -> str:
    """How a rank that raised ``error`` (None: returned) ended."""
    if error is None:
        return PASSED
    if isinstance(error, unittest.SkipTest):
        return SKIPPED
    # pytest's outcomes, looked up where a rank could have raised them: pytest is loaded
    outcomes = sys.modules.get("_pytest.outcomes")
    if outcomes is not None:
        if isinstance(error, outcomes.Skipped):
            return SKIPPED
        if isinstance(error, outcomes.XFailed):
            return XFAILED
    return FAILED


CODES = (PASSED, FAILED, SKIPPED, XFAILED)  # as exchanged between torchrun ranks


def combine(kinds: Sequence[str]) -> tuple[str, int | None]:
    """The test's outcome from each rank's, and the rank that decided it (None: every rank passed)."""
    for rank, kind in enumerate(kinds):
        if kind == FAILED:
            return FAILED, rank
    for rank, kind in enumerate(kinds):
        if kind in (SKIPPED, XFAILED):
            return kind, rank
    return PASSED, None


def decided(error: BaseException) -> BaseException:
    """What a world that raised ``error`` means: the first rank's skip or xfail, if no rank failed.

    The skip or xfail is the one the rank raised (its traceback gives the location
    pytest reports). Any other failure wins over them, and the ``RankError`` notes
    who skipped. Anything but a ``RankError`` (a mismatch, a deadlock) is the answer.
    """
    if not isinstance(error, RankError) or not error.failures:
        return error
    kinds = [(rank, exc, kind_of(exc)) for rank, exc in error.failures]
    if any(kind == FAILED for _, _, kind in kinds):
        others = [f"rank {rank} {kind}: {exc}" for rank, exc, kind in kinds if kind != FAILED]
        if others:
            error.add_note("; ".join(others))
        return error
    return kinds[0][1]


def outcome_exception(kind: str, reason: str, rank: int) -> BaseException:
    """A skip or xfail to raise in the pytest process for a rank's, where the original cannot be."""
    import pytest

    text = f"{reason} (rank {rank})" if reason else f"rank {rank}"
    if kind == SKIPPED:
        return pytest.skip.Exception(text, _use_item_location=True)
    if kind == XFAILED:
        return pytest.xfail.Exception(text)
    raise ValueError(f"outcome_exception() takes {SKIPPED!r} or {XFAILED!r}, got {kind!r}")


def reason_of(error: BaseException) -> str:
    """The reason a skip or xfail gave."""
    return str(getattr(error, "msg", None) or error)
