"""Spawned ranks that start once: rank processes kept for the session, each running one rank of many tests.

``--mesh-backend=spawn`` used to start a new Python process per rank per test, and
each one imported torch: seconds per test. A :class:`RankPools` keeps the processes
instead, as torch's ``MultiProcContinuousTest`` keeps its processes for a class and
pytest-xdist keeps its workers for a session. Process ``i`` runs rank ``i`` of every
test that has one: a test on 2 ranks takes processes 0 and 1, one on 4 ranks 0 to 3,
so tests of different world sizes share the processes they have in common.

Each test is a job of its own, as in a fresh process (:mod:`meshsim._modes.spawn`):
a new rendezvous store on a port the OS picks, a new process group, the test body
loaded from its module (imported once per process, as pytest imports it once per
session), this pytest process's environment, working directory and ``sys.path``
as they are when the test starts. When the body ends, the rank reports its outcome
first (on the same channel and in the same form as a fresh process), then puts the
process back as it found it: it destroys every process group, undoes the CUDA
emulation and ``monkeypatch`` changes made in it, and restores the environment, the
working directory, torch's RNG and the torch settings a test may flip (default dtype
and device, grad mode, deterministic algorithms, intra-op threads). A process that
cannot be put back is replaced: one that died, outlived the timeout, failed to
rendezvous, left a thread running, left a process group initialized or a
``torch.distributed`` module global changed, or did not finish cleaning up in time.
The next test gets a fresh process in its place; the others are kept.

What persists between tests in a kept process is what persists between the tests of
a long-lived torchrun job: imported modules and their globals, torch's caches and
registrations, CUDA context. Processes are grouped by what a process reads once as
it starts (:func:`pool_key`: the CUDA emulation and visible devices); they end when
the session ends (:meth:`RankPools.close`), and die with this process
(``PR_SET_PDEATHSIG`` on Linux). Every wait has a timeout.
"""

from __future__ import annotations

import datetime
import functools
import gc
import multiprocessing
import multiprocessing.connection
import os
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from multiprocessing.reduction import ForkingPickler
from typing import TYPE_CHECKING, Any

from meshsim._base.errors import format_user_traceback
from meshsim._modes.launch import die_with_parent
from meshsim._modes.spawn import (
    TestTarget,
    _collect,
    _Outcome,
    _raise_first_failure,
    _run_rank,
    client_store,
)

if TYPE_CHECKING:
    from meshsim._process.cuda import Spec
    from meshsim._record.ledger import Ledger

__all__ = ["PoolStatistics", "RankPools", "pool_key"]

_START = 120.0  # seconds a new rank process may take to import torch and say it is ready
_CLEANUP = 10.0  # seconds a rank process may take to put itself back after reporting
_STOP = 5.0  # seconds a rank process gets to leave at the session's end before it is killed
_POLL = 1.0  # seconds an idle rank process waits for its next job before checking on its parent

#: Environment variables a rank process reads once, as it starts (or as torch initializes):
#: processes started under different values are not interchangeable.
STARTUP_VARIABLES = ("MESHSIM_CUDA", "MESHSIM_CUDA_DEVICES", "CUDA_VISIBLE_DEVICES")


def pool_key(environ: dict[str, str] | None = None) -> tuple[tuple[str, str | None], ...]:
    """What makes rank processes incompatible: the startup variables' values (``os.environ``'s by default)."""
    source = os.environ if environ is None else environ
    return tuple((name, source.get(name)) for name in STARTUP_VARIABLES)


# -- messages ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class _Job:
    """One test for one rank process: what a fresh process would get from its arguments and its parent."""

    target: TestTarget
    funcargs: dict[str, Any]
    world_size: int
    port: int
    prefix: str  # the test's keys in the session's store: ``test<N>/``
    timeout: float
    record: bool
    environ: dict[str, str]
    cwd: str
    path: list[str]
    spare_threads: int
    cuda: Spec | None  # the CUDA emulation the rank installs for this test (sized for its world)


@dataclass(frozen=True)
class _Ready:
    """A new rank process has imported torch and waits for jobs."""

    pid: int


@dataclass(frozen=True)
class _Cleaned:
    """A rank process after a job: ``reason`` is None when it can run another, else why not."""

    reason: str | None


# -- the parent's side ----------------------------------------------------------------------------


