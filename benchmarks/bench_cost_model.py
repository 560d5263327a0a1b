"""meshsim's cost model against torch's Inductor estimator, call by call (a table, not a test).

Run: ``python benchmarks/bench_cost_model.py`` (``--markdown`` for the RESULTS.md table).

Both models price the same calls: all_reduce, all_gather, reduce_scatter and
all_to_all of 8 B to 1 GiB, on 2, 4 and 8 ranks of one node and on 16 and 64 ranks
across nodes. Without a visible GPU, Inductor models an 8-GPU Ampere node with NVLink
and HDR InfiniBand between nodes, so meshsim's side is its ``"dgx-a100"`` preset (a
visible Hopper makes it ``"dgx-h100"``). Both columns are microseconds; the ratio is
meshsim / Inductor. A row whose ratio is outside 0.5-2 says why the models differ.

Bytes are NCCL's count for the call: the all_reduce buffer, the whole gathered output
of an all_gather, the whole input of a reduce_scatter, an all_to_all's send buffer.
(Inductor's own graph-level caller passes a collective's input bytes, an all_gather's
shard: n times fewer than NCCL's count.)
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from dataclasses import dataclass

import torch

import meshsim
from meshsim import Collective
from meshsim._observe import cost

OPS = ("all_reduce", "all_gather", "reduce_scatter", "all_to_all")
SIZES = (8, 4 << 10, 1 << 20, 32 << 20, 1 << 30)
GROUPS = (2, 4, 8, 16, 64)


def inductor() -> tuple[Callable[[str, int, int], float], str]:
    """Inductor's estimate in seconds for (op, bytes, group size), and the GPU it assumes.

    Private torch API: ``torch._inductor.comm_analysis.estimate_nccl_collective_runtime_impl
    (tensor_storage_size_bytes, group_size, coll: NCCL_COLL) -> milliseconds`` and
    ``get_gpu_type()``. Checked on torch 2.13.0, whose model weighs NCCL's ring and tree
    algorithms and its three protocols; the same signature in earlier releases' source
    priced the ring alone, so their figures differ.
    """
    try:
        from torch._inductor import comm_analysis as ca
    except ImportError as exc:  # pragma: no cover - depends on the installed torch
        raise SystemExit(f"torch {torch.__version__} has no torch._inductor.comm_analysis: {exc}") from exc
    colls = {op: getattr(ca.NCCL_COLL, op.upper()) for op in OPS}

    def seconds(op: str, size: int, ranks: int) -> float:
        return float(ca.estimate_nccl_collective_runtime_impl(size, ranks, colls[op])) / 1e3

    return seconds, ca.get_gpu_type().name


def our_call(op: str, size: int, ranks: int) -> Collective:
    """The ledger entry rank 0 records for ``op`` moving ``size`` bytes (NCCL's count)."""
    shard = size // ranks
    traffic = {
        "all_reduce": (size, size),
        "all_gather": (shard, size),
        "reduce_scatter": (size, shard),
        "all_to_all": (size, size),
    }[op]
    return Collective(op, op, tuple(range(ranks)), torch.uint8, *traffic, None, 0, "bench")


@dataclass(frozen=True)
class Row:
    op: str
    ranks: int
    size: int
    ours: cost.Estimate
    theirs: float  # seconds

    @property
    def ratio(self) -> float:
        return self.ours.seconds / self.theirs


REASONS = {
    "a2a": "Inductor prices all_to_all as a ring all_reduce: 2(n-1) steps and 2(n-1)/n of the bytes; "
    "a pairwise exchange sends (n-1)/n of them once each way.",
    "a2a-net": "Inductor sends 2(n-1)/n of the bytes (a ring all_reduce's) through one NIC at 0.8x; "
    "a pairwise exchange sends the off-node (n-m)/n once, at the NIC's full speed.",
    "lat": "latency: Inductor's tree takes NCCL's tree constants (5.0 us a network step, 1.0 us a step "
    "inside a node once a call spans nodes); ours has one step latency per link for every algorithm "
    "(the ring's: 2.7 and 0.6 us).",
    "nics": "Inductor gives a ring across nodes one NIC (25 GB/s for Ampere, x0.8 on 2 nodes, x1-1.7 "
    "fitted above); NCCL runs a ring per NIC, so ours gets the node's 8 (2-node nccl-tests reach the "
    "node's whole NIC bandwidth: NVIDIA/nccl-tests#119, NVIDIA/nccl#1048).",
    "proto": "NCCL's LL protocol halves the bandwidth for its low latency at this size, and Inductor "
    "picks one protocol; ours takes LL's latency with Simple's bandwidth at once (optimistic).",
}


def why(row: Row, topo: meshsim.Topology) -> str:
    """The key in :data:`REASONS` of why the models differ by more than 2x (empty if they do not)."""
    if 0.5 <= row.ratio <= 2:
        return ""
    across = row.ranks > topo.gpus_per_node
    if row.op == "all_to_all":
        return "a2a-net" if across else "a2a"
    if row.size <= 64 << 10:
        return "lat"
    return "nics" if across else "proto"


def rows(topo: meshsim.Topology, theirs: Callable[[str, int, int], float]) -> list[Row]:
    return [
        Row(op, n, size, cost.estimate(our_call(op, size, n), topo), theirs(op, size, n))
        for op in OPS
        for n in GROUPS
        for size in SIZES
    ]


def size_label(size: int) -> str:
    for unit, scale in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if size >= scale:
            return f"{size // scale} {unit}"
    return f"{size} B"


def print_table(table: list[Row], topo: meshsim.Topology, gpu: str, markdown: bool) -> None:
    print(f"torch {torch.__version__}; Inductor assumes {gpu}; meshsim's topology: {topo}")
    header = ("op", "ranks", "bytes", "ours us", "Inductor us", "ours/Inductor", "ours: algorithm", "why")
    if markdown:
        print("\n| " + " | ".join(header) + " |")
        print("|" + "---|" * len(header))
    else:
        print(
            f"\n{'op':15} {'ranks':>5} {'bytes':>8} {'ours us':>10} {'Inductor us':>12} {'ratio':>6}  "
            "algorithm  why"
        )
    for row in table:
        cells = (
            row.op,
            str(row.ranks),
            size_label(row.size),
            f"{row.ours.seconds * 1e6:.1f}",
            f"{row.theirs * 1e6:.1f}",
            f"{row.ratio:.2f}",
            row.ours.algorithm,
            why(row, topo),
        )
        if markdown:
            print("| " + " | ".join(cells) + " |")
        else:
            op, ranks, size, ours, theirs, ratio, algorithm, reason = cells
            print(f"{op:15} {ranks:>5} {size:>8} {ours:>10} {theirs:>12} {ratio:>6}  {algorithm:9} {reason}")
    inside = [r.ratio for r in table if 0.5 <= r.ratio <= 2]
    print(f"\n{len(inside)} of {len(table)} rows within 2x; the others say why:")
    for key in sorted({why(r, topo) for r in table} - {""}):
        print(f"\n- {key}: {REASONS[key]}" if markdown else f"  {key}: {REASONS[key]}")


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--markdown", action="store_true", help="print the table as Markdown")
    args = parser.parse_args()
    theirs, gpu = inductor()
    topo = meshsim.topology("dgx-h100" if gpu == "HOPPER" else "dgx-a100")
    print_table(rows(topo, theirs), topo, gpu, args.markdown)


if __name__ == "__main__":
    main()
