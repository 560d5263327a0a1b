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

The plugin imports torch lazily: collecting a project that never uses it costs nothing.
"""

from __future__ import annotations

import inspect
from collections.abc import Generator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import pytest

if TYPE_CHECKING:
    from meshsim._modes import StaticSession

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
        self.static: StaticSession | None = None


_STATE = pytest.StashKey[_State]()


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
        "--multigpu-static",
        action="store_true",
        help="run under torchrun: each process is one rank of one process group kept for the session",
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


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers",
        "world(*sizes, backend=None): run the test body on each of these numbers of ranks; "
        "fixtures rank, world_size, distributed_mesh, distributed_mesh_2d, make_mesh and ledger "
        "are per rank. backend overrides --mesh-backend for this test.",
    )
    config.addinivalue_line(
        "markers",
        "multigpu_static: a distributed test (PhysicsNeMo's marker); simulated on --world-size ranks",
    )
    state = _State(
        config.getoption("mesh_backend"),
        config.getoption("world_size"),
        config.getoption("mesh_timeout"),
    )
    config.stash[_STATE] = state
    if config.getoption("multigpu_static"):
        _configure_static(config, state)


def _configure_static(config: pytest.Config, state: _State) -> None:
    from meshsim._modes import StaticSession, static_environment

    if _xdist_workers(config):
        raise pytest.UsageError(
            "--multigpu-static is incompatible with -n (pytest-xdist): torchrun already starts "
            "one pytest per rank; drop -n"
        )
    env = static_environment()
    if env is None:
        raise pytest.UsageError(
            "--multigpu-static runs one rank per process under torchrun, but RANK, WORLD_SIZE "
            "and LOCAL_RANK are not set. Run it as: torchrun --nproc_per_node=4 -m pytest "
            "--multigpu-static ...; or drop --multigpu-static to simulate the ranks in threads."
        )
    xml = getattr(config.option, "xmlpath", None)
    if xml and "{rank}" in xml:
        config.option.xmlpath = xml.replace("{rank}", str(env["RANK"]))
    session = StaticSession(env["RANK"], env["WORLD_SIZE"], env["LOCAL_RANK"], state.timeout)
    session.start()
    state.static = session


def _xdist_workers(config: pytest.Config) -> bool:
    workers = getattr(config.option, "numprocesses", None)
    return bool(workers) and workers != 0


@pytest.hookimpl(tryfirst=True)
def pytest_sessionstart(session: pytest.Session) -> None:
    """Under --multigpu-static only rank 0 reports: other ranks drop the terminal reporter."""
    config = session.config
    state = config.stash.get(_STATE, None)
    if state is None or state.static is None or state.static.rank == 0:
        return
    if config.getoption("mesh_report") == "rank0":
        reporter = config.pluginmanager.get_plugin("terminalreporter")
        if reporter is not None:
            config.pluginmanager.unregister(reporter)


def pytest_unconfigure(config: pytest.Config) -> None:
    state = config.stash.get(_STATE, None)
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
    static = config.stash[_STATE].static
    if static is None:
        return
    for item in items:
        spec = _spec(item)
        if spec is None:
            reason = "--multigpu-static runs only distributed tests (marked world or multigpu_static)"
            item.add_marker(pytest.mark.skip(reason=reason))
            continue
        size = _size(item, spec)
        if size != static.world_size:
            reason = f"needs a world of {size} ranks; torchrun started {static.world_size} (WORLD_SIZE)"
            item.add_marker(pytest.mark.skip(reason=reason))


@pytest.hookimpl(tryfirst=True)
def pytest_pyfunc_call(pyfuncitem: pytest.Function) -> bool | None:
    spec = _spec(pyfuncitem)
    if spec is None:
        return None
    state = pyfuncitem.config.stash[_STATE]
    test = pyfuncitem.obj
    names = inspect.signature(test).parameters
    funcargs = {name: pyfuncitem.funcargs[name] for name in names if name in pyfuncitem.funcargs}
    if state.static is not None:
        state.static.run(test, funcargs)
        return True
    backend = spec.backend or state.backend
    size = _size(pyfuncitem, spec)
    if backend == "spawn":
        from meshsim._spawn import TestTarget, run_in_processes

        target = TestTarget(pyfuncitem.module.__name__, str(pyfuncitem.path), test.__qualname__)
        run_in_processes(target, funcargs, size, timeout=state.timeout)
        return True
    from meshsim._errors import RankError
    from meshsim._modes import run_on_threads

    try:
        run_on_threads(test, funcargs, size, backend=backend, timeout=state.timeout)
    except RankError as error:
        raise _decided(error) from None
    return True


def _decided(error: BaseException) -> BaseException:
    """What a failed world means for the test: the first rank's skip or xfail if no rank failed.

    A skip or xfail is raised as the rank raised it (its traceback gives the
    location pytest reports); any other failure wins over them, noting who skipped.
    """
    from meshsim._errors import RankError
    from meshsim._outcomes import FAILED, kind_of

    if not isinstance(error, RankError) or not error.failures:
        return error
    kinds = [(rank, exc, kind_of(exc)) for rank, exc in error.failures]
    if any(kind == FAILED for _, _, kind in kinds):
        others = [f"rank {rank} {kind}: {exc}" for rank, exc, kind in kinds if kind != FAILED]
        if others:
            error.add_note("; ".join(others))
        return error
    return kinds[0][1]


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(
    item: pytest.Item, call: pytest.CallInfo[None]
) -> Generator[None, pytest.TestReport, pytest.TestReport]:
    report = yield
    if call.excinfo is not None and call.when == "call":
        text = _mesh_failure(call.excinfo.value)
        if text is not None:
            report.longrepr = text
    return report


def _mesh_failure(error: BaseException) -> str | None:
    """The report for a meshsim error: the failing rank's own traceback or the per-rank table."""
    from meshsim._errors import MeshError, RankError

    notes = "".join(f"\n{note}" for note in getattr(error, "__notes__", []))
    if isinstance(error, RankError):
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


def pytest_report_header(config: pytest.Config) -> list[str]:
    state = config.stash.get(_STATE, None)
    if state is None:
        return []
    if state.static is not None:
        return [f"meshsim: --multigpu-static, rank {state.static.rank} of {state.static.world_size}"]
    return [f"meshsim: --mesh-backend={state.backend}, multigpu_static world size {state.world_size}"]