@dataclass(frozen=True)
class PoolStatistics:
    """What the pools did: tests run, processes started, and why each replaced one was.

    Attributes:
        tests: tests the pools ran.
        started: rank processes started (the first of each index included).
        replaced: ``(rank, why)`` for each process ended because a test left it unusable.
    """

    tests: int
    started: int
    replaced: tuple[tuple[int, str], ...]

    def __str__(self) -> str:
        text = f"{self.tests} test(s) on {self.started} rank process(es)"
        if self.replaced:
            text += f", {len(self.replaced)} replaced after a test left it unusable"
        return text


class _RankProcess:
    """One kept rank process: the process, its end of a duplex pipe, its pid once ready."""

    def __init__(self, context: Any, rank: int) -> None:
        self.rank = rank
        self.conn, child_end = context.Pipe(duplex=True)
        self.process = context.Process(
            target=_worker_main, args=(rank, child_end), name=f"meshsim-spawn-rank-{rank}", daemon=True
        )
        self.process.start()
        child_end.close()
        self.pid: int | None = None

    def wait_ready(self, deadline: float) -> None:
        """Wait for the process's :class:`_Ready`.

        Raises:
            RuntimeError: it exited or did not say it was ready by ``deadline``.
        """
        message = _receive_by(self.conn, deadline)
        if isinstance(message, _Ready):
            self.pid = message.pid
            return
        self.process.join(0.5)
        why = (
            f"it exited with code {self.process.exitcode}"
            if not self.process.is_alive()
            else f"it did not start within {_START:g} s"
        )
        raise RuntimeError(f"meshsim could not start the process for spawned rank {self.rank}: {why}")

    def usable(self) -> bool:
        return bool(self.process.is_alive())

    def kill(self) -> None:
        self.conn.close()
        if self.process.is_alive():
            self.process.kill()
        self.process.join(_STOP)

    def stop(self) -> None:
        """Ask the process to leave (it ends its loop), then reap it; kill it if it does not."""
        try:
            self.conn.send(None)
        except OSError:
            pass  # already gone
        self.process.join(_STOP)
        self.kill()


_NOTHING: Any = object()


def _receive_by(conn: Any, deadline: float) -> Any:
    """The next message on ``conn``, or ``_NOTHING`` if none came by ``deadline`` or the other end closed."""
    try:
        if conn.poll(max(0.0, deadline - time.monotonic())):
            return conn.recv()
    except (EOFError, OSError):
        pass
    return _NOTHING


