"""pytest plugin: run one test body on N ranks, simulated or real.

Registered through the ``pytest11`` entry point, so any project that installs
meshsim has it. Markers:

- ``@pytest.mark.world(4)`` runs the body on 4 ranks; ``world(1, 2, 4)`` runs it
  once per size, with ids ``world=1``, ``world=2``, ``world=4``.
- ``@pytest.mark.multigpu_static`` (PhysicsNeMo's marker) runs it on
  ``--world-size`` ranks (default 4).

Ranks are threads on the in-memory backend by default (``--mesh-backend=sim``),
threads on real gloo (``gloo``), or processes (``spawn``); under ``torchrun ...
--multigpu-static`` each process is one rank of a real NCCL (or gloo) job.

The ``ledger_snapshot`` fixture pins a test's per-rank ledgers to
``__snapshots__/<module>.ledger.json`` beside its module (:mod:`meshsim._snapshot`);
``--mesh-snapshot-update`` rewrites them.

The plugin imports torch lazily: collecting a project that never uses it costs nothing.
"""

from __future__ import annotations

import inspect
import os
import re
import time
from collections import Counter
from collections.abc import Callable, Generator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest

if TYPE_CHECKING:
    from meshsim._modes import StaticSession
    from meshsim._simjob import SimulatedJob

BACKENDS = ("sim", "gloo", "spawn")
_WORLD_PARAM = "_meshsim_world"


@dataclass(frozen=True)
class WorldSpec:
    """What a test's markers ask for: world sizes and, optionally, a backend."""

    sizes: tuple[int, ...]
    backend: str | None


class _State:
    """Plugin state for one pytest run (kept in ``config.stash``)."""

    def __init__(self, backend: str, world_size: int, timeout: float) -> None:
        self.backend = backend
        self.world_size = world_size
        self.timeout = timeout
        self.static: StaticSession | None = None  # torchrun: this process is one rank
        self.job: SimulatedJob | None = None  # --multigpu-static simulated: the session's world
        self.suite: str | None = None  # "static" or "dynamic": the suite --multigpu-* selects
        self.owns_suite_options = False  # meshsim defined --multigpu-static/-dynamic (no conftest did)
        self.item: pytest.Item | None = None  # the distributed test being set up or run


_STATE = pytest.StashKey[_State]()
_SNAPSHOT = pytest.StashKey[str]()  # what a test's ledger snapshot check did: created, matched, updated
_WASTED = pytest.StashKey[
    list[tuple[str, str, str, int]]
]()  # a test's wasted calls: (api, site, reason, times)
_OWNS_SUITE_OPTIONS = pytest.StashKey[bool]()

# PhysicsNeMo's suite options: a conftest may define them itself (theirs does).
_SUITE_OPTIONS = (
    (
        "--multigpu-static",
        "multigpu_static",
        "the multi-GPU static suite: multigpu_static (and world) tests only. Under torchrun each "
        "process is one rank of one process group kept for the session; without torchrun the "
        "ranks are simulated (--world-size, --mesh-backend), set up as torchrun would",
    ),
    (
        "--multigpu-dynamic",
        "multigpu_dynamic",
        "the multi-GPU dynamic suite: multigpu_dynamic tests only (they start their own processes)",
    ),
)


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise pytest.UsageError(f"--world-size must be a positive integer, got {text!r}") from None
    if value < 1:
        raise pytest.UsageError(f"--world-size must be a positive integer, got {text!r}")
    return value


