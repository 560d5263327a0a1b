"""The spawn mode: each rank of a test is a process of its own (gloo on CPU, NCCL with enough GPUs).

This module runs a test on fresh processes (``--mesh-spawn=fresh``) and holds what
a rank process does for one test (:func:`_run_rank`); :mod:`meshsim._modes.spawn_pool`
keeps rank processes for the session and runs each test's ranks on them the same way.

The parent (the pytest process) owns the rendezvous: it starts a TCPStore server
on a socket it binds to 127.0.0.1 port 0, so the OS picks a free port and
concurrent pytest-xdist workers never race for one. Children
point gloo and NCCL at the loopback interface (:mod:`meshsim._process.loopback`), connect
as clients, run the test body as their rank, and send the outcome back on a
pipe. A child that raises, dies or outlives the timeout fails the test with its
rank; the others are then stopped. Children die with their parent
(``PR_SET_PDEATHSIG`` on Linux) and are always reaped: no zombies.
"""

from __future__ import annotations

import datetime
import importlib
import importlib.util
import multiprocessing
import multiprocessing.connection
import os
import sys
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, NamedTuple

from meshsim._base.errors import RankError, format_user_traceback
from meshsim._modes.launch import die_with_parent

if TYPE_CHECKING:
    from meshsim._process.cuda import Spec
    from meshsim._record.ledger import Ledger
    from meshsim._record.standing import Standing, Verdict

__all__ = ["TestTarget", "run_in_processes"]

# seconds the other ranks get to report once one rank has failed: those in a collective with it
# see its closed connection at once, unless they are still starting (a loaded machine)
_GRACE = 15.0
# seconds past the timeout a rank gets to report: its groups' collectives end by the timeout
# counted from their start, after the process's own (importing torch: 15 s seen on a loaded
# 2-core machine)
_REPORT_GRACE = 30.0


class _Outcome(NamedTuple):
    """How a rank ended, as its child reports it: kind is "ok", "error", "skipped", "xfailed",
    or (seen by the parent) "died" or "timeout"; ``ledger`` is the body's, on "ok" when recorded."""

    kind: str
    text: str
    when: float
    ledger: Ledger | None = None
    standing: Standing | None = None  # where the rank stood when it ended (issue 39's report)


@dataclass(frozen=True)
class TestTarget:
    """How a child process finds the test function: by module, or by file path."""

    module: str
    path: str
    qualname: str

    def load(self) -> Any:
        try:
            module = importlib.import_module(self.module)
        except ImportError:
            spec = importlib.util.spec_from_file_location(self.module, self.path)
            if spec is None or spec.loader is None:
                raise
            module = importlib.util.module_from_spec(spec)
            sys.modules[self.module] = module
            spec.loader.exec_module(module)
        owner: Any = module
        parts = self.qualname.split(".")
        for i, part in enumerate(parts[:-1]):
            owner = getattr(owner, part)
            if isinstance(owner, type) and i == len(parts) - 2:
                owner = owner()  # a test method: pytest would make a fresh instance too
        return getattr(owner, parts[-1])


def run_in_processes(
    target: TestTarget,
    funcargs: dict[str, Any],
    world_size: int,
    *,
    timeout: float,
    record: bool = False,
    cuda: Spec | None = None,
) -> list[Ledger | None]:
    """Run the test on ``world_size`` fresh processes; raise :class:`RankError` if a rank fails.

    ``cuda``: the CUDA emulation each rank's process installs (``--mesh-cuda``, sized for
    the world), handed to it as an argument; None: off.

    Returns:
        each rank's ledger of the body, rank 0's first, sent back by its process:
        recorded when ``record`` is true or the test asked for its ``ledger``, else None.
    """
    from meshsim._process.loopback import loopback_store

    store = loopback_store(world_size + 1, timeout=timeout)
    context = multiprocessing.get_context("spawn")
    children, pipes = [], []
    for rank in range(world_size):
        parent_end, child_end = context.Pipe(duplex=False)
        child = context.Process(
            target=_child_main,
            args=(target, funcargs, rank, world_size, store.port, timeout, record, child_end, cuda),
            name=f"meshsim-spawn-rank-{rank}",
            daemon=True,
        )
        child.start()
        child_end.close()
        children.append(child)
        pipes.append(parent_end)
    try:
        outcomes = _collect(children, pipes, timeout)
    finally:
        _reap(children)
        del store
    _raise_first_failure(outcomes, world_size)
    return [outcomes[rank].ledger for rank in range(world_size)]


