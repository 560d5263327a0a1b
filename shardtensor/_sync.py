"""sync_module_over_mesh: make a module's plain parameters and buffers identical over a 1-D mesh.

In data x domain parallelism every rank of a domain group holds a full replica of
the model's plain weights, and nothing else (DDP broadcasts over its own group,
FSDP2 not at all) makes those replicas start equal. Tensors are packed into one
buffer per dtype and broadcast from the source, so a module costs one broadcast per
dtype rather than one per tensor. Distributed tensors (ShardTensor, DTensor) are
left alone: their values are the caller's to place.
"""

from __future__ import annotations

from collections import defaultdict

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor

__all__ = ["sync_module_over_mesh"]


def sync_module_over_mesh(
    module: torch.nn.Module, mesh: DeviceMesh, src_mesh_rank: int = 0, verify: bool = False
) -> None:
    """Broadcast ``module``'s plain parameters and buffers from one position of ``mesh``.

    Args:
        module: synchronized in place.
        mesh: a 1-D mesh (for a multi-dim mesh pass the axis, e.g. ``mesh["domain"]``).
        src_mesh_rank: the source's position in ``mesh`` (not its global rank).
        verify: first check (one all_gather of Python objects) that every rank has
            the same names, shapes and dtypes, and afterwards that the values agree
            (two small all_reduces).

    Raises:
        ValueError: ``mesh`` is not 1-D, or ``src_mesh_rank`` is not a position in it.
        RuntimeError: the module is already sharded by FSDP2, holds state but none of
            it plain, holds meta tensors or tensors on another device type than the
            mesh's, or (``verify``) ranks disagree.
    """
    if mesh.ndim != 1:
        raise ValueError(
            f"sync_module_over_mesh expects a 1-D mesh, got a {mesh.ndim}-D one of shape "
            f"{tuple(mesh.shape)}; pass the axis to synchronize over, e.g. mesh['domain']"
        )
    size = mesh.size(0)
    if isinstance(src_mesh_rank, bool) or not isinstance(src_mesh_rank, int) or not 0 <= src_mesh_rank < size:
        raise ValueError(
            f"src_mesh_rank must be a position in the mesh, 0 to {size - 1}, got {src_mesh_rank!r}"
        )
    if _is_fsdp2(module):
        raise RuntimeError(
            "sync_module_over_mesh must run before fully_shard, while the replicated state is still plain"
        )
    named = _plain_state(module)
    if not named:
        if any(True for _ in module.parameters()) or any(True for _ in module.buffers()):
            raise RuntimeError(
                "sync_module_over_mesh found module state, but none of it is plain (all of it is "
                "ShardTensor or DTensor); distributed tensors are the caller's to initialize"
            )
        return
    _check_devices(named, mesh)
    group = mesh.get_group(0)
    if verify:
        _verify_metadata(named, group)
    with torch.no_grad():
        _broadcast_packed([t for _, t in named], group, dist.get_global_rank(group, src_mesh_rank))
    if verify:
        _verify_values(named, group)


def _is_fsdp2(module: torch.nn.Module) -> bool:
    from torch.distributed.fsdp import FSDPModule

    return isinstance(module, FSDPModule)


def _plain_state(module: torch.nn.Module) -> list[tuple[str, torch.Tensor]]:
    from shardtensor._tensor import ShardTensor

    named = [*module.named_parameters(), *module.named_buffers()]
    return [(n, t.detach()) for n, t in named if not isinstance(t, (ShardTensor, DTensor))]


def _check_devices(named: list[tuple[str, torch.Tensor]], mesh: DeviceMesh) -> None:
    for name, tensor in named:
        if tensor.is_meta:
            raise RuntimeError(
                f"sync_module_over_mesh cannot synchronize meta tensors; materialize {name!r} first"
            )
        if tensor.device.type != mesh.device_type:
            raise RuntimeError(
                f"sync_module_over_mesh found {name!r} on {tensor.device.type}, but the mesh's device type "
                f"is {mesh.device_type}"
            )


def _broadcast_packed(tensors: list[torch.Tensor], group: dist.ProcessGroup, root: int) -> None:
    """One broadcast per dtype: the tensors packed back to back, then copied out."""
    by_dtype: dict[torch.dtype, list[torch.Tensor]] = defaultdict(list)
    for t in tensors:
        by_dtype[t.dtype].append(t)
    for same in by_dtype.values():
        packed = torch.cat([t.reshape(-1) for t in same])
        dist.broadcast(packed, src=root, group=group)
        offset = 0
        for t in same:
            t.copy_(packed[offset : offset + t.numel()].view_as(t))
            offset += t.numel()


def _verify_metadata(named: list[tuple[str, torch.Tensor]], group: dist.ProcessGroup) -> None:
    mine = [(n, tuple(t.shape), str(t.dtype)) for n, t in named]
    everyone: list[object] = [None] * dist.get_world_size(group)
    dist.all_gather_object(everyone, mine, group=group)
    different = [r for r, theirs in enumerate(everyone) if theirs != everyone[0]]
    if different:
        raise RuntimeError(
            f"sync_module_over_mesh: parameter/buffer metadata differs across the mesh: group ranks "
            f"{different} differ from group rank 0 (names, shapes, dtypes per rank: {everyone})"
        )


def _checksum(tensor: torch.Tensor) -> torch.Tensor:
    values = torch.view_as_real(tensor) if tensor.is_complex() else tensor
    values = values.double()
    finite = torch.isfinite(values)
    kept = torch.where(finite, values, torch.zeros_like(values))
    return torch.stack((kept.sum(), kept.abs().sum(), torch.isnan(values).sum().double()))


def _verify_values(named: list[tuple[str, torch.Tensor]], group: dist.ProcessGroup) -> None:
    sums = torch.stack([_checksum(t) for _, t in named])
    low, high = sums.clone(), sums.clone()
    dist.all_reduce(low, op=dist.ReduceOp.MIN, group=group)
    dist.all_reduce(high, op=dist.ReduceOp.MAX, group=group)
    for (name, _), lo, hi in zip(named, low, high):
        if not torch.equal(lo, hi):
            raise RuntimeError(
                f"sync_module_over_mesh: the values of {name!r} differ across the mesh after the broadcast "
                f"(checksums min {lo.tolist()}, max {hi.tolist()})"
            )
