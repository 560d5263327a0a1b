"""Checking and normalizing placements: what from_local, redistribute and from_dtensor accept.

Supported: ``Shard(dim)`` (negative dims are normalized), ``Replicate()`` and
``Partial("sum")``, with each tensor dim sharded by at most one mesh dim.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TypeVar

from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Partial, Replicate, Shard
from torch.distributed.tensor.placement_types import Placement

__all__ = ["check_placements", "with_note"]

_E = TypeVar("_E", bound=BaseException)


def with_note(error: _E, note: str) -> _E:
    """``error`` with ``note`` attached where Python supports notes (3.11+); the message stays exact."""
    add_note = getattr(error, "add_note", None)
    if add_note is not None:
        add_note(note)
    return error


def check_placements(placements: object, mesh: DeviceMesh, ndim: int) -> tuple[Placement, ...]:
    """``placements`` as a tuple, checked against ``mesh`` and a tensor of ``ndim`` dims.

    Args:
        placements: one placement per mesh dim; None means all ``Replicate()``.
        mesh: the device mesh.
        ndim: the number of dims of the tensor being placed.

    Returns:
        the placements, with ``Shard`` dims made non-negative.

    Raises:
        TypeError: ``placements`` is not a sequence of Placement objects.
        ValueError: the wrong number of placements, a Shard dim out of range, a
            tensor dim sharded by two mesh dims, or an unsupported placement.
    """
    if placements is None:
        return (Replicate(),) * mesh.ndim
    if isinstance(placements, (Placement, str)) or not isinstance(placements, Sequence):
        raise TypeError(
            f"placements must be a list or tuple of Placement objects (Shard(dim), Replicate(), "
            f"Partial()), one per mesh dim, got {placements!r}"
        )
    for i, p in enumerate(placements):
        if not isinstance(p, Placement):
            raise TypeError(
                f"placements[{i}] is {p!r} of type {type(p).__name__}; expected a Placement: "
                "Shard(dim), Replicate() or Partial()"
            )
    if len(placements) != mesh.ndim:
        # PhysicsNeMo's exact message; the note names the values.
        error = ValueError("Mesh dimension must match placements length")
        note = f"the mesh has {mesh.ndim} dims, got {len(placements)} placements {list(placements)}"
        raise with_note(error, note)
    checked = tuple(_check_one(i, p, ndim) for i, p in enumerate(placements))
    _check_distinct_dims(checked)
    return checked


def _check_one(mesh_dim: int, placement: Placement, ndim: int) -> Placement:
    if isinstance(placement, Shard):
        # type() rather than isinstance: _StridedShard subclasses Shard in some torch versions.
        if type(placement) is not Shard:
            raise ValueError(
                f"placements[{mesh_dim}] is {placement!r}: only plain Shard(dim) is supported, "
                f"not {type(placement).__name__}"
            )
        if not -ndim <= placement.dim < ndim:
            raise ValueError(
                f"placements[{mesh_dim}] is Shard({placement.dim}), out of range for a tensor with "
                f"{ndim} dims (valid dims: {-ndim} to {ndim - 1})"
            )
        return Shard(placement.dim % ndim) if placement.dim < 0 else placement
    if isinstance(placement, Partial):
        if placement.reduce_op != "sum":
            raise ValueError(
                f"placements[{mesh_dim}] is {placement!r}: only Partial('sum') is supported, since "
                f"a {placement.reduce_op!r} partial has no well-defined gradient here"
            )
        return placement
    if isinstance(placement, Replicate):
        return placement
    raise ValueError(
        f"placements[{mesh_dim}] is {placement!r}: unsupported placement type {type(placement).__name__}; "
        "expected Shard(dim), Replicate() or Partial()"
    )


def _check_distinct_dims(placements: tuple[Placement, ...]) -> None:
    seen: dict[int, int] = {}
    for m, p in enumerate(placements):
        if isinstance(p, Shard):
            if p.dim in seen:
                raise ValueError(
                    f"tensor dim {p.dim} is sharded by mesh dims {seen[p.dim]} and {m} "
                    f"(placements {list(placements)}); sharding one tensor dim over several "
                    "mesh dims is not supported"
                )
            seen[p.dim] = m