def _collect(children: list[Any], pipes: list[Any], timeout: float) -> dict[int, _Outcome]:
    """Each rank's outcome."""
    outcomes: dict[int, _Outcome] = {}
    deadline = time.monotonic() + timeout + _REPORT_GRACE
    waiting = dict(enumerate(pipes))
    while waiting and time.monotonic() < deadline:
        ready = multiprocessing.connection.wait(list(waiting.values()), timeout=0.1)
        for rank, pipe in list(waiting.items()):
            if pipe in ready:
                outcomes[rank] = _receive(pipe, children[rank])
                del waiting[rank]
        if any(outcome.kind != "ok" for outcome in outcomes.values()):
            deadline = min(deadline, time.monotonic() + _GRACE)
    for rank in waiting:
        outcomes[rank] = _Outcome("timeout", f"rank {rank} did not finish within {timeout:g} s", time.time())
    return outcomes


def _receive(pipe: Any, child: Any) -> _Outcome:
    try:
        return pipe.recv()  # type: ignore[no-any-return]
    except (EOFError, OSError):
        child.join(1.0)
        return _Outcome(
            "died", f"the process exited with code {child.exitcode} before reporting", time.time()
        )


def _reap(children: list[Any]) -> None:
    for child in children:
        child.join(0.5)
    for child in children:
        if child.is_alive():
            child.kill()
        child.join(5.0)


def _raise_first_failure(outcomes: dict[int, _Outcome], world_size: int) -> None:
    """Raise for the rank that failed first: later failures are usually its consequences.

    A rank that skipped or xfailed first (``pytest.skip``, ``pytest.xfail``) decides
    the outcome: the ranks that fail after it are those it left waiting in a
    collective, whose group closed (see :mod:`meshsim._engine.outcomes`).
    """
    from meshsim._engine.outcomes import outcome_exception
    from meshsim._record.standing import verdict_error

    ended = sorted((outcome.when, rank) for rank, outcome in outcomes.items() if outcome.kind != "ok")
    if not ended:
        return
    rank = ended[0][1]
    kind, text = outcomes[rank].kind, outcomes[rank].text
    if kind in _SKIPS:
        raise outcome_exception(kind, text, rank)
    found = _verdict(outcomes, world_size)
    if found is not None and found.kind != "failed":
        raise verdict_error(found, "spawn")
    if found is not None:  # ranks wait for one that raised: it, not the first to end, is reported
        rank = found.culprits[0]
        kind, text = outcomes[rank].kind, outcomes[rank].text
    error = RankError(rank, world_size, text if kind == "error" else f"{kind}: {text}")
    if found is not None:
        error.add_note(found.message)
    later = [f"rank {r}: {outcomes[r][0]}" for _, r in ended if r != rank]
    if later:
        error.add_note("after it, " + "; ".join(later))
    raise error


_SKIPS = ("skipped", "xfailed")


def _verdict(outcomes: dict[int, _Outcome], world_size: int) -> Verdict | None:
    """Who the others waited for, from the standing each rank sent (silent: a rank that sent none)."""
    from meshsim._record.standing import FAILED, SILENT, Standing, verdict

    standings = []
    for rank in range(world_size):
        outcome = outcomes[rank]
        standing = outcome.standing
        if standing is None and outcome.kind == "error":  # failed outside the body (set-up)
            last = outcome.text.rstrip().splitlines()[-1:] or [""]
            standing = Standing(rank, FAILED, last[0])
        elif standing is None and outcome.kind in ("died", "timeout"):
            # its process exited or outlived the timeout: the rank's own failure, as a
            # rank that raises is on sim, not a deadlock of the others
            standing = Standing(rank, FAILED, outcome.text)
        elif standing is None:
            standing = Standing(rank, SILENT, "")
        standings.append(standing)
    return verdict(standings, world_size)


