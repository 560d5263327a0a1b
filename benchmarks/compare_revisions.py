"""``bench_meshsim.py``'s sim rows on two or more git revisions, paired: is a change slower?

Run: ``python benchmarks/compare_revisions.py BASE [REV ...]`` from the repository, e.g.
``python benchmarks/compare_revisions.py 1ddeaf9 HEAD`` (``.`` is the working tree as it is,
uncommitted edits included; the default REV). ``--workers K`` processes per revision,
``--rounds N``, ``--rows setup all_reduce`` to take only some rows, ``--line 1.03`` marks
the rows slower than that. ``--tricks``: ``bench_tricks.py``'s rows instead, each trick
shipped and plain (the rows both revisions have, by name).

Each revision is exported (``git archive``) into a temporary folder, and each of its
worker processes imports that tree's meshsim and runs that tree's own
``benchmarks/bench_meshsim.py`` row functions (``_runners()``, ``_ops()``). A driver asks
the workers for one row at a time, every revision's workers in a fresh random order per
round, so that each round compares the revisions under the same machine conditions.

Why several workers per revision: one process's own speed varies with its memory
layout by a few percent, enough to decide a 3% question by chance. A round takes
the median over a revision's workers; a row's ratio is the median over rounds of
REV / BASE, the range over rounds beside it. Not a test: nothing here asserts a speed.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent

# What a worker runs: one row per line asked, its microseconds per call (per world for setup) answered.
_WORKER = r"""
import importlib.util, json, statistics, sys, time
tree = sys.argv[1]
def load(name):
    spec = importlib.util.spec_from_file_location(name, tree + "/benchmarks/" + name + ".py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module
bench = load("bench_meshsim")
import meshsim
if not meshsim.__file__.startswith(tree):
    sys.exit(f"imported meshsim from {meshsim.__file__}, not from the tree {tree}")
runners = bench._runners()
tricks = None
def noop():
    return 0.0
print(json.dumps("ready"), flush=True)
for line in sys.stdin:
    kind, runner, ws, n = line.rstrip("\n").split("|")
    ws, n = int(ws), int(n)
    if kind in ("trick", "tricks") and tricks is None:
        tricks = {row[0]: row for row in load("bench_tricks").ROWS}
    if kind == "tricks":  # the names of bench_tricks.py's rows
        print(json.dumps(list(tricks)), flush=True)
        continue
    if kind == "trick":  # bench_tricks.py's row named runner: ws 0 the shipped variant, 1 the plain
        if runner not in tricks:
            print(json.dumps(None), flush=True)
            continue
        _, shipped, plain, measure, reps = tricks[runner]
        with (plain if ws else shipped)():
            microseconds = measure(reps)
        print(json.dumps(microseconds), flush=True)
        continue
    run = runners[runner]
    if kind == "setup":
        run(noop, ws)
        start = time.perf_counter()
        for _ in range(n):
            run(noop, ws)
        seconds = (time.perf_counter() - start) / n
    else:
        seconds = statistics.median(run(bench._ops(n)[kind], ws))
    print(json.dumps(seconds * 1e6), flush=True)
"""

RUNNERS = ("meshsim sim", "sim findings off")
OPS = ("all_gather_into_tensor", "all_reduce", "all_to_all_single", "all_reduce, same bytes")
# calls per measurement (worlds for setup), per world size: about 30 ms each on a 2-core VM
CALLS = {2: 300, 4: 150, 8: 80}
WORLDS = {2: 40, 4: 30, 8: 20}

Row = tuple[str, str, int, int]  # (row, runner, world size, calls)
Table = dict[Row, dict[str, list[float]]]  # per row, per revision: a value per round


def _export(rev: str, into: Path, index: int) -> Path:
    """``rev``'s tree in a folder of its own (``.``: the working tree itself)."""
    if rev == ".":
        return REPO
    folder = into / f"{index}-{rev.replace('/', '_')}"  # the index: "a/b" and "a_b" are two revisions
    folder.mkdir()
    try:
        archive = subprocess.run(
            ["git", "-C", str(REPO), "archive", "--format=tar", rev],
            check=True,
            capture_output=True,
            timeout=120,
        )
    except subprocess.CalledProcessError as exc:
        sys.exit(f"cannot export revision {rev!r}: {exc.stderr.decode().strip()}")
    subprocess.run(["tar", "-x", "-C", str(folder)], input=archive.stdout, check=True, timeout=120)
    if not (folder / "benchmarks" / "bench_meshsim.py").exists():
        sys.exit(f"revision {rev!r} has no benchmarks/bench_meshsim.py to run")
    return folder


class _Worker:
    def __init__(self, tree: Path) -> None:
        self.tree = tree
        env = dict(os.environ, PYTHONPATH=str(tree))
        self.proc = subprocess.Popen(
            [sys.executable, "-c", _WORKER, str(tree)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            env=env,
            cwd=tree,
        )
        self.ask_raw(None)

    def ask(self, row: str | None) -> Any:
        """The worker's answer to ``row`` (None: only read its next line)."""
        assert self.proc.stdin is not None and self.proc.stdout is not None
        if row is not None:
            self.proc.stdin.write(row + "\n")
            self.proc.stdin.flush()
        answer = self.proc.stdout.readline()
        if not answer:
            raise SystemExit(f"a worker for {self.tree} ended (exit status {self.proc.wait(30)})")
        value = json.loads(answer)
        if value is None:
            raise SystemExit(f"{self.tree}'s benchmarks have no row {row!r}")
        return value

    def ask_raw(self, row: str | None) -> float:
        value = self.ask(row)
        return float(value) if value != "ready" else 0.0

    def close(self) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.close()
        self.proc.wait(60)


def _rows(only: list[str] | None, sizes: list[int]) -> list[Row]:
    rows = []
    for runner in RUNNERS:
        for op in OPS:
            rows += [(op, runner, ws, CALLS[ws]) for ws in sizes]
        rows += [("setup", runner, ws, WORLDS[ws]) for ws in sizes]
    if only:
        rows = [row for row in rows if row[0] in only]
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("base", help="the revision the others are compared with")
    parser.add_argument("revs", nargs="*", default=["."], help="revisions to compare (default: the worktree)")
    parser.add_argument("--workers", type=int, default=4, help="processes per revision (default 4)")
    parser.add_argument("--rounds", type=int, default=12, help="rounds to take medians over (default 12)")
    parser.add_argument("--rows", nargs="+", default=None, choices=[*OPS, "setup"], help="only these rows")
    parser.add_argument("--sizes", type=int, nargs="+", default=[2, 4, 8], choices=sorted(CALLS))
    parser.add_argument("--line", type=float, default=1.03, help="mark ratios above this (default 1.03)")
    parser.add_argument("--tricks", action="store_true", help="bench_tricks.py's rows, shipped and plain")
    args = parser.parse_args()
    for name in ("workers", "rounds"):
        if getattr(args, name) < 1:
            parser.error(f"--{name} must be at least 1, got {getattr(args, name)}")
    if args.tricks and args.rows:
        parser.error("--rows picks bench_meshsim.py's rows, --tricks bench_tricks.py's: one or the other")
    revs = [args.base, *args.revs]
    if len(set(revs)) != len(revs):
        parser.error(f"each revision once, got {revs}")
    rows = _rows(args.rows, args.sizes)
    scratch = Path(tempfile.mkdtemp(prefix="meshsim-revs-"))
    workers: dict[str, list[_Worker]] = {}
    try:
        trees = {rev: _export(rev, scratch, i) for i, rev in enumerate(revs)}
        workers = {rev: [_Worker(trees[rev]) for _ in range(args.workers)] for rev in revs}
        keys = [(rev, j) for rev in revs for j in range(args.workers)]
        if args.tricks:  # the rows every revision's bench_tricks.py has, each shipped (0) and plain (1)
            names = [workers[rev][0].ask("tricks|-|0|0") for rev in revs]
            common = [name for name in names[0] if all(name in other for other in names[1:])]
            rows = [("trick", name, variant, 0) for name in common for variant in (0, 1)]
        for row in rows:  # warm every worker on every row
            for rev, j in keys:
                workers[rev][j].ask_raw("|".join(map(str, row)))
        got: Table = {row: {r: [] for r in revs} for row in rows}
        shuffle = random.Random(0).shuffle
        for _ in range(args.rounds):
            for row in rows:
                shuffle(keys)
                answers = {key: workers[key[0]][key[1]].ask_raw("|".join(map(str, row))) for key in keys}
                for rev in revs:
                    got[row][rev].append(statistics.median(answers[(rev, j)] for j in range(args.workers)))
    finally:
        for pool in workers.values():
            for worker in pool:
                worker.close()
        shutil.rmtree(scratch, ignore_errors=True)
    _print(got, revs, args)


def _print(got: Table, revs: list[str], args: argparse.Namespace) -> None:
    base = revs[0]
    unit = "us as bench_tricks.py measures each row" if args.tricks else "us per call (per world for setup)"
    print(
        f"{args.rounds} rounds, {args.workers} worker processes per revision (a round takes their median); "
        f"{unit}; ratio: median over rounds of rev / {base} (range over rounds); * above {args.line}"
    )
    names = ["trick", "variant"] if args.tricks else ["row", "runner", "ws"]
    head = [*names, *revs, *(f"{rev} / {base}" for rev in revs[1:])]
    print("| " + " | ".join(head) + " |")
    print("|" + "---|" * len(head))
    over = 0
    for (op, runner, ws, _), per_rev in got.items():
        row = [runner, ("shipped", "plain")[ws]] if args.tricks else [op, runner, str(ws)]
        cells = [*row, *(f"{statistics.median(per_rev[rev]):.1f}" for rev in revs)]
        for rev in revs[1:]:
            ratios = [a / b for a, b in zip(per_rev[rev], per_rev[base])]
            ratio = statistics.median(ratios)
            mark = " *" if ratio > args.line else ""
            over += ratio > args.line
            cells.append(f"{ratio:.3f} ({min(ratios):.2f}-{max(ratios):.2f}){mark}")
        print("| " + " | ".join(cells) + " |")
    print(f"{over} of {len(got) * (len(revs) - 1)} ratios above {args.line}")


if __name__ == "__main__":
    main()