def _positive_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise pytest.UsageError(
            f"--mesh-timeout must be a positive number of seconds, got {text!r}"
        ) from None
    if not value > 0:
        raise pytest.UsageError(f"--mesh-timeout must be a positive number of seconds, got {text!r}")
    return value


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("meshsim", "meshsim: distributed tests on simulated or real ranks")
    group.addoption(
        "--mesh-backend",
        choices=BACKENDS,
        default="sim",
        help="how world-marked tests get their ranks: sim (in-memory thread ranks, the default), "
        "gloo (thread ranks on real gloo), spawn (one process per rank per test)",
    )
    group.addoption(
        "--world-size",
        type=_positive_int,
        default=4,
        help="ranks for @pytest.mark.multigpu_static tests when simulated (default 4)",
    )
    group.addoption(
        "--mesh-timeout",
        type=_positive_float,
        default=60.0,
        help="seconds a world may make no progress before it is reported (default 60)",
    )
    group.addoption(
        "--mesh-report",
        choices=("rank0", "all"),
        default="rank0",
        help="under --multigpu-static, which ranks print reports (default rank0)",
    )
    group.addoption(
        "--mesh-redundant",
        choices=("off", "report", "error"),
        default="report",
        help="wasted collectives (calls that told no rank anything new, found on the sim backend): "
        "report lists them at the end of the session (the default), error fails their tests "
        "(@pytest.mark.allow_redundant allows known ones), off does not look",
    )
    group.addoption(
        "--mesh-trace",
        metavar="DIR",
        default=None,
        help="write each test's simulated worlds as timelines (Chrome trace-event JSON for Perfetto "
        "or chrome://tracing) to DIR/<test id>.json, created if missing; sim backend only",
    )
    group.addoption(
        "--mesh-snapshot-update",
        action="store_true",
        default=False,
        help="rewrite the ledger snapshots of tests that use the ledger_snapshot fixture "
        "(__snapshots__/<module>.ledger.json beside each test module) instead of comparing",
    )


@pytest.hookimpl(wrapper=True)
def pytest_load_initial_conftests(
    early_config: pytest.Config, parser: pytest.Parser, args: list[str]
) -> Generator[None, None, None]:
    """Define --multigpu-static / --multigpu-dynamic once the conftests have, unless one did."""
    result = yield
    owned = False
    for flag, dest, text in _SUITE_OPTIONS:
        if not _defined(parser, flag, dest):
            parser.getgroup("meshsim").addoption(flag, action="store_true", default=False, help=text)
            owned = True
    early_config.stash[_OWNS_SUITE_OPTIONS] = owned
    return result


def _defined(parser: pytest.Parser, flag: str, dest: str) -> bool:
    """Whether some plugin or conftest already defines ``flag``."""
    try:
        namespace = parser.parse_known_args([flag])
    except pytest.UsageError:
        return True  # defined, with an argument
    return getattr(namespace, dest, None) is not None


@pytest.hookimpl(tryfirst=True)
def pytest_cmdline_main(config: pytest.Config) -> int | None:
    """--multigpu-static --mesh-backend=spawn, no torchrun: start a pytest per rank, as torchrun would."""
    from meshsim._modes import static_environment

    if (
        not config.getoption("multigpu_static", default=False)
        or config.getoption("mesh_backend") != "spawn"
        or static_environment() is not None
        or config.option.help
        or config.option.version
    ):
        return None
    if _xdist_workers(config):
        raise pytest.UsageError(
            "--multigpu-static --mesh-backend=spawn starts one pytest process per rank; "
            "it is incompatible with -n (pytest-xdist): drop -n"
        )
    from meshsim._launch import launch

    size = config.getoption("world_size")
    print(
        f"meshsim: --multigpu-static --mesh-backend=spawn: {size} pytest processes, one per rank, "
        "started as torchrun would start them",
        flush=True,
    )
    args = config.invocation_params.args
    return launch(args, size, timeout=config.getoption("mesh_timeout"), cwd=str(config.invocation_params.dir))


@pytest.hookimpl(tryfirst=True)
def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers",
        "world(*sizes, backend=None): run the test body on each of these numbers of ranks; "
        "fixtures rank, world_size, distributed_mesh, distributed_mesh_2d, make_mesh, ledger and "
        "ledger_snapshot are per rank. backend overrides --mesh-backend for this test.",
    )
    config.addinivalue_line(
        "markers",
        "multigpu_static: a distributed test (PhysicsNeMo's marker); simulated on --world-size ranks",
    )
    config.addinivalue_line(
        "markers",
        "allow_redundant(*ops, reason=None): wasted collectives this test issues on purpose "
        "(all of them, or only these ops, e.g. 'all_gather'); not reported, and not failures "
        "under --mesh-redundant=error",
    )
    _configure_findings(config)
    _configure_trace(config)
    state = _State(
        config.getoption("mesh_backend"),
        config.getoption("world_size"),
        config.getoption("mesh_timeout"),
    )
    config.stash[_STATE] = state
    state.owns_suite_options = config.stash.get(_OWNS_SUITE_OPTIONS, False)
    if state.owns_suite_options:
        config.addinivalue_line(
            "markers", "multigpu_dynamic: a distributed test that starts its own processes"
        )
    static = bool(config.getoption("multigpu_static", default=False))
    dynamic = bool(config.getoption("multigpu_dynamic", default=False))
    if static and dynamic:
        raise pytest.UsageError("--multigpu-static and --multigpu-dynamic select different suites: give one")
    state.suite = "static" if static else "dynamic" if dynamic else None
    if static:
        _configure_static(config, state)


