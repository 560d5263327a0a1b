"""Named regions of a program: ``meshsim.region("step")`` marks one training step's collectives.

A region is a :func:`meshsim.record` block with a name. Where something collects the
regions of a rank (``meshsim run`` does, for every rank of a script), each block that
ends without raising is kept, in order, with its ledger; the summary then shows one
step, not the whole run. Elsewhere a region only records, as ``record`` does: a script
that marks its steps runs unchanged under torchrun or alone.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

from meshsim._base.context import current
from meshsim._record.ledger import Ledger, record

__all__ = ["collecting_regions", "region"]


@contextmanager
def region(name: str) -> Iterator[Ledger]:
    """Mark a region of the program (a training step) whose collectives are reported together.

    ``with meshsim.region("step"):`` around each step makes ``meshsim run``'s summary
    show the collectives and estimated time of one step, per step.

    Args:
        name: what the region is (``"step"``, ``"eval"``); regions of one name are
            compared with each other.

    Returns:
        a context manager; it yields the region's :class:`~meshsim.Ledger` (this rank's calls).

    Raises:
        TypeError: ``name`` is not a non-empty string.
    """
    if not isinstance(name, str) or not name:
        raise TypeError(f"region() needs a non-empty name such as 'step', got {name!r}")
    context = current()
    with record() as ledger:
        yield ledger
    sink = context.regions
    if sink is not None:
        sink.append((name, ledger))


@contextmanager
def collecting_regions() -> Iterator[list[tuple[str, Ledger]]]:
    """Keep the calling thread's regions, in order, while the block runs (a script's rank)."""
    context = current()
    outer = context.regions
    kept: list[tuple[str, Ledger]] = []
    context.regions = kept
    try:
        yield kept
    finally:
        context.regions = outer
