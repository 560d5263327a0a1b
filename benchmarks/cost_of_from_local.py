"""PhysicsNeMo's seed case priced: what from_local and a reshard round trip would cost on 4 GB200s.

Run: ``python benchmarks/cost_of_from_local.py`` (``--markdown`` for the RESULTS.md table).

The ledgers are real: every case runs on 4 simulated ranks (meshsim's ``sim``
backend) and records its collectives; meshsim's cost model then prices them on 4 GPUs
of one GB200 NVL72 (``meshsim.topology("gb200-nvl72")``: NVLink 5, one NVLink domain),
as the critical path across the ranks. Beside each estimate: what PhysicsNeMo measured
on 4x GB200 (PR #1791's description: ``from_local`` 0.378 ms with "infer", 0.036 ms with
"chunk" and ``global_shape``; without the shape negotiation, PR #1779, the reshard round
trip's forward went from 2.661 to 0.768 ms, with "infer": "chunk" was out of reach
before #1791).

The cases and shapes are ``benchmarks/bench_shardtensor.py``'s:

1. ``from_local`` of a local (1, 4, 12288, 1536) bfloat16 shard, ``Shard(1)``: "infer"
   (an all_gather of every rank's shape) or "chunk" with ``global_shape`` (nothing).
2. HealDA's reshard round trip, Shard(1) -> Shard(2) -> Shard(1) with a ``from_local``
   before each redistribute, local (1, 4, 512, 256) bfloat16, forward: infer or chunk,
   with or without the shape-negotiation all_to_all upstream had before #1779.

Not a test: nothing is asserted.
"""

from __future__ import annotations

import argparse
import contextlib
import warnings
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.tensor import Shard

import meshsim
from meshsim._observe import cost
from shardtensor import ShardTensor
from shardtensor._redistribute import _negotiate_shapes

warnings.filterwarnings("ignore", category=FutureWarning)

WORLD = 4
TOPOLOGY = "gb200-nvl72"
FROM_LOCAL = (1, 4, 12288, 1536)
RESHARD = (1, 4, 512, 256)


@dataclass(frozen=True)
class Case:
    name: str
    step: Callable[[DeviceMesh], object]
    measured_ms: float | None  # PhysicsNeMo's figure on 4x GB200, where it published one


def _global(local_shape: tuple[int, ...], dim: int) -> tuple[int, ...]:
    return tuple(s * WORLD if d == dim else s for d, s in enumerate(local_shape))


def _from_local(mode: str) -> Callable[[DeviceMesh], object]:
    def step(mesh: DeviceMesh) -> object:
        local = torch.zeros(FROM_LOCAL, dtype=torch.bfloat16)
        if mode == "infer":
            return ShardTensor.from_local(local, mesh, [Shard(1)])
        shape = _global(FROM_LOCAL, 1)
        return ShardTensor.from_local(local, mesh, [Shard(1)], "chunk", global_shape=shape)

    return step


def _reshard(mesh: DeviceMesh, x: torch.Tensor, dims: tuple[int, int], mode: str) -> torch.Tensor:
    """HealDA's ``_reshard_via_shardtensor``: from_local, redistribute, to_local."""
    source, target = dims
    shape = None if mode == "infer" else _global(tuple(x.shape), source)
    st = ShardTensor.from_local(x, mesh, [Shard(source)], mode, shape)
    return st.redistribute(placements=[Shard(target)]).to_local()


def _round_trip(mode: str, negotiate: bool) -> Callable[[DeviceMesh], object]:
    def step(mesh: DeviceMesh) -> object:
        x = torch.randn(RESHARD).to(torch.bfloat16)
        with _negotiate_shapes() if negotiate else contextlib.nullcontext():
            y = _reshard(mesh, x, (1, 2), mode)
            return _reshard(mesh, y, (2, 1), mode)

    return step


CASES = (
    Case("from_local, infer", _from_local("infer"), 0.378),
    Case("from_local, chunk + global_shape", _from_local("chunk"), 0.036),
    Case("round trip fwd, infer + negotiated", _round_trip("infer", True), 2.661),
    # #1779 measured 2.661 -> 0.768 ms by dropping the negotiation; from_local could not
    # take "chunk" until #1791, so its round trip ran "infer" both times
    Case("round trip fwd, infer", _round_trip("infer", False), 0.768),
    Case("round trip fwd, chunk + negotiated", _round_trip("chunk", True), None),
    Case("round trip fwd, chunk", _round_trip("chunk", False), None),
)


def _rank(case_index: int) -> meshsim.Ledger:
    mesh = init_device_mesh("cpu", (WORLD,))
    torch.manual_seed(dist.get_rank())
    step = CASES[case_index].step
    step(mesh)  # a warm-up, as the measured figures are after one
    with meshsim.record() as ledger:
        step(mesh)
    return ledger


def _calls(ledger: meshsim.Ledger) -> str:
    """``2 all_to_all_single bfloat16 1.0 MiB`` per kind of call, in first-call order."""
    kinds: dict[str, int] = {}
    for c in ledger:
        dtype = str(c.dtype).removeprefix("torch.")
        size = f"{c.bytes_out} B" if c.bytes_out < 1024 else f"{c.bytes_out / (1 << 20):.1f} MiB"
        key = f"{c.api} {dtype} {size}"
        kinds[key] = kinds.get(key, 0) + 1
    return ", ".join(f"{n} {key}" for key, n in kinds.items()) or "none"


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--markdown", action="store_true", help="print the table as Markdown")
    args = parser.parse_args()
    topo = meshsim.topology(TOPOLOGY)
    header = (
        "case",
        "collectives a call (api, dtype, bytes received)",
        "estimated",
        "measured",
        "not modelled",
    )
    print(f"{WORLD} ranks of {topo}")
    if args.markdown:
        print("\n| " + " | ".join(header) + " |\n" + "|---" * len(header) + "|")
    estimates: dict[str, float] = {}
    for i, case in enumerate(CASES):
        ledgers = meshsim.run(_rank, WORLD, args=(i,))
        estimates[case.name] = estimated = cost.critical_path(ledgers, topo).total
        measured, rest = "-", "-"
        if case.measured_ms is not None:
            measured = f"{case.measured_ms:.3f} ms"
            rest = cost.format_seconds(case.measured_ms / 1e3 - estimated)
        cells = (case.name, _calls(ledgers[0]), cost.format_seconds(estimated), measured, rest)
        print("| " + " | ".join(cells) + " |" if args.markdown else "  ".join(cells))
    print()
    for fast, slow in ((1, 0), (3, 2)):
        saved = estimates[CASES[slow].name] - estimates[CASES[fast].name]
        measured_ms = (CASES[slow].measured_ms or 0.0) - (CASES[fast].measured_ms or 0.0)
        share = saved / (measured_ms / 1e3)
        print(
            f"{CASES[fast].name} against {CASES[slow].name}: the model saves {cost.format_seconds(saved)},"
            f" PhysicsNeMo measured {measured_ms:.3f} ms saved ({share:.1%} of it on the wire)"
        )


if __name__ == "__main__":
    main()