_REDUNDANT_ENV = pytest.StashKey[tuple[bool, str | None]]()  # (set by us, the value before)
_TRACE_DIR = pytest.StashKey[Path]()
_TRACE_SINCE = pytest.StashKey[float]()


def _configure_trace(config: pytest.Config) -> None:
    """--mesh-trace=DIR: check the backend and make the folder."""
    folder = config.getoption("mesh_trace", None)
    if folder is None:
        return
    from meshsim._modes import static_environment

    backend = config.getoption("mesh_backend")
    torchrun = bool(config.getoption("multigpu_static", default=False)) and static_environment() is not None
    if backend != "sim" or torchrun:
        where = "under torchrun" if torchrun else f"with --mesh-backend={backend}"
        raise pytest.UsageError(
            f"--mesh-trace draws simulated worlds, whose ranks meshsim sees between calls; {where} "
            "there is nothing to draw (use --mesh-backend=sim)"
        )
    path = Path(folder)
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise pytest.UsageError(f"--mesh-trace={folder}: cannot make the folder: {exc}") from None
    config.stash[_TRACE_DIR] = path.resolve()
    config.stash[_TRACE_SINCE] = time.time()


def _configure_findings(config: pytest.Config) -> None:
    """--mesh-redundant=off: worlds of this process (and its children) do not look for waste."""
    if config.getoption("mesh_redundant", "report") != "off":
        return
    config.stash[_REDUNDANT_ENV] = (True, os.environ.get("MESHSIM_REDUNDANT"))
    os.environ["MESHSIM_REDUNDANT"] = "0"


def _unconfigure_findings(config: pytest.Config) -> None:
    ours, before = config.stash.get(_REDUNDANT_ENV, (False, None))
    if not ours:
        return
    if before is None:
        os.environ.pop("MESHSIM_REDUNDANT", None)
    else:
        os.environ["MESHSIM_REDUNDANT"] = before


def _configure_static(config: pytest.Config, state: _State) -> None:
    from meshsim._modes import static_environment

    env = static_environment()
    if env is None:
        _configure_simulated(config, state)
        return
    if _xdist_workers(config):
        raise pytest.UsageError(
            "--multigpu-static is incompatible with -n (pytest-xdist): torchrun already starts "
            "one pytest per rank; drop -n"
        )
    _configure_torchrun(config, state, env)


def _configure_simulated(config: pytest.Config, state: _State) -> None:
    """--multigpu-static without torchrun: one simulated job for the session (see meshsim._simjob)."""
    from meshsim._simjob import SimulatedJob

    job = SimulatedJob(config, state.world_size, state.backend, state.timeout)
    job.start()
    state.job = job


def _configure_torchrun(config: pytest.Config, state: _State, env: dict[str, int]) -> None:
    from meshsim._modes import StaticSession

    xml = getattr(config.option, "xmlpath", None)
    if xml and "{rank}" in xml:
        config.option.xmlpath = xml.replace("{rank}", str(env["RANK"]))
    # joined in pytest_sessionstart, after the conftests' pytest_configure (a manager's own init)
    state.static = StaticSession(env["RANK"], env["WORLD_SIZE"], env["LOCAL_RANK"], state.timeout)


def _xdist_workers(config: pytest.Config) -> bool:
    workers = getattr(config.option, "numprocesses", None)
    return bool(workers) and workers != 0


