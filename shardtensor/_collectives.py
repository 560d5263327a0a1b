"""The wire: each function is one collective over one mesh dim's group, on plain tensors.

Only collectives that NCCL, gloo and the simulated backend all provide with the
same meaning: equal-sized ``all_gather`` (uneven shards are padded to the largest),
``all_to_all_single`` with uneven splits, ``all_reduce`` and equal-sized
``reduce_scatter`` (padded likewise). Every function issues exactly one collective,
which is what the ledger tests count.

While torch.compile traces (Dynamo, AOTAutograd), the same collectives are issued as
functional collectives, which become nodes of the compiled graph instead of
running on the tracer's fake tensors; eagerly they are plain c10d calls.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist

from shardtensor import _torch_private
from shardtensor._spec import numel

__all__ = [
    "REDUCE_OPS",
    "all_gather_shapes",
    "all_reduce",
    "all_reduce_sum",
    "all_to_all_along",
    "exchange_shapes",
    "gather_along",
    "reduce_scatter_along",
    "with_size",
]

Shape = tuple[int, ...]
Group = dist.ProcessGroup

# torch 2.13 renamed the *_into_tensor / *_tensor collectives to *_single and
# deprecated the old names; 2.11 and 2.12 have only the old ones.
_all_gather_single: Callable[..., Any] = getattr(dist, "all_gather_single", dist.all_gather_into_tensor)
_reduce_scatter_single: Callable[..., Any] = getattr(
    dist, "reduce_scatter_single", dist.reduce_scatter_tensor
)


def with_size(shape: Sequence[int], dim: int, size: int) -> Shape:
    """``shape`` with ``shape[dim]`` replaced by ``size``."""
    return (*shape[:dim], size, *shape[dim + 1 :])


def _flat_chunks_are_consecutive(shape: Sequence[int], dim: int) -> bool:
    """Whether chunks along ``dim`` of a contiguous tensor lie back to back in memory."""
    return numel(tuple(shape[:dim])) == 1


def all_gather_shapes(shape: Shape, group: Group, device: str | torch.device) -> list[Shape]:
    """Every rank's ``shape`` in ``group`` (one all_gather of int64 vectors on ``device``)."""
    n = dist.get_world_size(group)
    mine = torch.tensor(shape, dtype=torch.int64, device=device)
    out = torch.empty(n * len(shape), dtype=torch.int64, device=device)
    _all_gather_single(out, mine, group=group)
    return [tuple(row) for row in out.view(n, len(shape)).tolist()]


def exchange_shapes(send: Sequence[Shape], group: Group, device: str | torch.device) -> list[Shape]:
    """Send ``send[j]`` to group rank ``j`` and return what each rank sent here (one all_to_all)."""
    n, ndim = len(send), len(send[0])
    mine = torch.tensor(send, dtype=torch.int64, device=device).view(-1)
    out = torch.empty(n * ndim, dtype=torch.int64, device=device)
    dist.all_to_all_single(out, mine, group=group)
    return [tuple(row) for row in out.view(n, ndim).tolist()]


def gather_along(local: torch.Tensor, dim: int, sizes: Sequence[int], group: Group) -> torch.Tensor:
    """Shard -> Replicate: concatenate every rank's shard along ``dim`` (one all_gather).

    Args:
        local: this rank's shard.
        dim: the sharded tensor dim.
        sizes: every rank's extent along ``dim``, in group-rank order (from the spec).
        group: the mesh dim's process group.
    """
    shapes = [with_size(local.shape, dim, s) for s in sizes]
    counts = [numel(s) for s in shapes]
    width = max(counts)
    flat = local.contiguous().view(-1)
    if flat.numel() < width:  # uneven shards travel padded to the largest
        flat = torch.nn.functional.pad(flat, (0, width - flat.numel()))
    if _torch_private.are_we_tracing():
        out: torch.Tensor = _torch_private.funcol().all_gather_tensor(flat, 0, group)
    else:
        out = flat.new_empty(len(sizes) * width)
        _all_gather_single(out, flat, group=group)
    full = with_size(local.shape, dim, sum(sizes))
    if len(set(counts)) == 1 and _flat_chunks_are_consecutive(full, dim):
        return out.view(full)
    pieces = [
        out[r * width : r * width + c].view(s) for r, (c, s) in enumerate(zip(counts, shapes, strict=True))
    ]
    return torch.cat(pieces, dim)


