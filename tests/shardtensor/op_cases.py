"""Layouts for the operator tests: 1-D and 2-D meshes, even, uneven and empty shards.

A layout id names the mesh and the kind of shard sizes along every sharded dim:

- ``even``: 2 per coordinate (torch.chunk's layout, what DTensor describes);
- ``uneven``: 1, 2, 3, ... per coordinate (no torch.chunk layout has these);
- ``empty``: one coordinate holds nothing (and the sizes are uneven).

On a 1-D mesh of 4 ranks tensor dim 0 is sharded; on the 2x2 mesh dims 0 and 1 are,
one per mesh dim. Every rank builds the same global tensor and cuts its shard out,
so results check against a single-process reference without communication; the
shards are wrapped with dict ``sharding_shapes`` (no collective), so ledgers count
only what an operator does.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.placement_types import Placement

from shardtensor import ShardTensor

from .shardtensor_cases import global_tensor

LAYOUTS = ["1d-even", "1d-uneven", "1d-empty", "2d-even", "2d-uneven", "2d-empty"]

# Tolerances against the single-process reference: reductions sum in another order,
# and bfloat16 rounds each rank's partial result.
TOLERANCE = {torch.float32: {"rtol": 1e-5, "atol": 1e-5}, torch.bfloat16: {"rtol": 3e-2, "atol": 3e-2}}


def sizes_for(kind: str, n: int) -> tuple[int, ...]:
    """Shard sizes over ``n`` coordinates for a layout kind."""
    if kind == "even":
        return (2,) * n
    if kind == "uneven":
        return tuple(r + 1 for r in range(n))
    if kind == "empty":
        return (3, 0) if n == 2 else tuple([2, 0, 3, 1, 2, 1, 1, 2][:n])
    raise ValueError(f"unknown layout kind {kind!r}")


class Layout:
    """A mesh, placements and per-mesh-dim sizes for tensors whose leading dims are sharded."""

    def __init__(self, layout_id: str, mesh_1d: DeviceMesh | None, mesh_2d: DeviceMesh | None) -> None:
        mesh_kind, kind = layout_id.split("-")
        mesh = mesh_1d if mesh_kind == "1d" else mesh_2d
        if mesh is None:
            raise ValueError(f"layout {layout_id!r} needs a {mesh_kind} mesh")
        self.mesh = mesh
        self.kind = kind
        self.placements: tuple[Placement, ...] = tuple(Shard(m) for m in range(mesh.ndim))
        self.sizes = {m: sizes_for(kind, mesh.size(m)) for m in range(mesh.ndim)}

    def extent(self, dim: int) -> int:
        """The global extent of a sharded tensor dim (dims 0 .. mesh.ndim - 1)."""
        return sum(self.sizes[dim])

    def shape(self, *rest: int) -> tuple[int, ...]:
        """A global shape whose sharded dims have this layout's extents, then ``rest``."""
        return (*(self.extent(m) for m in range(self.mesh.ndim)), *rest)

    def full(self, *rest: int, dtype: torch.dtype = torch.float32, offset: float = 0.0) -> torch.Tensor:
        return global_tensor(self.shape(*rest), dtype, self.mesh.device_type) + offset

    def shard(self, full: torch.Tensor, placements: Sequence[Placement] | None = None) -> ShardTensor:
        """``full`` laid out in this layout (or with ``placements``, same sizes) on every rank."""
        return distribute(full, self.mesh, placements or self.placements, self.sizes)


def distribute(
    full: torch.Tensor, mesh: DeviceMesh, placements: Sequence[Placement], sizes: dict[int, Sequence[int]]
) -> ShardTensor:
    """This rank's shard of ``full`` with ``sizes[m]`` along each Shard mesh dim ``m`` (no collective)."""
    coordinate = mesh.get_coordinate()
    assert coordinate is not None
    local = full
    for m, p in enumerate(placements):
        if isinstance(p, Shard):
            along = sizes[m]
            local = local.narrow(p.dim, sum(along[: coordinate[m]]), along[coordinate[m]])
    local = local.contiguous()
    shapes = {
        m: [_with(local.shape, p.dim, s) for s in sizes[m]]
        for m, p in enumerate(placements)
        if isinstance(p, Shard)
    }
    return ShardTensor.from_local(local, mesh, placements, shapes)


def replicated(full: torch.Tensor, mesh: DeviceMesh) -> ShardTensor:
    """``full`` as a Replicate ShardTensor (no collective)."""
    return ShardTensor.from_local(full, mesh, [Replicate()] * mesh.ndim, "chunk", tuple(full.shape))


def _with(shape: Sequence[int], dim: int, size: int) -> tuple[int, ...]:
    return tuple(size if d == dim else s for d, s in enumerate(shape))


def assert_layout_is_true(st: ShardTensor) -> None:
    """``st``'s spec records every rank's real shard sizes (checked by gathering the local shapes).

    A ``Partial`` mesh dim's local shape is the global one; ``Replicate`` likewise.
    """
    placements = [Replicate() if p.is_partial() else p for p in st.placements]
    inferred = ShardTensor.from_local(st._local_tensor.detach(), st.device_mesh, placements)
    assert inferred.spec.shard_sizes == st.spec.shard_sizes
    assert tuple(inferred.shape) == tuple(st.shape)


def close(actual: torch.Tensor, expected: torch.Tensor, dtype: torch.dtype) -> None:
    torch.testing.assert_close(actual.float(), expected.float(), **TOLERANCE[dtype])
