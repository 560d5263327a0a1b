"""Shared test data for the shardtensor tests: global tensors, layouts, and each rank's shard.

Every rank builds the same global tensor (seeded from its shape) on the mesh's
device and cuts its own shard out of it, so any rank can check any result against
the global reference without communication.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Shard
from torch.distributed.tensor.placement_types import Placement

from shardtensor import chunk_sizes

DTYPES = [torch.float32, torch.bfloat16]
DTYPE_IDS = ["float32", "bfloat16"]

# Extents of a sharded dim over n ranks: torch.chunk's layouts of every kind.
KINDS = {
    "even": lambda n: 2 * n,  # 2 per rank
    "uneven": lambda n: 2 * n - 1,  # the last rank holds 1
    "empty": lambda n: 3 * (n - 1),  # 9 over 4: 3,3,3,0
    "sparse": lambda n: n - 1,  # 3 over 4: 1,1,1,0
    "none": lambda n: 0,  # every shard empty
}


def global_tensor(shape: Sequence[int], dtype: torch.dtype, device: str) -> torch.Tensor:
    """The same pseudo-random tensor of ``shape`` on every rank (seeded from the shape)."""
    generator = torch.Generator().manual_seed(hash(tuple(shape)) % (2**31))
    return torch.randn(tuple(shape), generator=generator).to(device=device, dtype=dtype)


def shard(
    full: torch.Tensor,
    mesh: DeviceMesh,
    placements: Sequence[Placement],
    sizes: dict[int, Sequence[int]] | None = None,
) -> torch.Tensor:
    """This rank's shard of ``full``: ``sizes[m]`` per Shard mesh dim ``m`` (torch.chunk's by default)."""
    coordinate = mesh.get_coordinate()
    assert coordinate is not None
    local = full
    for m, p in enumerate(placements):
        if isinstance(p, Shard):
            along = sizes[m] if sizes is not None else chunk_sizes(full.shape[p.dim], mesh.size(m))
            start = sum(along[: coordinate[m]])
            local = local.narrow(p.dim, start, along[coordinate[m]])
    return local.contiguous()


def ramp(n: int, rank_sizes: Sequence[int] | None = None) -> tuple[int, ...]:
    """Uneven, non-chunk sizes for n ranks: 1, 2, 3, ... (``rank_sizes`` overrides)."""
    return tuple(rank_sizes) if rank_sizes is not None else tuple(r + 1 for r in range(n))


def numel(shape: Sequence[int]) -> int:
    return math.prod(shape)
