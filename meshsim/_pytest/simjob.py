"""``pytest --multigpu-static`` without torchrun: the static suite on simulated ranks, set up as by torchrun.

Under ``torchrun ... pytest --multigpu-static`` every process runs the whole
session: the conftest's ``pytest_configure`` (which typically initializes a
distributed manager and registers plugins), session-scoped fixtures (meshes,
groups), each test, and ``pytest_sessionfinish`` (clean-up). :class:`SimulatedJob`
gives that to simulated ranks: one world (a :class:`meshsim._engine.session.Session`)
lives for the session, and what a torchrun process would do once, each rank does
once, inside the rank, with the rank's state:

- the per-process hooks of the user's own plugins (conftest files, the
  plugins they register, and ``-p`` plugins; the user's code, not installed packages):
  ``pytest_configure`` and ``pytest_sessionstart`` run on every rank as the
  world's set-up, ``pytest_sessionfinish`` and ``pytest_unconfigure`` as its end.
  A plugin registered by such a hook is registered with pytest once (by the
  first rank); the other ranks run its ``pytest_configure`` as they would have
  on registering it;
- user fixtures the ranks need (see :mod:`meshsim.pytest_plugin`), each rank
  building its own value, kept for the fixture's scope;
- every ``multigpu_static`` test body.

A test that fails ends the world, as a failure ends a torchrun job: the next
test starts a new one, whose ranks run the set-up hooks again and build
session fixtures afresh when next needed.

What it cannot do: hooks that pytest itself needs the result of in its own
process (collection, reporting, ``pytest_runtest_*``) run once, in the pytest
process; so do function-scoped fixtures that need no per-rank value.
"""

from __future__ import annotations

import inspect
import os
import sys
import sysconfig
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import pytest

from meshsim._base import MESHSIM_DIR
from meshsim._base.context import current
from meshsim._engine import Ledger, Session, restart_numbering
from meshsim._modes.fixtures import PerRank, RankFixtures, resolve
from meshsim._modes.thread_ranks import local_device

__all__ = ["PER_PROCESS_HOOKS", "SimulatedJob", "is_user_code", "plugin_files"]

SETUP_HOOKS = ("pytest_configure", "pytest_sessionstart")
TEARDOWN_HOOKS = ("pytest_sessionfinish", "pytest_unconfigure")
PER_PROCESS_HOOKS = SETUP_HOOKS + TEARDOWN_HOOKS

_INSTALLED = tuple(
    {os.path.abspath(p) + os.sep for key in ("purelib", "platlib") if (p := sysconfig.get_paths().get(key))}
)


def is_user_code(path: str | os.PathLike[str] | None, rootpath: Path, plugins: tuple[str, ...] = ()) -> bool:
    """Whether ``path`` is the user's own code: not meshsim, not an installed package.

    It must be under the rootdir or one of ``plugins`` (the files and folders of the
    user's ``-p`` plugins, :func:`plugin_files`).
    """
    if not path:
        return False
    full = os.path.abspath(path)
    if full.startswith(MESHSIM_DIR) or full.startswith(_INSTALLED):
        return False
    parts = Path(full).parts
    if "site-packages" in parts or "dist-packages" in parts:
        return False
    return Path(full).is_relative_to(rootpath) or any(
        full == plugin or full.startswith(plugin + os.sep) for plugin in plugins
    )


_PLUGIN_FILES = pytest.StashKey[tuple[str, ...]]()