@pytest.hookimpl(trylast=True)
def pytest_sessionstart(session: pytest.Session) -> None:
    """Under torchrun, join the job; only rank 0 reports: other ranks drop the terminal reporter."""
    config = session.config
    state = config.stash.get(_STATE, None)
    if state is None or state.static is None:
        return
    state.static.start()
    if state.static.rank == 0:
        return
    if config.getoption("mesh_report") == "rank0":
        reporter = config.pluginmanager.get_plugin("terminalreporter")
        if reporter is not None:
            config.pluginmanager.unregister(reporter)


@pytest.hookimpl(trylast=True)
def pytest_unconfigure(config: pytest.Config) -> None:
    _unconfigure_findings(config)
    state = config.stash.get(_STATE, None)
    if state is not None and state.job is not None:
        job, state.job = state.job, None
        job.stop()
    if state is not None and state.static is not None:
        state.static.stop()
        state.static = None


def _spec(item: pytest.Item) -> WorldSpec | None:
    marker = item.get_closest_marker("world")
    if marker is not None:
        return _world_spec(marker, item.config)
    if item.get_closest_marker("multigpu_static") is not None:
        return WorldSpec((item.config.stash[_STATE].world_size,), None)
    return None


def _world_spec(marker: pytest.Mark, config: pytest.Config) -> WorldSpec:
    """The marker's sizes and backend; a bad marker fails its test's collection with a clear message."""
    sizes = marker.args
    unknown = set(marker.kwargs) - {"backend"}
    if unknown:
        raise pytest.Collector.CollectError(
            f"@pytest.mark.world takes sizes and backend=..., got {sorted(unknown)}"
        )
    if not sizes or not all(isinstance(n, int) and not isinstance(n, bool) and n > 0 for n in sizes):
        raise pytest.Collector.CollectError(
            f"@pytest.mark.world needs one or more positive int world sizes, got {sizes!r}"
        )
    backend = marker.kwargs.get("backend")
    if backend is not None and backend not in BACKENDS:
        raise pytest.Collector.CollectError(
            f"@pytest.mark.world(backend=...) must be one of {BACKENDS}, got {backend!r}"
        )
    return WorldSpec(tuple(sizes), backend)


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    marker = metafunc.definition.get_closest_marker("world")
    if marker is None:
        return
    spec = _world_spec(marker, metafunc.config)
    if len(spec.sizes) > 1:
        metafunc.fixturenames.append(_WORLD_PARAM)
        metafunc.parametrize(_WORLD_PARAM, spec.sizes, ids=[f"world={n}" for n in spec.sizes])


def _size(item: pytest.Item, spec: WorldSpec) -> int:
    callspec = getattr(item, "callspec", None)
    if callspec is not None and _WORLD_PARAM in callspec.params:
        return int(callspec.params[_WORLD_PARAM])
    return spec.sizes[0]


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    state = config.stash[_STATE]
    for item in items:
        reason = _not_selected(state, item)
        if reason is not None:
            item.add_marker(pytest.mark.skip(reason=reason))


def _not_selected(state: _State, item: pytest.Item) -> str | None:
    """Why ``item`` is not in the suite --multigpu-static / --multigpu-dynamic selects, if it is not."""
    if state.suite == "static":
        spec = _spec(item)
        if spec is None:
            return "--multigpu-static runs only distributed tests (marked world or multigpu_static)"
        if item.get_closest_marker("world") is None:
            return None  # multigpu_static: runs on whatever world the job has
        size = _size(item, spec)
        if state.static is not None and size != state.static.world_size:
            return f"needs a world of {size} ranks; torchrun started {state.static.world_size} (WORLD_SIZE)"
        return None
    if not state.owns_suite_options:
        return None  # the conftest that defines the options selects
    dynamic = item.get_closest_marker("multigpu_dynamic") is not None
    if state.suite == "dynamic" and not dynamic:
        return "--multigpu-dynamic runs only multigpu_dynamic tests"
    if state.suite is None and dynamic:
        return "a multigpu_dynamic test starts its own processes: run it with --multigpu-dynamic"
    return None


@pytest.hookimpl(wrapper=True)
def pytest_runtest_protocol(
    item: pytest.Item, nextitem: pytest.Item | None
) -> Generator[None, object, object]:
    """Note the distributed test being set up and run, for the fixtures it needs on its ranks."""
    state = item.config.stash.get(_STATE, None)
    if state is None:
        return (yield)
    state.item = item if _spec(item) is not None else None
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
    state = request.config.stash.get(_STATE, None)
    placeholder = _on_ranks(state, fixturedef, request) if state is not None else None
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