@dataclass
class RankPools:
    """The session's rank processes, by :func:`pool_key`; process ``i`` runs rank ``i`` of each test.

    Keyword args:
        context: the multiprocessing context the processes start in (``spawn``).
        spare_threads: how many threads more than it started with a process may hold after a
            test before it is replaced (Linux, where ``/proc`` counts them).
    """

    context: Any = field(default_factory=lambda: multiprocessing.get_context("spawn"))
    spare_threads: int = 256
    _pools: dict[tuple[tuple[str, str | None], ...], list[_RankProcess]] = field(default_factory=dict)
    _tests: int = 0
    _started: int = 0
    _replaced: list[tuple[int, str]] = field(default_factory=list)
    _store: Any = None  # the session's TCPStore server, made by the first test
    _unsettled: list[_RankProcess] = field(default_factory=list)  # reported, not yet put back

    def run(
        self,
        target: TestTarget,
        funcargs: dict[str, Any],
        world_size: int,
        *,
        timeout: float,
        record: bool = False,
        cuda: Spec | None = None,
    ) -> list[Ledger | None]:
        """Run the test on the first ``world_size`` kept processes; raise :class:`RankError` if a rank fails.

        The same contract as :func:`meshsim._modes.spawn.run_in_processes`: each rank's
        ledger of the body (rank 0's first) when ``record`` is true or the test asked
        for its ``ledger``, else None.

        Raises:
            RankError: a rank raised, died or outlived ``timeout``.
            RuntimeError: a rank process could not be started.
        """
        self._settle()
        processes = self._processes(world_size)
        port = self._store_port(timeout)
        job = _job(
            target,
            funcargs,
            world_size,
            port,
            f"test{self._tests}/",
            timeout,
            record,
            self.spare_threads,
            cuda,
        )
        payload = bytes(ForkingPickler.dumps(job))
        self._tests += 1
        try:
            for process in processes:
                _send(process, payload)
            outcomes = _collect([p.process for p in processes], [p.conn for p in processes], timeout)
        except BaseException:
            for process in processes:  # interrupted mid-test: nothing about them is known
                if process.usable():
                    self._drop(process, "the test was interrupted")
            raise
        for process in processes:
            if outcomes[process.rank].kind in ("died", "timeout"):
                self._drop(process, outcomes[process.rank].text)
        # The others put themselves back (destroy their group, restore their state) while
        # this process reports the test and sets up the next one, which waits for them first.
        self._unsettled = [process for process in processes if process.usable()]
        _raise_first_failure(outcomes, world_size)
        return [outcomes[rank].ledger for rank in range(world_size)]

    def _processes(self, world_size: int) -> list[_RankProcess]:
        """The first ``world_size`` processes of this environment's pool, started if missing."""
        pool = self._pools.setdefault(pool_key(), [])
        new = []
        for rank in range(world_size):
            if rank < len(pool) and pool[rank].usable():
                continue
            process = _RankProcess(self.context, rank)
            self._started += 1
            if rank < len(pool):
                pool[rank] = process
            else:
                pool.append(process)
            new.append(process)
        deadline = time.monotonic() + _START
        for process in new:
            try:
                process.wait_ready(deadline)
            except RuntimeError:
                self._drop(process, "it could not start")
                raise
        return pool[:world_size]

    def _store_port(self, timeout: float) -> int:
        """The port of the session's store: one server, and in each rank process one client, for every test.

        A new client per test made about one gloo group in ten wait 5 s in its rendezvous
        (``TCPStore::wait`` answered late on a fresh connection; 4 ranks, torch 2.13.0+cpu,
        ``benchmarks/bench_spawn.py``): each test's keys get a prefix of their own instead.
        """
        from meshsim._process.loopback import loopback_store

        if self._store is None:
            self._store = loopback_store(1, timeout=timeout)
        return int(self._store.port)

    def _settle(self) -> None:
        """After a test: keep each process that put itself back; end the others."""
        unsettled, self._unsettled = self._unsettled, []
        deadline = time.monotonic() + _CLEANUP
        for process in unsettled:
            message = _receive_by(process.conn, deadline)
            if not isinstance(message, _Cleaned):
                self._drop(process, f"it did not put itself back within {_CLEANUP:g} s")
            elif message.reason is not None:
                self._drop(process, message.reason)

    def _drop(self, process: _RankProcess, why: str) -> None:
        process.kill()
        self._replaced.append((process.rank, why))
        # its slot stays: usable() is false once killed, so the next test starts a new process there

    def pids(self) -> list[int]:
        """The pids of the live processes of this environment's pool, rank 0's first."""
        self._settle()
        return [p.pid for p in self._pools.get(pool_key(), []) if p.usable() and p.pid is not None]

    def statistics(self) -> PoolStatistics:
        self._settle()
        return PoolStatistics(self._tests, self._started, tuple(self._replaced))

    def close(self) -> None:
        """End every kept process: ask each to leave, reap it, kill it if it does not leave in time."""
        self._settle()
        pools, self._pools = self._pools, {}
        for pool in pools.values():
            for process in pool:
                if process.usable():
                    process.stop()
        self._store = None  # the server closes with the last reference


def _job(
    target: TestTarget,
    funcargs: dict[str, Any],
    world_size: int,
    port: int,
    prefix: str,
    timeout: float,
    record: bool,
    spare_threads: int,
    cuda: Spec | None,
) -> _Job:
    environ, cwd, path = dict(os.environ), os.getcwd(), list(sys.path)
    return _Job(
        target, funcargs, world_size, port, prefix, timeout, record, environ, cwd, path, spare_threads, cuda
    )


def _send(process: _RankProcess, payload: bytes) -> None:
    try:
        process.conn.send_bytes(payload)
    except OSError:
        pass  # it died while idle: its pipe's end reads as "died", and the test fails naming it


# -- the rank process's side --------------------------------------------------------------------


class _OneOutcome:
    """The pipe :func:`meshsim._modes.spawn._run_rank` reports on: the first outcome goes; kept open."""

    def __init__(self, conn: Any) -> None:
        self.conn = conn
        self.sent = False

    def send(self, outcome: _Outcome) -> None:
        if self.sent:
            return
        self.sent = True
        _flush()  # what the rank printed lands in this test's captured output
        self.conn.send(outcome)

    def close(self) -> None:
        """Kept open: the process reports the next test's outcome on it."""


