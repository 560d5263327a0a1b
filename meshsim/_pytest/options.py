"""Options and markers: meshsim's command-line options, the world markers, and which tests a suite selects.

Markers:

- ``@pytest.mark.world(4)`` runs the body on 4 ranks; ``world(1, 2, 4)`` runs it
  once per size, with ids ``world1``, ``world2``, ``world4`` (``-k world2`` selects one).
- ``@pytest.mark.multigpu_static`` (PhysicsNeMo's marker) runs it on
  ``--world-size`` ranks (default 4).
- ``@pytest.mark.allow_redundant`` (see :mod:`meshsim._pytest.findings`).

``--mesh-unmarked=ranks`` makes a ``--multigpu-static`` run torchrun-style: unmarked
tests run on every rank too, as ``torchrun -m pytest`` runs them
(:mod:`meshsim._pytest.torchrun_style`).

``--multigpu-static`` / ``--multigpu-dynamic`` are PhysicsNeMo's suite options: a
conftest may define them itself (theirs does); meshsim defines them otherwise.
"""

from __future__ import annotations

from collections.abc import Generator
from dataclasses import dataclass

import pytest

from meshsim._pytest.state import PluginState, state_of

__all__ = [
    "BACKENDS",
    "SIMULATED_RANK_ENVIRONMENT",
    "UNMARKED",
    "WorldSpec",
    "per_rank_module_names",
    "size_of",
    "spec_of",
    "static_environment_or_none",
    "unmarked_of",
]

BACKENDS = ("sim", "gloo", "spawn")
UNMARKED = ("skip", "ranks")
_WORLD_PARAM = "_meshsim_world"
_OWNS_SUITE_OPTIONS = pytest.StashKey[bool]()

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


