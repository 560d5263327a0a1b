"""``meshsim demo``: ShardTensor.from_local "infer" vs "chunk" on 4 simulated ranks.

Prints each mode's collective ledger (rank 0's) and per-call timings, then
checks that both modes build the same spec. Timings on simulated ranks show
what the extra all_gather costs here, not on GPUs; the ledger is what carries over.
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Any

import torch
import torch.distributed as dist

import meshsim


def _demo_rank(iterations: int, rows: int) -> dict[str, Any]:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard

    from shardtensor import ShardTensor

    world = dist.get_world_size()
    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("domain",))
    # uneven on purpose: torch.chunk gives the last rank fewer rows
    sizes = [len(c) for c in torch.arange(rows).chunk(world)] + [0] * world
    local = torch.randn(1, sizes[dist.get_rank()], 64, 32)
    global_shape = (1, rows, 64, 32)
    with meshsim.record() as infer:
        a = ShardTensor.from_local(local, mesh, [Shard(1)])
    with meshsim.record() as chunk:
        b = ShardTensor.from_local(
            local, mesh, [Shard(1)], sharding_shapes="chunk", global_shape=global_shape
        )
    times = {}
    for mode in ("infer", "chunk"):
        per_call = []
        for _ in range(iterations):
            start = time.perf_counter()
            if mode == "infer":
                ShardTensor.from_local(local, mesh, [Shard(1)])
            else:
                ShardTensor.from_local(
                    local, mesh, [Shard(1)], sharding_shapes="chunk", global_shape=global_shape
                )
            per_call.append(time.perf_counter() - start)
        times[mode] = statistics.median(per_call)
    return {
        "ledgers": {"infer": str(infer), "chunk": str(chunk)},
        "same_spec": a._spec == b._spec,
        "shapes": a._spec.sharding_shapes(),
        "times": times,
    }


def demo(args: argparse.Namespace) -> int:
    print(
        f"ShardTensor.from_local on {args.world_size} simulated ranks, global rows {args.rows} on Shard(1)\n"
    )
    results = meshsim.run(_demo_rank, args.world_size, args=(args.iterations, args.rows))
    first = results[0]
    for mode in ("infer", "chunk"):
        title = {
            "infer": 'sharding_shapes="infer" (default)',
            "chunk": 'sharding_shapes="chunk", global_shape=...',
        }[mode]
        print(f"--- {title}: rank 0's ledger")
        print(first["ledgers"][mode], "\n")
    print(f"per-rank shard shapes along mesh dim 0: {list(first['shapes'][0])}")
    same = all(r["same_spec"] for r in results)
    print(f"specs equal on every rank: {same}\n")
    infer = max(r["times"]["infer"] for r in results)
    chunk = max(r["times"]["chunk"] for r in results)
    print(f"{'mode':8} {'ms/call (max over ranks, median of ' + str(args.iterations) + ')':>44}")
    print(f"{'infer':8} {infer * 1e3:44.3f}")
    print(f"{'chunk':8} {chunk * 1e3:44.3f}")
    print(f"infer/chunk: {infer / chunk:.1f}x")
    return 0 if same else 1


def add_parser(sub: Any) -> None:
    """The ``demo`` command's options."""
    demo_parser = sub.add_parser("demo", help="from_local infer vs chunk on simulated ranks")
    demo_parser.add_argument("--world-size", type=int, default=4)
    demo_parser.add_argument("--rows", type=int, default=10, help="global size of the sharded dim")
    demo_parser.add_argument("--iterations", type=int, default=50)
    demo_parser.set_defaults(command=demo)