def _worker_main(rank: int, conn: Any) -> None:
    """A kept rank process: ready, then jobs until told to stop, its parent goes, or it is unusable."""
    die_with_parent()
    parent = os.getppid()
    try:
        baseline = _Baseline.take()
        conn.send(_Ready(os.getpid()))
        while (job := _next_job(conn, parent)) is not None:
            reason = _run_job(job, rank, conn, baseline)
            conn.send(_Cleaned(reason))
            if reason is not None:
                break
    except (EOFError, OSError, KeyboardInterrupt):
        pass  # the parent went, or closed its end: nothing is waiting for this process
    finally:
        _flush()
        # as a fresh rank does: no interpreter teardown (gloo has aborted in static destructors)
        os._exit(0)


def _next_job(conn: Any, parent: int) -> _Job | None:
    """The next job, or None when told to stop or when the parent is gone (this waits in short polls).

    A job that cannot be unpickled here (a test argument whose class this process
    cannot import) is the test's failure, reported as this rank's; the process waits
    for the next one.
    """
    while True:
        while not conn.poll(_POLL):
            if os.getppid() != parent:
                return None
        payload = conn.recv_bytes()
        try:
            job = ForkingPickler.loads(payload)
        except Exception as exc:
            conn.send(
                _Outcome(
                    "error", f"the test could not be received: {format_user_traceback(exc)}", time.time()
                )
            )
            conn.send(_Cleaned(None))
            continue
        return job if isinstance(job, _Job) else None


def _run_job(job: _Job, rank: int, conn: Any, baseline: _Baseline) -> str | None:
    """Run one test as this rank; returns None when the process is back as it was, else why it is not."""
    from meshsim._process.leaks import LeakCheck

    pipe = _OneOutcome(conn)
    baseline.enter(job)
    leaks = LeakCheck()
    try:
        store = _test_store(job)
        _run_rank(
            job.target, job.funcargs, rank, job.world_size, store, job.timeout, job.record, pipe, job.cuda
        )
    except BaseException as exc:  # before the body (store, rendezvous) or after it (destroying the group)
        pipe.send(_Outcome("error", format_user_traceback(exc), time.time()))
        return f"its set-up or teardown failed ({type(exc).__name__}: {exc})"
    finally:
        _undo_monkeypatches(job.funcargs)
        _flush()
    return baseline.restore(leaks, job.spare_threads)


_CLIENTS: dict[int, Any] = {}  # this process's client of the session's store, by port


def _test_store(job: _Job) -> Any:
    """The test's view of the session's store: this process's one client, the test's key prefix."""
    from torch._C._distributed_c10d import PrefixStore

    client = _CLIENTS.get(job.port)
    if client is None:
        client = _CLIENTS[job.port] = client_store(job.port, job.world_size, job.timeout)
    client.set_timeout(datetime.timedelta(seconds=job.timeout))
    return PrefixStore(job.prefix, client)


def _undo_monkeypatches(funcargs: dict[str, Any]) -> None:
    """The ``monkeypatch`` fixture a rank got pickled: what the body patched with it is undone here."""
    pytest = sys.modules.get("pytest")
    if pytest is None:
        return
    for value in funcargs.values():
        if isinstance(value, pytest.MonkeyPatch):
            value.undo()


def _flush() -> None:
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass


