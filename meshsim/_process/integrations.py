"""Per-rank state of the code ranks run, declared when (and only when) that code loads.

What a process owns once and a test may change inside a rank is per rank
(:mod:`meshsim._process.handover`), swapped at every hand-over:

- ``warnings``: the filters, ``showwarning`` and its implementation, the default
  action and the once-registry, so that ``warnings.catch_warnings`` and
  ``assertWarns`` in a rank see that rank's warnings only;
- ``torch.nn.modules.module``: the global module hooks (``register_module_forward_hook``
  and kin, which ``CommDebugMode``'s module tracker uses), so a rank's hooks see
  its own modules;
- torch.distributed flags that context managers set in a rank
  (``use_min_cost_redistribution_plan``) and DTensor's RNG tracker, so that ranks
  do not restore each other's saved values and the caller's value is back after
  the world (``implicit_replication`` is per thread in torch itself);
- DTensor's custom operator handlers (``DTensor._op_dispatcher._custom_op_handlers``),
  which ``loss_parallel()`` fills on entry and empties on exit, so that one rank's
  exit does not take away another's handlers;
- PhysicsNeMo's ``DistributedManager``, a Borg whose class-level ``_shared_state``
  holds ``rank``, ``world_size``, ``local_rank``, ``device``, meshes and groups:
  each rank starts empty, as a newly started process would. Its ``initialize()``
  then runs inside each rank as under torchrun (the rank's ``init_process_group``
  adopts its group, see :mod:`meshsim._process.patches`).

A module is never imported for this: a declaration is made when it is already
loaded as a world starts, or as it finishes loading while a world runs (an import
hook, installed only while worlds run). Ranks start from shallow copies of the
caller's values (as after a fork; hook tables hold functions bound to live objects);
empty hook tables and the warnings state start as one copy every rank shares until a
rank changes it (see :class:`meshsim._process.handover.WorldSlots`).
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import sys
from collections.abc import Callable, Sequence
from types import ModuleType
from typing import Any

from meshsim._process.handover import declare, declared, per_rank

__all__ = ["ImportHook", "install"]


def _physicsnemo_manager(module: ModuleType) -> None:
    manager = getattr(module, "DistributedManager", None)
    if isinstance(manager, type) and isinstance(vars(manager).get("_shared_state"), dict):
        if not declared(manager, "_shared_state"):
            per_rank(manager, "_shared_state", fresh=dict)


def _warnings(module: ModuleType) -> None:
    # The C part of warnings reads these from the module on every warning (3.10-3.13), and
    # caches per-location decisions under a version of the filters that must move when
    # the filters do: catch_warnings bumps it on entry and exit, so does a swap here.
    mutated = getattr(module, "_filters_mutated", None) or getattr(module, "_filters_mutated_lock_held", None)
    for name in ("filters", "onceregistry"):
        if hasattr(module, name):
            declare(module, name, after_set=mutated, share="unchanged")
    for name in ("showwarning", "_showwarnmsg_impl", "defaultaction"):
        if hasattr(module, name):
            declare(module, name)


_MODULE_HOOKS = (
    "_global_buffer_registration_hooks",
    "_global_module_registration_hooks",
    "_global_parameter_registration_hooks",
    "_global_backward_pre_hooks",
    "_global_backward_hooks",
    "_global_is_full_backward_hook",
    "_global_forward_pre_hooks",
    "_global_forward_hooks",
    "_global_forward_hooks_always_called",
    "_global_forward_hooks_with_kwargs",
)


def _module_hooks(module: ModuleType) -> None:
    for name in _MODULE_HOOKS:  # checked in torch 2.11-2.15
        if hasattr(module, name):
            declare(module, name, share="empty")


def _c10d_globals(module: ModuleType) -> None:
    # init_process_group sets them and nothing resets them (checked in 2.11-2.15)
    for name in ("_backend", "_default_pg_init_method"):
        if hasattr(module, name):
            declare(module, name, duplicate=_same)


def _redistribute_flags(module: ModuleType) -> None:
    for name in ("_FORCE_MIN_COST_REDISTRIBUTION_PLAN", "_DISABLE_REDISTRIBUTE_TRANSFORM_OPTIMIZATION"):
        if hasattr(module, name):
            declare(module, name)


def _dtensor_rng(module: ModuleType) -> None:
    if hasattr(module, "_rng_tracker"):
        declare(module, "_rng_tracker", duplicate=_same)  # None until a rank makes its own


def _dtensor_handlers(module: ModuleType) -> None:
    # loss_parallel() adds its handlers on entry and pops them on exit; context parallel
    # rebinds the dict and binds the saved one back. torch's C++ dispatch reads the
    # attribute on every DTensor op (checked in 2.11-2.15). Ranks share one copy until
    # one changes it: a hand-over compares about ten entries.
    dtensor = getattr(module, "DTensor", None)
    dispatcher = getattr(dtensor, "_op_dispatcher", None)
    if isinstance(getattr(dispatcher, "_custom_op_handlers", None), dict):
        declare(dispatcher, "_custom_op_handlers", share="unchanged")


def _same(value: Any) -> Any:
    return value


# the module objects whose state is declared (a reloaded module is a new object)
_DECLARED: dict[str, ModuleType] = {}

# module name -> what to declare once it has loaded
_INTEGRATIONS: dict[str, Callable[[ModuleType], None]] = {
    "warnings": _warnings,
    "torch.nn.modules.module": _module_hooks,
    "torch.distributed.distributed_c10d": _c10d_globals,
    "torch.distributed.tensor._redistribute": _redistribute_flags,
    "torch.distributed.tensor._random": _dtensor_rng,
    "torch.distributed.tensor._api": _dtensor_handlers,
    "physicsnemo.distributed.manager": _physicsnemo_manager,
}


def install() -> Callable[[], None]:
    """Declare the per-rank state of the integrated modules, imported now or later; returns the undo step.

    Modules already imported are declared at once; an :class:`ImportHook` at the
    front of ``sys.meta_path`` declares the others as they load, until undone.
    """
    hook = ImportHook()
    sys.meta_path.insert(0, hook)
    for name, declare_state in _INTEGRATIONS.items():
        module = sys.modules.get(name)
        if module is not None and module is not _DECLARED.get(name):
            declare_state(module)
            _DECLARED[name] = module  # declarations last: the next world need not look again

    def undo() -> None:
        if hook in sys.meta_path:
            sys.meta_path.remove(hook)

    return undo


class ImportHook(importlib.abc.MetaPathFinder):
    """A finder that declares an integrated module's per-rank state as soon as it has loaded.

    It finds nothing itself: it asks the finders after it for the module's spec and
    wraps that spec's loader so that the declaration follows the module's execution.
    """

    def find_spec(
        self, fullname: str, path: Sequence[str] | None, target: ModuleType | None = None
    ) -> importlib.machinery.ModuleSpec | None:
        declare_state = _INTEGRATIONS.get(fullname)
        if declare_state is None:
            return None
        spec = _find_with_others(self, fullname, path, target)
        loader: Any = spec.loader if spec is not None else None
        if loader is None or not hasattr(loader, "exec_module"):
            return spec
        execute = loader.exec_module

        def exec_module(module: ModuleType) -> None:
            execute(module)
            declare_state(module)
            _DECLARED[fullname] = module

        loader.exec_module = exec_module  # this spec's own loader object
        return spec


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
