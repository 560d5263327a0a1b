"""Distributed tests: a world-marked test's body and its per-rank fixtures run on its ranks.

A test marked ``world`` (or ``multigpu_static``) runs its body once per rank: on
thread ranks (sim, gloo), in one process per rank (spawn), on the session's
simulated job (``--multigpu-static``), or as this process's rank under torchrun.
The fixtures ``rank``, ``world_size``, ``distributed_mesh``, ``distributed_mesh_2d``,
``make_mesh``, ``ledger`` and ``ledger_snapshot`` are placeholders each rank
resolves (:mod:`meshsim._modes.fixtures`); user fixtures the ranks need are set up
on the ranks themselves. A failed rank's traceback, or the per-rank table of a
mismatch, is the test's report.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Generator
from typing import Any

import pytest

from meshsim._engine.outcomes import decided
from meshsim._pytest.options import WorldSpec, size_of, spec_of
from meshsim._pytest.state import PluginState, state_of

__all__: list[str] = []


@pytest.hookimpl(wrapper=True)
def pytest_runtest_protocol(
    item: pytest.Item, nextitem: pytest.Item | None
) -> Generator[None, object, object]:
    """Note the distributed test being set up and run, for the fixtures it needs on its ranks."""
    state = state_of(item.config)
    state.item = item if spec_of(item) is not None else None
    try:
        return (yield)
    finally:
        state.item = None


@pytest.hookimpl(wrapper=True)
def pytest_fixture_setup(
    fixturedef: pytest.FixtureDef[Any], request: pytest.FixtureRequest
) -> Generator[None, object, object]:
    """Set up the user fixtures a distributed test's ranks need on the ranks themselves.

    A fixture from the user's own code (conftest files, their plugins, test
    modules) that a distributed test requests runs on every rank, each building its
    own value, when it is wider than function scope (what a torchrun process sets up
    once: managers, meshes, groups) or depends on a per-rank value (``rank``,
    ``distributed_mesh``, another such fixture). pytest keeps a placeholder that each
    rank resolves; its scope ends on the ranks too. Other fixtures run once, here.
    """
    placeholder = _on_ranks(state_of(request.config), fixturedef, request)
    if placeholder is None:
        return (yield)
    original = fixturedef.func
    # pytest calls fixturedef.func and caches what it returns for the fixture's scope
    # (FixtureDef.func is an attribute in pytest 8 and 9, typed Final)
    fixturedef.func = lambda **_: placeholder  # type: ignore[misc]
    try:
        return (yield)
    finally:
        fixturedef.func = original  # type: ignore[misc]


def _on_ranks(state: PluginState, fixturedef: pytest.FixtureDef[Any], request: pytest.FixtureRequest) -> Any:
    """The placeholder for a fixture that runs on the ranks, or None for one that runs here."""
    from meshsim._modes.fixtures import PerRank, recipe
    from meshsim._pytest.simjob import is_user_code

    item = state.item
    if item is None or state.static is not None:
        return None
    spec = spec_of(item)
    if spec is None or (spec.backend or state.backend) == "spawn":
        return None  # spawned ranks get pickled arguments: fixtures run here
    if not is_user_code(_source_file(fixturedef.func), request.config.rootpath):
        return None
    values = {name: request.getfixturevalue(name) for name in fixturedef.argnames}
    if fixturedef.scope == "function" and not any(isinstance(v, PerRank) for v in values.values()):
        return None
    func = fixturedef.func
    instance = getattr(request, "instance", None)
    if instance is not None and inspect.isfunction(func) and "." in func.__qualname__:
        func = func.__get__(instance)  # a fixture defined in a test class
    key = object()  # this instance of the fixture (a parametrized one has several)
    job, world = state.job, state.job.world() if state.job is not None else 0
    if job is not None and item.get_closest_marker("world") is None:
        request.addfinalizer(lambda: job.finish_fixture(key, world))
    return recipe(fixturedef.argname, func, values, fixturedef.scope, key)


def _source_file(func: Any) -> str | None:
    try:
        return inspect.getsourcefile(func)
    except TypeError:
        return None


@pytest.hookimpl(tryfirst=True)
def pytest_pyfunc_call(pyfuncitem: pytest.Function) -> bool | None:
    spec = spec_of(pyfuncitem)
    if spec is None:
        _refuse_per_rank_values(pyfuncitem)
        return None
    state = state_of(pyfuncitem.config)
    test = pyfuncitem.obj
    names = inspect.signature(test).parameters
    funcargs = {name: pyfuncitem.funcargs[name] for name in names if name in pyfuncitem.funcargs}
    if state.static is not None:
        # every process gets every rank's ledger; rank 0 alone writes the snapshot file
        check = _ledger_checks(pyfuncitem, write=state.static.rank == 0)
        state.static.run(test, funcargs, check=check)
        return True
    check = _ledger_checks(pyfuncitem, write=True)
    ledgers = _run_ranks(pyfuncitem, state, spec, test, funcargs, record=check is not None)
    if check is not None:
        check([ledger for ledger in ledgers if ledger is not None])
    return True


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
        from meshsim._modes.spawn import TestTarget, run_in_processes

        target = TestTarget(item.module.__name__, str(item.path), test.__qualname__)
        return run_in_processes(target, funcargs, size, timeout=state.timeout, record=record)
    from meshsim._modes.thread_ranks import run_on_threads

    try:
        return run_on_threads(test, funcargs, size, backend=backend, timeout=state.timeout, record=record)
    except RankError as error:
        raise decided(error) from None


def _refuse_per_rank_values(item: pytest.Function) -> None:
    """A test that runs once cannot take a fixture whose value lives on ranks (set up for an earlier test)."""
    from meshsim._modes.fixtures import PerRank

    names = [name for name, value in item.funcargs.items() if isinstance(value, PerRank)]
    if names:
        pytest.fail(
            f"fixture{'s' if len(names) > 1 else ''} {', '.join(map(repr, names))} run on the ranks of "
            "distributed tests (set up by an earlier one, in a wider scope); this test runs once, "
            "outside any rank. Mark it @pytest.mark.world(n) or @pytest.mark.multigpu_static, or give "
            "the fixture function scope.",
            pytrace=False,
        )


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(
    item: pytest.Item, call: pytest.CallInfo[None]
) -> Generator[None, pytest.TestReport, pytest.TestReport]:
    """A meshsim error's report: the failing rank's own traceback, or the per-rank table."""
    report = yield
    if call.excinfo is not None and call.when == "call":
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


def _placeholder(request: pytest.FixtureRequest, name: str) -> Any:
    from meshsim._modes.fixtures import PLACEHOLDERS

    state = state_of(request.config)
    if spec_of(request.node) is None and state.static is None:
        pytest.fail(
            f"fixture {name!r} is per rank; mark the test with @pytest.mark.world(n) "
            "(or @pytest.mark.multigpu_static) to run it on n ranks",
            pytrace=False,
        )
    return PLACEHOLDERS[name]


@pytest.fixture
def rank(request: pytest.FixtureRequest) -> Any:
    """This rank's global rank (``dist.get_rank()``), inside a world-marked test."""
    return _placeholder(request, "rank")


