"""Ranks on one intra-op thread (the default) against ``num_threads="auto"``.

Run: ``python benchmarks/bench_num_threads.py`` (``--rounds N``, ``--sizes 4 8``, ``--quick``).

A serialized world runs one rank at a time, its rank threads pinned to one CPU, which makes
hand-overs cheap. With ``num_threads="auto"`` (one intra-op thread per CPU the caller may use)
each rank thread stays pinned, and the threads its kernels fan out to (torch's OpenMP team,
started unpinned: ``Worker.start_team``) run on the caller's CPUs. ``--unpinned`` adds a column
for ``auto`` with the world not pinned at all, the design this replaced. Programs, on N
simulated ranks (milliseconds per world, the whole world):

- small: ``bench_floor``'s DTensor programs (64x64 float32 on a 1-D mesh): hand-over bound;
- heavy: each rank gathers a 4 MiB shard from every rank (``all_gather_into_tensor``),
  splits and concatenates it along another dim (as DTensor's all_gather fallback does on a
  batch dim), and multiplies a 512 x 512 matrix by itself.

Printed: each side's median over rounds, and auto / 1 (and unpinned / 1): the median of the
rounds' ratios (the sides take turns within a round, their order reversed every other round),
with its range. Below 1: faster than one thread. Not a test: nothing here asserts a speed.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import statistics
import sys
import time
from collections.abc import Callable, Iterator

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import bench_floor  # the sibling script, found through the path above

import meshsim
from meshsim._engine import affinity, threads

SMALL = ("S(0)->R", "x.sum(0).full_tensor()", "matmul, sharded k")


def _heavy(world_size: int, steps: int) -> Callable[[], float]:
    def body() -> float:
        torch.manual_seed(dist.get_rank())
        shard = torch.randn(1024, 1024)  # 4 MiB
        square = torch.randn(512, 512)
        dist.barrier()
        start = time.perf_counter()
        for _ in range(steps):
            gathered = torch.empty(world_size * 1024, 1024)
            dist.all_gather_into_tensor(gathered, shard)
            pieces = torch.cat(gathered.split(1024, dim=0), dim=1)  # rows gathered, re-laid by columns
            pieces.sum()
            square @ square
        dist.barrier()
        return time.perf_counter() - start

    return body


def _small(name: str, steps: int) -> Callable[[], float]:
    program = next(p for p in bench_floor.PROGRAMS if p.name.startswith(name))

    def body() -> float:
        step = program.setup(dist.get_world_size())
        for _ in range(2):
            step()
        dist.barrier()
        start = time.perf_counter()
        for _ in range(steps):
            step()
        dist.barrier()
        return time.perf_counter() - start

    return body


@contextlib.contextmanager
def _unpinned() -> Iterator[None]:
    """Worlds that do not pin: no CPU to choose (the placement's two sources say none)."""
    current_cpu, idle_cpus = affinity.current_cpu, threads.idle_cpus
    affinity.current_cpu = lambda allowed: None
    threads.idle_cpus = lambda count: set()
    try:
        yield
    finally:
        affinity.current_cpu, threads.idle_cpus = current_cpu, idle_cpus


def _time(body: Callable[[], float], world_size: int, side: str, steps: int) -> float:
    num_threads = 1 if side == "1 thread" else "auto"
    with _unpinned() if side == "unpinned" else contextlib.nullcontext():
        seconds = meshsim.run(body, world_size, num_threads=num_threads, gpu_paths=False, timeout=600)
    return max(seconds) / steps * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--sizes", type=int, nargs="+", default=[4, 8])
    parser.add_argument("--quick", action="store_true", help="3 rounds, fewer steps")
    parser.add_argument("--unpinned", action="store_true", help="add auto with the world unpinned")
    args = parser.parse_args()
    rounds = 3 if args.quick else args.rounds
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    print(f"{cpus} CPUs; ms per step for the whole world; medians over {rounds} rounds")
    sides = ["1 thread", "auto", *(["unpinned"] if args.unpinned else [])]
    print(
        f"{'program':<28}{'ws':>4}"
        + "".join(f"{side:>10}" for side in sides)
        + "".join(f"{side + ' / 1':>16}{'range':>11}" for side in sides[1:])
    )
    small_steps, heavy_steps = (20, 2) if args.quick else (50, 4)

    def make(name: str, size: int) -> tuple[Callable[[], float], int]:
        if name in SMALL:
            return _small(name, small_steps), small_steps
        return _heavy(size, heavy_steps), heavy_steps

    for name in [*SMALL, "heavy: gather, cat, matmul"]:
        for size in args.sizes:
            body, steps = make(name, size)
            times: dict[str, list[float]] = {side: [] for side in sides}
            ratios: dict[str, list[float]] = {side: [] for side in sides[1:]}
            for r in range(rounds):
                got = {}
                for side in sides if r % 2 == 0 else sides[::-1]:
                    got[side] = _time(body, size, side, steps)
                    times[side].append(got[side])
                for side in sides[1:]:
                    ratios[side].append(got[side] / got["1 thread"])
            line = f"{name:<28}{size:>4}" + "".join(
                f"{statistics.median(times[side]):>10.3f}" for side in sides
            )
            for side in sides[1:]:
                low, high = min(ratios[side]), max(ratios[side])
                line += f"{statistics.median(ratios[side]):>15.2f}x{low:>6.2f}-{high:.2f}"
            print(line, flush=True)


if __name__ == "__main__":
    main()
