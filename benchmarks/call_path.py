"""The path of one ``dist.all_reduce`` on simulated ranks, module by module, and its return trips.

Prints, for each rank of a 2-rank world whose ranks record a ledger, the meshsim
modules its call passes through, in order (consecutive calls within one module
collapsed), and counts the *return trips*: calls into a meshsim module the call
already passed through (control coming back to a module it had left). Trips into
or out of the observers (``_observe``; ``_ledger``, ``_sites``, ``_findings``,
``_trace``, ``_recorder`` in the flat layout of earlier versions) are counted apart.

    python benchmarks/call_path.py            # this checkout
    PYTHONPATH=/path/to/other/checkout python benchmarks/call_path.py

It also classifies every call from one meshsim module into another by the static import
graph (each module's imports, ``if TYPE_CHECKING:`` blocks left out, followed transitively):
*down* when the caller's module imports the callee's, *up* when only the callee's imports the
caller's (a lower layer calling back into a higher one), *cycle* when each imports the other,
*lateral* when neither does (a call through an object handed over), and counts the calls
against the import direction (up or cycle), the observers' apart.

It reads module names from file paths, so it runs on any version of meshsim.
"""

from __future__ import annotations

import ast
import os
import sys
import threading
from typing import Any

import torch
import torch.distributed as dist

import meshsim

ROOT = os.path.dirname(os.path.abspath(meshsim.__file__)) + os.sep
OBSERVERS = ("_observe/", "_ledger", "_sites", "_findings", "_trace", "_recorder")


def _module(filename: str) -> str | None:
    if not filename.startswith(ROOT):
        return None
    return filename[len(ROOT) :].removesuffix(".py")


def _observer(module: str) -> bool:
    return module.startswith(OBSERVERS)


def _imports(path: str, package: str) -> set[str]:
    """The meshsim modules (dotted, below ``meshsim.``; ``""``: the package) the file imports at run time."""
    with open(path, encoding="utf-8") as source:
        tree = ast.parse(source.read())
    typing_only = {
        id(inner)
        for node in ast.walk(tree)
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test)
        for inner in ast.walk(node)
    }
    found: set[str] = set()
    for node in ast.walk(tree):
        if id(node) in typing_only:
            continue
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative: from the file's package up
                parts = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(parts + ([base] if base else []))
            found.add(base)
            found.update(f"{base}.{alias.name}" for alias in node.names)  # submodules, if any
    # "" is the package itself (its __init__: ``from meshsim import run``)
    ours = [name for name in found if name.split(".")[0] == "meshsim"]
    return {name.removeprefix("meshsim").removeprefix(".") for name in ours}


def _import_graph() -> dict[str, set[str]]:
    """Per module (as :func:`_module` names it), the modules it imports, transitively."""
    files: dict[str, str] = {}  # dotted name -> key
    paths: dict[str, str] = {}
    for folder, _, names in os.walk(ROOT):
        for name in names:
            if name.endswith(".py"):
                path = os.path.join(folder, name)
                key = _module(path)
                assert key is not None  # below ROOT
                files[key.removesuffix("__init__").removesuffix("/").replace("/", ".")] = key
                paths[key] = path
    direct: dict[str, set[str]] = {}
    for key, path in paths.items():
        dotted = "meshsim." + key.replace("/", ".")  # the package a relative import starts from:
        package = dotted.removesuffix(".__init__") if key.endswith("__init__") else dotted.rsplit(".", 1)[0]
        direct[key] = {files[name] for name in _imports(path, package) if name in files}
    reach: dict[str, set[str]] = {}
    for key in direct:
        seen, todo = set(), list(direct[key])
        while todo:
            nxt = todo.pop()
            if nxt not in seen:
                seen.add(nxt)
                todo.extend(direct.get(nxt, ()))
        reach[key] = seen
    return reach


def _direction(caller: str, callee: str, reach: dict[str, set[str]]) -> str:
    down, up = callee in reach.get(caller, ()), caller in reach.get(callee, ())
    return "cycle" if down and up else "down" if down else "up" if up else "lateral"


class _Path:
    """One rank's calls: the module sequence and the return trips."""

    def __init__(self) -> None:
        self.stack: list[str | None] = []
        self.sequence: list[str] = []
        self.trips: list[tuple[str, str]] = []
        self.observer_trips: list[tuple[str, str]] = []
        self.calls: list[tuple[str, str, str]] = []  # (caller, callee, function) across modules

    def __call__(self, frame: Any, event: str, arg: Any) -> None:
        if event == "call":
            module = _module(frame.f_code.co_filename)
            caller = next((m for m in reversed(self.stack) if m is not None), None)
            if module is not None and module != caller:
                if caller is not None:
                    self.calls.append((caller, module, frame.f_code.co_name))
                if module in self.sequence:
                    observed = _observer(module) or (caller is not None and _observer(caller))
                    (self.observer_trips if observed else self.trips).append((caller or "?", module))
                if not self.sequence or self.sequence[-1] != module:
                    self.sequence.append(module)
            self.stack.append(module)
        elif event == "return" and self.stack:
            self.stack.pop()


def _body(paths: dict[int, _Path], lock: threading.Lock) -> None:
    t = torch.ones(4)
    dist.all_reduce(t)  # warm: groups, caches and sites are made once
    path = _Path()
    with meshsim.record():
        sys.setprofile(path)
        try:
            dist.all_reduce(t)
        finally:
            sys.setprofile(None)
    with lock:
        paths[dist.get_rank()] = path


def main() -> None:
    paths: dict[int, _Path] = {}
    lock = threading.Lock()
    meshsim.run(_body, 2, args=(paths, lock))
    reach = _import_graph()
    print(f"meshsim at {ROOT}")
    for rank in sorted(paths):
        path = paths[rank]
        modules = sorted(set(path.sequence))
        print(f"\nrank {rank}: {len(path.sequence)} module visits across {len(modules)} modules")
        print("  " + " -> ".join(path.sequence))
        print(f"  return trips (not into observers): {len(path.trips)}")
        for caller, callee in path.trips:
            print(f"    {caller} -> {callee}")
        print(f"  return trips into or out of observers: {len(path.observer_trips)}")
        for caller, callee in path.observer_trips:
            print(f"    {caller} -> {callee}")
        against = [
            (caller, callee, name, direction)
            for caller, callee, name in path.calls
            if (direction := _direction(caller, callee, reach)) in ("up", "cycle")
        ]
        own = [call for call in against if not (_observer(call[0]) or _observer(call[1]))]
        print(
            f"  calls against the import direction (up or cycle): {len(own)}, "
            f"and {len(against) - len(own)} into or out of observers"
        )
        for caller, callee, name, direction in against:
            print(f"    {direction:5} {caller} -> {callee}.{name}")


if __name__ == "__main__":
    main()
