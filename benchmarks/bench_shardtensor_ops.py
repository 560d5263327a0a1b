"""Per-op time of ShardTensor against DTensor on the same even layout, 4 simulated ranks.

Run: ``python benchmarks/bench_shardtensor_ops.py`` (``--quick`` for a smoke run,
``--rounds N`` for more rounds). For each op and each of two sizes, the same global
tensors are laid out the same way (torch.chunk's layout, which both describe) as a
ShardTensor and as a DTensor, and the op runs on each:

- pointwise: ``x * y`` (both ``Shard(0)``) and ``torch.relu(x)``;
- sum over the sharded dim: ``x.sum(dim=0)`` (a ``Partial`` result, no collective), and
  followed by ``full_tensor()`` (one all_reduce);
- matmul: ``x @ w`` with ``x`` ``Shard(0)`` and ``w`` ``Replicate`` (no collective), and
  with the contraction dim sharded, ``Shard(1) @ Shard(0)`` (a ``Partial`` result).

Grad mode is on (as in a training step) and no operand requires grad. Every variant
is measured in the same run, inside the ranks, interleaved round by round; each cell
is the median round. "ratio" is ShardTensor's time over DTensor's
(below 1: ShardTensor is faster). Simulated ranks run one at a time, so a call that
waits at a collective includes the other ranks' work; "cpu" is the calling rank's
own thread CPU time. Both are the maximum over ranks. Not a test: nothing here
asserts a speed.
"""

from __future__ import annotations

import argparse
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass, replace
from statistics import median
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor

import meshsim
from shardtensor import ShardTensor

warnings.filterwarnings("ignore", category=FutureWarning)

WORLD = 4
WARMUP = 5


@dataclass(frozen=True)
class Config:
    sizes: tuple[tuple[str, int], ...]  # (label, n): global tensors are (n, n)
    iters: int
    rounds: int


FULL = Config((("small", 64), ("large", 512)), 200, 9)
QUICK = Config((("small", 32), ("large", 256)), 20, 2)

OPS: dict[str, tuple[tuple[Any, ...], Callable[..., Any]]] = {
    # name: ((placements of each operand), op)
    "x * y": (((Shard(0),), (Shard(0),)), lambda x, y: x * y),
    "relu(x)": (((Shard(0),),), torch.relu),
    "x.sum(0)": (((Shard(0),),), lambda x: x.sum(0)),
    "x.sum(0).full_tensor()": (((Shard(0),),), lambda x: x.sum(0).full_tensor()),
    "x @ w, S(0) @ R": (((Shard(0),), (Replicate(),)), lambda x, w: x @ w),
    "x @ w, S(1) @ S(0)": (((Shard(1),), (Shard(0),)), lambda x, w: x @ w),
}


@dataclass(frozen=True)
class Timing:
    wall: float
    cpu: float
    counts: dict[str, int]


def _counts_of(step: Callable[[], object]) -> dict[str, int]:
    for _ in range(WARMUP):
        step()
    with meshsim.record() as ledger:
        step()
    return ledger.counts()


def _time(step: Callable[[], object], iters: int) -> tuple[float, float]:
    dist.barrier()
    wall, cpu = time.perf_counter(), time.thread_time()
    for _ in range(iters):
        step()
    return (time.perf_counter() - wall) / iters, (time.thread_time() - cpu) / iters


def _operands(mesh: DeviceMesh, n: int, placements: tuple[Any, ...], kind: str) -> list[torch.Tensor]:
    out: list[torch.Tensor] = []
    for i, p in enumerate(placements):
        full = torch.randn(n, n, generator=torch.Generator().manual_seed(i))
        dtensor = distribute_tensor(full, mesh, list(p))
        out.append(ShardTensor.from_dtensor(dtensor) if kind == "ShardTensor" else dtensor)
    return out


def _steps(mesh: DeviceMesh, config: Config) -> dict[tuple[str, str, str], Callable[[], object]]:
    steps: dict[tuple[str, str, str], Callable[[], object]] = {}
    for label, n in config.sizes:
        for name, (placements, op) in OPS.items():
            for kind in ("DTensor", "ShardTensor"):
                operands = _operands(mesh, n, placements, kind)
                steps[(label, name, kind)] = lambda op=op, operands=operands: op(*operands)
    return steps


def _rank_main(config: Config) -> dict[tuple[str, str, str], Timing]:
    mesh = init_device_mesh("cpu", (WORLD,))
    steps = _steps(mesh, config)
    counts = {key: _counts_of(step) for key, step in steps.items()}
    rounds: dict[tuple[str, str, str], list[tuple[float, float]]] = {key: [] for key in steps}
    for _ in range(config.rounds):  # interleaved, so that drift on a shared machine hits every variant
        for key, step in steps.items():
            rounds[key].append(_time(step, config.iters))
    return {
        key: Timing(median(w for w, _ in t), median(c for _, c in t), counts[key])
        for key, t in rounds.items()
    }


def _worst(per_rank: list[dict[Any, Timing]], key: Any) -> Timing:
    timings = [r[key] for r in per_rank]
    return Timing(max(t.wall for t in timings), max(t.cpu for t in timings), timings[0].counts)


def _counts(counts: dict[str, int]) -> str:
    return ", ".join(f"{n} {op}" for op, n in sorted(counts.items())) or "none"


def _print(per_rank: list[dict[Any, Timing]], config: Config, seconds: float) -> None:
    print(f"ShardTensor vs DTensor per op, {WORLD} simulated ranks (meshsim), torch {torch.__version__}")
    print("global (n, n) float32 tensors in torch.chunk's layout on a 1-D mesh; per call, max over ranks")
    header = (
        f"{'op':24} {'size':6} {'DTensor us':>11} {'Shard us':>9} {'ratio':>6} "
        f"{'DT cpu us':>10} {'ST cpu us':>10} {'ratio':>6}  collectives (DTensor | ShardTensor)"
    )
    print(header)
    for label, n in config.sizes:
        for name in OPS:
            dt = _worst(per_rank, (label, name, "DTensor"))
            st = _worst(per_rank, (label, name, "ShardTensor"))
            print(
                f"{name:24} {n:6} {dt.wall * 1e6:11.1f} {st.wall * 1e6:9.1f} {st.wall / dt.wall:6.2f} "
                f"{dt.cpu * 1e6:10.1f} {st.cpu * 1e6:10.1f} {st.cpu / dt.cpu:6.2f}  "
                f"{_counts(dt.counts)} | {_counts(st.counts)}"
            )
    print(f"\n(ratio: ShardTensor / DTensor; {config.iters} calls x {config.rounds} rounds; {seconds:.1f} s)")


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="small shapes and few iterations (a smoke test)")
    parser.add_argument("--rounds", type=int, default=None, help="rounds to take medians over (default 9)")
    args = parser.parse_args()
    config = QUICK if args.quick else FULL
    if args.rounds is not None:
        if args.rounds < 1:
            parser.error(f"--rounds must be at least 1, got {args.rounds}")
        config = replace(config, rounds=args.rounds)
    start = time.perf_counter()
    per_rank: list[dict[Any, Timing]] = meshsim.run(_rank_main, WORLD, args=(config,), timeout=1200)
    _print(per_rank, config, time.perf_counter() - start)


if __name__ == "__main__":
    main()


_ = DTensor  # the type the DTensor operands have
