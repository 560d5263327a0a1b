"""``--mesh-backend=spawn`` against ``sim`` on the same tests: rank processes kept, and fresh per test.

Run: ``python benchmarks/bench_spawn.py`` (``--rounds N``, ``--paths ...``, ``--subset EXPR``).

Each case is one ``pytest <paths> -q -p no:cacheprovider`` in a new process, timed from
start to exit:

- ``sim``: simulated thread ranks (the default backend);
- ``spawn``: ``--mesh-backend=spawn``, rank processes kept for the session (``--mesh-spawn=pool``);
- ``spawn fresh``: ``--mesh-backend=spawn --mesh-spawn=fresh``, new processes for every test.

A fresh process per rank per test costs seconds, so ``spawn fresh`` runs only on the tests
``-k SUBSET`` selects, and ``sim`` and ``spawn`` run on that subset too, for a comparison on
the same tests; on the whole of ``--paths`` only ``sim`` and ``spawn`` run. Within a round the
runs alternate (the order turns each round), so load from elsewhere falls on every case alike.

Printed: per case the tests that ran (passed, failed, ...), the median wall time over the
rounds, and its ratio to ``sim`` on the same tests; on stderr, each run's failed tests.
Not a test: nothing here asserts a speed.
"""

from __future__ import annotations

import argparse
import os
import re
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

BACKENDS = {
    "sim": [],
    "spawn": ["--mesh-backend=spawn"],
    "spawn fresh": ["--mesh-backend=spawn", "--mesh-spawn=fresh"],
}


@dataclass(frozen=True)
class Case:
    """One pytest command: a backend on the whole of the paths, or on the subset."""

    backend: str
    subset: str | None

    @property
    def label(self) -> str:
        return f"{self.backend}, -k {self.subset!r}" if self.subset else f"{self.backend}, all"


def _run(case: Case, paths: list[str], timeout: float) -> tuple[float, str]:
    """Wall seconds of one pytest run, and its final counts (``1524 passed``)."""
    command = [
        sys.executable,
        "-m",
        "pytest",
        *paths,
        "-q",
        "-p",
        "no:cacheprovider",
        "-rf",
        *BACKENDS[case.backend],
    ]
    if case.subset:
        command += ["-k", case.subset]
    start = time.perf_counter()
    done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=timeout)
    wall = time.perf_counter() - start
    counts = re.findall(
        r"^=*\s*(\d+ (?:passed|failed|skipped|errors?|xfailed|deselected).*?) in [\d.]+s", done.stdout, re.M
    )
    if done.returncode not in (0, 1) or not counts:
        tail = (done.stdout + done.stderr)[-3000:]
        raise SystemExit(f"{case.label}: pytest exited {done.returncode}:\n{tail}")
    for line in re.findall(r"^FAILED .*$", done.stdout, re.M):
        print(f"{case.label}: {line}", file=sys.stderr)
    return wall, counts[-1]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=1, help="runs of each case, alternating (default 1)")
    parser.add_argument(
        "--paths", nargs="+", default=["tests/shardtensor"], help="test paths (default tests/shardtensor)"
    )
    parser.add_argument(
        "--subset",
        default="test_readme",
        help="-k expression for the comparison with fresh processes (default: %(default)r)",
    )
    parser.add_argument("--no-whole", action="store_true", help="skip the runs on the whole of --paths")
    parser.add_argument("--timeout", type=float, default=3600.0, help="seconds one pytest run may take")
    args = parser.parse_args()
    if args.rounds < 1:
        parser.error(f"--rounds must be at least 1, got {args.rounds}")

    cases = [Case(b, args.subset) for b in ("sim", "spawn", "spawn fresh")]
    if not args.no_whole:
        cases = [Case("sim", None), Case("spawn", None), *cases]
    walls: dict[Case, list[float]] = {case: [] for case in cases}
    counts: dict[Case, str] = {}
    for round_ in range(args.rounds):
        turn = round_ % len(cases)
        for case in cases[turn:] + cases[:turn]:
            wall, counted = _run(case, args.paths, args.timeout)
            walls[case].append(wall)
            counts[case] = counted
            print(f"round {round_ + 1}: {case.label}: {wall:.1f} s ({counted})", file=sys.stderr, flush=True)

    print(f"pytest {' '.join(args.paths)} -q -p no:cacheprovider; {args.rounds} round(s), median wall time")
    print(f"{'case':<48} {'tests':<40} {'wall s':>8} {'vs sim':>8}")
    for case in cases:
        sim = statistics.median(walls[Case("sim", case.subset)])
        wall = statistics.median(walls[case])
        print(f"{case.label:<48} {counts[case]:<40} {wall:>8.1f} {wall / sim:>7.2f}x")


if __name__ == "__main__":
    main()
