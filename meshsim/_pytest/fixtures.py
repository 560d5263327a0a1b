"""Per-rank fixtures: meshsim's own (``rank``, ``distributed_mesh``, ``ledger``...) and the user's.

The fixtures ``rank``, ``world_size``, ``distributed_mesh``, ``distributed_mesh_2d``,
``make_mesh``, ``ledger`` and ``ledger_snapshot`` are placeholders each rank
resolves (:mod:`meshsim._modes.fixtures`). A user fixture (from conftest files, test modules,
or ``-p`` plugins that are not installed packages) that a distributed test
needs (in its signature, autouse, or through ``usefixtures``) runs on every rank
when a torchrun process would set it up for itself: wider than function scope, or
depending on a per-rank value. :mod:`meshsim._pytest.ranks` runs the body with them.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable, Generator
from typing import TYPE_CHECKING, Any

import pytest

from meshsim._pytest.monkeypatch import rank_monkeypatch
from meshsim._pytest.options import spec_of
from meshsim._pytest.state import PluginState, state_of

if TYPE_CHECKING:
    from meshsim._pytest.simjob import SimulatedJob

__all__ = ["refuse_per_rank_values", "with_fixtures_for_ranks"]


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

    A fixture from the user's own code (conftest files, their plugins, ``-p`` plugins
    that are not installed packages, test modules) that a distributed test requests
    runs on every rank, each building its own value, when it is wider than function
    scope (what a torchrun process sets up once: managers, meshes, groups) or depends
    on a per-rank value (``rank``, ``distributed_mesh``, another such fixture). pytest
    keeps a placeholder that each rank resolves; its scope ends on the ranks too. Other
    fixtures run once, here.

    On the static suite's simulated job the ranks build it right away, where pytest
    sets it up: a skip or failure there (an autouse ``skip_on_cpu(device)`` whose
    ``device`` is per rank) ends the test's set-up before the fixtures pytest would
    set up after it, as in each torchrun process. A world-marked test's world starts
    with its body: its ranks build such fixtures then, in pytest's order.
    """
    state = state_of(request.config)
    placeholder = _on_ranks(state, fixturedef, request)
    if placeholder is None:
        return (yield)
    job = _job_of(state)
    original = fixturedef.func

    def set_up(**_: object) -> Any:
        if job is not None:
            _build_on_job(job, placeholder)
        return placeholder

    # pytest calls fixturedef.func, and caches what it returns, or raises, for the fixture's
    # scope (FixtureDef.func is an attribute in pytest 8 and 9, typed Final)
    fixturedef.func = set_up  # type: ignore[misc]
    try:
        return (yield)
    finally:
        fixturedef.func = original  # type: ignore[misc]


def _job_of(state: PluginState) -> SimulatedJob | None:
    """The simulated static job the current test runs on (None: a world of its own, or torchrun)."""
    item = state.item
    if state.job is None or item is None or item.get_closest_marker("world") is not None:
        return None
    return state.job


def _build_on_job(job: SimulatedJob, placeholder: Any) -> None:
    """Build ``placeholder`` on every rank of the job; a rank's skip, xfail or failure is raised here."""
    from meshsim._base.errors import RankError
    from meshsim._engine.outcomes import decided

    try:
        job.build_fixture(placeholder)
    except RankError as error:
        raise decided(error) from None


def _on_ranks(state: PluginState, fixturedef: pytest.FixtureDef[Any], request: pytest.FixtureRequest) -> Any:
    """The placeholder for a fixture that runs on the ranks, or None for one that runs here."""
    from meshsim._modes.fixtures import PerRank, recipe
    from meshsim._pytest.simjob import is_user_code, plugin_files

    item = state.item
    if item is None or state.static is not None:
        return None
    spec = spec_of(item)
    if spec is None or (spec.backend or state.backend) == "spawn":
        return None  # spawned ranks get pickled arguments: fixtures run here
    xunit = _is_xunit(fixturedef)
    if not xunit and not is_user_code(
        _source_file(fixturedef.func), request.config.rootpath, plugin_files(request.config)
    ):
        return None
    values = {name: request.getfixturevalue(name) for name in fixturedef.argnames}
    if (
        fixturedef.scope == "function"
        and not xunit
        and not any(isinstance(v, PerRank) for v in values.values())
    ):
        return None
    func = fixturedef.func
    instance = getattr(request, "instance", None)
    if instance is not None and not xunit and inspect.isfunction(func) and "." in func.__qualname__:
        func = func.__get__(instance)  # a fixture defined in a test class
    if "monkeypatch" in values:  # what a torchrun process patches is its own
        values["monkeypatch"] = rank_monkeypatch(item)
    key = object()  # this instance of the fixture (a parametrized one has several)
    job = _job_of(state)
    if job is not None:
        world = job.world()
        request.addfinalizer(lambda: job.finish_fixture(key, world))
    return recipe(fixturedef.argname, func, values, fixturedef.scope, key)


def _is_xunit(fixturedef: pytest.FixtureDef[Any]) -> bool:
    """Whether this is pytest's fixture for a test module's or class's ``setup_*`` / ``teardown_*``.

    They run the user's own set-up, for its effects only (``dist.init_process_group``, a
    parallel state's groups), which each torchrun process has for itself: on every rank,
    whatever their scope. pytest names them ``_xunit_setup_<kind>_fixture_<module or class>``
    (pytest 8 and 9) and defines them in its own module, so the source file does not tell.
    """
    return fixturedef.argname.startswith("_xunit_setup_")


def _source_file(func: Any) -> str | None:
    try:
        return inspect.getsourcefile(func)
    except TypeError:
        return None


def with_fixtures_for_ranks(
    test: Callable[..., object], every: dict[str, Any], funcargs: dict[str, Any]
) -> tuple[Callable[..., object], dict[str, Any]]:
    """Also build, on each rank, the per-rank fixtures the body does not take (autouse, usefixtures).

    They go in pytest's set-up order; the body gets its own arguments only.
    """
    from meshsim._modes.fixtures import PerRank

    extra = [name for name, value in every.items() if name not in funcargs and isinstance(value, PerRank)]
    if not extra:
        return test, funcargs

    @functools.wraps(test)
    def body(**kwargs: Any) -> object:
        for name in extra:
            del kwargs[name]
        return test(**kwargs)

    return body, {
        name: funcargs.get(name, value) for name, value in every.items() if name in funcargs or name in extra
    }


def refuse_per_rank_values(item: pytest.Function) -> None:
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
