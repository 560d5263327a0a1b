"""One simulated world: N rank threads, each with an initialized default process group.

A :class:`World` lives from :meth:`World.start` to :meth:`World.close` and runs
:meth:`World.call` after call on every rank, as a torchrun job's processes run
test after test. :func:`meshsim.run` is a world with one call; a session
(:mod:`meshsim._engine.session`) keeps one across a pytest session. Nothing a world
touches outlives it: c10d's world and group registry are per rank thread, every
per-rank value is an entry of the hand-over registry, and the caller's process
state (:mod:`meshsim._process.state`) is put back between calls and at the end.

Observers are instruments (:class:`meshsim._sim.rendezvous.Instrument`) the world hands its
rendezvous for each call: the findings (a world's own), a trace (``trace=`` or an
open watch's), and whatever the open watches (:mod:`meshsim._observe.watch`) ask for.
"""

from __future__ import annotations

import datetime
import functools
import math
import os
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, cast

import torch
from torch._C._distributed_c10d import Store

from meshsim._base.context import Seat, current
from meshsim._base.errors import (
    CollectiveMismatchError,
    DeadlockError,
    MeshError,
    RankError,
    WorldAborted,
    diagnosis,
    format_user_traceback,
)
from meshsim._base.waits import Waitable
from meshsim._baton.scheduler import SAFETY_POLL, Scheduler
from meshsim._engine import affinity as _affinity
from meshsim._engine import threads as _threads
from meshsim._engine.interrupt import interrupt
from meshsim._engine.kinds import Ranks, ranks_for
from meshsim._engine.outcomes import FAILED, decided, kind_of
from meshsim._observe import findings as _findings
from meshsim._observe import trace as _trace
from meshsim._observe.watch import looking_for_waste, open_watches
from meshsim._process import cuda as _cuda
from meshsim._process import modules as _modules
from meshsim._process import patches as _patches
from meshsim._process import rng as _rng
from meshsim._process import state as _state
from meshsim._process.leaks import LeakCheck
from meshsim._process.state import ProcessState
from meshsim._sim.backend import BACKEND_NAME, create_process_group
from meshsim._sim.rendezvous import NONE, Instrument, Instruments, Rendezvous

__all__ = ["World", "run", "run_ranks"]