def _on_ranks(state: _State, fixturedef: pytest.FixtureDef[Any], request: pytest.FixtureRequest) -> Any:
    """The placeholder for a fixture that runs on the ranks, or None for one that runs here."""
    from meshsim._fixtures import PerRank, recipe
    from meshsim._simjob import is_user_code

    item = state.item
    if item is None or state.static is not None:
        return None
    spec = _spec(item)
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
    spec = _spec(pyfuncitem)
    if spec is None:
        _refuse_per_rank_values(pyfuncitem)
        return None
    state = pyfuncitem.config.stash[_STATE]
    test = pyfuncitem.obj
    names = inspect.signature(test).parameters
    funcargs = {name: pyfuncitem.funcargs[name] for name in names if name in pyfuncitem.funcargs}
    if state.static is not None:
        # every process gets every rank's ledger; rank 0 alone writes the file
        check = _snapshot_check(pyfuncitem, write=state.static.rank == 0)
        state.static.run(test, funcargs, check=check)
        return True
    check = _snapshot_check(pyfuncitem, write=True)
    ledgers = _run_ranks(pyfuncitem, state, spec, test, funcargs, record=check is not None)
    if check is not None:
        check([ledger for ledger in ledgers if ledger is not None])
    return True


def _run_ranks(
    item: pytest.Function,
    state: _State,
    spec: WorldSpec,
    test: Any,
    funcargs: dict[str, Any],
    *,
    record: bool,
) -> list[Any]:
    """Run the body on the test's ranks in this pytest process's way; returns each rank's ledger (or None)."""
    from meshsim._errors import RankError

    if state.job is not None and item.get_closest_marker("world") is None:
        try:
            return state.job.run_test(test, funcargs, record=record)
        except RankError as error:
            raise _decided(error) from None
    backend = spec.backend or state.backend
    size = _size(item, spec)
    if backend == "spawn":
        from meshsim._spawn import TestTarget, run_in_processes

        target = TestTarget(item.module.__name__, str(item.path), test.__qualname__)
        return run_in_processes(target, funcargs, size, timeout=state.timeout, record=record)
    from meshsim._modes import run_on_threads

    try:
        return run_on_threads(test, funcargs, size, backend=backend, timeout=state.timeout, record=record)
    except RankError as error:
        raise _decided(error) from None


def _snapshot_check(item: pytest.Function, *, write: bool) -> Callable[[list[Any]], None] | None:
    """For a test that uses ``ledger_snapshot``: what checks every rank's ledger against its file."""
    if "ledger_snapshot" not in item.fixturenames:
        return None
    from meshsim._snapshot import SnapshotMismatchError, check_snapshot

    path = _snapshot_file(item.path)
    key = item.nodeid.split("::", 1)[-1]  # the test id without its file: moving the file keeps it
    update = bool(item.config.getoption("mesh_snapshot_update"))

    def check(ledgers: list[Any]) -> None:
        try:
            item.stash[_SNAPSHOT] = check_snapshot(path, key, ledgers, update=update, write=write)
        except SnapshotMismatchError as error:
            error.add_note(
                "If the change is intended, rerun with --mesh-snapshot-update to rewrite the snapshot, "
                "and review the file's diff."
            )
            raise

    return check


def _snapshot_file(module: Path) -> Path:
    """Where ``module``'s ledger snapshots live: ``__snapshots__/<stem>.ledger.json`` beside it."""
    return module.parent / "__snapshots__" / f"{module.stem}.ledger.json"


def _refuse_per_rank_values(item: pytest.Function) -> None:
    """A test that runs once cannot take a fixture whose value lives on ranks (set up for an earlier test)."""
    from meshsim._fixtures import PerRank

    names = [name for name, value in item.funcargs.items() if isinstance(value, PerRank)]
    if names:
        pytest.fail(
            f"fixture{'s' if len(names) > 1 else ''} {', '.join(map(repr, names))} run on the ranks of "
            "distributed tests (set up by an earlier one, in a wider scope); this test runs once, "
            "outside any rank. Mark it @pytest.mark.world(n) or @pytest.mark.multigpu_static, or give "
            "the fixture function scope.",
            pytrace=False,
        )


