"""Generated layouts for ShardTensor: spec equality, bitwise round trips, exact collectives, gradients.

Meshes are 1-D or 2-D on 1 to 8 simulated ranks, global shapes include extents
smaller than the mesh (so shards are empty), placements are random. Each example
is one world; every check inside it uses references computed with torch.chunk
directly, not with shardtensor's own arithmetic.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.placement_types import Placement

import meshsim
from shardtensor import ShardTensor

MESHES = [(1,), (2,), (3,), (4,), (5,), (8,), (1, 2), (2, 1), (2, 2), (2, 3), (3, 2), (2, 4), (4, 2)]


@dataclass(frozen=True)
class Case:
    mesh: tuple[int, ...]
    shape: tuple[int, ...]
    src: tuple[Placement, ...]
    dst: tuple[Placement, ...]
    dtype: torch.dtype

    def __repr__(self) -> str:
        return (
            f"Case(mesh={self.mesh}, shape={self.shape}, src={self.src}, dst={self.dst}, dtype={self.dtype})"
        )


@st.composite
def placements(draw: st.DrawFn, mesh_ndim: int, tensor_ndim: int) -> tuple[Placement, ...]:
    """One placement per mesh dim; a tensor dim is sharded by at most one mesh dim."""
    free = list(range(tensor_ndim))
    chosen: list[Placement] = []
    for _ in range(mesh_ndim):
        if free and draw(st.booleans()):
            dim = draw(st.sampled_from(free))
            free.remove(dim)
            chosen.append(Shard(dim))
        else:
            chosen.append(Replicate())
    return tuple(chosen)


@st.composite
def cases(draw: st.DrawFn) -> Case:
    mesh = draw(st.sampled_from(MESHES))
    ndim = draw(st.integers(1, 3))
    shape = tuple(draw(st.lists(st.integers(0, 9), min_size=ndim, max_size=ndim)))
    src = draw(placements(len(mesh), ndim))
    dst = draw(placements(len(mesh), ndim))
    dtype = draw(st.sampled_from([torch.float32, torch.bfloat16]))
    return Case(mesh, shape, src, dst, dtype)


def reference_piece(
    full: torch.Tensor, coords: list[int], mesh: tuple[int, ...], where: tuple[Placement, ...]
) -> torch.Tensor:
    """This coordinate's shard, cut with torch.chunk (empty where torch.chunk runs out)."""
    piece = full
    for m, p in enumerate(where):
        if isinstance(p, Shard):
            chunks = torch.chunk(full, mesh[m], dim=p.dim)
            lengths = [c.shape[p.dim] for c in chunks] + [0] * mesh[m]
            start = sum(lengths[: coords[m]])
            piece = piece.narrow(p.dim, start, lengths[coords[m]])
    return piece.contiguous()


def expected_hops(case: Case) -> dict[str, int] | None:
    """The collectives a redistribution needs, or None where mesh dims interact.

    Shard->Replicate is one all_gather, Shard(a)->Shard(b) one all_to_all,
    Replicate->Shard a local slice; only when no target tensor dim is sharded by
    another mesh dim (then the hop may route through Replicate) is the count exact.
    """
    counts: dict[str, int] = {}
    for m, (a, b) in enumerate(zip(case.src, case.dst)):
        if a == b:
            continue
        others = [p for i, p in enumerate(case.src) if i != m] + [p for i, p in enumerate(case.dst) if i != m]
        if isinstance(b, Shard) and any(isinstance(p, Shard) and p.dim == b.dim for p in others):
            return None
        if isinstance(a, Shard) and isinstance(b, Replicate):
            counts["all_gather"] = counts.get("all_gather", 0) + 1
        elif isinstance(a, Shard) and isinstance(b, Shard):
            counts["all_to_all"] = counts.get("all_to_all", 0) + 1
    return counts


def _check_world(case: Case) -> list[str]:
    """Runs on every rank; returns what failed (an empty list when all is well)."""
    mesh = init_device_mesh("cpu", case.mesh)
    coords = list(mesh.get_coordinate() or [])
    generator = torch.Generator().manual_seed(1234)
    full = torch.randn(case.shape, generator=generator).to(case.dtype)
    weight = torch.randn(case.shape, generator=generator).to(case.dtype)
    local = reference_piece(full, coords, case.mesh, case.src)
    problems: list[str] = []

    with meshsim.record() as chunk_ledger:
        chunked = ShardTensor.from_local(
            local, mesh, case.src, sharding_shapes="chunk", global_shape=case.shape
        )
    with meshsim.record() as infer_ledger:
        inferred = ShardTensor.from_local(local, mesh, case.src)
    shard_dims = sum(isinstance(p, Shard) for p in case.src)
    if chunked.spec != inferred.spec:
        problems.append(f"chunk spec {chunked.spec!r} != infer spec {inferred.spec!r}")
    if len(chunk_ledger) != 0:
        problems.append(f"chunk mode issued {chunk_ledger.counts()}")
    if infer_ledger.counts() != ({"all_gather": shard_dims} if shard_dims else {}):
        problems.append(f"infer issued {infer_ledger.counts()} for {shard_dims} Shard mesh dims")

    with meshsim.record() as hop_ledger:
        moved = chunked.redistribute(mesh, case.dst)
    expected = expected_hops(case)
    if expected is not None and hop_ledger.counts() != expected:
        problems.append(f"{case.src} -> {case.dst} issued {hop_ledger.counts()}, expected {expected}")
    if not set(hop_ledger.counts()) <= {"all_gather", "all_to_all"}:
        problems.append(f"unexpected collectives {hop_ledger.counts()}")
    if not torch.equal(moved.to_local(), reference_piece(full, coords, case.mesh, case.dst)):
        problems.append("the redistributed shard is not torch.chunk's piece of the global tensor")
    back = moved.redistribute(mesh, case.src)
    if not torch.equal(back.to_local(), local):
        problems.append("the round trip is not bitwise equal to the input")

    leaf = local.clone().requires_grad_()
    st_ = ShardTensor.from_local(leaf, mesh, case.src, sharding_shapes="chunk", global_shape=case.shape)
    (st_.redistribute(mesh, case.dst).full_tensor() * weight).sum().backward()
    want = reference_piece(weight, coords, case.mesh, case.src)
    if leaf.grad is None or not torch.equal(leaf.grad, want):
        problems.append("gradient through from_local/redistribute/full_tensor is not the reference")
    return problems


@settings(deadline=None)  # a world per example; thread timing is noisy
@given(cases())
def test_generated_layouts(case: Case) -> None:
    world = 1
    for extent in case.mesh:
        world *= extent
    results = meshsim.run(_check_world, world, args=(case,), timeout=60)
    failed = {rank: problems for rank, problems in enumerate(results) if problems}
    assert not failed, f"{case}: {failed}"
    assert dist.is_initialized() is False
