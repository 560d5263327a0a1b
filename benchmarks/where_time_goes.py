"""Where a simulated all_reduce spends its time: each rank's CPU per call, with parts taken out.

Run: ``python benchmarks/where_time_goes.py [--world-size 4]``.

A diagnostic for the sim backend's speed work, not a test and not a user tool: it
swaps meshsim internals for stubs, so the stubbed variants compute wrong results.
Each variant is measured in turn, round after round, and the table gives medians
of each rank's CPU time (``time.thread_time``) per ``dist.all_reduce`` of 1 KiB,
which hand-overs between rank threads do not blur the way wall time on a busy
machine does. What a part costs is the difference between two rows.
"""

from __future__ import annotations

import argparse
import statistics
import time
import warnings
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch
import torch.distributed as dist

import meshsim
from meshsim._process import handover as _handover
from meshsim._sim import collectives as _collectives

warnings.filterwarnings("ignore", category=FutureWarning)

CALLS = 2000


def _per_rank_cpu(direct: bool) -> float:
    x = torch.ones(256)
    group: Any = dist.group.WORLD
    opts = dist.AllreduceOptions()
    opts.reduceOp = dist.ReduceOp.SUM  # type: ignore[assignment]  # torch converts it
    opts.asyncOp = False

    def through_torch() -> object:
        return dist.all_reduce(x)

    def into_the_backend() -> object:  # what torch's dist.all_reduce calls after its checks
        return group.allreduce([x], opts)

    call: Callable[[], object] = into_the_backend if direct else through_torch
    for _ in range(200):
        call()
    start = time.thread_time()
    for _ in range(CALLS):
        call()
    return (time.thread_time() - start) / CALLS * 1e6


def _rng_entries() -> list[Any]:
    """The hand-over registry's entries for torch's RNG (a diagnostic reaches into it)."""
    return [s for s in _handover._REGISTRY.slots if s.label.startswith("torch's CPU RNG")]


@contextmanager
def _without(parts: set[str]) -> Iterator[None]:
    execute = vars(_collectives.AllReduce)["execute"]
    rng = _rng_entries() if "rng" in parts else []
    if rng:
        _handover._REGISTRY.remove(rng)
    if "execute" in parts:
        _collectives.AllReduce.execute = staticmethod(lambda payloads: None)  # type: ignore[method-assign,assignment]
    try:
        yield
    finally:
        if rng:
            _handover._REGISTRY.add(rng)
        _collectives.AllReduce.execute = execute  # type: ignore[method-assign]


VARIANTS: dict[str, tuple[set[str], bool]] = {
    "as shipped": (set(), False),
    "without the per-rank RNG swap": ({"rng"}, False),
    "without moving the data": ({"execute"}, False),
    "without torch's dist.all_reduce code": (set(), True),
    "without all three": ({"rng", "execute"}, True),
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--world-size", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=7)
    args = parser.parse_args()
    meshsim.run(_per_rank_cpu, args.world_size, args=(False,))  # warm-up: imports, first-use costs
    results: dict[str, list[float]] = {name: [] for name in VARIANTS}
    alone: list[float] = []
    for _ in range(args.rounds):
        alone += meshsim.run(_per_rank_cpu, 1, args=(False,))
        for name, (parts, direct) in VARIANTS.items():
            with _without(parts):
                per_rank = meshsim.run(_per_rank_cpu, args.world_size, args=(direct,))
            results[name].append(statistics.mean(per_rank))
    ws, rounds = args.world_size, args.rounds
    print(f"each rank's CPU per dist.all_reduce of 1 KiB, {ws} ranks (median of {rounds} rounds)")
    for name, values in results.items():
        print(f"  {name:40} {statistics.median(values):7.1f} us")
    print(f"  {'one rank alone, as shipped (no hand-over)':40} {statistics.median(alone):7.1f} us")


if __name__ == "__main__":
    main()
