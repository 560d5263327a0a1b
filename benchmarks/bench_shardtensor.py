"""ShardTensor costs on 4 simulated ranks: from_local "infer" vs "chunk", and a reshard round trip.

Run: ``python benchmarks/bench_shardtensor.py`` (``--quick`` for small shapes and few
iterations, ``--rounds N`` for more rounds). Reproduces the shape of PhysicsNeMo's two
tables (PRs #1791 and #1779):

1. ``from_local`` per call, ``"infer"`` (a shape all_gather) vs ``"chunk"`` with
   ``global_shape`` (no communication): local shard (1, 4, 12288, 1536) bfloat16,
   ``Shard(1)`` on a 1-D mesh.
2. A HealDA-style reshard round trip, Shard(1) -> Shard(2) -> Shard(1) with a
   ``from_local`` before each redistribute, forward and forward+backward, for
   infer or chunk, with or without the shape-negotiation all_to_all that upstream
   had before #1779 (a private switch here).

Every variant is measured in the same run, inside the ranks, interleaved round by
round; the table shows each variant's median round. Simulated ranks run one
at a time, handing over at collectives, so "wall" per call includes the other ranks'
work whenever a collective makes a rank wait for them (4 ranks' CPU work, serialized);
"cpu" is the calling rank's own thread CPU time, closer to what one rank of a real
job spends. Both are the maximum over ranks. Not a test: nothing here asserts a speed.
"""

from __future__ import annotations

import argparse
import contextlib
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass, replace
from statistics import median
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.tensor import Shard

import meshsim
from shardtensor import ShardTensor
from shardtensor._redistribute import _negotiate_shapes

warnings.filterwarnings("ignore", category=FutureWarning)

WORLD = 4
WARMUP = 3


@dataclass(frozen=True)
class Config:
    from_local_shape: tuple[int, ...]
    from_local_iters: int
    reshard_shape: tuple[int, ...]
    reshard_iters: int
    rounds: int  # every variant once per round; the table shows the median round


FULL = Config((1, 4, 12288, 1536), 50, (1, 4, 512, 256), 50, 5)
QUICK = Config((1, 4, 1024, 128), 10, (1, 4, 256, 64), 5, 2)

VARIANTS = {
    "infer + negotiated": ("infer", True),
    "infer": ("infer", False),
    "chunk + negotiated": ("chunk", True),
    "chunk": ("chunk", False),
}


@dataclass(frozen=True)
class Timing:
    wall: float  # seconds per call
    cpu: float
    counts: dict[str, int]


def _counts_of(step: Callable[[], object]) -> dict[str, int]:
    """The collectives one call of ``step`` issues on this rank (after a warm-up)."""
    for _ in range(WARMUP):
        step()
    with meshsim.record() as ledger:
        step()
    return ledger.counts()


def _time(step: Callable[[], object], iters: int) -> tuple[float, float]:
    """Wall and thread-CPU seconds per call of ``step`` on this rank."""
    dist.barrier()  # every rank starts the timed loop together
    wall, cpu = time.perf_counter(), time.thread_time()
    for _ in range(iters):
        step()
    return (time.perf_counter() - wall) / iters, (time.thread_time() - cpu) / iters


def _global(local_shape: tuple[int, ...], dim: int) -> tuple[int, ...]:
    return tuple(s * WORLD if d == dim else s for d, s in enumerate(local_shape))


def _from_local_steps(mesh: DeviceMesh, config: Config) -> dict[str, Callable[[], object]]:
    local = torch.zeros(config.from_local_shape, dtype=torch.bfloat16)
    shape = _global(config.from_local_shape, 1)
    return {
        "infer": lambda: ShardTensor.from_local(local, mesh, [Shard(1)]),
        "chunk": lambda: ShardTensor.from_local(local, mesh, [Shard(1)], "chunk", global_shape=shape),
    }


def _reshard(mesh: DeviceMesh, x: torch.Tensor, dims: tuple[int, int], mode: str) -> torch.Tensor:
    """HealDA's ``_reshard_via_shardtensor``: from_local, redistribute, to_local."""
    source, target = dims
    shape = tuple(x.shape) if mode == "infer" else _global(tuple(x.shape), source)
    st = ShardTensor.from_local(x, mesh, [Shard(source)], mode, None if mode == "infer" else shape)
    return st.redistribute(placements=[Shard(target)]).to_local()


