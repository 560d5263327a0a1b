"""One simulated world: N rank threads, each with an initialized default process group.

:func:`run` is the whole life of a world: start the rank threads, supervise them
(timeouts), stop them, restore the process, and return or raise. Nothing a world
touches outlives it: c10d's world and group registry are per rank thread, and the
process-global state in :mod:`meshsim._state` is put back.
"""

from __future__ import annotations

import datetime
import functools
import math
import os
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch._C._distributed_c10d import Store

from meshsim import _affinity, _findings, _patches, _threads, _trace
from meshsim._backend import (
    BACKEND_NAME,
    RankContext,
    bind_rank,
    create_process_group,
)
from meshsim._errors import (
    CollectiveMismatchError,
    DeadlockError,
    MeshError,
    RankError,
    WorldAborted,
    format_user_traceback,
)
from meshsim._interrupt import interrupt
from meshsim._leaks import Watch
from meshsim._outcomes import decided
from meshsim._rendezvous import Rendezvous
from meshsim._scheduler import SAFETY_POLL, Scheduler
from meshsim._state import ProcessState, RankState
from meshsim._worldkinds import Ranks, ranks_for

__all__ = ["run", "run_ranks"]

BACKENDS = ("sim", "gloo")
_STOP_GRACE = 1.0  # seconds a stopped world waits for rank threads still running user code
_INTERRUPT_AFTER = 0.05  # seconds before interrupting them: most leave at their next collective


def run(
    fn: Callable[..., Any],
    world_size: int,
    *,
    args: Sequence[Any] = (),
    kwargs: dict[str, Any] | None = None,
    timeout: float = 60.0,
    backend: str = "sim",
    serialize: bool = True,
    gpu_paths: bool = True,
    num_threads: int | None = 1,
    redundant: bool | None = None,
    trace: str | os.PathLike[str] | None = None,
) -> list[Any]:
    """Run ``fn(*args, **kwargs)`` on every rank of a simulated world and return the results.

    Each rank is a thread with its own default process group (``dist.get_rank()``
    answers per rank). The world is torn down before this returns or raises.

    Args:
        fn: the per-rank program.
        world_size: the number of ranks (1 or more).

    Keyword args:
        args: positional arguments for ``fn``, the same on every rank.
        kwargs: keyword arguments for ``fn``.
        timeout: seconds the world may go without progress while some rank waits
            (a rank stuck in its own code while others wait for it).
        backend: ``"sim"`` (in-memory, checked, the default) or ``"gloo"`` (a real
            ``ProcessGroupGloo`` per rank over loopback, for fidelity checks: while the
            world runs, ``GLOO_SOCKET_IFNAME`` names the loopback interface). On
            gloo, groups made without a timeout get ``timeout``; when a rank fails,
            the locals of its traceback's frames are cleared (the text is kept), so
            that its groups close and peers blocked on it are released.
        serialize: run one rank at a time, handing over only at collectives, so runs
            are deterministic and each rank has its own RNG state and ``RANK``
            environment. ``False`` runs ranks concurrently and shares them.
        gpu_paths: where torch takes a different collective on CPU meshes than on
            GPUs (DTensor Shard->Shard is all_gather+chunk on CPU, all_to_all on
            CUDA), take the GPU path, so ledgers show what GPUs do.
        num_threads: ``torch.set_num_threads`` in each rank thread; None leaves it.
        redundant: look for wasted collectives (calls that could not tell any rank
            anything new: ``Collective.redundant`` in ledgers). None (the default):
            on unless ``MESHSIM_REDUNDANT=0`` is in the environment. ``sim`` only.
        trace: write the world as a timeline to this file when it ends, failed or not:
            Chrome trace-event JSON, one track per rank, a slice per collective from
            arrival to release, arrows to the last rank to arrive (Perfetto's UI and
            chrome://tracing open it). ``sim`` only. Under pytest, ``--mesh-trace=DIR``
            gives each test's worlds a file without this argument.

    Returns:
        each rank's return value, in rank order.

    Raises:
        RankError: a rank's code raised; the original exception is ``__cause__``. A
            failure on any rank wins over a skip on another (the error notes who skipped).
        pytest.skip.Exception, pytest.xfail.Exception, unittest.SkipTest: no rank failed
            and one skipped (``pytest.skip``, ``pytest.importorskip``, ``unittest.SkipTest``)
            or xfailed (``pytest.xfail``): the first such rank's own exception, so that pytest
            and unittest report the test skipped or xfailed.
        CollectiveMismatchError: ranks entered different collectives.
        DeadlockError: no rank could make progress, or the timeout expired.
        TypeError, ValueError: a bad argument.
    """
    world = _world_for(
        fn,
        world_size,
        args=args,
        kwargs=kwargs,
        timeout=timeout,
        backend=backend,
        serialize=serialize,
        gpu_paths=gpu_paths,
        num_threads=num_threads,
        redundant=redundant,
        trace=trace,
    )
    try:
        return world.run()
    except RankError as error:
        outcome = decided(error)
        if outcome is error:
            raise
    # raised outside the except block: the rank's skip is not "during" the RankError
    raise outcome


