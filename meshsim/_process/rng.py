"""Per-rank Python ``random`` and NumPy legacy global RNGs for rank threads.

``random.seed``, ``random.random``, ``numpy.random.seed``, ``numpy.random.rand``
... are module-level functions bound to one process-wide generator. While a
world runs they are replaced by functions that use the calling rank's own
generator (a copy of the caller's state when the rank first draws, as after a
fork), and the caller's generator is left untouched. Threads that are not
ranks keep using the process-wide generators. The replacements are removed
when the world ends.

Code that took a reference before the world (``from random import random``)
bypasses this; torch's own RNG is swapped per rank by the scheduler instead
(see :mod:`meshsim._process.state`).
"""

from __future__ import annotations

import random
import sys
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, cast

from meshsim._base.context import current

__all__ = ["enter_rank", "install", "leave_rank", "numpy_fingerprint"]

_NUMPY_ALIASES = {"seed": "seed", "sample": "random_sample", "ranf": "random_sample"}
# (module, name, original, router): routers are built once per original function,
# since a world installs them on every start (this runs in a world's set-up time).
_Route = tuple[Any, str, Any, Callable[..., Any]]
_routes: dict[tuple[int, str], _Route] = {}


def _python_names() -> dict[str, str]:
    inst = random._inst  # type: ignore[attr-defined]
    return {
        n: n
        for n in dir(random)
        if not n.startswith("_") and getattr(getattr(random, n), "__self__", None) is inst
    }


def _numpy_names(nprandom: Any) -> dict[str, str]:
    state = nprandom.mtrand._rand
    names = {
        n: n
        for n in dir(nprandom)
        if not n.startswith("_") and getattr(getattr(nprandom, n), "__self__", None) is state
    }
    names.update({k: v for k, v in _NUMPY_ALIASES.items() if hasattr(nprandom, k)})
    return names


def _python_generator() -> Any:
    here = current()
    gen = here.python_rng
    if gen is None:
        gen = random.Random()
        gen.setstate(random._inst.getstate())  # type: ignore[attr-defined]
        here.python_rng = gen
    return gen


def _numpy_generator() -> Any:
    here = current()
    gen = here.numpy_rng
    if gen is None:
        nprandom = sys.modules["numpy.random"]
        gen = nprandom.RandomState()
        gen.set_state(nprandom.mtrand._rand.get_state())
        here.numpy_rng = gen
    return gen


def _router(original: Callable[..., Any], method: str, pick: Callable[[], Any]) -> Callable[..., Any]:
    here = current()

    def routed(*args: Any, **kwargs: Any) -> Any:
        if not here.own_rng:
            return original(*args, **kwargs)
        return getattr(pick(), method)(*args, **kwargs)

    routed.__name__ = getattr(original, "__name__", method)
    routed.__doc__ = getattr(original, "__doc__", None)
    routed.__wrapped__ = original  # type: ignore[attr-defined]
    return routed


@dataclass(frozen=True)
class _ModulePlan:
    """One module's routes, as the mappings a world's start and end write into its namespace."""

    namespace: dict[str, Any]
    names: tuple[str, ...]
    originals: tuple[Any, ...]
    routed: dict[str, Any]
    restored: dict[str, Any]

    def current(self) -> tuple[Any, ...]:
        return tuple(map(self.namespace.get, self.names))


def _plan() -> list[_ModulePlan]:
    modules: list[tuple[Any, dict[str, str], Callable[[], Any]]] = [
        (random, _python_names(), _python_generator)
    ]
    nprandom = sys.modules.get("numpy.random")
    if nprandom is not None:
        modules.append((nprandom, _numpy_names(nprandom), _numpy_generator))
    return [_module_plan(module, names, pick) for module, names, pick in modules]


def _module_plan(module: Any, names: dict[str, str], pick: Callable[[], Any]) -> _ModulePlan:
    routes = []
    for name, method in names.items():
        original = getattr(module, name)
        route = _routes.get((id(module), name))
        if route is None or route[2] is not original:
            route = (module, name, original, _router(original, method, pick))
            _routes[(id(module), name)] = route
        routes.append(route)
    return _ModulePlan(
        cast(dict[str, Any], module.__dict__),  # a module's namespace: a plain dict
        tuple(name for _, name, _, _ in routes),
        tuple(original for _, _, original, _ in routes),
        {name: routed for _, name, _, routed in routes},
        {name: original for _, name, original, _ in routes},
    )


_plans: dict[tuple[int, int], list[_ModulePlan]] = {}


def install() -> Callable[[], None]:
    """Route the module-level RNG functions per rank; returns the step that puts them back."""
    key = (id(random.random), id(sys.modules.get("numpy.random")))
    plan = _plans.get(key)
    # rebuilt when a module's functions were rebound since (monkeypatching, a reload)
    if plan is None or any(part.current() != part.originals for part in plan):
        plan = _plans[key] = _plan()
    for part in plan:
        part.namespace.update(part.routed)  # one call per module: this runs at every world's start

    def undo() -> None:
        for part in reversed(plan):
            part.namespace.update(part.restored)

    return undo


def enter_rank() -> None:
    """Give the calling thread its own generators (created on first draw)."""
    here = current()
    here.own_rng = True
    here.python_rng = here.numpy_rng = None


def leave_rank() -> None:
    here = current()
    here.own_rng = False
    here.python_rng = here.numpy_rng = None


def numpy_fingerprint() -> Any:
    """Something equal exactly when NumPy's global RNG is in the same state (None without NumPy)."""
    nprandom = sys.modules.get("numpy.random")
    if nprandom is None:
        return None
    _, keys, pos, has_gauss, gauss = nprandom.mtrand._rand.get_state()
    return (keys.tobytes(), pos, has_gauss, gauss)
