"""scatter_tensor: a tensor that exists on one rank, distributed over a mesh (PhysicsNeMo's API).

The source broadcasts the whole tensor along the mesh, one mesh dim at a time over
that dim's existing group (no new process group): first along mesh dim 0 among the
ranks that share the source's other coordinates, then along mesh dim 1 among those
that now hold it, and so on. Every rank then cuts its torch.chunk shard out locally.
The shape and dtype travel first, as Python objects, unless both are given.
"""

from __future__ import annotations

import operator
from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Replicate
from torch.distributed.tensor.placement_types import Placement

from shardtensor._placements import check_placements
from shardtensor._spec import make_spec

__all__ = ["scatter_tensor"]


def scatter_tensor(
    tensor: torch.Tensor | None,
    global_src: int,
    mesh: DeviceMesh,
    placements: Sequence[Placement],
    global_shape: Sequence[int] | None = None,
    dtype: torch.dtype | None = None,
    requires_grad: bool = False,
) -> Any:
    """Distribute ``tensor``, held by global rank ``global_src``, over ``mesh`` in ``placements``.

    Args:
        tensor: the whole tensor on ``global_src``; ignored (may be None) elsewhere.
        global_src: the global rank that holds it; must be in ``mesh``.
        mesh: the device mesh.
        placements: one per mesh dim (``Shard`` dims are chunked as torch.chunk does).
        global_shape: the tensor's shape, if every rank knows it (with ``dtype``,
            saves broadcasting the metadata).
        dtype: the tensor's dtype (the source's tensor is cast to it).
        requires_grad: make the result an autograd leaf that requires grad.

    Returns:
        a ShardTensor (a leaf: no autograd history leads back to ``tensor``).

    Raises:
        ValueError: ``global_src`` is not an int rank of ``mesh``, bad placements, or
            (on the source) a tensor that does not have ``global_shape``.
        TypeError: the source passed no tensor.
    """
    from shardtensor._tensor import ShardTensor

    if isinstance(global_src, bool) or not isinstance(global_src, int):
        raise ValueError(f"Global source must be an integer rank, got {global_src!r}")
    ranks = mesh.mesh.flatten().tolist()
    if global_src not in ranks:
        raise ValueError(f"Please specify a tensor source in this mesh: {global_src} is not in {ranks}")
    me = dist.get_rank()
    src_coordinate = _coordinate_of(mesh, global_src)
    coordinate = tuple(mesh.get_coordinate() or ())
    if me == global_src:
        tensor = _check_source(tensor, global_shape, dtype)
    shape, kind = _metadata(tensor, global_shape, dtype, mesh, src_coordinate, coordinate)
    checked = check_placements(placements, mesh, len(shape))
    buffer = (
        tensor
        if me == global_src and tensor is not None
        else torch.empty(shape, dtype=kind, device=mesh.device_type)
    )
    with torch.no_grad():
        _broadcast_along_mesh(buffer, mesh, src_coordinate, coordinate)
        replicated = make_spec(mesh, (Replicate(),) * mesh.ndim, shape, kind, {}, coordinate=coordinate)
        moved = ShardTensor(buffer, replicated).redistribute(placements=checked)
    result = ShardTensor(moved._local_tensor.detach(), moved._spec)
    if requires_grad:
        result.requires_grad_(True)
    return result


def _check_source(
    tensor: torch.Tensor | None, global_shape: Sequence[int] | None, dtype: torch.dtype | None
) -> torch.Tensor:
    if not isinstance(tensor, torch.Tensor):
        raise TypeError(f"scatter_tensor: the source rank must pass a tensor, got {type(tensor).__name__}")
    if global_shape is not None and tuple(tensor.shape) != tuple(operator.index(s) for s in global_shape):
        raise ValueError(
            f"scatter_tensor: the source's tensor has shape {tuple(tensor.shape)}, but global_shape is "
            f"{tuple(global_shape)}"
        )
    tensor = tensor.detach()
    if dtype is not None and tensor.dtype != dtype:
        tensor = tensor.to(dtype)
    return tensor.contiguous()


def _coordinate_of(mesh: DeviceMesh, rank: int) -> tuple[int, ...]:
    where = (mesh.mesh == rank).nonzero()
    return tuple(int(i) for i in where[0].tolist())


def _participates(mesh_dim: int, src: tuple[int, ...], mine: tuple[int, ...]) -> bool:
    """Whether this rank's group along ``mesh_dim`` holds the tensor at that step."""
    return mine[mesh_dim + 1 :] == src[mesh_dim + 1 :]


def _source_in_group(mesh: DeviceMesh, mesh_dim: int, src: tuple[int, ...]) -> tuple[Any, int]:
    group = mesh.get_group(mesh_dim)
    return group, dist.get_global_rank(group, src[mesh_dim])


def _broadcast_along_mesh(
    tensor: torch.Tensor, mesh: DeviceMesh, src: tuple[int, ...], mine: tuple[int, ...]
) -> None:
    for m in range(mesh.ndim):
        if _participates(m, src, mine) and mesh.size(m) > 1:
            group, root = _source_in_group(mesh, m, src)
            dist.broadcast(tensor, src=root, group=group)


def _metadata(
    tensor: torch.Tensor | None,
    global_shape: Sequence[int] | None,
    dtype: torch.dtype | None,
    mesh: DeviceMesh,
    src: tuple[int, ...],
    mine: tuple[int, ...],
) -> tuple[tuple[int, ...], torch.dtype]:
    if global_shape is not None and dtype is not None:
        return tuple(operator.index(s) for s in global_shape), dtype
    box: list[Any] = [(tuple(tensor.shape), tensor.dtype) if tensor is not None else None]
    for m in range(mesh.ndim):
        if _participates(m, src, mine) and mesh.size(m) > 1:
            group, root = _source_in_group(mesh, m, src)
            dist.broadcast_object_list(box, src=root, group=group)
    shape, kind = box[0]
    return tuple(shape), kind