def run_ranks(fn: Callable[..., Any], world_size: int, **options: Any) -> list[Any]:
    """:func:`run`, with a world whose ranks raised always raising ``RankError``.

    For meshsim's unittest bases, which report skips in unittest's terms.
    """
    return _world_for(fn, world_size, **options).run()


def _world_for(
    fn: Callable[..., Any],
    world_size: int,
    *,
    args: Sequence[Any] = (),
    kwargs: dict[str, Any] | None = None,
    timeout: float = 60.0,
    backend: str = "sim",
    serialize: bool = True,
    gpu_paths: bool = True,
    num_threads: int | None = 1,
    redundant: bool | None = None,
    trace: str | os.PathLike[str] | None = None,
) -> _World:
    """The world :func:`run` runs, its arguments checked."""
    _check_args(fn, world_size, timeout, backend, num_threads)
    if redundant is not None and not isinstance(redundant, bool):
        raise TypeError(f"redundant must be True, False or None, got {redundant!r}")
    if trace is not None:
        _trace.checked_path(trace)
        if backend != "sim":
            raise ValueError(
                f"trace={str(trace)!r} draws a simulated world; backend={backend!r} ranks are not "
                "seen by meshsim between their calls: use backend='sim'"
            )
    world = _World(
        fn,
        world_size,
        tuple(args),
        dict(kwargs or {}),
        timeout=timeout,
        backend=backend,
        serialize=serialize and backend == "sim",
        gpu_paths=gpu_paths,
        num_threads=num_threads,
        redundant=redundant,
        trace=trace,
    )
    return world


def _name_of(fn: Any) -> str:
    return getattr(fn, "__qualname__", None) or getattr(fn, "__name__", None) or type(fn).__name__


def _check_args(fn: Any, world_size: Any, timeout: Any, backend: Any, num_threads: Any) -> None:
    if not callable(fn):
        raise TypeError(f"run() needs a callable to run on every rank, got {fn!r}")
    if isinstance(world_size, bool) or not isinstance(world_size, int):
        raise TypeError(f"world_size must be an int, got {world_size!r}")
    if world_size < 1:
        raise ValueError(f"world_size must be at least 1, got {world_size}")
    if (
        isinstance(timeout, bool)
        or not isinstance(timeout, (int, float))
        or not timeout > 0
        or math.isinf(timeout)
    ):
        raise ValueError(f"timeout must be a positive, finite number of seconds, got {timeout!r}")
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {', '.join(map(repr, BACKENDS))}, got {backend!r}")
    if num_threads is not None and (
        isinstance(num_threads, bool) or not isinstance(num_threads, int) or num_threads < 1
    ):
        raise ValueError(f"num_threads must be a positive int or None, got {num_threads!r}")


