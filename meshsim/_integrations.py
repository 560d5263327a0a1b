"""Per-rank state of projects meshsim's users run, declared when (and only when) those projects load.

PhysicsNeMo's ``DistributedManager`` is a Borg: every instance shares the
class-level ``_shared_state`` dict that holds ``rank``, ``world_size``,
``local_rank``, ``device``, meshes and groups. A torchrun process has one; each
simulated rank gets its own, starting empty as in a newly started process. Its
``initialize()`` then runs inside each rank as under torchrun (the rank's
``init_process_group`` adopts its group, see :mod:`meshsim._patches`).

A project is never imported for this: a declaration is made when its module is
already loaded as a world starts, or as the module finishes loading while a
world runs (an import hook, installed only while worlds run).
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import sys
from collections.abc import Callable, Sequence
from types import ModuleType
from typing import Any

from meshsim._perrank import declared, per_rank

__all__ = ["ImportHook", "declare_loaded"]


def _physicsnemo_manager(module: ModuleType) -> None:
    manager = getattr(module, "DistributedManager", None)
    if isinstance(manager, type) and isinstance(vars(manager).get("_shared_state"), dict):
        if not declared(manager, "_shared_state"):
            per_rank(manager, "_shared_state", fresh=dict)


# module name -> what to declare once it has loaded
_INTEGRATIONS: dict[str, Callable[[ModuleType], None]] = {
    "physicsnemo.distributed.manager": _physicsnemo_manager,
}


def declare_loaded() -> None:
    """Declare the per-rank state of every integrated module already imported."""
    for name, declare in _INTEGRATIONS.items():
        module = sys.modules.get(name)
        if module is not None:
            declare(module)


class ImportHook(importlib.abc.MetaPathFinder):
    """A finder that declares an integrated module's per-rank state as soon as it has loaded.

    It finds nothing itself: it asks the finders after it for the module's spec and
    wraps that spec's loader so that the declaration follows the module's execution.
    """

    def find_spec(
        self, fullname: str, path: Sequence[str] | None, target: ModuleType | None = None
    ) -> importlib.machinery.ModuleSpec | None:
        declare = _INTEGRATIONS.get(fullname)
        if declare is None:
            return None
        spec = _find_with_others(self, fullname, path, target)
        loader: Any = spec.loader if spec is not None else None
        if loader is None or not hasattr(loader, "exec_module"):
            return spec
        execute = loader.exec_module

        def exec_module(module: ModuleType) -> None:
            execute(module)
            declare(module)

        loader.exec_module = exec_module  # this spec's own loader object
        return spec

    def install(self) -> None:
        sys.meta_path.insert(0, self)

    def uninstall(self) -> None:
        if self in sys.meta_path:
            sys.meta_path.remove(self)


def _find_with_others(
    hook: ImportHook, fullname: str, path: Sequence[str] | None, target: ModuleType | None
) -> importlib.machinery.ModuleSpec | None:
    for finder in sys.meta_path:
        if finder is hook or not hasattr(finder, "find_spec"):
            continue
        spec = finder.find_spec(fullname, path, target)
        if spec is not None:
            return spec  # type: ignore[no-any-return]
    return None
