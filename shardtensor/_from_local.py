"""From ``from_local``'s arguments to a ShardTensorSpec: checks, then the chunk, dict or infer mode.

Every check runs before the one collective any mode makes ("infer"'s shape
all_gather), so a bad argument fails on the rank that passed it and costs the
others nothing but the report. Error messages that PhysicsNeMo has are kept word
for word; the rest name the value and what was expected.
"""

from __future__ import annotations

import operator
from collections.abc import Mapping, Sequence

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Shard
from torch.distributed.tensor.placement_types import Placement

from shardtensor._collectives import all_gather_shapes
from shardtensor._placements import check_placements
from shardtensor._spec import ShardTensorSpec, chunk_layout, make_spec

__all__ = ["MODES", "build_spec", "check_mode"]

MODES = ("chunk", "infer")
Shape = tuple[int, ...]
ShardingShapes = str | Mapping[int, Sequence[Sequence[int]]]


def check_mode(sharding_shapes: object, global_shape: object) -> None:
    """Upstream's first two checks, in upstream's order.

    Raises:
        ValueError: an unknown mode string, or "chunk" without ``global_shape``.
        TypeError: ``sharding_shapes`` is neither a string nor a mapping.
    """
    if isinstance(sharding_shapes, str):
        if sharding_shapes not in MODES:
            raise ValueError("If sharding_shapes is a string, it must be one of: 'chunk', 'infer'")
        if sharding_shapes == "chunk" and global_shape is None:
            raise ValueError("If sharding_shapes is 'chunk', global_shape must be provided")
    elif not isinstance(sharding_shapes, Mapping):
        raise TypeError(
            f"sharding_shapes must be 'infer', 'chunk' or a dict {{mesh_dim: [shape per coordinate]}}, "
            f"got {sharding_shapes!r} of type {type(sharding_shapes).__name__}"
        )


def build_spec(
    local: torch.Tensor,
    mesh: DeviceMesh,
    placements: object,
    sharding_shapes: object,
    global_shape: object,
) -> ShardTensorSpec:
    """The spec of ``local`` as this rank's shard: see ``ShardTensor.from_local``."""
    check_mode(sharding_shapes, global_shape)
    checked = check_placements(placements, mesh, local.ndim)
    shape = _check_global_shape(global_shape, local.ndim)
    _check_in_mesh(mesh)
    local_shape = tuple(local.shape)
    if sharding_shapes == "chunk":
        if shape is None:  # check_mode guarantees a global_shape; this is for the type checker
            raise ValueError("If sharding_shapes is 'chunk', global_shape must be provided")
        spec = make_spec(mesh, checked, shape, local.dtype, chunk_layout(mesh, checked, shape))
        _check_expected(spec, local_shape)
        return spec
    if isinstance(sharding_shapes, Mapping):
        sizes = _sizes_from_dict(sharding_shapes, mesh, checked, local_shape)
    else:
        sizes = _sizes_from_gather(mesh, checked, local_shape)
    spec = make_spec(mesh, checked, _global_from(local_shape, checked, sizes), local.dtype, sizes)
    _check_agrees(shape, spec, sharding_shapes)
    return spec


def _check_global_shape(global_shape: object, ndim: int) -> Shape | None:
    if global_shape is None:
        return None
    if isinstance(global_shape, (str, bytes, torch.Tensor)) or not isinstance(global_shape, Sequence):
        raise TypeError(f"global_shape must be a tuple of ints (or torch.Size), got {global_shape!r}")
    try:
        shape = tuple(operator.index(s) for s in global_shape)
    except TypeError:
        raise TypeError(
            f"global_shape must be a tuple of ints (or torch.Size), got {global_shape!r}"
        ) from None
    if len(shape) != ndim:
        raise ValueError(
            f"global_shape {shape} has {len(shape)} dims, but the local tensor has {ndim}; "
            "they must have the same number of dims"
        )
    if any(s < 0 for s in shape):
        raise ValueError(f"global_shape {shape} has a negative size")
    return shape


def _check_in_mesh(mesh: DeviceMesh) -> None:
    if mesh.get_coordinate() is None:
        raise ValueError(f"rank {dist.get_rank()} is not part of device_mesh {mesh}")


def _check_expected(spec: ShardTensorSpec, local_shape: Shape) -> None:
    if spec.local_shape != local_shape:
        # PhysicsNeMo's message (global rank), then the values that explain it.
        raise ValueError(
            f"Rank {dist.get_rank()} expected local shape {spec.local_shape} does not match tensor's "
            f"local shape {local_shape} (global_shape {spec.shape} with placements "
            f"{list(spec.placements)}, chunked as torch.chunk does: {_sizes_text(spec)})"
        )


def _sizes_text(spec: ShardTensorSpec) -> str:
    parts = [f"mesh dim {m} sizes {s}" for m, s in enumerate(spec.shard_sizes) if s is not None]
    return ", ".join(parts) or "nothing is sharded, so the local shape is the global shape"


