"""What differs between a world of simulated ranks and one of gloo ranks, one strategy object each.

The world's life cycle (:mod:`meshsim._engine.world`) is the same for both; these say
how a rank's default group is made and torn down, what the ranks rendezvous on,
what wraps a rank's run, and how long a stopping world waits for its threads.

- :class:`SimRanks`: the in-memory backend. Ranks run one at a time (serialized),
  their groups need no store traffic and own no buffers, and a stopped rank is
  gone at its next collective.
- :class:`GlooRanks`: real ``ProcessGroupGloo`` groups over loopback, ranks running
  at once. A dispatch mode records the ledger; a rank blocked in C++ cannot be
  interrupted, so a stopping world waits for the groups' timeout, and a failed
  rank's frame locals are cleared so its groups close and its peers fail at once.
"""

from __future__ import annotations

import datetime
import os
import sys
import threading
import types
from collections.abc import Callable, Mapping

import torch.distributed as dist
from torch._C._distributed_c10d import HashStore, PrefixStore, Store

from meshsim._base.context import Seat, current
from meshsim._base.errors import MeshError
from meshsim._baton.scheduler import Scheduler
from meshsim._process import patches as _patches
from meshsim._process import thread_worlds as _thread_worlds
from meshsim._process.loopback import loopback_environment
from meshsim._record.recorder import DispatchRecorder
from meshsim._record.standing import standing_of, verdict, verdict_error
from meshsim._sim.backend import BACKEND_NAME, default_process_group
from meshsim._sim.store import SimStore

__all__ = ["GlooRanks", "Ranks", "SimRanks", "ranks_for"]

_STOP_GRACE = 1.0  # seconds a stopped world waits for rank threads still running user code


class Ranks:
    """How one backend's ranks meet, start, end and stop."""

    serialize: bool

    def prepare(self) -> None:
        """Set up the process for the world (the caller's state is captured first, and put back)."""

    def store(self, scheduler: Scheduler) -> Store:
        """The store the world's ranks rendezvous on."""
        raise NotImplementedError

    def init_default_group(self, context: Seat, store: Store, timeout: float) -> None:
        """Make ``context``'s rank thread's default group (again, after user code destroyed it)."""
        raise NotImplementedError

    def destroy_groups(self) -> None:
        """Tear down the calling rank thread's groups (a no-op if the user already did)."""
        raise NotImplementedError

    def run(self, rank_run: Callable[[], str]) -> str:
        """Run a rank's part of the world; returns how it ended."""
        return rank_run()

    def give_up_at(self, start: float, timeout: float) -> float:
        """When a world stopping since ``start`` stops waiting for its rank threads."""
        return start + _STOP_GRACE

    def let_go(self, exc: BaseException) -> None:
        """Drop what a failed or stopped rank's exception holds that keeps its groups open."""

    def verdict(self, endings: Mapping[int, BaseException | None], world_size: int) -> MeshError | str | None:
        """What a rank's failure means, from every rank's standing (real ranks only).

        Returns:
            the error that names the rank the others wait for (a peer that finished, went
            elsewhere or entered a different collective); or the per-rank table, as a note
            for the failing rank's own error; or None (nothing to add: sim checks calls itself).
        """
        return None


class SimRanks(Ranks):
    """Simulated ranks on the in-memory backend."""

    def __init__(self, serialize: bool) -> None:
        self.serialize = serialize
        self._group_store: Store | None = None

    def store(self, scheduler: Scheduler) -> Store:
        store = SimStore(scheduler, _seat_rank)
        self._group_store = _thread_worlds.default_group_store(store)
        return store

    def init_default_group(self, context: Seat, store: Store, timeout: float) -> None:
        assert self._group_store is not None  # store() ran at the world's start
        pg = default_process_group(context)
        _thread_worlds.install_default_group(pg, BACKEND_NAME, self._group_store, context.world_size)

    def destroy_groups(self) -> None:
        _thread_worlds.forget_groups()  # nothing to shut down: buffers are the world's


