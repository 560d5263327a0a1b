"""view and _unsafe_view on per-rank layouts: which dims stay sharded, and every rank's sizes.

DTensor refuses to flatten a dim whose global extent does not divide by the mesh
size, since its shards are torch.chunk's. With per-rank sizes, a view keeps a
sharded dim sharded whenever each rank's piece is itself a view of a contiguous
block of the global tensor:

- the dim is kept as it is: same sizes;
- it is the leading dim of a flattened group: sizes times the product of the
  group's other extents;
- it is (the leading dim of) a group split into pieces and becomes the leading
  piece: sizes divided by the product of the other pieces, where every rank's
  size divides.

Anything else (a sharded dim flattened behind another dim, or a split that does
not divide every rank's size) gathers that mesh dim first, as DTensor would.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import torch
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.placement_types import Placement

from shardtensor import _torch_private
from shardtensor._spec import ShardTensorSpec, make_spec

__all__ = ["VIEW_OPS", "view_layouts"]

aten = torch.ops.aten
VIEW_OPS = frozenset({aten.view.default, aten._unsafe_view.default})

Sizes = tuple[int, ...]


class _Gather(Exception):
    """This mesh dim's sharded tensor dim does not survive the view."""


def view_layouts(spec: ShardTensorSpec, size: Sequence[int]) -> tuple[ShardTensorSpec, ShardTensorSpec]:
    """The layout the input needs and the layout of the result, for ``view(size)``.

    Raises:
        RuntimeError: ``size`` is not a view of the input's global shape (torch's message).
    """
    out_shape = _infer(spec.shape, size)
    dim_map = _torch_private.view_dim_map(spec.shape, out_shape)
    source = spec
    while True:
        try:
            placements, sizes = _through(source, dim_map)
            break
        except _Gather as gather:
            source = _replicate_mesh_dim(source, int(str(gather)))
    stride = torch.empty_strided(spec.shape, spec.stride, device="meta").view(out_shape).stride()
    out = make_spec(spec.mesh, placements, out_shape, spec.dtype, sizes, tuple(stride), spec.coordinate)
    return source, out


def _infer(shape: Sequence[int], size: Sequence[int]) -> tuple[int, ...]:
    return tuple(torch.empty(tuple(shape), device="meta").view(tuple(size)).shape)


def _through(
    spec: ShardTensorSpec, dim_map: list[tuple[Any, ...]]
) -> tuple[tuple[Placement, ...], dict[int, Sizes]]:
    sharded = {p.dim: m for m, p in enumerate(spec.placements) if isinstance(p, Shard)}
    placements: list[Placement] = []
    sizes: dict[int, Sizes] = {}
    for m, p in enumerate(spec.placements):
        if not isinstance(p, Shard):
            placements.append(p)
            continue
        carriers = []
        for o, entry in enumerate(dim_map):
            carried = _carried(entry, p.dim, spec.shape, spec.shard_sizes[m], sharded)  # type: ignore[arg-type]
            if carried is not None:
                carriers.append((o, carried))
        if len(carriers) != 1:
            raise _Gather(str(m))
        o, along = carriers[0]
        placements.append(Shard(o))
        sizes[m] = along
    return tuple(placements), sizes


def _carried(
    entry: tuple[Any, ...], dim: int, shape: tuple[int, ...], along: Sizes, sharded: dict[int, int]
) -> Sizes | None:
    """The sizes of the output dim described by ``entry`` if it carries sharded ``dim``.

    Raises:
        _Gather: ``entry`` uses ``dim`` in a way a per-rank layout cannot follow; its
            message is the mesh dim to gather (where two sharded dims are flattened
            together, the one behind: the leading one can then stay sharded).
    """
    kind = entry[0]
    if kind == "in":
        return along if entry[1] == dim else None
    if kind == "flat":
        dims = entry[1]
        if dim not in dims:
            return None
        if dims[0] != dim:
            raise _Gather(str(sharded[dim]))
        behind = [sharded[d] for d in dims[1:] if d in sharded]
        if behind:
            raise _Gather(str(behind[0]))
        return tuple(s * math.prod(shape[d] for d in dims[1:]) for s in along)
    if kind == "split":
        flat = _carried(entry[1], dim, shape, along, sharded)
        if flat is None:
            return None
        group, index = entry[2], entry[3]
        if index != 0:
            return None  # a trailing piece: whole on every rank, the leading piece carries the shards
        rest = math.prod(group[1:])
        if any(s % rest for s in flat):
            raise _Gather(str(sharded[dim]))
        return tuple(s // rest for s in flat)
    return None  # a new size-1 dim, or a form DTensor has that views do not make


def _replicate_mesh_dim(spec: ShardTensorSpec, mesh_dim: int) -> ShardTensorSpec:
    placements = tuple(Replicate() if m == mesh_dim else p for m, p in enumerate(spec.placements))
    sizes = {m: s for m, s in enumerate(spec.shard_sizes) if s is not None and m != mesh_dim}
    return make_spec(spec.mesh, placements, spec.shape, spec.dtype, sizes, spec.stride, spec.coordinate)
