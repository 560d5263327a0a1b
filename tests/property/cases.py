"""Hypothesis glue for the property tests: which profile a property runs under, and drawing a case."""

from __future__ import annotations

import gc
from collections.abc import Iterator, Sequence
from contextlib import contextmanager

from faults import Case, draw_case
from hypothesis import note, settings
from hypothesis import strategies as st
from programs import HypothesisSource
from worlds import leftovers, next_world_problems, open_gloo_device, snapshot

PROFILES = ("property", "thorough")  # registered in the root conftest.py


def profile(share: float = 1.0) -> settings:
    """The loaded profile if the root conftest.py registered it (--hypothesis-profile), else ``property``,
    with ``share`` of its examples (for the slower properties)."""
    name = settings.get_current_profile_name()
    chosen = settings.get_profile(name if name in PROFILES else "property")
    return settings(chosen, max_examples=max(1, round(chosen.max_examples * share)))


def draw(data: st.DataObject, *, kinds: Sequence[str] = (), gloo: bool = False) -> Case:
    """A case drawn through hypothesis (so that failures shrink), printed if the test fails."""
    case = draw_case(HypothesisSource(data.draw), kinds=kinds, gloo=gloo)
    note(str(case))
    return case


@contextmanager
def leaves_no_trace(backend: str = "sim") -> Iterator[None]:
    """Property 3: the process is as before the block, and the next world runs correctly.

    gloo cases start and end with a garbage collection: sockets an earlier test left in
    reference cycles must not close in the middle of this case, nor this case's in a later
    one. The snapshot after the block is taken before that collection: a world must not
    need one to let go of its descriptors.
    """
    if backend == "gloo":
        open_gloo_device()
        gc.collect()
    before = snapshot(backend)
    try:
        yield
        assert leftovers(before, snapshot(backend)) == []
        assert next_world_problems(backend) == []
    finally:
        if backend == "gloo":
            gc.collect()