def _decided(error: BaseException) -> BaseException:
    """What a failed world means for the test (:func:`meshsim._outcomes.decided`)."""
    from meshsim._outcomes import decided

    return decided(error)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_call(item: pytest.Item) -> Generator[None, None, None]:
    """Collect the wasted collectives the test's worlds find; under --mesh-redundant=error, fail on them."""
    folder = item.config.stash.get(_TRACE_DIR, None)
    if folder is None:
        return (yield from _collect_findings(item))
    from meshsim._trace import per_test

    with per_test(folder, item.nodeid):
        return (yield from _collect_findings(item))


def _collect_findings(item: pytest.Item) -> Generator[None, None, None]:
    mode = item.config.getoption("mesh_redundant", "report")
    if mode == "off":
        return (yield)
    from meshsim._findings import collecting

    with collecting() as found:
        try:
            result = yield
        finally:
            kept = _not_allowed(item, found)
            if kept:
                item.stash[_WASTED] = kept
    if kept and mode == "error":
        raise _RedundantCollectives(_wasted_text(kept, item.nodeid))
    return result


class _RedundantCollectives(AssertionError):
    """The test issued collectives that told no rank anything new (``--mesh-redundant=error``)."""


def _not_allowed(item: pytest.Item, found: list[Any]) -> list[tuple[str, str, str, int]]:
    """The findings the test's allow_redundant markers do not allow, counted per (api, site, reason)."""
    allowed: set[str] = set()
    everything = False
    for marker in item.iter_markers("allow_redundant"):
        if not marker.args:
            everything = True
        allowed.update(str(op) for op in marker.args)
    if everything:
        return []
    counts: Counter[tuple[str, str, str]] = Counter(
        (f.api, f.site, f.reason) for f in found if f.op not in allowed and f.api not in allowed
    )
    return [(api, site, reason, times) for (api, site, reason), times in counts.items()]


def _wasted_text(wasted: list[tuple[str, str, str, int]], nodeid: str) -> str:
    lines = [f"{nodeid} issued {_calls(sum(t for *_, t in wasted))} that told no rank anything new:"]
    for api, site, reason, times in wasted:
        again = f" ({times} times)" if times > 1 else ""
        lines.append(f"  {api} at {site}{again}: {reason}")
    lines.append(
        "Remove them, or mark the test @pytest.mark.allow_redundant(...) if they are meant; "
        "--mesh-redundant=report lists them without failing."
    )
    return "\n".join(lines)


def _calls(n: int) -> str:
    return f"{n} collective" if n == 1 else f"{n} collectives"


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(
    item: pytest.Item, call: pytest.CallInfo[None]
) -> Generator[None, pytest.TestReport, pytest.TestReport]:
    report = yield
    snapshot = item.stash.get(_SNAPSHOT, None)
    if snapshot is not None and call.when == "call":
        report.meshsim_snapshot = snapshot  # type: ignore[attr-defined]  # travels to xdist's controller
    wasted = item.stash.get(_WASTED, None)
    if wasted is not None and call.when == "call":
        report.meshsim_redundant = [list(w) for w in wasted]  # type: ignore[attr-defined]  # as above
    if (
        call.excinfo is not None
        and call.when == "call"
        and isinstance(call.excinfo.value, _RedundantCollectives)
    ):
        report.longrepr = str(call.excinfo.value)
    if call.excinfo is not None and call.when == "call":
        text = _mesh_failure(call.excinfo.value)
        if text is not None:
            report.longrepr = text
    return report


def _mesh_failure(error: BaseException) -> str | None:
    """The report for a meshsim error: the failing rank's own traceback or the per-rank table."""
    from meshsim._errors import MeshError, RankError
    from meshsim._snapshot import SnapshotMismatchError

    notes = "".join(f"\n{note}" for note in getattr(error, "__notes__", []))
    if isinstance(error, (RankError, SnapshotMismatchError)):
        return f"{error}{notes}"
    if isinstance(error, MeshError):
        return f"{type(error).__name__}: {error}{notes}"
    return None


def _placeholder(request: pytest.FixtureRequest, name: str) -> Any:
    from meshsim._fixtures import PLACEHOLDERS

    state = request.config.stash[_STATE]
    if _spec(request.node) is None and state.static is None:
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