class _World:
    def __init__(
        self,
        fn: Callable[..., Any],
        world_size: int,
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
        *,
        timeout: float,
        backend: str,
        serialize: bool,
        gpu_paths: bool,
        num_threads: int | None,
        redundant: bool | None = None,
        trace: str | os.PathLike[str] | None = None,
        traced: bool = True,
    ) -> None:
        self.fn, self.args, self.kwargs = fn, args, kwargs
        self.world_size = world_size
        self.timeout = timeout
        self.group_timeout = datetime.timedelta(seconds=timeout)  # of the groups ranks make
        self.backend = backend
        self.kind: Ranks = ranks_for(backend, serialize=serialize)
        self.gpu_paths = gpu_paths
        self.num_threads = num_threads
        self.workers, self.new_workers = _threads.take(world_size)
        # Filled at the start with the ranks' states' own methods, not the world's: no
        # reference cycle, so a world is freed when run() returns instead of by the
        # garbage collector (~40 objects a world).
        self.saves: list[Callable[[], None]] = []
        self.loads: list[Callable[[], None]] = []
        self.scheduler = Scheduler(
            world_size,
            [worker.bell for worker in self.workers],
            serialize=serialize,
            switch_out=self.saves,
            switch_in=self.loads,
        )
        # wakes the caller when the last rank thread is through, not when the last
        # rank finishes its function and is still tidying up
        self.jobs = _threads.Countdown(world_size, also=self.scheduler.finished)
        findings = _findings.enabled_by_default() if redundant is None else redundant
        path = _trace.target(trace) if backend == "sim" and traced else None
        self.tracer = _trace.Tracer(path, world_size, _name_of(fn)) if path is not None else None
        self.rendezvous = Rendezvous(
            self.scheduler, findings=findings and backend == "sim", tracer=self.tracer
        )
        self.results: list[Any] = [None] * world_size
        self.failures: list[tuple[int, BaseException, str]] = []
        self.num_threads_default = 1  # the caller's, for reused threads when num_threads is None
        self.store: Store | None = None
        self.stuck: list[int] = []
        self.cpu: int | None = None
        self.cpus: frozenset[int] | None = None  # where rank threads run
        self.states: list[RankState] = []  # each rank's per-process state (serialize mode)
        self.watch: Watch | None = None  # torch.distributed globals as the world started

    # -- the caller's side ----------------------------------------------------------

    def run(self) -> list[Any]:
        allowed = self.place()
        # The caller runs on the ranks' CPU too while the world lives: its hand-overs
        # with them (the start, the end) then need no cross-CPU wake-up, which made a
        # world's set-up and teardown ~1.5x slower on a 2-CPU VM. New rank threads
        # inherit the pinning.
        pinned = _affinity.pin(self.cpu, allowed)
        try:
            return self._run()
        finally:
            if pinned:
                _affinity.unpin(allowed)

    def place(self) -> frozenset[int] | None:
        """Choose the CPU(s) rank threads run on; returns the caller's (see :meth:`pin_caller`)."""
        allowed = _affinity.affinity()  # read once: each affinity system call costs a few microseconds
        self.cpu = self._rank_cpu(allowed) if self.scheduler.serialize else None
        self.cpus = frozenset({self.cpu}) if self.cpu is not None else allowed
        return allowed

    def _run(self) -> list[Any]:
        saved = self.open()
        try:
            try:
                self._supervise()
            except BaseException as exc:  # KeyboardInterrupt in the caller
                self.scheduler.abort(exc)
                raise
        finally:
            self.close(saved)
            if self.tracer is not None:
                self.finish_trace(self.tracer)
        return self._outcome()

    def finish_trace(self, tracer: _trace.Tracer) -> None:
        """Write the trace, with the world's error on the process if no rank raised it."""
        error = self.scheduler.error
        if error is not None and not tracer.failed:  # no rank raised it: a timeout, a deadlock
            tracer.error(None, error)
        tracer.write()

    def open(self) -> ProcessState:
        """Install what worlds need, capture the caller's state and start the ranks; returns that state."""
        # Patches first: they declare the per-rank state of integrated projects already
        # loaded, which the caller's state then includes.
        _patches.install(BACKEND_NAME, create_process_group)
        try:
            self.watch = Watch()
            saved = ProcessState.capture()
            self.num_threads_default = saved.num_threads
            try:
                self._start(saved)
            except BaseException as exc:
                self.scheduler.abort(exc)
                self._stop()
                saved.restore()
                raise
        except BaseException:
            _patches.uninstall()
            raise
        return saved

    def close(self, saved: ProcessState) -> None:
        """Wait for (or stop) the ranks and put the caller's state back; the world's end."""
        try:
            self._stop()
            saved.restore()
        finally:
            _patches.uninstall()
        if self.watch is not None:
            self.watch.report()

    def _start(self, caller: ProcessState) -> None:
        self.kind.prepare()  # after the caller's state was captured: close() puts it back
        self.store = self.kind.store(self.scheduler)

        if self.scheduler.serialize:
            self.states = states = RankState.fresh(self.world_size, caller)
            self.saves[:] = [state.save for state in states]
            self.loads[:] = [state.load for state in states]
            states[0].load_world_env()
        for rank, worker in enumerate(self.workers):
            worker.assign(functools.partial(self._rank_main, rank), self.jobs, f"meshsim-rank-{rank}")
        for worker in self.new_workers:  # they inherit the caller's pinning (run)
            worker.cpus = self.cpus
            worker.thread.start()
        self.scheduler.begin()

    def _rank_cpu(self, allowed: frozenset[int] | None) -> int | None:
        """The one CPU serialized ranks run on: where reused threads already are, if they agree."""
        reused = self.workers[: len(self.workers) - len(self.new_workers)]  # take() puts them first
        pinned = {w.cpus for w in reused}
        if len(pinned) == 1:
            cpus = pinned.pop()
            if cpus is not None and len(cpus) == 1:
                (cpu,) = cpus
                if _affinity.may_run_on(cpu, allowed):
                    return cpu  # moving threads to another CPU costs ~25 us each
        return _affinity.current_cpu(allowed)

    def _supervise(self) -> None:
        self.supervise(self.scheduler.finished)

    def supervise(self, until: threading.Event) -> None:
        """Check the world's timeout and nudge parked ranks until ``until`` or the world's end."""
        poll = min(0.05, self.timeout / 10)
        scheduler = self.scheduler
        nudged = time.monotonic()
        while not until.wait(poll):
            if scheduler.finished.is_set():
                return
            scheduler.check_timeout(self.timeout)
            nudged = _nudge_every_second(scheduler, nudged)

    def _stop(self) -> None:
        """Wait for every rank's job; after an abort, interrupt ranks still running user code."""
        start = nudged = time.monotonic()
        interrupted: set[int] = set()
        while not self.jobs.wait(0.01):
            nudged = _nudge_every_second(self.scheduler, nudged)
            if self.scheduler.error is None:
                continue
            now = time.monotonic()
            if now > self._give_up_at(start):
                break
            if now - start > _INTERRUPT_AFTER:
                interrupted -= _patches.take_swallowed_interrupts()
                interrupt(self.scheduler.running_idents(), interrupted)
        self.stuck = [r for r, worker in enumerate(self.workers) if worker.busy]
        self._release_workers()

    def _release_workers(self) -> None:
        """Keep a clean world's rank threads for the next world; end a failed world's."""
        workers = self.workers
        if self.scheduler.error is None and not self.stuck:
            retire = _threads.give_back(workers)
        else:
            retire = [w for w in workers if not w.busy]
            for rank in self.stuck:
                workers[rank].abandon()
        for worker in retire:
            worker.retire(_STOP_GRACE)

    def _give_up_at(self, start: float) -> float:
        """When a stopping world stops waiting for its rank threads and leaves them behind."""
        return self.kind.give_up_at(start, self.timeout)

    def outcome(self) -> list[Any]:
        """Each rank's result, or raise what made the world fail."""
        return self._outcome()

    def _outcome(self) -> list[Any]:
        error = self.scheduler.error
        if error is None:
            return self.results
        if isinstance(error, RankError):
            error = self._rank_error()
        if self.stuck and isinstance(error, MeshError):
            error.add_note(
                f"meshsim could not stop rank thread(s) {self.stuck}: they are blocked outside "
                "Python (e.g. in time.sleep or a C library) and were left as daemon threads"
            )
        raise error

    def _rank_error(self) -> RankError:
        own = [(rank, exc) for rank, exc, _ in self.failures]
        rank, exc, text = self.failures[0]
        error = RankError(rank, self.world_size, text, own)
        error.__cause__ = exc
        return error

    # -- the ranks' side --------------------------------------------------------------

    def _rank_main(self, rank: int) -> None:
        try:
            entered = _patches.enter_rank_thread(gpu_paths=self.gpu_paths, group_timeout=self.group_timeout)
            try:
                self._rank_body(rank)
            finally:
                _patches.leave_rank_thread(entered)
        except WorldAborted:
            pass  # interrupted while leaving; the world already failed

    def _rank_body(self, rank: int) -> None:
        context = RankContext(rank, self.world_size, self.scheduler, self.rendezvous)
        context.init_default = self._init_process_group
        bind_rank(context)
        # per thread; ProcessState restores the default. None: what a new thread gets.
        num_threads = self.num_threads if self.num_threads is not None else self.num_threads_default
        if torch.get_num_threads() != num_threads:
            torch.set_num_threads(num_threads)
        # Serialized ranks never run at once, so one core loses nothing, and keeps
        # torch's per-thread state warm in one cache across hand-overs (torch calls
        # right after a hand-over ran ~3x slower without it). New threads start
        # pinned (see run); a reused one may come from a world pinned elsewhere.
        self.workers[rank].pin(self.cpus)
        outcome = "stopped: the world failed"
        try:
            self.scheduler.start(rank)
            outcome = self.kind.run(functools.partial(self._call_fn, rank, context))
        except WorldAborted:
            pass
        finally:
            bind_rank(None)
            self.scheduler.finish(rank, outcome)

    def _call_fn(self, rank: int, context: RankContext) -> str:
        """Run the rank's function between its process groups' set-up and teardown; returns how it ended."""
        # The failure is recorded before the process groups are torn down: on gloo,
        # tearing down closes sockets, and the peers' resulting errors must not be
        # mistaken for the first failure.
        tracer = self.tracer
        start = tracer.now() if tracer is not None else 0.0
        outcome = "stopped: the world failed"
        try:
            self._init_process_group(context)
            self.results[rank] = self.fn(*self.args, **self.kwargs)
            outcome = "finished: its function returned"
        except WorldAborted as exc:
            self._let_go(exc)
        except BaseException as exc:
            if self.tracer is not None:  # (a session's world is traced call by call)
                self.tracer.error(rank, exc)
            self._rank_failed(rank, exc)
            self._let_go(exc)
            outcome = f"failed: {type(exc).__name__}: {exc}".splitlines()[0]
        finally:
            self._destroy_process_groups()
            if tracer is not None:
                tracer.rank_function(rank, _name_of(self.fn), start, outcome)
        return outcome

    def _init_process_group(self, context: RankContext) -> None:
        assert self.store is not None  # made at the world's start
        self.kind.init_default_group(context, self.store, self.timeout)

    def _destroy_process_groups(self) -> None:
        """Tear down this rank thread's c10d state (a no-op if the user already did)."""
        self.kind.destroy_groups()

    def _rank_failed(self, rank: int, exc: BaseException) -> None:
        if isinstance(exc, (CollectiveMismatchError, DeadlockError)):
            self.scheduler.abort(exc)
            return
        if self.scheduler.error is not None:
            return  # a consequence of the failure that stopped the world (gloo peers see closed sockets)
        text = format_user_traceback(exc)
        self.failures.append((rank, exc, text))
        self.scheduler.abort(RankError(rank, self.world_size, text))

    def _let_go(self, exc: BaseException) -> None:
        """Drop what a failed or stopped rank's frames hold that keeps its groups open (gloo)."""
        self.kind.let_go(exc)


def _nudge_every_second(scheduler: Scheduler, last: float) -> float:
    """Nudge parked ranks once :data:`SAFETY_POLL` s have passed since ``last``; returns the new last."""
    now = time.monotonic()
    if now - last < SAFETY_POLL:
        return last
    scheduler.nudge()
    return now
