"""Redistribute: the hops between two specs on one mesh, and their backward.

A plan is a list of hops, one mesh dim each, made from the two specs alone, so
every rank makes the same plan and issues the same collectives:

1. mesh dims that become ``Replicate``: ``Shard`` -> all_gather, ``Partial`` -> all_reduce
   (with the partial's own reduce op: sum, max, min; a pending p-norm reduces as DTensor does);
2. mesh dims that change to another ``Shard``: ``Shard(a)`` -> one all_to_all,
   ``Partial("sum")`` -> reduce_scatter; where the new tensor dim is still sharded by
   another mesh dim (or the partial is not a sum), reduce or gather now and slice in step 3;
3. mesh dims that go from ``Replicate`` to ``Shard``: a local slice, no collective;
   from ``Replicate`` to ``Partial`` (only operators ask for it): the value on
   coordinate 0 and the reduction's identity elsewhere, no collective.

Shard sizes always come from the specs, so no hop sends shapes. The private
:func:`_negotiate_shapes` switch brings back upstream's shape-negotiation all_to_all
(before PhysicsNeMo PR #1779) for benchmarks and tests only.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass
from typing import Any

import torch
from torch.distributed.tensor import Partial, Replicate, Shard
from torch.distributed.tensor.placement_types import Placement

from shardtensor import _collectives as wire
from shardtensor import _torch_private
from shardtensor._spec import ShardTensorSpec, chunk_sizes, make_spec

__all__ = ["plan", "redistribute_local", "target_spec"]

# per thread (each has its own context): simulated ranks share one process
_negotiate: ContextVar[bool] = ContextVar("shardtensor_negotiate_shapes", default=False)


@contextmanager
def _negotiate_shapes() -> Iterator[None]:
    """Private benchmark/test switch: Shard->Shard hops first all_to_all their shapes.

    This is upstream's behaviour before PhysicsNeMo PR #1779 (one extra all_to_all
    per hop), kept to measure and test against. Must be entered on every rank.
    """
    token = _negotiate.set(True)
    try:
        yield
    finally:
        _negotiate.reset(token)


def _negotiating() -> bool:
    return _negotiate.get()


def target_spec(src: ShardTensorSpec, placements: tuple[Placement, ...]) -> ShardTensorSpec:
    """The spec ``src`` has after redistributing to ``placements``.

    A tensor dim that stays sharded by the same mesh dim keeps its (possibly uneven)
    sizes; a newly sharded one is chunked as torch.chunk does.
    """
    sizes: dict[int, tuple[int, ...]] = {}
    for m, p in enumerate(placements):
        if isinstance(p, Shard):
            kept = src.shard_sizes[m] if src.placements[m] == p else None
            sizes[m] = kept if kept is not None else chunk_sizes(src.shape[p.dim], src.mesh.size(m))
    return make_spec(src.mesh, placements, src.shape, src.dtype, sizes, coordinate=src.coordinate)


@dataclass(frozen=True)
class Hop:
    """One step of a plan: ``kind`` on ``mesh_dim``, ending at ``placement`` with ``sizes``."""

    kind: str  # "all_gather", "all_reduce", "all_to_all", "reduce_scatter", "slice" or "partition"
    mesh_dim: int
    placement: Placement
    sizes: tuple[int, ...] | None


def plan(src: ShardTensorSpec, dst: ShardTensorSpec) -> list[Hop]:
    """The hops from ``src`` to ``dst`` (same mesh and shape); identical on every rank."""
    current = list(src.placements)
    changing = [
        m
        for m in range(src.mesh.ndim)
        if (current[m], src.shard_sizes[m]) != (dst.placements[m], dst.shard_sizes[m])
    ]
    hops: list[Hop] = []
    for m in changing:
        if isinstance(dst.placements[m], Replicate):
            hops.append(_to_replicate(m, current[m]))
            current[m] = Replicate()
    for m in changing:
        target = dst.placements[m]
        if isinstance(target, Shard) and not isinstance(current[m], Replicate):
            hops.append(_to_shard(m, current, target, dst.shard_sizes[m]))
            current[m] = hops[-1].placement
    for m in changing:
        target = dst.placements[m]
        if isinstance(target, Shard) and isinstance(current[m], Replicate):
            hops.append(Hop("slice", m, target, dst.shard_sizes[m]))
        elif isinstance(target, Partial):
            if not isinstance(current[m], Replicate):
                raise ValueError(
                    f"cannot redistribute mesh dim {m} from {current[m]} to {target}: only Replicate "
                    "becomes Partial"
                )
            hops.append(Hop("partition", m, target, None))
    return hops


def _to_replicate(mesh_dim: int, current: Placement) -> Hop:
    kind = "all_reduce" if isinstance(current, Partial) else "all_gather"
    return Hop(kind, mesh_dim, Replicate(), None)


def _to_shard(mesh_dim: int, current: list[Placement], target: Shard, sizes: tuple[int, ...] | None) -> Hop:
    """Shard or Partial -> ``target`` in one collective, or to Replicate where that cannot be."""
    sharded_elsewhere = any(
        isinstance(p, Shard) and p.dim == target.dim for m, p in enumerate(current) if m != mesh_dim
    )
    source = current[mesh_dim]
    # Shard(a)->Shard(a) with new sizes, a target dim still sharded by another mesh
    # dim, or a partial that is not a sum: go through Replicate, then slice.
    not_a_sum = isinstance(source, Partial) and (type(source) is not Partial or source.reduce_op != "sum")
    if sharded_elsewhere or source == target or not_a_sum:
        return _to_replicate(mesh_dim, source)
    kind = "reduce_scatter" if isinstance(source, Partial) else "all_to_all"
    return Hop(kind, mesh_dim, target, sizes)


def redistribute_local(local: torch.Tensor, src: ShardTensorSpec, dst: ShardTensorSpec) -> torch.Tensor:
    """This rank's shard of ``dst`` from its shard of ``src`` (not differentiable)."""
    if src == dst:
        return local
    placements = list(src.placements)
    sizes = list(src.shard_sizes)
    for hop in plan(src, dst):
        local = _run(hop, local, placements, sizes, src)
        placements[hop.mesh_dim] = hop.placement
        sizes[hop.mesh_dim] = hop.sizes
    return local