def all_to_all_along(
    local: torch.Tensor,
    src_dim: int,
    dst_dim: int,
    recv_shapes: Sequence[Shape],
    send_sizes: Sequence[int],
    group: Group,
) -> torch.Tensor:
    """Shard(src_dim) -> Shard(dst_dim): split along ``dst_dim``, exchange, join along ``src_dim``.

    One all_to_all with uneven splits; nothing about shapes travels.

    Args:
        local: this rank's shard (full along ``dst_dim``).
        src_dim: the tensor dim sharded now.
        dst_dim: the tensor dim sharded afterwards.
        recv_shapes: the shape of the piece each group rank sends here.
        send_sizes: each group rank's extent along ``dst_dim`` afterwards.
        group: the mesh dim's process group.
    """
    chunks = torch.split(local, list(send_sizes), dim=dst_dim)
    send = _pack(local, chunks, dst_dim)
    recv_counts = [numel(s) for s in recv_shapes]
    send_counts = [c.numel() for c in chunks]
    if _torch_private.are_we_tracing():
        out: torch.Tensor = _torch_private.funcol().all_to_all_single(send, recv_counts, send_counts, group)
    else:
        out = send.new_empty(sum(recv_counts))
        dist.all_to_all_single(out, send, recv_counts, send_counts, group=group)
    full = with_size(recv_shapes[0], src_dim, sum(s[src_dim] for s in recv_shapes))
    if _flat_chunks_are_consecutive(full, src_dim):
        return out.view(full)
    pieces = [p.view(s) for p, s in zip(torch.split(out, recv_counts), recv_shapes, strict=True)]
    return torch.cat(pieces, src_dim)


def _pack(local: torch.Tensor, chunks: Sequence[torch.Tensor], dim: int) -> torch.Tensor:
    """The chunks flattened back to back in one buffer (one copy, none where they already are)."""
    if local.is_contiguous() and _flat_chunks_are_consecutive(local.shape, dim):
        return local.view(-1)
    send = local.new_empty(local.numel())
    offset = 0
    for chunk in chunks:
        send[offset : offset + chunk.numel()].view(chunk.shape).copy_(chunk)
        offset += chunk.numel()
    return send


REDUCE_OPS = {"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX, "min": dist.ReduceOp.MIN}


def all_reduce(local: torch.Tensor, reduce_op: str, group: Group) -> torch.Tensor:
    """Partial -> Replicate: the reduction over the group, in a new tensor (one all_reduce).

    Args:
        local: this rank's contribution.
        reduce_op: "sum", "max" or "min".
        group: the mesh dim's process group.
    """
    if _torch_private.are_we_tracing():
        result: torch.Tensor = _torch_private.funcol().all_reduce(local.contiguous(), reduce_op, group)
        return result
    out = local.clone(memory_format=torch.contiguous_format)
    dist.all_reduce(out, op=REDUCE_OPS[reduce_op], group=group)
    return out


def all_reduce_sum(local: torch.Tensor, group: Group) -> torch.Tensor:
    """Partial -> Replicate: the sum over the group, in a new tensor (one all_reduce)."""
    return all_reduce(local, "sum", group)


def reduce_scatter_along(
    local: torch.Tensor, dim: int, sizes: Sequence[int], coordinate: int, group: Group
) -> torch.Tensor:
    """Partial -> Shard(dim): this rank's piece of the sum (one reduce_scatter).

    Args:
        local: this rank's partial tensor (full along ``dim``).
        dim: the tensor dim sharded afterwards.
        sizes: each group rank's extent along ``dim`` afterwards.
        coordinate: this rank's position in ``group``.
        group: the mesh dim's process group.
    """
    chunks = torch.split(local, list(sizes), dim=dim)
    counts = [c.numel() for c in chunks]
    width = max(counts)
    if len(set(counts)) == 1:
        send = _pack(local, chunks, dim)
    else:  # uneven pieces travel padded to the largest
        send = local.new_zeros(len(sizes) * width)
        for r, chunk in enumerate(chunks):
            send[r * width : r * width + counts[r]].view(chunk.shape).copy_(chunk)
    if _torch_private.are_we_tracing():
        out: torch.Tensor = _torch_private.funcol().reduce_scatter_tensor(send, "sum", 0, group)
    else:
        out = local.new_empty(width)
        _reduce_scatter_single(out, send, op=dist.ReduceOp.SUM, group=group)
    return out[: counts[coordinate]].view(chunks[coordinate].shape)