@pytest.fixture
def world_size(request: pytest.FixtureRequest) -> Any:
    """The number of ranks (``dist.get_world_size()``), inside a world-marked test."""
    return _placeholder(request, "world_size")


@pytest.fixture
def distributed_mesh(request: pytest.FixtureRequest) -> Any:
    """A 1-D DeviceMesh over every rank, dim name ``"domain"`` (PhysicsNeMo's fixture).

    ``cpu`` on simulated and gloo ranks, ``cuda`` under NCCL; built once per world
    (once per session under ``--multigpu-static``).
    """
    return _placeholder(request, "distributed_mesh")


@pytest.fixture
def distributed_mesh_2d(request: pytest.FixtureRequest) -> Any:
    """A ``(2, world_size // 2)`` DeviceMesh, dim names ``("axis1", "axis2")`` (PhysicsNeMo's fixture).

    Needs an even world size: 2 ranks give (2, 1), 4 give (2, 2), 8 give (2, 4).
    """
    return _placeholder(request, "distributed_mesh_2d")


@pytest.fixture
def make_mesh(request: pytest.FixtureRequest) -> Any:
    """``make_mesh(shape, names=None)`` builds (and caches) a DeviceMesh over every rank.

    Example: ``mesh = make_mesh((2, 4), ("dp", "tp"))`` in an 8-rank test.
    """
    return _placeholder(request, "make_mesh")


@pytest.fixture
def ledger(request: pytest.FixtureRequest) -> Any:
    """This rank's :class:`meshsim.Ledger` of the collectives the test body issues.

    It fills while the body runs, so assert on it at the end of the body::

        assert ledger.counts() == {"all_gather": 1}

    The same records on every backend: sim, gloo, spawn and ``--multigpu-static``.
    """
    return _placeholder(request, "ledger")


@pytest.fixture
def ledger_snapshot(request: pytest.FixtureRequest) -> Any:
    """Pin the test's per-rank ledgers to a snapshot file beside its module; fail when they change.

    The whole body's collectives are recorded on every rank (as ``ledger`` records
    them; the value is that same :class:`meshsim.Ledger`) and, once the body has passed
    on every rank, compared with the entry for this test id in
    ``__snapshots__/<module>.ledger.json``: one line per call (op, api, group, dtype,
    bytes in and out, reduce op, peer; no call sites). The first run writes the
    entry; a later run whose collectives differ fails with a diff per rank;
    ``--mesh-snapshot-update`` rewrites it. Every backend and ``--multigpu-static``
    share the file. ``@pytest.mark.usefixtures("ledger_snapshot")`` works too.
    """
    return _placeholder(request, "ledger_snapshot")