def _run(
    hop: Hop,
    local: torch.Tensor,
    placements: list[Placement],
    sizes: list[tuple[int, ...] | None],
    spec: ShardTensorSpec,
) -> torch.Tensor:
    m = hop.mesh_dim
    group = spec.mesh.get_group(m)
    current = placements[m]
    if hop.kind == "all_reduce":
        return _reduce(local, current, spec.mesh, m, group)
    if hop.kind == "partition":
        return _partition(local, hop.placement, spec.coordinate[m])
    if hop.kind == "all_gather":
        return wire.gather_along(local, _dim(current), _known(sizes[m]), group)
    new_dim, new_sizes, coordinate = _dim(hop.placement), _known(hop.sizes), spec.coordinate[m]
    if hop.kind == "slice":
        offset = sum(new_sizes[:coordinate])
        return local.narrow(new_dim, offset, new_sizes[coordinate]).contiguous()
    if hop.kind == "reduce_scatter":
        return wire.reduce_scatter_along(local, new_dim, new_sizes, coordinate, group)
    return _all_to_all(local, _dim(current), new_dim, _known(sizes[m]), new_sizes, coordinate, group, spec)


def _reduce(local: torch.Tensor, partial: Placement, mesh: Any, mesh_dim: int, group: Any) -> torch.Tensor:
    """Partial -> Replicate over one mesh dim: one all_reduce with the partial's reduce op."""
    if type(partial) is Partial and partial.reduce_op in wire.REDUCE_OPS:
        return wire.all_reduce(local, partial.reduce_op, group)
    if isinstance(partial, Partial) and _torch_private.is_norm_partial(partial):
        return _torch_private.reduce_partial_value(partial, local, mesh, mesh_dim)
    raise ValueError(f"shardtensor cannot reduce a {partial!r} placement (supported: sum, max, min, p-norm)")


def _partition(local: torch.Tensor, partial: Placement, coordinate: int) -> torch.Tensor:
    """Replicate -> Partial over one mesh dim, exactly: the value once, the identity elsewhere."""
    op = partial.reduce_op if isinstance(partial, Partial) else None
    if type(partial) is Partial and op == "sum":
        return local if coordinate == 0 else torch.zeros_like(local)
    if type(partial) is Partial and op in ("max", "min"):
        return local
    raise ValueError(f"shardtensor cannot make a {partial!r} placement out of a replicated value")


def _all_to_all(
    local: torch.Tensor,
    src_dim: int,
    dst_dim: int,
    src_sizes: tuple[int, ...],
    dst_sizes: tuple[int, ...],
    coordinate: int,
    group: Any,
    spec: ShardTensorSpec,
) -> torch.Tensor:
    mine = wire.with_size(local.shape, dst_dim, dst_sizes[coordinate])
    recv = [wire.with_size(mine, src_dim, s) for s in src_sizes]
    if _negotiating():
        send = [wire.with_size(local.shape, dst_dim, s) for s in dst_sizes]
        recv = wire.exchange_shapes(send, group, spec.mesh.device_type)
    return wire.all_to_all_along(local, src_dim, dst_dim, recv, dst_sizes, group)


def _dim(placement: Placement) -> int:
    if not isinstance(placement, Shard):
        raise RuntimeError(f"shardtensor internal error: expected a Shard placement, got {placement}")
    return placement.dim


def _known(sizes: tuple[int, ...] | None) -> tuple[int, ...]:
    if sizes is None:
        raise RuntimeError("shardtensor internal error: a Shard mesh dim without shard sizes")
    return sizes
