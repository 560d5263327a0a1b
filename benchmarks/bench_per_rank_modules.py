"""What modules declared with ``meshsim.per_rank_module`` cost a world: its start, and its hand-overs.

Run: ``python benchmarks/bench_per_rank_modules.py`` (``--rounds N``, ``--modules 1 8``,
``--names 100``, ``--calls 200``).

Each declared module is a generated one of ``--names`` globals (a parallel-state module has
some 160). A world of 4 ranks issues ``--calls`` barriers (each a hand-over per rank) with
none declared, and with ``--modules`` of them declared: every rank runs each module's code
at its first call, and every hand-over copies each namespace out and the next rank's in.

Printed: each side's median milliseconds per world over rounds, and declared / none: the
median of the rounds' ratios (the sides take turns within a round, their order reversed
every other round), with its range. Not a test: nothing here asserts a speed.
"""

from __future__ import annotations

import argparse
import importlib
import statistics
import sys
import tempfile
import time
from pathlib import Path
from types import ModuleType

import torch.distributed as dist

import meshsim

WORLD = 4


def _modules(count: int, names: int, where: Path) -> list[ModuleType]:
    sys.path.insert(0, str(where))
    made = []
    for k in range(count):
        lines = ["import os", "RANK = int(os.environ.get('RANK', '0'))"]
        lines += [f"VALUE_{i} = {i}" for i in range(names - 3)]
        lines.append("def get():\n    return RANK")
        (where / f"bench_prm_{k}.py").write_text("\n".join(lines) + "\n")
        made.append(importlib.import_module(f"bench_prm_{k}"))
    return made


def _world(calls: int) -> float:
    def body() -> None:
        for _ in range(calls):
            dist.barrier()

    start = time.perf_counter()
    meshsim.run(body, WORLD)
    return (time.perf_counter() - start) * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--modules", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--names", type=int, default=100)
    parser.add_argument("--calls", type=int, default=200)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as folder:
        modules = _modules(max(args.modules), args.names, Path(folder))
        _world(args.calls)  # warm up
        print(f"{WORLD} ranks, {args.calls} barriers per world, modules of {args.names} names; ms per world")
        print(f"{'modules':>9} {'none':>9} {'declared':>9} {'declared / none':>22}")
        for count in args.modules:
            plain: list[float] = []
            declared: list[float] = []
            ratios: list[float] = []
            for r in range(args.rounds):
                pair = {}
                for side in ("none", "declared") if r % 2 == 0 else ("declared", "none"):
                    if side == "none":
                        pair[side] = _world(args.calls)
                    else:
                        with meshsim.per_rank_module(*modules[:count]):
                            pair[side] = _world(args.calls)
                plain.append(pair["none"])
                declared.append(pair["declared"])
                ratios.append(pair["declared"] / pair["none"])
            spread = f"{statistics.median(ratios):.2f} ({min(ratios):.2f}-{max(ratios):.2f})"
            none, some = statistics.median(plain), statistics.median(declared)
            print(f"{count:>9} {none:>9.1f} {some:>9.1f} {spread:>22}")


if __name__ == "__main__":
    main()