BACKENDS = ("sim", "gloo")
_STOP_GRACE = 1.0  # seconds a stopped world waits for rank threads still running user code
_INTERRUPT_AFTER = 0.05  # seconds before interrupting them: most leave at their next collective
_STILL_COMPUTING = 0.01  # CPU seconds over a grace that show a rank still runs Python


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
    num_threads: int | str | None = 1,
    redundant: bool | None = None,
    trace: str | os.PathLike[str] | None = None,
    cuda: str | _cuda.Spec | None = None,
    nnodes: int = 1,
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
        num_threads: ``torch.set_num_threads`` in each rank thread; ``"auto"``: one per
            CPU the caller may use; None leaves it. With more than one, the threads a rank's
            kernels fan out to run on the caller's CPUs while the rank thread stays on the
            world's one CPU (one rank runs at a time: its kernels have the CPUs to themselves).
        redundant: look for wasted collectives (calls that could not tell any rank
            anything new: ``Collective.redundant`` in ledgers). None (the default):
            on unless ``MESHSIM_REDUNDANT=0`` is in the environment. ``sim`` only.
        trace: write the world as a timeline to this file when it ends, failed or not:
            Chrome trace-event JSON, one track per rank, a slice per collective from
            arrival to release, arrows to the last rank to arrive (Perfetto's UI and
            chrome://tracing open it). ``sim`` only. Under pytest, ``--mesh-trace=DIR``
            gives each test's worlds a file without this argument.
        cuda: ``"cpu"``: emulate CUDA on the CPU, so code written for GPUs runs unchanged
            (``device="cuda"``, ``torch.cuda.set_device``, ``init_process_group("nccl")``,
            streams, the CUDA RNG; see the README's "GPU code without a GPU");
            ``"cuda:N"``: every rank's ``cuda:k`` is this process's one GPU ``N``. None
            (the default): ``MESHSIM_CUDA``'s value, else what the calling thread
            emulates (the pytest process under ``--mesh-cuda``), else off. Ranks see a
            node's 8 GPUs, or one per rank per node where that is more
            (``MESHSIM_CUDA_DEVICES`` sets the count).
        nnodes: simulated nodes of ``world_size // nnodes`` ranks each: the environment
            says so as torchrun's does for that many nodes (``LOCAL_RANK``, ``GROUP_RANK``,
            ``LOCAL_WORLD_SIZE``, ...; ``sim`` only). It must divide ``world_size``.

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
    try:
        world = World(
            world_size,
            timeout=timeout,
            backend=backend,
            serialize=serialize,
            gpu_paths=gpu_paths,
            num_threads=num_threads,
            redundant=redundant,
            cuda=_cuda.resolve(cuda),  # the face: MESHSIM_CUDA where cuda is None
            nnodes=nnodes,
        )
        return _run_once(world, fn, args, kwargs, trace)
    except RankError as error:
        outcome = decided(error)
        if outcome is error:
            raise
    # raised outside the except block: the rank's skip is not "during" the RankError
    raise outcome


def run_ranks(
    fn: Callable[..., Any],
    world_size: int,
    *,
    args: Sequence[Any] = (),
    kwargs: dict[str, Any] | None = None,
    trace: str | os.PathLike[str] | None = None,
    **options: Any,
) -> list[Any]:
    """:func:`run`, with a world whose ranks raised always raising ``RankError``.

    For meshsim's unittest bases, which report skips in unittest's terms. ``options`` are
    :class:`World`'s (``timeout``, ``backend``, ``serialize``, ``gpu_paths``, ``num_threads``,
    ``redundant``, ``cuda``), as for :func:`run`; ``cuda`` None is ``MESHSIM_CUDA``'s, as there.
    """
    options["cuda"] = _cuda.resolve(options.get("cuda"))  # the face of meshsim's unittest bases
    return _run_once(World(world_size, **options), fn, args, kwargs, trace)


def _run_once(
    world: World,
    fn: Callable[..., Any],
    args: Sequence[Any],
    kwargs: dict[str, Any] | None,
    trace: str | os.PathLike[str] | None,
) -> list[Any]:
    """``fn`` as the one call of ``world``, from its start to its close."""
    path = None
    if trace is not None:
        path = _trace.checked_path(trace)
        if world.backend != "sim":
            raise ValueError(
                f"trace={str(trace)!r} draws a simulated world; backend={world.backend!r} ranks are "
                "not seen by meshsim between their calls: use backend='sim'"
            )
    _check_fn(fn)
    with world.pinned():  # one pinning from start to close: between them the caller only waits
        return world.start(only=(fn, tuple(args), dict(kwargs or {})), trace=path).close()


def name_of(fn: Any) -> str:
    """What a trace and error messages call ``fn``."""
    return getattr(fn, "__qualname__", None) or getattr(fn, "__name__", None) or type(fn).__name__


def _check_fn(fn: Any) -> None:
    if not callable(fn):
        raise TypeError(f"run() needs a callable to run on every rank, got {fn!r}")


def _check_args(world_size: Any, timeout: Any, backend: Any, num_threads: Any) -> None:
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
    if (
        num_threads is not None
        and num_threads != "auto"
        and (isinstance(num_threads, bool) or not isinstance(num_threads, int) or num_threads < 1)
    ):
        raise ValueError(f"num_threads must be a positive int, 'auto' or None, got {num_threads!r}")


def _threads_for(num_threads: int | str | None) -> int | None:
    """A rank's intra-op threads: ``"auto"`` is one per CPU the caller may use."""
    if num_threads != "auto":
        return cast("int | None", num_threads)
    allowed = _affinity.affinity()
    return len(allowed) if allowed is not None else os.cpu_count() or 1


def num_threads_from_environment() -> int | str:
    """``MESHSIM_NUM_THREADS`` (a positive int or ``auto``; 1 where unset), for the worlds of meshsim's faces.

    Raises:
        ValueError: the variable holds anything else.
    """
    text = os.environ.get("MESHSIM_NUM_THREADS", "").strip()
    if not text:
        return 1
    if text.lower() == "auto":
        return "auto"
    if text.isdigit() and int(text) >= 1:
        return int(text)
    raise ValueError(f"MESHSIM_NUM_THREADS must be a positive int or 'auto', got {text!r}")


@dataclass(frozen=True)
class _Call:
    """One call the ranks run: ``fn(*args, **kwargs)``, named ``name`` in traces."""

    fn: Callable[..., Any]
    args: tuple[Any, ...]
    kwargs: dict[str, Any]
    name: str
    reseed: bool  # Python's or NumPy's global RNG changed in the caller since the last call


class _Post(Waitable):
    """Where ranks wait for call number k: completed once it is posted (``call`` None: the world's end)."""

    idle = True

    def __init__(self) -> None:
        super().__init__()
        self.call: _Call | None = None

    def describe(self, rank: int) -> str:
        return "done with this call, waiting for the next"

    def missing(self) -> tuple[int, ...]:
        return ()


# A world of one call (meshsim.run) never waits for its ranks to be idle between calls.
_NEVER_IDLE = threading.Event()


class World:
    """One world of ``world_size`` rank threads, from :meth:`start` to :meth:`close`.

    Args:
        world_size: the number of ranks (1 or more).

    Keyword args:
        timeout, backend, serialize, gpu_paths, num_threads, redundant, nnodes: as for
            :func:`meshsim.run`.
        cuda: the CUDA emulation (a :class:`meshsim._process.cuda.Spec`, or its text as
            ``--mesh-cuda`` takes it); None: what the calling thread emulates, else off.
            The world sizes it to its ranks per node.

    Raises:
        TypeError, ValueError: a bad argument.
    """

    def __init__(
        self,
        world_size: int,
        *,
        timeout: float = 60.0,
        backend: str = "sim",
        serialize: bool = True,
        gpu_paths: bool = True,
        num_threads: int | str | None = 1,
        redundant: bool | None = None,
        cuda: str | _cuda.Spec | None = None,
        nnodes: int = 1,
    ) -> None:
        _check_args(world_size, timeout, backend, num_threads)
        if isinstance(nnodes, bool) or not isinstance(nnodes, int) or nnodes < 1 or world_size % nnodes:
            raise ValueError(
                f"nnodes must be a positive int that divides world_size {world_size} "
                f"(nodes of equal size, as torchrun starts them), got {nnodes!r}"
            )
        self.nnodes = nnodes
        if redundant is not None and not isinstance(redundant, bool):
            raise TypeError(f"redundant must be True, False or None, got {redundant!r}")
        # parsed now, so a bad value fails before any thread starts
        asked = _cuda.resolve(cuda) if cuda is not None else None
        if asked is None:  # a world started from a thread that emulates (the pytest process) emulates too
            asked = _cuda.emulated_here()
        self.cuda_asked = asked  # what ranks' own worlds inherit
        self.cuda = asked.sized(world_size // nnodes) if asked is not None else None
        self.world_size = world_size
        self.timeout = timeout
        self.group_timeout = datetime.timedelta(seconds=timeout)  # of the groups ranks make
        self.backend = backend
        self.kind: Ranks = ranks_for(backend, serialize=serialize and backend == "sim")
        self.serialize = serialize and backend == "sim"
        self.gpu_paths = gpu_paths
        self.num_threads = _threads_for(num_threads)
        self.redundant = redundant
        self.results: list[Any] = [None] * world_size
        self.failures: list[tuple[int, BaseException, str]] = []
        # how each rank's part of the current call ended (None: returned), for the report
        # of a gloo world whose ranks disagree (kinds.GlooRanks.verdict)
        self.endings: dict[int, BaseException | None] = {}
        self._where_ranks_stood: str | None = None  # the first failure's note: every rank's state
        self.stuck: list[int] = []
        self.started = self.closed = False
        # set by start()
        self.scheduler: Scheduler = None  # type: ignore[assignment]
        self.rendezvous: Rendezvous = None  # type: ignore[assignment]
        self.workers: list[_threads.Worker] = []
        self.new_workers: list[_threads.Worker] = []
        self.findings: _findings.Findings | None = None
        self.store: Store | None = None
        self.cpu: int | None = None
        self.cpus: frozenset[int] | None = None  # where rank threads run
        self._allowed: frozenset[int] | None = None  # the caller's CPUs
        self._pinnings = 0  # nested _Pinning blocks open: the outermost pins and unpins
        self._starvation = _affinity.Starvation()  # whether the pinned world gets its CPU
        self._saved: ProcessState | None = None  # the caller's state as the last call began
        self._leaks: LeakCheck | None = None
        self._posts: list[_Post] = []
        # every rank that has not finished waits for the next call (a world of more than one call)
        self._idle = _NEVER_IDLE
        self._calls = 0  # calls posted so far
        self._env: dict[str, str | None] = {}  # what the ranks changed in the environment, kept across calls
        self._num_threads_default = 1  # the caller's, for reused threads when num_threads is None

    # -- the caller's side ----------------------------------------------------------

    def start(
        self,
        *,
        only: tuple[Callable[..., Any], tuple[Any, ...], dict[str, Any]] | None = None,
        trace: os.PathLike[str] | None = None,
    ) -> World:
        """Install what worlds need, capture the caller's state and start the ranks; returns the world.

        The ranks set up their default process groups and wait for the first
        :meth:`call`; this returns once they do, with the caller's own state in place.

        Keyword args:
            only: ``(fn, args, kwargs)``, the world's one call (``meshsim.run``): the
                ranks run it right away and finish after it, with no wait in between;
                :meth:`close` then returns its results.
            trace: with ``only``: write its timeline to this file (``sim`` only).

        Raises:
            RuntimeError: the world was started before.
            RankError, CollectiveMismatchError, DeadlockError: the ranks' set-up failed.
        """
        if self.started:
            raise RuntimeError("this world was started already: a World runs once, from start() to close()")
        if not self.serialize:
            how = "backend='gloo'" if self.backend == "gloo" else "serialize=False"
            _modules.refuse_unserialized(f"a world with {how}")
        self.started = True
        saved = self._open()
        if only is None:
            self._idle = threading.Event()
            self.scheduler.on_idle = self._idle.set
        try:
            with self.pinned():
                if only is not None:
                    fn, args, kwargs = only
                    name = name_of(fn)
                    self._observe(name, trace)
                    self._post(_Call(fn, args, kwargs, name, False), last=True, reload=False)
                self._launch(saved)
                if only is None:
                    self.supervise(self._idle)
        except BaseException as exc:  # KeyboardInterrupt in the caller
            self.scheduler.abort(exc)
            self.close()
            raise
        if only is None:
            if self.scheduler.error is not None:
                self.close()  # raises what stopped the world's set-up
            saved.restore()  # the caller's own state until the first call
        return self

    def call(
        self,
        fn: Callable[..., Any],
        args: Sequence[Any] = (),
        kwargs: dict[str, Any] | None = None,
        *,
        name: str | None = None,
        traced: bool = True,
    ) -> list[Any]:
        """Run ``fn(*args, **kwargs)`` on every rank; returns each rank's result, in rank order.

        Between calls the caller's own process state is in place; what the caller
        changes meanwhile, every rank takes at the call (as torchrun would have done
        it in every process). A call that fails on any rank ends the world, as a
        failure ends a torchrun job.

        Keyword args:
            name: what a trace calls the call (``fn``'s name by default).
            traced: an open watch's tracer draws the call (False: a session's set-up replay).

        Raises:
            RankError, CollectiveMismatchError, DeadlockError: as :func:`meshsim.run`.
            RuntimeError: the world is not running.
        """
        if not self.started or self.closed or (self._calls and self._posts[self._calls - 1].call is None):
            raise RuntimeError("call() needs a running world: start() it first; a failed call ends it")
        previous = self._saved
        assert previous is not None  # start() captured it
        saved = self._saved = ProcessState.capture(previous.slots)
        reseed = saved.reseeds(previous)
        _state.apply_environ_changes(self._env)
        if self.serialize:
            _state.set_world_environment(self.world_size, self.nnodes)
        label = name or name_of(fn)
        self._observe(label, None, traced=traced)
        try:
            with self.pinned():
                self._post(_Call(fn, tuple(args), dict(kwargs or {}), label, reseed), last=False, reload=True)
                self.supervise(self._idle)
        except BaseException as exc:  # KeyboardInterrupt in the caller
            self.scheduler.abort(exc)
            self.close()
            raise
        if self.scheduler.error is not None:
            self.close()  # raises what made the call fail
        self._finish_call()
        self._env = {**self._env, **_state.environ_changes(saved.environ)}
        saved.restore()
        return list(self.results)

    def close(self) -> list[Any]:
        """End the world, letting every rank finish; returns the last call's results, or raises what failed.

        A no-op (returning the last results) once the world is closed.
        """
        if self.closed or not self.started:
            return self.outcome() if self.started else []
        self.closed = True
        saved = self._saved
        assert saved is not None
        try:
            with self.pinned():
                try:
                    if self.scheduler.error is None and not self._ending():
                        saved = ProcessState.capture(saved.slots)  # the caller's state now, to put back
                        _state.apply_environ_changes(self._env)
                        self._post(None, last=False, reload=True)
                    self.supervise(self.scheduler.finished)
                except BaseException as exc:
                    self.scheduler.abort(exc)
                    raise
                finally:
                    self._stop()
                    self._finish_call()  # once every rank is through: their last events are in
                    saved.restore()
        finally:
            _patches.uninstall()
            self._release_cuda()
        if self._leaks is not None:
            self._leaks.report()
        return self.outcome()

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
            if self.cpu is not None and self._starvation.starved():
                self._unpin()

    def outcome(self) -> list[Any]:
        """Each rank's result of the last call, or raise what made the world fail."""
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

    # -- internals of the caller's side ---------------------------------------------

    def pinned(self) -> _Pinning:
        """The caller on the ranks' CPU for the block; nested blocks pin once (a run's start to close)."""
        return _Pinning(self)

    def _unpin(self) -> None:
        """Let the OS place the world's threads: its CPU is shared with something else (see affinity)."""
        allowed = self._allowed
        if allowed is None:
            return
        self.cpu, self.cpus = None, allowed  # rank threads that start from now on
        for worker in self.workers:
            worker.move(allowed)
        _affinity.unpin(allowed)  # the caller

    def _place(self) -> frozenset[int] | None:
        """Choose the CPU(s) rank threads run on; returns the caller's."""
        allowed = _affinity.affinity()  # read once: each affinity system call costs a few microseconds
        self.cpu = self._rank_cpu(allowed) if self.serialize else None
        self.cpus = frozenset({self.cpu}) if self.cpu is not None else allowed
        return allowed

    def _open(self) -> ProcessState:
        """Install the patches, capture the caller's state, and make the scheduler and the rendezvous."""
        # Patches first: they declare the per-rank state of integrated projects already
        # loaded, which the caller's state then includes.
        if self.cuda is not None:
            _patches.install_cuda(self.cuda)
        try:
            _patches.install(BACKEND_NAME, create_process_group)
        except BaseException:
            self._release_cuda()
            raise
        # taken once nothing before can fail: every failure from here gives them back
        self.workers, self.new_workers = _threads.take(self.world_size)
        try:
            self._leaks = LeakCheck()
            saved = self._saved = ProcessState.capture()
            self._num_threads_default = saved.num_threads
            self.scheduler = Scheduler(
                self.world_size,
                [worker.bell for worker in self.workers],
                serialize=self.serialize,
                handover=saved.slots if self.serialize else None,
            )
            self.rendezvous = Rendezvous(self.scheduler)
            if self.backend == "sim" and looking_for_waste(self.redundant, _findings.enabled_by_default):
                self.findings = _findings.Findings()
            # wakes the caller when the last rank thread is through, not when the last
            # rank finishes its function and is still tidying up
            self.jobs = _threads.Countdown(self.world_size, also=self.scheduler.finished)
        except BaseException:
            self.closed = True
            _threads.give_back(self.workers)
            _patches.uninstall()
            self._release_cuda()
            raise
        return saved

    def _release_cuda(self) -> None:
        if self.cuda is not None:
            _patches.uninstall_cuda(self.cuda)

    def _launch(self, caller: ProcessState) -> None:
        """Start the rank threads; rank 0 (every rank, unserialized) runs at once."""
        self.kind.prepare()  # after the caller's state was captured: close() puts it back
        self.store = self.kind.store(self.scheduler)
        if self.serialize:
            _state.set_world_environment(self.world_size, self.nnodes)  # before the ranks' values
            caller.slots.start(self.world_size)
        for rank, worker in enumerate(self.workers):
            worker.assign(functools.partial(self._rank_main, rank), self.jobs, f"meshsim-rank-{rank}")
        for worker in self.new_workers:  # they inherit the caller's pinning
            worker.cpus = self.cpus
            worker.thread.start()
        self.scheduler.begin()

    def _rank_cpu(self, allowed: frozenset[int] | None) -> int | None:
        """The one CPU serialized ranks run on: where reused threads already are, if they agree."""
        if self.workers:  # taken already (a session's start places after taking)
            reused = self.workers[: len(self.workers) - len(self.new_workers)]  # take() puts them first
            pinned = {w.cpus for w in reused}
        else:  # meshsim.run places first (one pinning from start to close): the threads it will take
            pinned = _threads.idle_cpus(self.world_size)
        if len(pinned) == 1:
            cpus = pinned.pop()
            if cpus is not None and len(cpus) == 1:
                (cpu,) = cpus
                if _affinity.may_run_on(cpu, allowed):
                    return cpu  # moving threads to another CPU costs ~25 us each
        return _affinity.current_cpu(allowed)

    def _observe(self, name: str, trace: os.PathLike[str] | None, *, traced: bool = True) -> None:
        """Hand the rendezvous this call's instruments: the world's findings, and a tracer if it is drawn."""
        watches = open_watches()
        tracer = None
        if self.backend == "sim" and traced:
            if trace is not None:
                tracer = _trace.Tracer(trace, self.world_size, name)  # type: ignore[arg-type]
            else:
                for watch in watches:
                    if watch.tracer is not None:
                        tracer = watch.tracer(name, self.world_size)
        instruments: list[Instrument] = []
        findings = self.findings
        if findings is not None:
            findings.sinks = [watch.findings for watch in watches if watch.findings is not None]
            findings.looking = tracer is not None
            instruments.append(findings)
        if tracer is not None:
            instruments.append(tracer)
        self.rendezvous.instruments = Instruments(instruments) if instruments else NONE

    def _post(self, call: _Call | None, *, last: bool, reload: bool) -> None:
        """Post the next call (None: the world's end; ``last``: the end right after it).

        ``reload``: the caller's state was in place since the ranks last ran, so the
        rank that runs next loads its own (see :meth:`Scheduler.resume`).
        """
        entries = [call, None] if last and call is not None else [call]
        with self.scheduler:
            posts = [self._post_for(self._calls + i) for i in range(len(entries))]
            for post, entry in zip(posts, entries):
                post.call = entry
            self._calls += len(entries)
        self.results = [None] * self.world_size
        self.endings = {}
        self._idle.clear()
        for post in posts:
            self.scheduler.resume(post, reload=reload)

    def _ending(self) -> bool:
        """Whether the world's end is posted already."""
        return bool(self._calls) and self._posts[self._calls - 1].call is None

    def _post_for(self, k: int) -> _Post:
        """Post number ``k``, made by whoever asks first (the caller, or a rank waiting for it). Lock held."""
        while len(self._posts) <= k:
            self._posts.append(_Post())
        return self._posts[k]

    def _finish_call(self) -> None:
        """The call's end for its instruments: the world's error, if no rank raised it, and the trace."""
        if self.rendezvous is None:  # type: ignore[comparison-overlap]  # start() failed early
            return
        instruments = self.rendezvous.instruments
        error = self.scheduler.error
        if error is not None and not isinstance(error, RankError):
            for failed in instruments.failed:
                failed(None, error)
        for ended in instruments.ended:
            ended()
        self.rendezvous.instruments = NONE

    def _stop(self) -> None:
        """Wait for every rank's job; after an abort, interrupt ranks still running user code."""
        start = nudged = time.monotonic()
        interrupted: set[int] = set()
        give_up: float | None = None
        limit = 0.0  # the last moment a rank that keeps computing is waited for
        cpu = None  # the running ranks' CPU time when the grace began
        while not self.jobs.wait(0.01):
            nudged = _nudge_every_second(self.scheduler, nudged)
            if self.scheduler.error is None:
                continue
            now = time.monotonic()
            if give_up is None:
                give_up = self.kind.give_up_at(start, self.timeout)
                limit = give_up + self.timeout
                cpu = self.scheduler.running_cpu()
            # a rank may enter a collective after the stop began (a slow first import)
            give_up = max(give_up, self.kind.give_up_at(start, self.timeout))
            if now > give_up:
                # A rank that computed during the grace runs Python and will take the
                # interrupt once it gets the CPU (a loaded machine starves it; a fresh
                # process's first import takes long): give it another grace, for up to one
                # more world timeout. One blocked in C is left.
                used = self.scheduler.running_cpu()
                if cpu is None or used is None or used - cpu < _STILL_COMPUTING or now > limit:
                    break
                give_up, cpu = now + _STOP_GRACE, used
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

    def _rank_error(self) -> RankError:
        own = [(rank, exc) for rank, exc, _ in self.failures]
        rank, exc, text = self.failures[0]
        error = RankError(rank, self.world_size, text, own)
        error.__cause__ = exc
        if self._where_ranks_stood is not None:
            error.add_note(self._where_ranks_stood)
        return error

    # -- the ranks' side --------------------------------------------------------------

    def _rank_main(self, rank: int) -> None:
        try:
            _patches.enter_rank_thread(
                gpu_paths=self.gpu_paths,
                group_timeout=self.group_timeout,
                cuda=self.cuda,
                cuda_asked=self.cuda_asked,
            )
            try:
                self._rank_body(rank)
            finally:
                _patches.leave_rank_thread()
        except WorldAborted:
            pass  # interrupted while leaving; the world already failed

    def _rank_body(self, rank: int) -> None:
        here = current()
        seat = here.seat = Seat(rank, self.world_size, self.scheduler, self.rendezvous)
        seat.init_default = self._init_process_group
        # per thread; ProcessState restores the default. None: what a new thread gets.
        num_threads = self.num_threads if self.num_threads is not None else self._num_threads_default
        if torch.get_num_threads() != num_threads:
            torch.set_num_threads(num_threads)
        # Serialized ranks never run at once, so one core loses nothing, and keeps
        # torch's per-thread state warm in one cache across hand-overs (torch calls
        # right after a hand-over ran ~3x slower without it). New threads start
        # pinned (see start); a reused one may come from a world pinned elsewhere.
        pinned = self.cpu is not None
        if pinned and num_threads > 1:  # its kernels' threads run where the caller may
            self.workers[rank].start_team(num_threads, self._allowed)
        self.workers[rank].pin(self.cpus)
        if pinned:  # processes the rank forks run where the caller may, too
            here.child_cpus = self._allowed
        outcome = "stopped: the world failed"
        try:
            self.scheduler.start(rank)
            outcome = self.kind.run(functools.partial(self._serve, rank, seat))
        except WorldAborted:
            pass
        finally:
            here.seat = here.child_cpus = None
            self.scheduler.finish(rank, outcome)

    def _serve(self, rank: int, seat: Seat) -> str:
        """Run the world's calls between the rank's default group's set-up and teardown; says how it ended."""
        # The failure is recorded before the process groups are torn down: on gloo,
        # tearing down closes sockets, and the peers' resulting errors must not be
        # mistaken for the first failure.
        outcome = "stopped: the world failed"
        try:
            self._init_process_group(seat)
            k = 0
            while True:
                call = self._next_call(rank, k)
                if call is None:
                    return outcome
                k += 1
                outcome = self._run_call(rank, call)
        except WorldAborted as exc:
            self.kind.let_go(exc)
            return "stopped: the world failed"
        finally:
            self.kind.destroy_groups()

    def _next_call(self, rank: int, k: int) -> _Call | None:
        scheduler = self.scheduler
        posts = self._posts
        if k < len(posts):  # made already (a run's call and its end are posted at once): no lock
            post = posts[k]
        else:
            with scheduler:
                post = self._post_for(k)
        scheduler.wait(rank, post)
        return post.call

    def _run_call(self, rank: int, call: _Call) -> str:
        """Run ``call`` on ``rank``: its result, or the failure that stops the world."""
        instruments = self.rendezvous.instruments
        for started in instruments.rank_started:
            started(rank, call.name)
        outcome = "stopped: the world failed"
        try:
            if call.reseed:
                _rng.enter_rank()  # draw afresh from the caller's newly seeded generators
            _modules.import_pending()  # the modules declared per rank that it has not imported itself
            self.results[rank] = call.fn(*call.args, **call.kwargs)
            self.endings[rank] = None  # before the rank's groups close: a peer's report may ask
            outcome = "finished: its function returned"
        except WorldAborted:
            raise
        except BaseException as exc:
            self.endings[rank] = exc
            for failed in instruments.failed:
                failed(rank, exc)
            self._rank_failed(rank, exc)
            self.kind.let_go(exc)
            outcome = f"failed: {type(exc).__name__}: {exc}".splitlines()[0]
            raise WorldAborted() from None
        finally:
            for finished in instruments.rank_finished:
                finished(rank, call.name, outcome)
        return outcome

    def _init_process_group(self, seat: Seat) -> None:
        assert self.store is not None  # made at the world's start
        self.kind.init_default_group(seat, self.store, self.timeout)

    def _rank_failed(self, rank: int, exc: BaseException) -> None:
        exc = diagnosis(exc)  # a foreign group's error, not torch's logger failing to name it
        if isinstance(exc, (CollectiveMismatchError, DeadlockError)):
            self.scheduler.abort(exc)
            return
        if self.scheduler.error is not None:
            return  # a consequence of the failure that stopped the world (gloo peers see closed sockets)
        # a skip or xfail decides the test (see outcomes): no verdict for it
        found = self.kind.verdict(self.endings, self.world_size) if kind_of(exc) == FAILED else None
        if found is not None and not isinstance(found, str):
            # a gloo rank whose collective failed because a peer finished, failed or went elsewhere
            self.scheduler.abort(found)
            return
        self._where_ranks_stood = found
        text = format_user_traceback(exc)
        self.failures.append((rank, exc, text))
        self.scheduler.abort(RankError(rank, self.world_size, text))


class _Pinning:
    """The caller runs on the ranks' CPU while it waits on them.

    Its hand-overs with them (a call's start and end) then need no cross-CPU
    wake-up, which made a world's set-up and teardown ~1.5x slower on a 2-CPU VM.
    New rank threads inherit the pinning.
    """

    def __init__(self, world: World) -> None:
        self.world = world
        self.pinned = False

    def __enter__(self) -> None:
        world = self.world
        if world._pinnings:  # already held by an enclosing block
            world._pinnings += 1
            return
        world._pinnings = 1
        if world._allowed is None and world.cpus is None:
            world._allowed = world._place()
        self.pinned = _affinity.pin(world.cpu, world._allowed)
        world._starvation.restart()

    def __exit__(self, *exc_info: object) -> None:
        self.world._pinnings -= 1
        if self.pinned:
            _affinity.unpin(self.world._allowed)


def _nudge_every_second(scheduler: Scheduler, last: float) -> float:
    """Nudge parked ranks once :data:`SAFETY_POLL` s have passed since ``last``; returns the new last."""
    now = time.monotonic()
    if now - last < SAFETY_POLL:
        return last
    scheduler.nudge()
    return now
