"""The rank context: what meshsim knows of the calling thread, in one per-thread record.

Every layer asks the same record, through :func:`current`, "which rank am I, and
what is open here?":

- ``seat``: the thread's place in a world (its rank, the world size, the world's
  scheduler and rendezvous), while the thread is a rank of a simulated or gloo world;
- ``ledgers``: the :func:`meshsim.record` blocks open in the thread, innermost last
  (any thread: a torchrun process's main thread records too);
- ``recorder``: the dispatch recorder entered in the thread (gloo, spawned and
  torchrun ranks, whose collectives meshsim sees at the dispatcher);
- ``c10d``: the per-thread c10d world view the thread entered as a rank, and what
  torch asks of a rank thread: ``mesh_token`` (DeviceMesh's identity),
  ``gpu_paths`` (DTensor takes its GPU collectives) and ``group_timeout``;
- ``own_rng`` and ``python_rng`` / ``numpy_rng``: whether the module-level RNG
  functions draw from the rank's own generators, and those generators (made on
  first draw);
- ``child_cpus``: the CPUs a process forked from the thread runs on, where meshsim
  pinned the thread to fewer (a rank of a serialized world);
- ``regions``: where the thread's :func:`meshsim.region` blocks go, while something
  collects them (``meshsim run``'s ranks), else None;
- ``cuda``: the thread's CUDA emulation, while it emulates (a rank of a world that
  emulates, the pytest process under ``--mesh-cuda``, a child process): its dispatch
  mode (:class:`meshsim._process.cuda.tensors.CudaMode`), which carries the world's
  :class:`~meshsim._process.cuda.spec.Spec` and the thread's own counters; None elsewhere.

The record is a ``threading.local`` whose class attributes are the values of a
thread that is no rank: reading a field costs one attribute lookup in C, which
matters on the paths every collective takes.
"""

from __future__ import annotations

import datetime
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

__all__ = ["Context", "Seat", "current"]


@dataclass
class Seat:
    """A rank's place in its world: what the rank's process groups need from the world.

    Attributes:
        rank, world_size: the rank and the number of ranks.
        scheduler, rendezvous: the world's (a :class:`meshsim._baton.scheduler.Scheduler` and a
            :class:`meshsim._sim.rendezvous.Rendezvous`; typed loosely here, below the layers
            that define them).
        init_default: makes the rank's default group again, after user code destroyed it.
        inits: default groups made so far (gloo: each meets on keys of its own).
    """

    rank: int
    world_size: int
    scheduler: Any
    rendezvous: Any
    init_default: Callable[[Seat], None] | None = None
    inits: int = 0


class Context(threading.local):
    """The calling thread's record (see the module docstring); the class attributes are a plain thread's."""

    seat: Seat | None = None
    recorder: Any = None
    c10d: Any = None
    mesh_token: int | None = None
    gpu_paths: bool = False
    group_timeout: datetime.timedelta | None = None
    own_rng: bool = False
    python_rng: Any = None
    numpy_rng: Any = None
    child_cpus: frozenset[int] | None = None
    regions: list[Any] | None = None
    cuda: Any = None  # meshsim._process.cuda.tensors.CudaMode

    def __init__(self) -> None:
        # runs once in each thread that touches the record: every thread its own list
        self.ledgers: list[Any] = []  # meshsim._record.ledger.Ledger


_CONTEXT = Context()


def current() -> Context:
    """The calling thread's record: read its fields in the thread that asks (they are per thread)."""
    return _CONTEXT
