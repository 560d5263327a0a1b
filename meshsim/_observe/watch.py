"""Who watches the worlds a process starts: the one channel from worlds to their observers.

A world is often started deep inside user code (``meshsim.run`` in a test body,
torch's unittest bases), where nobody can hand it instruments. Whoever wants to see
such worlds (the pytest plugin's findings report and traces, per test) opens a
:class:`Watch` for as long as it watches; each call a world runs meanwhile takes
what the open watches ask for:

- ``findings``: a list that collects the call's wasted collectives
  (:class:`meshsim._observe.findings.Finding`);
- ``redundant=False``: the world does not look for wasted collectives at all
  (``--mesh-redundant=off``);
- ``tracer``: builds the call's timeline (``tracer(name, world_size)``, a
  :class:`meshsim._observe.trace.Tracer` or None).

This is the only process-wide registry meshsim's own parts talk through.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

__all__ = ["Watch", "looking_for_waste", "open_watches", "watching"]


@dataclass(eq=False)
class Watch:
    """What one watcher asks of the worlds started while it watches (see the module docstring)."""

    findings: list[Any] | None = None  # of meshsim._observe.findings.Finding
    redundant: bool | None = None
    tracer: Callable[[str, int], Any] | None = None  # makes a meshsim._observe.trace.Tracer, or None


_lock = threading.Lock()
_open: list[Watch] = []


class watching:  # a context manager, named as contextlib's are
    """Keep ``watch`` open while the block runs (worlds of any thread see it).

    A class, not a generator: a benchmark's world opens one per call.
    """

    def __init__(self, watch: Watch) -> None:
        self.watch = watch

    def __enter__(self) -> Watch:
        with _lock:
            _open.append(self.watch)
        return self.watch

    def __exit__(self, *exc_info: object) -> None:
        with _lock:
            _open.remove(self.watch)


def open_watches() -> tuple[Watch, ...]:
    """The watches open now, oldest first."""
    with _lock:
        return tuple(_open)


def looking_for_waste(asked: bool | None, default: Callable[[], bool]) -> bool:
    """Whether a world looks for wasted collectives: ``asked`` if given, else no open watch refuses it.

    ``default()``: whether worlds look unless told otherwise, asked only when nothing above decides.
    """
    if asked is not None:
        return asked
    if any(w.redundant is False for w in open_watches()):
        return False
    return default()