def pytest_terminal_summary(terminalreporter: Any, exitstatus: int, config: pytest.Config) -> None:
    """The wasted collectives tests issued; one line each on what ledger snapshot checks and traces did."""
    _summarize_wasted(terminalreporter)
    folder = config.stash.get(_TRACE_DIR, None)
    if folder is not None:  # xdist workers write too: count the files, not this process's worlds
        since = config.stash[_TRACE_SINCE]
        written = [p for p in folder.glob("*.json") if p.stat().st_mtime >= since]
        terminalreporter.write_line(f"meshsim: traces: {len(written)} written to {folder}")
    done = Counter(
        outcome
        for reports in terminalreporter.stats.values()
        for report in reports
        if (outcome := getattr(report, "meshsim_snapshot", None)) is not None
    )
    if done:
        words = {"created": "written", "updated": "rewritten", "matched": "unchanged"}
        parts = [f"{done[kind]} {word}" for kind, word in words.items() if done[kind]]
        terminalreporter.write_line(f"meshsim: ledger snapshots: {', '.join(parts)}")


def _summarize_wasted(terminalreporter: Any) -> None:
    """A section listing the wasted collectives, one entry per call site and rule (sizes and call
    numbers aside), with the tests that issued them (xdist workers' reports included). ``-v`` names
    every test, not the first few."""
    groups: dict[tuple[str, str, str], tuple[Counter[str], Counter[str]]] = {}
    for reports in terminalreporter.stats.values():
        for report in reports:
            for api, site, reason, times in getattr(report, "meshsim_redundant", None) or ():
                rule = re.sub(r"\d+", "N", reason)
                reasons, tests = groups.setdefault((api, site, rule), (Counter(), Counter()))
                reasons[reason] += times
                tests[report.nodeid] += times
    if not groups:
        return
    shown = None if terminalreporter.config.getoption("verbose", 0) > 0 else 3
    total = sum(sum(tests.values()) for _, tests in groups.values())
    everywhere = {nodeid for _, tests in groups.values() for nodeid in tests}
    terminalreporter.section("meshsim: redundant collectives", sep="=")
    for (api, site, _), (reasons, tests) in sorted(groups.items(), key=lambda kv: -sum(kv[1][1].values())):
        reason, _count = reasons.most_common(1)[0]
        variants = f" (and {len(reasons) - 1} more like it)" if len(reasons) > 1 else ""
        terminalreporter.write_line(f"{api} at {site}: {reason}{variants}")
        terminalreporter.write_line(f"  {_calls(sum(tests.values()))} in {_tests(len(tests))}:")
        names = sorted(tests)
        for nodeid in names[:shown]:
            again = f" ({tests[nodeid]} times)" if tests[nodeid] > 1 else ""
            terminalreporter.write_line(f"    {nodeid}{again}")
        if shown is not None and len(names) > shown:
            terminalreporter.write_line(f"    ... and {len(names) - shown} more (-v lists them)")
    terminalreporter.write_line(
        f"{_calls(total)} in {_tests(len(everywhere))} told no rank anything new "
        "(--mesh-redundant=error fails them; @pytest.mark.allow_redundant allows known ones)"
    )


def _tests(n: int) -> str:
    return f"{n} test" if n == 1 else f"{n} tests"


def pytest_report_header(config: pytest.Config) -> list[str]:
    state = config.stash.get(_STATE, None)
    if state is None:
        return []
    if state.static is not None:
        return [f"meshsim: --multigpu-static, rank {state.static.rank} of {state.static.world_size}"]
    if state.job is not None:
        lines = [
            f"meshsim: --multigpu-static on {state.world_size} simulated ranks (--mesh-backend="
            f"{state.backend}): one job for the session, set up as torchrun would"
        ]
        if state.backend == "gloo":
            lines.append(
                "meshsim: gloo thread ranks run at once and share what a process owns (RANK in the "
                "environment, RNGs, singletons declared per rank): use --mesh-backend=sim or spawn for "
                "code that reads its rank from them"
            )
        return lines
    return [f"meshsim: --mesh-backend={state.backend}, multigpu_static world size {state.world_size}"]