@dataclass
class _Baseline:
    """What a test may change in its rank process that a fresh one would not have; restored after a test."""

    environ: dict[str, str]
    cwd: str
    hooks: tuple[Any, Any]
    rng: Any
    settings: dict[str, Any]
    threads: set[int]
    native_threads: int | None  # the threads it had after its first test

    @classmethod
    def take(cls) -> _Baseline:
        import torch

        from meshsim._process.loopback import loopback_environment

        # every gloo (or NCCL) group this process makes listens on loopback, as a fresh rank's
        os.environ.update(loopback_environment(nccl=True))
        hooks = (sys.excepthook, threading.excepthook)
        rng = torch.get_rng_state()
        return cls(dict(os.environ), os.getcwd(), hooks, rng, _settings(), _thread_ids(), None)

    def enter(self, job: _Job) -> None:
        """The test's start: the parent's environment, directory and path, as a fresh process has them."""
        from meshsim._process.loopback import loopback_environment

        _set_environ({**job.environ, **loopback_environment(nccl=True)})
        os.chdir(job.cwd)
        sys.path[:] = job.path

    def restore(self, leaks: Any, spare_threads: int) -> str | None:
        """Put the process back; None if it is as it was, else what the test left that cannot be undone."""
        import torch
        import torch.distributed as dist

        _set_environ(self.environ)
        os.chdir(self.cwd)
        # init_process_group wraps sys.excepthook on every call and never unwraps it (torch 2.11-2.15)
        sys.excepthook, threading.excepthook = self.hooks
        torch.set_rng_state(self.rng)
        if torch.cuda.is_initialized():  # type: ignore[no-untyped-call]
            torch.cuda.manual_seed_all(torch.initial_seed())  # a fresh process's CUDA generators
        for name, value in self.settings.items():
            get, put = _setting_table()[name]
            if get() != value:
                put(value)
        if dist.is_available() and dist.is_initialized():
            return "it still had a process group initialized after the test"
        # A destroyed group's threads (gloo's, NCCL's) end when the group object is freed, and
        # DeviceMesh and DTensor objects hold groups in reference cycles: without a collection
        # here a kept process gathered thousands of threads over tests/shardtensor. What survives
        # is frozen, so the next collection looks at the next test's objects only (a full one
        # took 1-2 s per test on a loaded machine); cyclic garbage that forms among frozen
        # objects later is not freed, which a process that lives for a session can afford.
        gc.collect()
        gc.freeze()
        # Groups a test keeps alive where the collector cannot see them (an autograd hook that
        # holds a gradient: a cycle through C++) keep their native threads (3 per gloo group);
        # tests/shardtensor left about 2000 in each process. Past a bound the process goes.
        # Counted from the end of the process's first test, which starts torch's own pools.
        now = _native_threads()
        if self.native_threads is None:
            self.native_threads = now
        elif now is not None and now > self.native_threads + spare_threads:
            return (
                f"it held {now - self.native_threads} threads more than it started with (process groups "
                "kept alive past their test)"
            )
        left = [t.name for t in threading.enumerate() if t.ident not in self.threads and t.is_alive()]
        if left:
            return f"the test left thread(s) running in it: {', '.join(sorted(left))}"
        changed = [f"{m}.{name}" for m, name, _, _ in leaks.changed_globals() if (m, name) not in _TORCH_OWN]
        if changed:
            return f"the test left torch.distributed global(s) changed: {', '.join(changed)}"
        return None


# torch.distributed globals torch itself changes in every process, which need no undoing (torch 2.11-2.15):
# init_process_group sets the first two and nothing resets them (the next init sets them anew);
# DeviceMesh registers its opaque types once per process.
_TORCH_OWN = frozenset(
    {
        ("torch.distributed.distributed_c10d", "_backend"),
        ("torch.distributed.distributed_c10d", "_default_pg_init_method"),
        ("torch.distributed.device_mesh", "_distributed_opaque_types_registered"),
    }
)


def _set_environ(values: dict[str, str]) -> None:
    for name in [name for name in os.environ if name not in values]:
        del os.environ[name]
    for name, value in values.items():
        if os.environ.get(name) != value:
            os.environ[name] = value


def _native_threads() -> int | None:
    """How many threads this process has, Python's and native ones (None where ``/proc`` does not say)."""
    try:
        return len(os.listdir("/proc/self/task"))
    except OSError:
        return None


def _thread_ids() -> set[int]:
    return {t.ident for t in threading.enumerate() if t.ident is not None}


def _torch_setting(get: str, put: str) -> tuple[Callable[[], Any], Callable[[Any], None]]:
    import torch

    return getattr(torch, get), getattr(torch, put)


def _deterministic() -> tuple[bool, bool]:
    import torch

    return torch.are_deterministic_algorithms_enabled(), torch.is_deterministic_algorithms_warn_only_enabled()


def _set_deterministic(value: tuple[bool, bool]) -> None:
    import torch

    torch.use_deterministic_algorithms(value[0], warn_only=value[1])


def _default_device() -> Any:
    import torch

    return torch.get_default_device()  # torch 2.3+


def _set_default_device(value: Any) -> None:
    import torch

    torch.set_default_device(None if value == torch.device("cpu") else value)


@functools.cache
def _setting_table() -> dict[str, tuple[Callable[[], Any], Callable[[Any], None]]]:
    return {
        "default dtype": _torch_setting("get_default_dtype", "set_default_dtype"),
        "grad mode": _torch_setting("is_grad_enabled", "set_grad_enabled"),
        "intra-op threads": _torch_setting("get_num_threads", "set_num_threads"),
        "deterministic algorithms": (_deterministic, _set_deterministic),
        "default device": (_default_device, _set_default_device),
    }


def _settings() -> dict[str, Any]:
    return {name: get() for name, (get, _) in _setting_table().items()}
