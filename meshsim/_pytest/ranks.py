"""Distributed tests: a world-marked test's body runs on its ranks, with its per-rank fixtures.

A test marked ``world`` (or ``multigpu_static``) runs its body once per rank: on
thread ranks (sim, gloo), in one process per rank (spawn), on the session's
simulated job (``--multigpu-static``), or as this process's rank under torchrun.
Its fixtures that live on ranks (:mod:`meshsim._pytest.fixtures`) are built there
first. A passed body's ledgers go to the checks features add to the run's state
(snapshots, cost). A failed rank's traceback, or the per-rank table of a mismatch,
is the test's report.
"""

from __future__ import annotations

import inspect
import sys
from collections.abc import Callable, Generator
from typing import Any

import pytest

from meshsim._engine.outcomes import decided
from meshsim._pytest.fixtures import refuse_per_rank_values, with_fixtures_for_ranks
from meshsim._pytest.monkeypatch import rank_monkeypatch, release_rank_monkeypatches
from meshsim._pytest.options import WorldSpec, size_of, spec_of
from meshsim._pytest.state import PluginState, state_of

__all__: list[str] = []


@pytest.hookimpl(tryfirst=True)
def pytest_pyfunc_call(pyfuncitem: pytest.Function) -> bool | None:
    spec = spec_of(pyfuncitem)
    if spec is None:
        refuse_per_rank_values(pyfuncitem)
        return None
    state = state_of(pyfuncitem.config)
    test = pyfuncitem.obj
    names = inspect.signature(test).parameters
    funcargs = {name: pyfuncitem.funcargs[name] for name in names if name in pyfuncitem.funcargs}
    if (spec.backend or state.backend) != "spawn":  # spawned ranks get only the body's arguments
        if "monkeypatch" in funcargs and state.static is None:
            funcargs["monkeypatch"] = rank_monkeypatch(pyfuncitem)  # what a rank patches is its own
        test, funcargs = with_fixtures_for_ranks(test, pyfuncitem.funcargs, funcargs)
    if state.static is not None:
        # every process gets every rank's ledger; rank 0 alone writes the snapshot file
        check = _ledger_checks(pyfuncitem, write=state.static.rank == 0)
        try:
            state.static.run(test, funcargs, check=check)
        except BaseException as error:
            _out_of_step(pyfuncitem, error)
            raise
        return True
    check = _ledger_checks(pyfuncitem, write=True)
    try:
        ledgers = _run_ranks(pyfuncitem, state, spec, test, funcargs, record=check is not None)
    finally:
        release_rank_monkeypatches(pyfuncitem)
    if check is not None:
        check([ledger for ledger in ledgers if ledger is not None])
    return True


def _out_of_step(item: pytest.Function, error: BaseException) -> None:
    """Under torchrun, after a failure that left the ranks' collectives out of step: stop the session.

    A collective one rank entered and another never will stays in the job's process
    group; the next test's calls would meet the wrong ones. When rank 0 (the one that
    prints) never reported, this rank prints the report itself.
    """
    static = state_of(item.config).static
    if static is None or not static.out_of_step:
        return
    item.session.shouldstop = (
        f"meshsim: {item.nodeid} left the ranks' collectives out of step (see its report); "
        "the job's process group cannot run more tests"
    )
    if static.rank != 0 and static.printer_silent and item.config.getoption("mesh_report") == "rank0":
        sys.stderr.write(
            f"meshsim: rank {static.rank}, as rank 0 did not report: {item.nodeid} failed\n{error}\n"
        )
        for note in getattr(error, "__notes__", []):
            sys.stderr.write(f"{note}\n")
        sys.stderr.flush()


def _ledger_checks(item: pytest.Function, *, write: bool) -> Callable[[list[Any]], None] | None:
    """What every rank's ledger of a passed body goes to: the features' checks, in their order.

    Each one runs whatever the one before raised (a changed snapshot is still priced);
    the first failure is the test's, with the others' messages as its notes.
    """
    wanted = (check_for(item, write) for _, check_for in state_of(item.config).ledger_checks)
    checks = [check for check in wanted if check is not None]
    if not checks:
        return None

    def check(ledgers: list[Any]) -> None:
        failures: list[BaseException] = []
        for each in checks:
            try:
                each(ledgers)
            except Exception as error:  # the first is raised below, the rest noted on it
                failures.append(error)
        if failures:
            for later in failures[1:]:
                failures[0].add_note(str(later))
            raise failures[0]

    return check


def _run_ranks(
    item: pytest.Function,
    state: PluginState,
    spec: WorldSpec,
    test: Any,
    funcargs: dict[str, Any],
    *,
    record: bool,
) -> list[Any]:
    """Run the body on the test's ranks in this pytest process's way; returns each rank's ledger (or None)."""
    from meshsim._base.errors import RankError

    if state.job is not None and item.get_closest_marker("world") is None:
        try:
            return state.job.run_test(test, funcargs, record=record)
        except RankError as error:
            raise decided(error) from None
    backend = spec.backend or state.backend
    size = size_of(item, spec)
    if backend == "spawn":
        from meshsim._modes.spawn import TestTarget
        from meshsim._pytest.spawn import run_spawned

        target = TestTarget(item.module.__name__, str(item.path), test.__qualname__)
        cuda = state.cuda.sized(size) if state.cuda is not None else None
        return run_spawned(
            item.config, target, funcargs, size, timeout=state.timeout, record=record, cuda=cuda
        )
    from meshsim._modes.thread_ranks import run_on_threads

    try:
        return run_on_threads(
            test,
            funcargs,
            size,
            backend=backend,
            timeout=state.timeout,
            num_threads=state.num_threads,
            record=record,
            cuda=state.cuda,
        )
    except RankError as error:
        raise decided(error) from None


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(
    item: pytest.Item, call: pytest.CallInfo[None]
) -> Generator[None, pytest.TestReport, pytest.TestReport]:
    """A meshsim error's report: the failing rank's own traceback, or the per-rank table.

    In the body, or in a fixture the static suite's ranks set up (:mod:`meshsim._pytest.fixtures`).
    """
    report = yield
    if call.excinfo is not None and call.when in ("setup", "call"):
        text = _mesh_failure(call.excinfo.value)
        if text is not None:
            report.longrepr = text
    return report


def _mesh_failure(error: BaseException) -> str | None:
    from meshsim._base.errors import MeshError, RankError
    from meshsim._observe.snapshot import SnapshotMismatchError

    notes = "".join(f"\n{note}" for note in getattr(error, "__notes__", []))
    if isinstance(error, (RankError, SnapshotMismatchError)):
        return f"{error}{notes}"
    if isinstance(error, MeshError):
        return f"{type(error).__name__}: {error}{notes}"
    return None