def _round_trip(
    mesh: DeviceMesh, mode: str, negotiate: bool, backward: bool, config: Config
) -> Callable[[], object]:
    x = torch.randn(config.reshard_shape).to(torch.bfloat16).requires_grad_(backward)
    grad = torch.ones(config.reshard_shape, dtype=torch.bfloat16)

    def step() -> None:
        with _negotiate_shapes() if negotiate else contextlib.nullcontext():
            y = _reshard(mesh, x, (1, 2), mode)
            z = _reshard(mesh, y, (2, 1), mode)
            if backward:
                x.grad = None
                z.backward(grad)

    return step


def _steps(mesh: DeviceMesh, config: Config) -> dict[str, tuple[Callable[[], object], int]]:
    """Every measured variant: its step and its iterations per round."""
    steps = {
        f"from_local/{name}": (step, config.from_local_iters)
        for name, step in _from_local_steps(mesh, config).items()
    }
    for backward in (False, True):
        for name, (mode, negotiate) in VARIANTS.items():
            step = _round_trip(mesh, mode, negotiate, backward, config)
            steps[f"{'fwd+bwd' if backward else 'fwd'}/{name}"] = (step, config.reshard_iters)
    return steps


def _rank_main(config: Config) -> dict[str, Timing]:
    torch.manual_seed(dist.get_rank())
    mesh = init_device_mesh("cpu", (WORLD,))
    steps = _steps(mesh, config)
    counts = {key: _counts_of(step) for key, (step, _) in steps.items()}
    rounds: dict[str, list[tuple[float, float]]] = {key: [] for key in steps}
    for _ in range(config.rounds):  # interleaved, so that drift on a shared machine hits every variant
        for key, (step, iters) in steps.items():
            rounds[key].append(_time(step, iters))
    return {
        key: Timing(median(w for w, _ in times), median(c for _, c in times), counts[key])
        for key, times in rounds.items()
    }


def _worst(per_rank: list[dict[str, Timing]], key: str) -> Timing:
    timings = [r[key] for r in per_rank]
    return Timing(max(t.wall for t in timings), max(t.cpu for t in timings), timings[0].counts)


def _counts(counts: dict[str, int]) -> str:
    return ", ".join(f"{n} {op}" for op, n in sorted(counts.items())) or "none"


def _row(label: str, t: Timing, base: Timing) -> str:
    return (
        f"{label:22} {t.wall * 1e3:10.3f} {t.cpu * 1e3:10.3f} {base.wall / t.wall:9.2f}x "
        f"{base.cpu / t.cpu:9.2f}x  {_counts(t.counts)}"
    )


def _print(per_rank: list[dict[str, Timing]], config: Config, seconds: float) -> None:
    header = f"{'':22} {'wall ms':>10} {'cpu ms':>10} {'wall gain':>10} {'cpu gain':>9}  collectives per call"
    print(f"ShardTensor on {WORLD} simulated ranks (meshsim), torch {torch.__version__}")
    print("per call, the maximum over ranks")
    print(f"\n1. from_local, local {config.from_local_shape} bfloat16, Shard(1), ", end="")
    print(f"{config.from_local_iters} iterations")
    print("   upstream, 4x GB200: infer 0.378 ms, chunk 0.036 ms")
    print(header)
    base = _worst(per_rank, "from_local/infer")
    for name in ("infer", "chunk + global_shape"):
        print(_row(name, _worst(per_rank, f"from_local/{name.split()[0]}"), base))
    print("\n2. reshard round trip S(1)->S(2)->S(1), from_local each time, ", end="")
    print(f"local {config.reshard_shape} bfloat16, {config.reshard_iters} iterations")
    print("   upstream forward: 2.661 ms (infer + negotiated) -> 0.768 ms")
    for phase in ("fwd", "fwd+bwd"):
        print(f"{phase}:")
        print(header)
        base = _worst(per_rank, f"{phase}/infer + negotiated")
        for name in VARIANTS:
            print(_row(name, _worst(per_rank, f"{phase}/{name}"), base))
    print(f"\n(gain: the first row's time / this row's; {config.rounds} rounds; whole run {seconds:.1f} s)")


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="small shapes and few iterations (a smoke test)")
    parser.add_argument(
        "--rounds", type=int, default=None, help="rounds to take medians over (default 5, 2 with --quick)"
    )
    args = parser.parse_args()
    config = QUICK if args.quick else FULL
    if args.rounds is not None:
        if args.rounds < 1:
            parser.error(f"--rounds must be at least 1, got {args.rounds}")
        config = replace(config, rounds=args.rounds)
    start = time.perf_counter()
    per_rank: list[dict[str, Any]] = meshsim.run(_rank_main, WORLD, args=(config,), timeout=600)
    _print(per_rank, config, time.perf_counter() - start)


if __name__ == "__main__":
    main()