@dataclass(frozen=True)
class WorldSpec:
    """What a test's markers ask for: world sizes and, optionally, a backend."""

    sizes: tuple[int, ...]
    backend: str | None


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
        "--mesh-allow-unrun",
        action="store_true",
        default=False,
        help="under torchrun --multigpu-static, exit 0 when every selected distributed test was "
        "skipped for needing another world size (a CI matrix that runs each size); by default "
        "such a job fails",
    )
    group.addoption(
        "--mesh-redundant",
        choices=("off", "summary", "report", "error"),
        default="summary",
        help="wasted collectives (calls that told no rank anything new, found on the sim backend): "
        "summary counts them in one line at the end and shows a failing test's own (the default), "
        "report lists them all, error fails their tests (@pytest.mark.allow_redundant allows "
        "known ones; calls torch's DDP/FSDP make by design never fail), off does not look",
    )
    group.addoption(
        "--mesh-trace",
        metavar="DIR",
        default=None,
        help="write each test's simulated worlds as timelines (Chrome trace-event JSON for Perfetto "
        "or chrome://tracing) to DIR/<test id>.json, created if missing; sim backend only",
    )
    group.addoption(
        "--mesh-library",
        action="append",
        default=[],
        metavar="MODULE",
        help="count this module's (or folder's) code as a library, as shardtensor is: ledger sites "
        "name the first line outside it, the library's own line kept as the entry's via "
        "(repeatable; adds to the mesh_library ini option)",
    )
    parser.addini(
        "mesh_library",
        type="linelist",
        default=[],
        help="modules (or folders) whose code is a library's, as with --mesh-library",
    )
    group.addoption(
        "--mesh-unmarked",
        choices=UNMARKED,
        default=None,
        help="under --multigpu-static, what unmarked tests do: skip (the default), or ranks: run on "
        "every rank of the job, as under torchrun -m pytest, each rank importing the test tree's "
        "modules itself (overrides the mesh_unmarked ini option)",
    )
    parser.addini(
        "mesh_unmarked",
        default="skip",
        help="under --multigpu-static, what unmarked tests do: skip or ranks (see --mesh-unmarked)",
    )
    group.addoption(
        "--mesh-per-rank-modules",
        action="append",
        default=[],
        metavar="MODULES",
        help="comma-separated module names (a name covers its submodules) that each simulated rank "
        "imports for itself, as each torchrun process does: their module globals are per rank "
        "(repeatable; adds to the mesh_per_rank_modules ini option)",
    )
    parser.addini(
        "mesh_per_rank_modules",
        type="linelist",
        default=[],
        help="modules each simulated rank imports for itself, as with --mesh-per-rank-modules",
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
def pytest_configure(config: pytest.Config) -> None:
    """The markers, and the suite the options select."""
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
    state = state_of(config)
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
    state.unmarked = unmarked_of(config)
    libraries = [*config.getini("mesh_library"), *(config.getoption("mesh_library", None) or [])]
    if libraries:
        from meshsim._engine import library_code

        try:
            state.watches.enter_context(library_code(*libraries))
        except ValueError as error:
            raise pytest.UsageError(f"--mesh-library / mesh_library: {error}") from None


def spec_of(item: pytest.Item) -> WorldSpec | None:
    """What ``item``'s markers ask for, or None for a test that runs once, normally."""
    marker = item.get_closest_marker("world")
    if marker is not None:
        return _world_spec(marker)
    state = state_of(item.config)
    if item.get_closest_marker("multigpu_static") is not None or _runs_unmarked(state):
        return WorldSpec((state.world_size,), None)
    return None


def _runs_unmarked(state: PluginState) -> bool:
    """Whether unmarked tests run on the ranks (``--multigpu-static --mesh-unmarked=ranks``)."""
    return state.suite == "static" and state.unmarked == "ranks"


def unmarked_of(config: pytest.Config, given: str | None = None) -> str:
    """``--mesh-unmarked`` (or ``given``), else the ``mesh_unmarked`` ini option.

    Raises:
        pytest.UsageError: the ini option is neither ``skip`` nor ``ranks``.
    """
    given = given or config.getoption("mesh_unmarked", default=None)
    value = given or str(config.getini("mesh_unmarked")).strip()
    if value not in UNMARKED:
        raise pytest.UsageError(f"mesh_unmarked must be one of {', '.join(UNMARKED)}, got {value!r}")
    return value


def per_rank_module_names(config: pytest.Config) -> list[str]:
    """The modules ``--mesh-per-rank-modules`` and ``mesh_per_rank_modules`` name, in order, once each.

    Raises:
        pytest.UsageError: a name is not a dotted module name.
    """
    given = [
        *config.getini("mesh_per_rank_modules"),
        *(config.getoption("mesh_per_rank_modules", None) or []),
    ]
    names: list[str] = []
    for entry in given:
        for name in (part.strip() for part in str(entry).split(",")):
            if not name:
                continue
            if not all(piece.isidentifier() for piece in name.split(".")):
                raise pytest.UsageError(
                    f"--mesh-per-rank-modules / mesh_per_rank_modules: {name!r} is not a module name "
                    "(dotted identifiers, e.g. megatron.core.parallel_state)"
                )
            if name not in names:
                names.append(name)
    return names


def _world_spec(marker: pytest.Mark) -> WorldSpec:
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
    spec = _world_spec(marker)
    if len(spec.sizes) > 1:
        metafunc.fixturenames.append(_WORLD_PARAM)
        metafunc.parametrize(_WORLD_PARAM, spec.sizes, ids=[f"world{n}" for n in spec.sizes])


def size_of(item: pytest.Item, spec: WorldSpec) -> int:
    """The world size this instance of the test runs on."""
    callspec = getattr(item, "callspec", None)
    if callspec is not None and _WORLD_PARAM in callspec.params:
        return int(callspec.params[_WORLD_PARAM])
    return spec.sizes[0]


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        reason = _not_selected(item)
        if reason is not None:
            item.add_marker(pytest.mark.skip(reason=reason))


def _not_selected(item: pytest.Item) -> str | None:
    """Why ``item`` is not in the suite --multigpu-static / --multigpu-dynamic selects, if it is not."""
    state = state_of(item.config)
    if state.suite == "static":
        spec = spec_of(item)
        if spec is None:
            return (
                "--multigpu-static runs only distributed tests (marked world or multigpu_static); "
                "--mesh-unmarked=ranks runs unmarked tests on every rank, as torchrun -m pytest does"
            )
        if item.get_closest_marker("world") is None:
            return None  # multigpu_static: runs on whatever world the job has
        size = size_of(item, spec)
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


#: Set when the pytest process holds rank 0's torchrun environment for a simulated job
#: (:mod:`meshsim._pytest.torchrun_style`): not torchrun's.
SIMULATED_RANK_ENVIRONMENT = pytest.StashKey[bool]()


def static_environment_or_none(config: pytest.Config) -> dict[str, int] | None:
    """torchrun's rank variables, when this run is ``--multigpu-static`` under torchrun."""
    if not config.getoption("multigpu_static", default=False):
        return None
    if config.stash.get(SIMULATED_RANK_ENVIRONMENT, False):
        return None
    from meshsim._modes.torchrun import static_environment

    return static_environment()


def pytest_report_header(config: pytest.Config) -> list[str]:
    """The options' line; under ``--multigpu-static`` the job's own line says more (launch, static)."""
    if config.getoption("multigpu_static", default=False):
        return []
    state = state_of(config)
    return [f"meshsim: --mesh-backend={state.backend}, multigpu_static world size {state.world_size}"]
