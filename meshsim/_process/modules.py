"""Modules each simulated rank imports for itself: their globals per rank, as in a torchrun process.

Each torchrun process imports a module once, with its own environment: a helper's
``rank = int(os.environ["LOCAL_RANK"])`` is that process's rank, and a library's
module globals (Megatron's ``parallel_state._TENSOR_MODEL_PARALLEL_GROUP``) are that
process's groups. Rank threads share one import. :func:`per_rank_module` declares a
module whose whole namespace each rank owns; it is one more entry of the hand-over
registry (:mod:`meshsim._process.handover`), not a mechanism of its own:

- the module stays one object, in ``sys.modules`` and wherever code imported it or
  its functions: a function's globals are its module's namespace dict, and that dict's
  *contents* are what is swapped. So ``from parallel_state import get_group``, done
  anywhere before or after, reads the running rank's globals. (Per-rank copies of the
  module object in ``sys.modules`` would leave every earlier importer on one copy.)
- a rank's value of the entry is the namespace's contents; a hand-over saves them
  (a shallow copy of the dict, in C) and loads the incoming rank's (``clear`` and
  ``update``).
- each rank runs the module's code itself, in its own rank thread with its own
  environment, before the first call of a world that it runs (:func:`import_pending`):
  its starting value is *pending* until then. The caller's namespace is back between
  calls and when the world ends. A declared module that another declared module imports
  (``from helpers import Utils``) runs first, so the importer binds the rank's own.

Costs: every world runs every declared module's code once per rank (a failed test ends
a session's world, and the next one runs them again, as a relaunched job would), and
every hand-over copies the declared namespaces. What cannot work: ranks that run at once
(gloo thread ranks, ``serialize=False``) would share one namespace; a world refuses to
start there while modules are declared (:func:`refuse_unserialized`). Classes a module
defines are made once per rank: an object made by one rank's class is not an instance
of another rank's. C extension modules cannot be run twice and are refused.
"""

from __future__ import annotations

import builtins
import importlib
import sys
from collections.abc import Callable, Iterable
from types import ModuleType
from typing import Any

from meshsim._process.handover import PerRankState, Slot, add_slots, declared_slots

__all__ = ["ModuleSlot", "declared_modules", "import_pending", "per_rank_module", "refuse_unserialized"]

# What the import system puts in a module's namespace before its code runs.
_IMPORT_SET = (
    "__name__",
    "__doc__",
    "__package__",
    "__loader__",
    "__spec__",
    "__path__",
    "__file__",
    "__cached__",
    "__builtins__",
)
_PENDING: Any = type("_Pending", (), {"__repr__": lambda self: "<not imported by this rank yet>"})()
_REFUSED = ("meshsim", "torch", "builtins", "sys", "importlib", "pytest", "_pytest")

_by_name: dict[str, ModuleSlot] = {}  # every declared module, by name, in declaration order
_pending: set[ModuleSlot] = set()  # the declared modules the running rank has not run yet


class ModuleSlot(Slot):
    """A module whose namespace each rank owns: its value is the namespace's contents, or pending."""

    __slots__ = ("module", "namespace", "pending")
    retake_caller = True

    def __init__(self, module: ModuleType) -> None:
        self.owner = module
        self.name = None
        self.fresh = None
        self.label = module.__name__
        self.duplicate = dict
        self.after_set = None
        self.share = None
        self.pristine = None
        self.module = module
        self.namespace = vars(module)
        self.pending = False

    def get(self) -> Any:
        return _PENDING if self.pending else dict(self.namespace)

    def set(self, value: Any) -> None:
        if value is _PENDING:
            self.pending = True
            _pending.add(self)
            return
        if self.pending:
            self.pending = False
            _pending.discard(self)
        namespace = self.namespace
        namespace.clear()
        namespace.update(value)

    def start(self, caller: Any, rank: int = 0) -> Any:
        return _PENDING

    def starts(self, caller: Any, world_size: int) -> list[Any]:
        return [_PENDING] * world_size

    def moved(self, before: Any, now: Any) -> bool:
        return False  # what the caller's namespace holds between calls is the caller's own

    def joined_late(self, rank: int | None = None) -> Any:
        return self.get() if rank is None else _PENDING

    def copy(self, value: Any) -> Any:
        return value if value is _PENDING else dict(value)

    def run(self) -> None:
        """Run the module's code in the running rank, from a namespace as the import system leaves it."""
        self.pending = False
        _pending.discard(self)
        namespace = self.namespace
        kept = {key: namespace[key] for key in _IMPORT_SET if key in namespace}
        prefix = self.label + "."
        submodules = {  # set on a package by the import of each submodule, not by its code
            key: value
            for key, value in namespace.items()
            if isinstance(value, ModuleType) and value.__name__ == prefix + key
        }
        namespace.clear()
        namespace.update(kept)
        try:
            self.module.__spec__.loader.exec_module(self.module)  # type: ignore[union-attr]
        except BaseException as error:
            error.add_note(
                f"meshsim: raised while this rank imported {self.label} for itself "
                "(declared per rank: each rank runs its code, as each torchrun process does)"
            )
            raise
        finally:
            for key, value in submodules.items():
                namespace.setdefault(key, value)