def _child_main(
    target: TestTarget,
    funcargs: dict[str, Any],
    rank: int,
    world_size: int,
    port: int,
    timeout: float,
    record: bool,
    pipe: Any,
    cuda: Spec | None = None,
) -> None:
    die_with_parent()
    try:
        store = client_store(port, world_size, timeout)
        _run_rank(target, funcargs, rank, world_size, store, timeout, record, pipe, cuda)
    except BaseException as exc:  # failed before or after the body: still report it
        _report(pipe, _Outcome("error", format_user_traceback(exc), time.time()))
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        # exit without running interpreter teardown: gloo/DTensor workers have been
        # seen to abort (SIGABRT) in static destructors after a clean run
        os._exit(0)


def _report(pipe: Any, outcome: _Outcome) -> None:
    try:
        pipe.send(outcome)
        pipe.close()
    except OSError:
        pass  # already reported


def client_store(port: int, world_size: int, timeout: float) -> Any:
    """A ``TCPStore`` client of the parent's server on ``port`` (127.0.0.1), ``timeout`` seconds per wait."""
    from torch._C._distributed_c10d import TCPStore

    from meshsim._process.loopback import LOOPBACK_HOST

    return TCPStore(LOOPBACK_HOST, port, world_size + 1, False, timeout=datetime.timedelta(seconds=timeout))


def _run_rank(
    target: TestTarget,
    funcargs: dict[str, Any],
    rank: int,
    world_size: int,
    store: Any,
    timeout: float,
    record: bool,
    pipe: Any,
    cuda: Spec | None,
) -> None:
    import torch
    import torch.distributed as dist

    from meshsim._modes.fixtures import RankFixtures, resolve
    from meshsim._process.loopback import loopback_environment
    from meshsim._record.recorder import DispatchRecorder
    from meshsim._record.standing import standing_of

    # Every gloo (or NCCL) group of this rank, the test's own included, listens on
    # loopback. Not undone: the process is this rank's alone (a kept one sets it once).
    os.environ.update(loopback_environment(nccl=True))
    delta = datetime.timedelta(seconds=timeout)
    if torch.cuda.is_available() and torch.cuda.device_count() >= world_size:
        torch.cuda.set_device(rank)
        dist.init_process_group("nccl", rank=rank, world_size=world_size, store=store, timeout=delta)
    else:
        dist.init_process_group("gloo", rank=rank, world_size=world_size, store=store, timeout=delta)
    emulating = _emulate_cuda(cuda)
    if emulating is not None:  # as on real GPUs above: the rank's own
        from meshsim._process.cuda import take_local_device

        take_local_device(rank)
    recorder: DispatchRecorder | None = None
    try:
        test = target.load()
        fixtures = RankFixtures()
        if record:
            fixtures.open_ledger()
        kwargs = resolve(funcargs, fixtures)
        recorder = DispatchRecorder()
        with recorder, fixtures.recording():
            test(**kwargs)
        standing = standing_of(rank, recorder, ended=True)
        _report(pipe, _Outcome("ok", "", time.time(), fixtures.ledger, standing))
    except BaseException as exc:
        # reported before the process group goes down: its closing sockets make the
        # other ranks fail too, and the parent must know who failed first
        _report(pipe, _ended(exc)._replace(standing=standing_of(rank, recorder, ended=True, error=exc)))
    finally:
        dist.destroy_process_group()
        if emulating is not None:
            _stop_emulating(emulating)


def _emulate_cuda(spec: Spec | None) -> Spec | None:
    """``--mesh-cuda`` in this rank's process: the pytest process's setting, sized for the world.

    Installed after the rank's own group is made, so that group is what the machine
    really has (gloo here). Undone when the test ends (:func:`_stop_emulating`): a kept
    rank process (:mod:`meshsim._modes.spawn_pool`) makes the next test's group on the
    machine as it is. Returns the spec installed (None: nothing).
    """
    if spec is None:
        return None
    from meshsim._process import cuda
    from meshsim._process.patches import install_cuda

    install_cuda(spec)
    cuda.enter_rank(spec)
    return spec


def _stop_emulating(spec: Spec) -> None:
    from meshsim._process import cuda
    from meshsim._process.patches import uninstall_cuda

    cuda.leave_rank()
    uninstall_cuda(spec)


def _ended(exc: BaseException) -> _Outcome:
    """A rank's outcome for the parent: a skip or xfail with its reason, or an error with its traceback."""
    from meshsim._engine.outcomes import FAILED, kind_of, reason_of

    kind = kind_of(exc)
    if kind == FAILED:
        return _Outcome("error", format_user_traceback(exc), time.time())
    return _Outcome(kind, reason_of(exc), time.time())
