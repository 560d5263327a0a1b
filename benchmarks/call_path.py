"""The path of one ``dist.all_reduce`` on simulated ranks, module by module, and its return trips.

Prints, for each rank of a 2-rank world whose ranks record a ledger, the meshsim
modules its call passes through, in order (consecutive calls within one module
collapsed), and counts the *return trips*: calls into a meshsim module the call
already passed through (control coming back to a module it had left). Trips into
or out of the observers (``_observe``; ``_ledger``, ``_sites``, ``_findings``,
``_trace``, ``_recorder`` in the flat layout of earlier versions) are counted apart.

    python benchmarks/call_path.py            # this checkout
    PYTHONPATH=/path/to/other/checkout python benchmarks/call_path.py

It reads module names from file paths, so it runs on any version of meshsim.
"""

from __future__ import annotations

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


class _Path:
    """One rank's calls: the module sequence and the return trips."""

    def __init__(self) -> None:
        self.stack: list[str | None] = []
        self.sequence: list[str] = []
        self.trips: list[tuple[str, str]] = []
        self.observer_trips: list[tuple[str, str]] = []

    def __call__(self, frame: Any, event: str, arg: Any) -> None:
        if event == "call":
            module = _module(frame.f_code.co_filename)
            caller = next((m for m in reversed(self.stack) if m is not None), None)
            if module is not None and module != caller:
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


if __name__ == "__main__":
    main()