def per_rank_module(*modules: str | ModuleType) -> PerRankState:
    """Declare modules that each simulated rank imports for itself: their globals are per rank.

    Each rank of a serialized world (the ``sim`` backend) runs the module's code once,
    in its own thread, with its own ``RANK`` / ``LOCAL_RANK`` and devices, before the
    first call it runs, as each torchrun process imports it; whenever the rank runs,
    the module's globals are its own (``parallel_state._TENSOR_MODEL_PARALLEL_GROUP``,
    a helper's ``rank = int(os.environ["LOCAL_RANK"])``). The module stays one object:
    functions imported from it anywhere read the running rank's globals. Between calls
    and after the world, the caller's are back::

        meshsim.per_rank_module("megatron.core.parallel_state", "tests.unit_tests.test_utilities")

    Args:
        modules: module names (imported now if they are not yet) or modules. A name
            also covers its submodules imported by now.

    Returns:
        a handle whose ``remove()`` (or the end of a ``with`` block) undoes the declaration.

    Raises:
        TypeError: an argument is neither a module nor a name.
        ValueError: a module cannot run twice (a C extension, a namespace package, meshsim,
            torch or the import system) or is declared per rank already.
        ImportError: a name cannot be imported.
    """
    found: list[ModuleType] = []
    for given in modules:
        for module in _modules_of(given):
            if module not in found and module.__name__ not in _by_name:
                found.append(module)
    slots = tuple(ModuleSlot(_runnable(module)) for module in found)
    for slot in slots:
        _refuse_overlap(slot)
    handle = add_slots(slots, on_remove=_forget)
    _by_name.update((slot.label, slot) for slot in slots)
    return handle


def _modules_of(given: str | ModuleType) -> list[ModuleType]:
    if isinstance(given, ModuleType):
        return [given]
    if not isinstance(given, str):
        raise TypeError(f"per_rank_module() takes module names or modules, got {given!r}")
    if not given or not all(part.isidentifier() for part in given.split(".")):
        raise ValueError(f"per_rank_module(): {given!r} is not a module name (dotted identifiers)")
    top = importlib.import_module(given)
    prefix = given + "."
    return [top] + [m for name, m in list(sys.modules.items()) if name.startswith(prefix) and m is not None]


def _runnable(module: ModuleType) -> ModuleType:
    """``module``, if its code can run again in a rank; else a ValueError that says why not."""
    name = module.__name__
    if name.split(".")[0] in _REFUSED:
        raise ValueError(
            f"per_rank_module({name!r}): meshsim, torch, pytest and the import system are one per process"
        )
    spec = getattr(module, "__spec__", None)
    loader = getattr(spec, "loader", None)
    if loader is None or not hasattr(loader, "exec_module") or getattr(module, "__file__", None) is None:
        raise ValueError(
            f"per_rank_module({name!r}): it has no code a rank could run again (a built-in or namespace "
            "package): declare the modules that hold the state"
        )
    if not str(module.__file__).endswith(".py"):
        raise ValueError(
            f"per_rank_module({name!r}): {module.__file__} is a C extension, which cannot be imported "
            "twice; declare its state with meshsim.per_rank(...) instead"
        )
    return module


def _refuse_overlap(slot: ModuleSlot) -> None:
    names = [other.label for other in declared_slots() if other.owner is slot.owner]
    if names:
        raise ValueError(
            f"per_rank_module({slot.label!r}): {', '.join(names)} {'is' if len(names) == 1 else 'are'} "
            "declared per rank already; the module's whole namespace would include "
            f"{'it' if len(names) == 1 else 'them'}: remove that declaration first"
        )


def _forget(slots: Iterable[Slot]) -> None:
    for slot in slots:
        if isinstance(slot, ModuleSlot) and _by_name.get(slot.label) is slot:
            del _by_name[slot.label]
            _pending.discard(slot)


def declared_modules() -> list[str]:
    """The names of the modules declared per rank, in declaration order."""
    return list(_by_name)


def refuse_unserialized(where: str) -> None:
    """Raise when modules are declared per rank and ranks would run at once (``where`` says how).

    Raises:
        RuntimeError: naming the modules and what to do.
    """
    if _by_name:
        names = ", ".join(_by_name)
        raise RuntimeError(
            f"modules declared per rank ({names}) need ranks that run one at a time, each swapping in "
            f"its own globals; {where} runs ranks at once, so they would share one copy of each "
            "module, and the last rank's writes would win. Use the sim backend (pytest "
            "--mesh-backend=sim), or spawn / torchrun (processes), or remove the declaration"
        )


def import_pending() -> None:
    """Run, in the running rank, every declared module it has not imported for itself yet.

    Runs at the start of each call of a world; nothing to do (one set's truth test) once
    the rank has run them. A declared module that a running one imports runs first.
    """
    if not _pending:
        return
    original = builtins.__import__
    builtins.__import__ = _importing(original)
    try:
        for slot in list(_by_name.values()):
            if slot.pending:
                slot.run()
    finally:
        builtins.__import__ = original


def _importing(original: Callable[..., ModuleType]) -> Callable[..., ModuleType]:
    """``__import__`` that first runs, in this rank, the pending declared modules an import reaches."""

    def __import__(
        name: str,
        globals: dict[str, Any] | None = None,
        locals: Any = None,
        fromlist: Any = (),
        level: int = 0,
    ) -> ModuleType:
        module = original(name, globals, locals, fromlist, level)
        if _pending:
            full = _absolute(name, globals, level)
            wanted = [".".join(full.split(".")[: i + 1]) for i in range(full.count(".") + 1)]
            wanted += [f"{full}.{each}" for each in fromlist or () if isinstance(each, str)]
            for each in wanted:
                slot = _by_name.get(each)
                if slot is not None and slot.pending:
                    slot.run()
        return module

    return __import__


def _absolute(name: str, globals: dict[str, Any] | None, level: int) -> str:
    if not level:
        return name
    package = (globals or {}).get("__package__") or ""
    base = package.rsplit(".", level - 1)[0] if level > 1 else package
    return f"{base}.{name}" if name else base