def plugin_files(config: pytest.Config) -> tuple[str, ...]:
    """Where the plugins named with ``-p`` live, when they are the user's own code (not installed).

    Under torchrun every process runs them as it runs the rootdir's conftests: their
    per-process hooks and the fixtures ranks need run on every rank. A plugin module is
    its file; a package, its folder.
    """
    found = config.stash.get(_PLUGIN_FILES, None)
    if found is not None:
        return found
    files: list[str] = []
    for name in getattr(config.option, "plugins", None) or []:
        module = sys.modules.get(name) if isinstance(name, str) and not name.startswith("no:") else None
        path = getattr(module, "__file__", None)
        if path is None:
            continue
        full = os.path.abspath(path)
        if os.path.basename(full) == "__init__.py":
            full = os.path.dirname(full)
        if is_user_code(full, Path(full).parent):  # not meshsim, not installed
            files.append(full)
    config.stash[_PLUGIN_FILES] = result = tuple(files)
    return result


class SimulatedJob:
    """The simulated torchrun job of one ``pytest --multigpu-static`` session (registered as a plugin).

    Args:
        config: the pytest config.
        world_size: ranks of the job (``--world-size``).
        backend: ``"sim"`` or ``"gloo"``.
        timeout: the world's timeout (``--mesh-timeout``).
        num_threads: each rank's intra-op threads (``MESHSIM_NUM_THREADS``).
        cuda: the CUDA emulation (``--mesh-cuda``, resolved; None: off).
    """

    def __init__(
        self,
        config: pytest.Config,
        world_size: int,
        backend: str,
        timeout: float,
        num_threads: int | str | None = 1,
        *,
        cuda: Any = None,
    ) -> None:
        self.config = config
        self.world_size = world_size
        self.backend = backend
        self.session = Session(
            world_size, backend=backend, timeout=timeout, num_threads=num_threads, cuda=cuda
        )
        if cuda is not None and backend == "sim":  # each rank on its local GPU, as torchrun ranks
            # (gloo thread ranks run at once and share one current device: none takes its own)
            self.session.add_setup(local_device)
        self._fixtures: dict[int, RankFixtures] = {}  # each rank's, in the current world
        self._fixtures_world = 0  # which world they belong to
        self._wrapped: list[tuple[Any, Callable[..., Any]]] = []  # (hook impl, its own function)
        self._undo: list[Callable[[], None]] = []

    # -- the pytest process's side ------------------------------------------------

    def start(self) -> None:
        """Route the user's per-process hooks to the ranks, from now until :meth:`stop`."""
        manager = self.config.pluginmanager
        for name in PER_PROCESS_HOOKS:
            self._route(name, getattr(manager.hook, name).get_hookimpls())
        self._undo.append(manager.add_hookcall_monitoring(self._before_hook, _after_hook))
        original = manager.register
        manager.register = self._register_on_rank(original)  # type: ignore[method-assign]
        self._undo.append(lambda: vars(manager).pop("register", None))

    def stop(self) -> None:
        """End the world (running the user's clean-up hooks already ran there) and undo :meth:`start`."""
        try:
            self.session.close()
        finally:
            for undo in reversed(self._undo):
                undo()
            self._undo.clear()
            for impl, function in self._wrapped:
                impl.function = function
            self._wrapped.clear()

    def run_test(
        self, test: Callable[..., object], funcargs: dict[str, Any], *, record: bool = False
    ) -> list[Ledger | None]:
        """Run a test body on every rank of the job's world.

        Returns:
            each rank's ledger of the body, rank 0's first: recorded when ``record`` is
            true or the test asked for its ``ledger``, else None.
        """
        return self.session.call(self._body, test, funcargs, record, name=getattr(test, "__name__", None))

    def build_fixture(self, placeholder: PerRank) -> None:
        """Build a user fixture on every rank now, where pytest sets it up; raises as a test body's call.

        A skip or failure there stops the test's set-up at that fixture, as in each
        torchrun process: the fixtures pytest would set up after it are not reached.
        """
        self.session.call(self._build, placeholder, name=f"fixture {placeholder.name}")

    def finish_fixture(self, key: object, world: int) -> None:
        """Tear down a user fixture on the ranks that built it (if their world still runs)."""
        if self.session.running and world == self.session.worlds:
            self.session.call(self._finish, key)

    def world(self) -> int:
        """The current (or next) world's number: fixtures built in another are gone."""
        return self.session.worlds if self.session.running else self.session.worlds + 1

    # -- hooks of the user's plugins ----------------------------------------------

    def _before_hook(self, hook_name: str, hook_impls: Sequence[Any], kwargs: Mapping[str, object]) -> None:
        if hook_name in PER_PROCESS_HOOKS:
            self._route(hook_name, hook_impls)

    def _route(self, hook_name: str, impls: Sequence[Any]) -> None:
        wrapped = {id(impl) for impl, _ in self._wrapped}
        for impl in impls:
            if id(impl) in wrapped or not _is_user_plugin(impl.plugin, self.config):
                continue
            self._wrapped.append((impl, impl.function))
            impl.function = self._dispatcher(hook_name, impl.function)

    def _dispatcher(self, hook_name: str, function: Callable[..., Any]) -> Callable[..., Any]:
        job = self

        def on_the_ranks(*args: Any) -> Any:
            if current().c10d is not None:
                return function(*args)  # already on a rank (a plugin registered by a rank)
            if hook_name in SETUP_HOOKS:
                job.session.add_setup(function, *args)
                if not job.session.running:
                    job.session.call(_nothing)  # starts the world, which runs the set-up
                return None
            if job.session.running:
                return job.session.call(function, *args)[0]
            return None  # no world: nothing was set up to clean

        on_the_ranks.__name__ = getattr(function, "__name__", hook_name)
        on_the_ranks.__wrapped__ = function  # type: ignore[attr-defined]
        return on_the_ranks

    def _register_on_rank(self, register: Callable[..., Any]) -> Callable[..., Any]:
        manager = self.config.pluginmanager
        config = self.config

        def register_plugin(plugin: Any, name: str | None = None) -> str | None:
            if current().c10d is not None and manager.is_registered(plugin):
                # Registered by another rank (or an earlier world): do what registering
                # it would have done here, under torchrun, in this rank's process.
                configure = getattr(plugin, "pytest_configure", None)
                if callable(configure):
                    wants = inspect.signature(configure).parameters
                    configure(**({"config": config} if "config" in wants else {}))
                return manager.get_name(plugin)
            result: str | None = register(plugin, name)
            return result

        return register_plugin

    # -- the ranks' side -------------------------------------------------------------

    def _rank_fixtures(self) -> RankFixtures:
        context = current().seat
        assert context is not None  # runs in a rank thread
        if self._fixtures_world != self.session.worlds:
            self._fixtures, self._fixtures_world = {}, self.session.worlds
        return self._fixtures.setdefault(context.rank, RankFixtures())

    def _body(self, test: Callable[..., object], funcargs: dict[str, Any], record: bool) -> Ledger | None:
        fixtures = self._rank_fixtures()
        # Each test's ledger is its own and numbers each group's calls from 0, as a
        # new world (or a torchrun static test) does.
        fixtures.ledger = None
        restart_numbering()
        if record:
            fixtures.open_ledger()
        kwargs = resolve(funcargs, fixtures)
        with fixtures.recording():
            test(**kwargs)
        ledger, fixtures.ledger = fixtures.ledger, None
        fixtures.finish(scope="function")
        return ledger

    def _build(self, placeholder: PerRank) -> None:
        placeholder.build(self._rank_fixtures())

    def _finish(self, key: object) -> None:
        self._rank_fixtures().finish(key)


def _nothing() -> None:
    """A call that only starts the world."""


def _after_hook(
    outcome: object, hook_name: str, hook_impls: Sequence[Any], kwargs: Mapping[str, object]
) -> None:
    """Nothing to do after hooks (add_hookcall_monitoring needs both)."""


def _is_user_plugin(plugin: object, config: pytest.Config) -> bool:
    return is_user_code(getattr(plugin, "__file__", None), config.rootpath, plugin_files(config))
