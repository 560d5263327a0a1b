"""Torchrun-style suites on simulated ranks: ``--mesh-unmarked=ranks`` and ``--mesh-per-rank-modules``.

Suites written for ``torchrun --nproc-per-node=N -m pytest`` mark nothing: every
test runs in every process, and each process imports the test tree itself, with its
own ``LOCAL_RANK``. With ``pytest --multigpu-static --mesh-unmarked=ranks`` (no
torchrun), the simulated job (:mod:`meshsim._pytest.simjob`) gives them that:

- unmarked tests run on every rank (:func:`meshsim._pytest.options.spec_of`);
- the pytest process has rank 0's torchrun environment (``RANK``, ``LOCAL_RANK``,
  ``WORLD_SIZE``, ...) from before the conftests import to the end of the run, so
  module code that reads it at import works while pytest collects;
- every module of the user's own code (under the rootdir, or a ``-p`` plugin, not an
  installed package or meshsim) is declared per rank
  (:func:`meshsim.per_rank_module`): each rank runs its code itself, with its own
  environment, and owns its globals. Those loaded with the conftests are declared
  before the job's world starts; test modules, once collected.

``--mesh-per-rank-modules`` (and the ``mesh_per_rank_modules`` ini option) declare
library modules the same way, with or without ``--mesh-unmarked``.

Thread ranks that run at once (``--mesh-backend=gloo``) would share those modules:
the options are refused there. Spawned ranks (``--mesh-backend=spawn``) and torchrun's
are processes: unmarked tests run there too, and need no declarations.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Generator
from types import ModuleType
from typing import Any

import pytest

from meshsim._pytest.options import SIMULATED_RANK_ENVIRONMENT, per_rank_module_names, unmarked_of
from meshsim._pytest.state import state_of

__all__: list[str] = []

_SAVED_ENVIRON = pytest.StashKey[dict[str, str | None]]()
_DECLARED = pytest.StashKey[list[Any]]()


@pytest.hookimpl(wrapper=True)
def pytest_load_initial_conftests(
    early_config: pytest.Config, parser: pytest.Parser, args: list[str]
) -> Generator[None, None, None]:
    """Give the pytest process rank 0's torchrun environment before the conftests import."""
    known = early_config.known_args_namespace  # the options are not parsed yet
    given = getattr(known, "mesh_unmarked", None)
    if (
        _simulated_static(args)
        and known.mesh_backend == "sim"
        and unmarked_of(early_config, given) == "ranks"
    ):
        from meshsim._engine import torchrun_environment

        wanted = torchrun_environment(0, known.world_size)
        early_config.stash[_SAVED_ENVIRON] = {key: os.environ.get(key) for key in wanted}
        early_config.stash[SIMULATED_RANK_ENVIRONMENT] = True  # not torchrun's: the job stays simulated
        os.environ.update(wanted)
    return (yield)


def _simulated_static(args: list[str]) -> bool:
    """Whether this is ``--multigpu-static`` on simulated ranks (not under torchrun, not spawned)."""
    from meshsim._modes.torchrun import static_environment

    return "--multigpu-static" in args and static_environment() is None


@pytest.hookimpl(tryfirst=True)
def pytest_configure(config: pytest.Config) -> None:
    """Refuse what gloo thread ranks cannot give; declare the conftests' modules and the named libraries."""
    state = state_of(config)
    names = per_rank_module_names(config)
    if state.suite != "static" or state.static is not None or config.getoption("mesh_backend") == "spawn":
        return
    if state.unmarked != "ranks" and not names:
        return
    if state.backend != "sim":
        what = "--mesh-unmarked=ranks" if state.unmarked == "ranks" else "--mesh-per-rank-modules"
        raise pytest.UsageError(
            f"{what} gives each simulated rank its own imports, swapped in whenever it runs; "
            f"--mesh-backend={state.backend} thread ranks run at once and would share them. "
            "Use --mesh-backend=sim (the default) or spawn"
        )
    from meshsim._engine import per_rank_module

    declared = config.stash.setdefault(_DECLARED, [])
    if names:
        try:
            declared.append(per_rank_module(*names))
        except (ImportError, ValueError) as error:
            raise pytest.UsageError(f"--mesh-per-rank-modules / mesh_per_rank_modules: {error}") from None
    if state.unmarked == "ranks":
        _declare_user_modules(config)


def pytest_collection_finish(session: pytest.Session) -> None:
    """The test modules (and the helpers they import) collection loaded: each rank imports them itself."""
    if session.config.stash.get(_DECLARED, None) is not None and state_of(session.config).unmarked == "ranks":
        _declare_user_modules(session.config)


def _declare_user_modules(config: pytest.Config) -> None:
    from meshsim._engine import declared_modules, per_rank_module
    from meshsim._pytest.simjob import is_user_code

    known = set(declared_modules())
    plugins = _plugin_files(config)
    modules = [
        module
        for name, module in list(sys.modules.items())
        if name not in known
        and name != "__main__"
        and _runs_again(module)
        and is_user_code(module.__file__, config.rootpath, plugins)
    ]
    if modules:
        config.stash[_DECLARED].append(per_rank_module(*modules))


def _runs_again(module: ModuleType | None) -> bool:
    """A module whose source a rank can run again (not a namespace package or a C extension)."""
    path = getattr(module, "__file__", None)
    loader = getattr(getattr(module, "__spec__", None), "loader", None)
    return bool(path) and str(path).endswith(".py") and hasattr(loader, "exec_module")


def _plugin_files(config: pytest.Config) -> tuple[str, ...]:
    from meshsim._pytest.simjob import plugin_files

    return plugin_files(config)


@pytest.hookimpl(trylast=True)
def pytest_unconfigure(config: pytest.Config) -> None:
    """Undo the declarations and put the pytest process's environment back."""
    declared: list[Any] = config.stash.get(_DECLARED, [])
    for handle in reversed(declared):
        handle.remove()
    config.stash[_DECLARED] = []
    saved = config.stash.get(_SAVED_ENVIRON, None)
    if saved is not None:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
        del config.stash[_SAVED_ENVIRON]