def _global_from(local_shape: Shape, placements: tuple[Placement, ...], sizes: Mapping[int, Shape]) -> Shape:
    shape = list(local_shape)
    for m, p in enumerate(placements):
        if isinstance(p, Shard):
            shape[p.dim] = sum(sizes[m])
    return tuple(shape)


def _check_agrees(given: Shape | None, spec: ShardTensorSpec, mode: object) -> None:
    if given is not None and given != spec.shape:
        how = "inferred from every rank's local shape" if mode == "infer" else "implied by sharding_shapes"
        raise ValueError(
            f"global_shape {given} does not match the global shape {spec.shape} {how} ({_sizes_text(spec)})"
        )


def _sizes_from_gather(
    mesh: DeviceMesh, placements: tuple[Placement, ...], local_shape: Shape
) -> dict[int, Shape]:
    """The "infer" mode: one all_gather of the local shape per Shard mesh dim, over that dim's group."""
    sharded = {m: p.dim for m, p in enumerate(placements) if isinstance(p, Shard)}
    gathered = {m: all_gather_shapes(local_shape, mesh.get_group(m), mesh.device_type) for m in sharded}
    # Checked only once every gather is done: a rank that raises has left no peer waiting.
    for m, dim in sharded.items():
        _check_cross_section(m, dim, gathered[m], local_shape, "gathered")
    return {m: tuple(s[dim] for s in gathered[m]) for m, dim in sharded.items()}


def _check_cross_section(
    mesh_dim: int, dim: int, shapes: Sequence[Shape], local_shape: Shape, what: str
) -> None:
    """Shapes along a mesh dim must equal this rank's everywhere but the sharded tensor dim."""
    for r, shape in enumerate(shapes):
        if len(shape) != len(local_shape) or any(
            a != b for d, (a, b) in enumerate(zip(shape, local_shape, strict=True)) if d != dim
        ):
            raise ValueError(
                f"Rank {dist.get_rank()}: the {what} shape {tuple(shape)} of coordinate {r} along mesh "
                f"dim {mesh_dim} differs from the local shape {local_shape} outside the sharded tensor "
                f"dim {dim}; all local shapes must match except along the sharded dimension"
            )


def _sizes_from_dict(
    sharding_shapes: Mapping[int, Sequence[Sequence[int]]],
    mesh: DeviceMesh,
    placements: tuple[Placement, ...],
    local_shape: Shape,
) -> dict[int, Shape]:
    sharded = {m: p.dim for m, p in enumerate(placements) if isinstance(p, Shard)}
    if not sharding_shapes and sharded:
        raise ValueError("sharding_shapes as a dict cannot be empty")  # PhysicsNeMo's message
    keys = set(sharding_shapes)
    if keys != set(sharded):
        raise ValueError(
            f"sharding_shapes has keys {sorted(keys, key=repr)} but the Shard placements are on mesh dims "
            f"{sorted(sharded)} (missing: {sorted(set(sharded) - keys)}, extra: "
            f"{sorted(keys - set(sharded), key=repr)}); give one entry per Shard mesh dim"
        )
    return {m: _entry_sizes(m, dim, sharding_shapes[m], mesh, local_shape) for m, dim in sharded.items()}


def _entry_sizes(mesh_dim: int, dim: int, entry: object, mesh: DeviceMesh, local_shape: Shape) -> Shape:
    shapes = _as_shapes(mesh_dim, entry)
    if len(shapes) != mesh.size(mesh_dim):
        raise ValueError(
            f"sharding_shapes[{mesh_dim}] has {len(shapes)} shapes, but mesh dim {mesh_dim} has "
            f"{mesh.size(mesh_dim)} coordinates; give one shape per coordinate"
        )
    coordinate = mesh.get_local_rank(mesh_dim)
    if shapes[coordinate] != local_shape:
        raise ValueError(
            f"Rank {dist.get_rank()}: sharding_shapes[{mesh_dim}][{coordinate}] is {shapes[coordinate]}, "
            f"but this rank's local tensor has shape {local_shape}"
        )
    _check_cross_section(mesh_dim, dim, shapes, local_shape, "given")
    return tuple(s[dim] for s in shapes)


def _as_shapes(mesh_dim: int, entry: object) -> list[Shape]:
    bad = TypeError(
        f"sharding_shapes[{mesh_dim}] must be a sequence of shapes (tuples of non-negative ints), "
        f"one per mesh coordinate, got {entry!r}"
    )
    if isinstance(entry, (str, bytes)) or not isinstance(entry, Sequence):
        raise bad
    try:
        shapes = [tuple(operator.index(s) for s in shape) for shape in entry]
    except TypeError:
        raise bad from None
    if any(s < 0 for shape in shapes for s in shape):
        raise ValueError(f"sharding_shapes[{mesh_dim}] has a negative size: {shapes}")
    return shapes
