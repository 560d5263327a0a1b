"""A world that outlives one call: its ranks run call after call, as a torchrun job's processes run a session.

``meshsim.run`` gives each call a world of its own. A :class:`Session` keeps one
world across calls, so what a rank sets up in one call (a distributed manager's
state, meshes, groups, module globals declared per rank) is there in the next,
as in a torchrun process that runs test after test. Between calls the ranks wait
and the caller's own process state (RNG, environment, declared per-rank values)
is in place; what the caller changes meanwhile, every rank takes at the next call
(see :meth:`meshsim._process.state.ProcessState.hand_to_ranks`).

A call that fails on any rank ends the world, as a failure ends a torchrun job:
the next call starts a new one, which first replays the session's set-up calls
(:meth:`Session.add_setup`), as a relaunched job would run its start-up again.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from meshsim._base.context import current
from meshsim._engine.affinity import pin, unpin
from meshsim._engine.scheduler import Waitable
from meshsim._engine.world import _check_args, _name_of, _World
from meshsim._observe import trace as _trace
from meshsim._process import rng as _rng
from meshsim._process import state as _state
from meshsim._process.state import ProcessState

__all__ = ["Session"]


@dataclass(frozen=True)
class _Call:
    fn: Callable[..., Any]
    args: tuple[Any, ...]
    reseed: bool  # Python's or NumPy's global RNG changed in the caller since the last call


class _Board(Waitable):
    """Where ranks wait between calls; completed when the next call (or the end) is posted."""

    idle = True

    def __init__(self) -> None:
        super().__init__()
        self.call: _Call | None = None

    def describe(self, rank: int) -> str:
        return "done with this call, waiting for the next"

    def missing(self) -> tuple[int, ...]:
        return ()


class _Calls:
    """The ranks' side: each rank runs :meth:`loop` as its world's function."""

    def __init__(self, world_size: int) -> None:
        self.board = _Board()
        self.results: list[Any] = [None] * world_size
        self.idle = threading.Event()

    def loop(self) -> None:
        context = current().seat
        assert context is not None  # the world's function runs in a rank thread
        rank, scheduler = context.rank, context.scheduler
        while True:
            board = self.board
            scheduler.wait(rank, board)
            call = board.call
            if call is None:
                return
            if call.reseed:
                _rng.enter_rank()  # draw afresh from the caller's newly seeded generators
            self.results[rank] = call.fn(*call.args)


class Session:
    """Ranks that run call after call in one world, started on the first call.

    Args:
        world_size: the number of ranks.

    Keyword args:
        backend, timeout, gpu_paths, num_threads: as for :func:`meshsim.run`.
    """

    def __init__(
        self,
        world_size: int,
        *,
        backend: str = "sim",
        timeout: float = 60.0,
        gpu_paths: bool = True,
        num_threads: int | None = 1,
    ) -> None:
        _check_args(self.call, world_size, timeout, backend, num_threads)
        self.world_size = world_size
        self.backend = backend
        self.timeout = timeout
        self.gpu_paths = gpu_paths
        self.num_threads = num_threads
        self.worlds = 0  # worlds started so far (a failed call ends one)
        self._setup: list[tuple[Callable[..., Any], tuple[Any, ...]]] = []
        self._world: _World | None = None
        self._calls: _Calls | None = None
        self._saved: ProcessState | None = None
        self._env: dict[Any, Any] = {}  # what the ranks changed in the environment, kept across calls
        self._allowed: frozenset[int] | None = None  # the caller's CPUs

    @property
    def running(self) -> bool:
        """Whether a world is up (it starts on the first call and ends with a failed one)."""
        return self._world is not None

    def add_setup(self, fn: Callable[..., Any], *args: Any) -> None:
        """Run ``fn(*args)`` on every rank now, and again first thing in every later world."""
        self._setup.append((fn, args))
        if self._world is not None:
            self._call(fn, args)

    def call(self, fn: Callable[..., Any], *args: Any, name: str | None = None) -> list[Any]:
        """Run ``fn(*args)`` on every rank; returns each rank's result, or raises as :func:`meshsim.run`.

        ``name``: what a trace calls the call (under pytest ``--mesh-trace``); ``fn``'s name by default.
        """
        if self._world is None:
            self._start()
            for setup, setup_args in self._setup:
                self._call(setup, setup_args)
        world = self._world
        path = _trace.target(None) if self.backend == "sim" else None
        if world is None or path is None:
            return self._call(fn, args)
        tracer = _trace.Tracer(path, self.world_size, name or _name_of(fn))
        world.tracer = world.rendezvous.tracer = tracer
        start = tracer.now()
        try:
            return self._call(fn, args)
        finally:
            world.tracer = world.rendezvous.tracer = None
            outcome = (
                "finished: its function returned" if world.scheduler.error is None else "the world failed"
            )
            for rank in range(self.world_size):  # one slice per rank for the call, from its start
                tracer.rank_function(rank, name or _name_of(fn), start, outcome)
            world.finish_trace(tracer)

    def close(self) -> None:
        """End the world (if one runs), letting every rank finish; raises if that fails."""
        world, calls, previous = self._world, self._calls, self._saved
        if world is None or calls is None or previous is None:
            return
        self._world = self._calls = self._saved = None
        saved = ProcessState.capture(previous.slots)  # the caller's state now, to put back
        _state.apply_environ_changes(self._env)
        self._env = {}
        try:
            try:
                calls.board.call = None
                world.scheduler.resume(calls.board)
                world.supervise(world.scheduler.finished)
            except BaseException as exc:
                world.scheduler.abort(exc)
                raise
        finally:
            world.close(saved)
        world.outcome()

    # -- internals ----------------------------------------------------------------

    def _start(self) -> None:
        calls = _Calls(self.world_size)
        world = _World(
            calls.loop,
            self.world_size,
            (),
            {},
            timeout=self.timeout,
            backend=self.backend,
            serialize=self.backend == "sim",
            gpu_paths=self.gpu_paths,
            num_threads=self.num_threads,
            traced=False,  # call by call instead (_call)
        )
        world.scheduler.on_idle = calls.idle.set
        self._allowed = allowed = world.place()
        pinned = pin(world.cpu, allowed)
        try:
            saved = world.open()
            try:
                world.supervise(calls.idle)  # every rank set up and waiting for a call
            except BaseException as exc:
                world.scheduler.abort(exc)
                world.close(saved)
                raise
        finally:
            if pinned:
                unpin(allowed)
        if world.scheduler.error is not None:
            world.close(saved)
            world.outcome()  # raises what stopped the world's start
        self._world, self._calls, self._saved = world, calls, saved
        self.worlds += 1
        saved.restore()  # the caller's own state until the first call

    def _call(self, fn: Callable[..., Any], args: Sequence[Any]) -> list[Any]:
        world, calls, previous = self._world, self._calls, self._saved
        assert world is not None and calls is not None and previous is not None
        saved = ProcessState.capture(previous.slots)
        reseed = saved.hand_to_ranks(previous, world.states)
        _state.apply_environ_changes(self._env)
        if world.states:
            world.states[0].load_world_env()
        pinned = pin(world.cpu, self._allowed)
        try:
            calls.idle.clear()
            calls.results = [None] * self.world_size
            board, calls.board = calls.board, _Board()
            board.call = _Call(fn, tuple(args), reseed)
            world.scheduler.resume(board)
            world.supervise(calls.idle)
        except BaseException as exc:  # KeyboardInterrupt in the caller
            world.scheduler.abort(exc)
            self._end(world, saved)
            raise
        finally:
            if pinned:
                unpin(self._allowed)
        if world.scheduler.error is not None:
            self._end(world, saved)
            world.outcome()  # raises what made the call fail
        self._env = {**self._env, **_state.environ_changes(saved.environ)}
        self._saved = saved
        saved.restore()
        return list(calls.results)

    def _end(self, world: _World, saved: ProcessState) -> None:
        """A failed call's world: stop it and put the caller's state back."""
        self._world = self._calls = self._saved = None
        self._env = {}
        world.close(saved)