class GlooRanks(Ranks):
    """Thread ranks with real gloo process groups, on loopback."""

    serialize = False

    def __init__(self) -> None:
        # each rank's recorder: when it last entered a collective, the call it is in
        self._recorders: dict[int, DispatchRecorder] = {}
        self._idents: dict[int, int] = {}  # each rank's thread, to see whether it is blocked in c10d

    def prepare(self) -> None:
        # Every gloo group the ranks make, the user's own included, listens on loopback;
        # the world puts the caller's environment back.
        os.environ.update(loopback_environment(nccl=False))

    def store(self, scheduler: Scheduler) -> Store:
        return HashStore()

    def init_default_group(self, context: Seat, store: Store, timeout: float) -> None:
        # A default group made again (user code destroyed it) meets on keys of its own.
        store = PrefixStore(f"again{context.inits}/", store) if context.inits else store
        context.inits += 1
        _patches.init_process_group_unpatched(
            "gloo",
            rank=context.rank,
            world_size=context.world_size,
            store=store,
            timeout=datetime.timedelta(seconds=timeout),
        )
        # gloo's init returns once this rank's side of every connection is up; a rank
        # that went on to end (an empty body) would close a connection its peer was
        # still setting up, failing the peer's init with "Connection closed by peer".
        # Ranks leave together, through the store: no collective, nothing in ledgers.
        store.set(f"connected/{context.rank}", "1")
        store.wait([f"connected/{r}" for r in range(context.world_size)], datetime.timedelta(seconds=timeout))

    def destroy_groups(self) -> None:
        if dist.is_initialized():
            dist.destroy_process_group()

    def run(self, rank_run: Callable[[], str]) -> str:
        recorder = DispatchRecorder()
        seat = current().seat
        assert seat is not None  # a rank thread runs its part with its seat taken
        self._recorders[seat.rank] = recorder
        self._idents[seat.rank] = threading.get_ident()
        with recorder:
            return rank_run()

    def give_up_at(self, start: float, timeout: float) -> float:
        # Ranks blocked in C++ cannot be interrupted, but the groups' timeout (the world's)
        # releases each collective that long after it began; one may begin after the stop
        # did (a rank finishing a slow first import).
        began: float = max([start, *(recorder.entered for recorder in list(self._recorders.values()))])
        return min(began, start + timeout) + timeout + _STOP_GRACE

    def let_go(self, exc: BaseException) -> None:
        _drop_frame_locals(exc)

    def verdict(self, endings: Mapping[int, BaseException | None], world_size: int) -> MeshError | str | None:
        blocked = _blocked_in_c10d(self._idents)
        standings = [
            standing_of(
                rank,
                self._recorders.get(rank),
                ended=rank in endings,
                error=endings.get(rank),
                blocked=rank in blocked,
            )
            for rank in range(world_size)
        ]
        found = verdict(standings, world_size)
        if found is None:
            return None
        if found.kind == "failed":
            return found.message
        return verdict_error(found, "gloo")


# torch.distributed's modules that issue and wait on a collective's Work (c10d's
# ``work.wait()``, funcol's ``wait_tensor``, c10d's logging of a failed call): a rank
# thread with a frame in one of them is in its last call. Checked on torch 2.13 and 2.14.
_WAITS_IN = tuple(
    os.path.join(os.path.dirname(dist.__file__), name)
    for name in ("distributed_c10d.py", "c10d_logger.py", "_functional_collectives.py")
)


def _blocked_in_c10d(idents: Mapping[int, int]) -> set[int]:
    """The ranks whose thread is inside torch.distributed's collectives (waiting on a Work)."""
    frames = sys._current_frames()
    try:
        blocked = set()
        for rank, ident in list(idents.items()):
            frame = frames.get(ident)
            while frame is not None:
                if frame.f_code.co_filename in _WAITS_IN:
                    blocked.add(rank)
                    break
                frame = frame.f_back
        return blocked
    finally:
        frames.clear()  # it holds this frame: a cycle keeping every rank's frames (and groups) alive


def _seat_rank() -> int | None:
    """The calling thread's rank in its world (None outside rank threads): who waits on the store."""
    seat = current().seat
    return None if seat is None else seat.rank


def ranks_for(backend: str, *, serialize: bool) -> Ranks:
    """The strategy for ``backend`` ("sim" or "gloo")."""
    return SimRanks(serialize) if backend == "sim" else GlooRanks()


def _drop_frame_locals(exc: BaseException) -> None:
    """Clear the locals of the frames ``exc`` (and its cause and context) passed through.

    A gloo group closes its connections only when its last reference goes, and a
    failed rank's frames often hold one (``group = dist.new_group(...)``, or torch's
    own frames of the collective it was in): while they do, the peers blocked in a
    collective with this rank wait out the group's timeout instead of failing at once
    on the closed connection. The traceback's text was taken before this, so only
    locals are lost.
    """
    seen: set[int] = set()
    pending: list[BaseException | None] = [exc]
    while pending:
        current = pending.pop()
        if current is None or id(current) in seen:
            continue
        seen.add(id(current))
        _clear_frames(current.__traceback__)
        pending += [current.__cause__, current.__context__]
        pending += getattr(current, "exceptions", ())  # an ExceptionGroup's members


def _clear_frames(tb: types.TracebackType | None) -> None:
    """``traceback.clear_frames``, keeping pytest's own frames (``pytest.skip``, ``pytest.xfail``).

    They hold no groups, and their ``__tracebackhide__`` locals are how pytest finds
    the user's line to report a skip at.
    """
    keep = tuple(
        os.path.dirname(module.__file__) + os.sep
        for module in (sys.modules.get("_pytest"), sys.modules.get("pluggy"))
        if module is not None and module.__file__
    )
    while tb is not None:
        if not keep or not tb.tb_frame.f_code.co_filename.startswith(keep):
            try:
                tb.tb_frame.clear()
            except RuntimeError:
                pass  # still executing
        tb = tb.tb_next
