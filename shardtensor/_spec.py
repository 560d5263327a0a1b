"""ShardTensorSpec and the one chunking rule: pure shape arithmetic, no communication.

A spec is one rank's view of a sharded tensor: the mesh, the placements, the global
shape, stride and dtype (``tensor_meta``, as in DTensor), and, for every ``Shard``
mesh dim, the size of the sharded tensor dim on each coordinate along that mesh dim
(``shard_sizes``). Sharding one tensor dim over several mesh dims is not supported,
so these sizes, the global shape and this rank's mesh coordinate determine every
per-rank shape.

PhysicsNeMo's field names are accepted and readable: ``ShardTensorSpec(mesh=...,
placements=..., tensor_meta=..., _local_shape=..., _sharding_shapes=...)``, where
``_sharding_shapes[m][r]`` is the full local shape of coordinate ``r`` along mesh
dim ``m`` (a cross-section through this rank). Unlike upstream's, a spec is
immutable: ``dataclasses.replace`` makes a changed copy.

A spec built without sharding shapes (``_sharding_shapes=None`` or ``{}`` while some
mesh dim is ``Shard``) records a layout whose sizes are unknown. It can be
compared and used as a target, but a ShardTensor always holds a spec with known
sizes: wrapping a local tensor in a size-less spec assumes torch.chunk's layout and
checks it against the local shape (:func:`resolve_chunk_layout`).
"""

from __future__ import annotations

import dataclasses
import hashlib
import math
import operator
from collections.abc import Mapping, Sequence
from typing import Any, NamedTuple

import torch
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Partial, Replicate, Shard
from torch.distributed.tensor.placement_types import Placement

from shardtensor import _torch_private

__all__ = [
    "ShardTensorSpec",
    "TensorMeta",
    "chunk_layout",
    "chunk_sharding_shapes",
    "chunk_sizes",
    "contiguous_stride",
    "make_spec",
    "numel",
    "resolve_chunk_layout",
    "without_partial",
]

Shape = tuple[int, ...]
Sizes = tuple[int, ...]


def chunk_sizes(size: int, parts: int) -> tuple[int, ...]:
    """The sizes ``torch.chunk`` (and DTensor) give ``parts`` ranks sharing ``size`` elements.

    Every chunk has ``ceil(size / parts)`` elements except the last non-empty one;
    trailing chunks may be empty: 9 over 4 is (3, 3, 3, 0), 6 over 4 is (2, 2, 2, 0),
    10 over 4 is (3, 3, 3, 1). This is the only chunking rule in shardtensor (upstream
    PhysicsNeMo mixed two and broke on 6 or 9 rows over 4 ranks).

    Args:
        size: the extent of the tensor dim being split (0 or more).
        parts: the number of ranks (1 or more).

    Returns:
        ``parts`` non-negative sizes summing to ``size``.

    Raises:
        ValueError: a negative ``size`` or a ``parts`` below 1.
    """
    if size < 0 or parts < 1:
        raise ValueError(f"chunk_sizes needs size >= 0 and parts >= 1, got size={size}, parts={parts}")
    chunk = -(-size // parts)
    return tuple(max(0, min(chunk, size - i * chunk)) for i in range(parts))


def contiguous_stride(shape: Sequence[int]) -> tuple[int, ...]:
    """The row-major (C-contiguous) stride of ``shape``."""
    stride = [1] * len(shape)
    for i in range(len(shape) - 2, -1, -1):
        stride[i] = stride[i + 1] * max(shape[i + 1], 1)
    return tuple(stride)


class TensorMeta(NamedTuple):
    """A tensor's global shape, stride and dtype (the fields of DTensor's ``TensorMeta``)."""

    shape: tuple[int, ...]
    stride: tuple[int, ...]
    dtype: torch.dtype


@dataclasses.dataclass(frozen=True, eq=False, repr=False, init=False)
class ShardTensorSpec:
    """How one rank sees a sharded tensor; equal specs describe identical layouts.

    Args:
        mesh: the device mesh.
        placements: one ``Shard(dim)`` (non-negative dim), ``Replicate()`` or
            ``Partial()`` per mesh dim.
        tensor_meta: the global shape, stride and dtype (any object with those
            three attributes, e.g. DTensor's ``TensorMeta``).

    Keyword args:
        _local_shape: this rank's local shape (checked when the sizes are known).
        _sharding_shapes: ``{mesh_dim: (local shape of coordinate 0, ...)}`` for
            every ``Shard`` mesh dim, each entry a cross-section through this rank;
            None or ``{}`` when unknown.

    Attributes (derived):
        shape, stride, dtype: the fields of ``tensor_meta``.
        shard_sizes: per mesh dim, the size of its sharded tensor dim on each
            coordinate along it; None for mesh dims that are not ``Shard`` (and
            for ``Shard`` mesh dims whose sizes are unknown).
        coordinate: this rank's coordinate on the mesh.
        local_shape: the shape of this rank's local tensor (None if unknown).
        is_resolved: whether every ``Shard`` mesh dim has known sizes.

    Raises:
        ValueError: inconsistent fields (each message names the values).
    """

    mesh: DeviceMesh
    placements: tuple[Placement, ...]
    tensor_meta: TensorMeta
    _local_shape: tuple[int, ...] | None
    _sharding_shapes: Mapping[int, tuple[Shape, ...]] | None

    # Derived, set once in __init__ (not init arguments, so dataclasses.replace ignores them).
    shape: tuple[int, ...] = dataclasses.field(init=False)
    stride: tuple[int, ...] = dataclasses.field(init=False)
    dtype: torch.dtype = dataclasses.field(init=False)
    shard_sizes: tuple[Sizes | None, ...] = dataclasses.field(init=False)
    coordinate: tuple[int, ...] = dataclasses.field(init=False)
    local_shape: tuple[int, ...] | None = dataclasses.field(init=False)
    is_resolved: bool = dataclasses.field(init=False)  # every Shard mesh dim has known sizes

    def __init__(
        self,
        mesh: DeviceMesh,
        placements: Sequence[Placement],
        tensor_meta: Any,
        *,
        _local_shape: Sequence[int] | None = None,
        _sharding_shapes: Mapping[int, Sequence[Sequence[int]]] | None = None,
    ) -> None:
        placements = tuple(placements)
        meta = _as_tensor_meta(tensor_meta)
        if len(placements) != mesh.ndim:
            raise ValueError(f"a spec needs one placement per mesh dim ({mesh.ndim}), got {list(placements)}")
        coordinate = mesh.get_coordinate()
        if coordinate is None:
            raise ValueError(f"this rank is not part of the mesh {mesh}")
        coordinate = tuple(coordinate)
        sizes = _sizes_from_shapes(mesh, placements, meta.shape, _sharding_shapes)
        _set_fields(self, mesh, placements, meta, sizes, coordinate, _local_shape)

    @classmethod
    def _from_sizes(
        cls,
        mesh: DeviceMesh,
        placements: tuple[Placement, ...],
        meta: TensorMeta,
        sizes: tuple[Sizes | None, ...],
        coordinate: tuple[int, ...],
    ) -> ShardTensorSpec:
        """The fast internal constructor: ``sizes`` per mesh dim, already normalized."""
        spec = object.__new__(cls)
        _set_fields(spec, mesh, placements, meta, sizes, coordinate, None)
        return spec

    # -- identity ------------------------------------------------------------------------------

    def _key(self) -> tuple[object, ...]:
        key: tuple[object, ...] = self.__dict__.get("_key_cache") or (
            self.mesh,
            self.placements,
            self.tensor_meta,
            self.shard_sizes,
            self.coordinate,
            None if self.is_resolved else self.local_shape,
        )
        object.__setattr__(self, "_key_cache", key)
        return key

    def __eq__(self, other: object) -> bool:
        if self is other:
            return True
        if not isinstance(other, ShardTensorSpec):
            return NotImplemented
        return self._key() == other._key()

    def __hash__(self) -> int:
        try:
            return self._hash_cache  # type: ignore[attr-defined, no-any-return]
        except AttributeError:
            cached = hash(self._key())
            object.__setattr__(self, "_hash_cache", cached)
            return cached

    def __reduce__(self) -> tuple[Any, tuple[Any, ...]]:
        # Only the defining fields travel (torch.compile's caches pickle specs): derived
        # ones, the cached hash above all, are remade in the process that loads it.
        local = None if self.is_resolved else self.local_shape
        return _unpickle, (self.mesh, self.placements, self.tensor_meta, self.shard_sizes, local)

    def _stable_hash(self) -> str:
        """A hash that is the same in every process (for torch.compile's AOT autograd cache)."""
        parts = (
            _PICKLE_FORMAT,
            _torch_private.mesh_stable_hash(self.mesh),
            repr(self.placements),
            self.shape,
            self.stride,
            str(self.dtype),
            self.shard_sizes,
            self.coordinate,
            self.local_shape,
        )
        return hashlib.blake2b(repr(parts).encode(), digest_size=16).hexdigest()

    @property
    def ndim(self) -> int:
        """The number of tensor dims."""
        return len(self.shape)

    # -- per-rank shapes -----------------------------------------------------------------------

    def sharding_shapes(
        self, mesh_dim: int | None = None
    ) -> dict[int, tuple[tuple[int, ...], ...]] | tuple[tuple[int, ...], ...]:
        """Per-rank local shapes along each ``Shard`` mesh dim.

        Entry ``r`` of mesh dim ``m`` is the full local shape of the rank at
        coordinate ``r`` along ``m``, other mesh coordinates held at this rank's.

        Args:
            mesh_dim: return only this mesh dim's shapes.

        Returns:
            ``{mesh_dim: (shape of coordinate 0, shape of coordinate 1, ...)}`` with
            a key for every ``Shard`` mesh dim, or one such tuple for ``mesh_dim``.

        Raises:
            ValueError: ``mesh_dim`` is not a ``Shard`` mesh dim, or the sizes are unknown.
        """
        shapes = self._sharding_shapes
        if shapes is None:
            raise ValueError(
                f"this spec records no sharding shapes ({self}); build it with known sizes, "
                "or wrap a local tensor in it to assume torch.chunk's layout"
            )
        if mesh_dim is None:
            return dict(shapes)
        if mesh_dim not in shapes:
            raise ValueError(
                f"mesh dim {mesh_dim} is not sharded (placements {self.placements}); "
                f"Shard mesh dims: {sorted(shapes)}"
            )
        return shapes[mesh_dim]

    def offsets(self, mesh_dim: int | None = None) -> tuple[int, ...] | int:
        """Where this rank's shard starts in the global tensor, per mesh dim.

        Args:
            mesh_dim: return only this mesh dim's offset.

        Returns:
            one offset per mesh dim (0 for mesh dims that are not ``Shard``), along
            that mesh dim's sharded tensor dim; or the offset of ``mesh_dim``.
        """
        offsets = tuple(
            sum(sizes[: self.coordinate[m]]) if sizes is not None else 0
            for m, sizes in enumerate(self.shard_sizes)
        )
        return offsets if mesh_dim is None else offsets[mesh_dim]

    def __repr__(self) -> str:
        return (
            f"ShardTensorSpec(mesh={self.mesh!r}, placements={self.placements!r}, "
            f"tensor_meta={self.tensor_meta!r}, shard_sizes={self.shard_sizes!r})"
        )

    def __str__(self) -> str:
        placements = "[" + ", ".join(map(str, self.placements)) + "]"
        dtype = str(self.dtype).removeprefix("torch.")
        mesh = "x".join(map(str, self.mesh.shape))
        sizes = "; ".join(
            f"mesh dim {m}: {', '.join(map(str, s))}" for m, s in enumerate(self.shard_sizes) if s is not None
        )
        text = f"{placements} {tuple(self.shape)} {dtype} on a {mesh} {self.mesh.device_type} mesh"
        if not self.is_resolved:
            return f"{text} (sharding shapes unknown)"
        return f"{text} (sizes {sizes})" if sizes else text


# Part of every stable hash: a new value keeps torch.compile's on-disk caches from
# handing back specs pickled in an older form.
_PICKLE_FORMAT = "shardtensor-spec-2"


def _unpickle(
    mesh: DeviceMesh,
    placements: tuple[Placement, ...],
    meta: TensorMeta,
    sizes: tuple[Sizes | None, ...],
    local_shape: tuple[int, ...] | None,
) -> ShardTensorSpec:
    coordinate = mesh.get_coordinate()
    if coordinate is None:
        raise ValueError(f"a ShardTensorSpec was loaded on a rank that is not part of its mesh {mesh}")
    spec = object.__new__(ShardTensorSpec)
    _set_fields(spec, mesh, placements, meta, sizes, tuple(coordinate), local_shape)
    return spec


def _set_fields(
    spec: ShardTensorSpec,
    mesh: DeviceMesh,
    placements: tuple[Placement, ...],
    meta: TensorMeta,
    sizes: tuple[Sizes | None, ...],
    coordinate: tuple[int, ...],
    given_local: Sequence[int] | None,
) -> None:
    """Fill a spec's fields (frozen: set once, here) and check the local shape."""
    local: list[int] = list(meta.shape)
    resolved = True
    for m, (p, s) in enumerate(zip(placements, sizes)):
        if isinstance(p, Shard):
            if s is None:
                resolved = False
            else:
                local[p.dim] = s[coordinate[m]]
    local_shape: tuple[int, ...] | None = tuple(local)
    if given_local is not None:
        given = tuple(given_local)
        if resolved and given != local_shape:
            raise ValueError(
                f"_local_shape {given} does not match the local shape {local_shape} that the sharding "
                f"shapes give this rank (coordinate {coordinate}, placements {list(placements)})"
            )
        local_shape = given
    elif not resolved:
        local_shape = None
    set_ = object.__setattr__
    set_(spec, "mesh", mesh)
    set_(spec, "placements", placements)
    set_(spec, "tensor_meta", meta)
    set_(spec, "shape", meta.shape)
    set_(spec, "stride", meta.stride)
    set_(spec, "dtype", meta.dtype)
    set_(spec, "shard_sizes", sizes)
    set_(spec, "coordinate", coordinate)
    set_(spec, "local_shape", local_shape)
    set_(spec, "is_resolved", resolved)
    set_(spec, "_local_shape", local_shape)
    set_(spec, "_sharding_shapes", _shapes_from_sizes(placements, sizes, local_shape) if resolved else None)


def _as_tensor_meta(meta: Any) -> TensorMeta:
    if isinstance(meta, TensorMeta):
        return meta
    try:
        shape, stride, dtype = meta.shape, meta.stride, meta.dtype
    except AttributeError:
        raise TypeError(
            f"tensor_meta must have shape, stride and dtype (e.g. shardtensor.TensorMeta), got {meta!r}"
        ) from None
    if not isinstance(dtype, torch.dtype) or len(tuple(shape)) != len(tuple(stride)):
        raise ValueError(f"tensor_meta {meta!r} needs a dtype and one stride per dim")
    return TensorMeta(tuple(shape), tuple(stride), dtype)


def _sizes_from_shapes(
    mesh: DeviceMesh,
    placements: tuple[Placement, ...],
    shape: Shape,
    shapes: Mapping[int, Sequence[Sequence[int]]] | None,
) -> tuple[Sizes | None, ...]:
    """Per mesh dim sizes from PhysicsNeMo's ``{mesh_dim: [local shape per coordinate]}``."""
    sharded = {m: p.dim for m, p in enumerate(placements) if isinstance(p, Shard)}
    for m, p in enumerate(placements):
        if isinstance(p, Shard) and not 0 <= p.dim < len(shape):
            raise ValueError(f"mesh dim {m} shards tensor dim {p.dim}, out of range for global shape {shape}")
    if not shapes:  # None or {}: unknown where anything is sharded, nothing to know otherwise
        return tuple(None for _ in placements)
    extra = sorted(set(shapes) - set(sharded))
    if extra or set(shapes) != set(sharded):
        raise ValueError(
            f"_sharding_shapes has keys {sorted(shapes)} but the Shard placements are on mesh dims "
            f"{sorted(sharded)} (placements {list(placements)}); give one entry per Shard mesh dim"
        )
    sizes: list[Sizes | None] = [None] * len(placements)
    for m, dim in sharded.items():
        entry = [tuple(operator.index(s) for s in local) for local in shapes[m]]
        if any(len(local) != len(shape) for local in entry):
            raise ValueError(f"_sharding_shapes[{m}] = {entry} has shapes of the wrong rank for {shape}")
        sizes[m] = tuple(local[dim] for local in entry)
        _check_sizes(m, dim, sizes[m], shape, mesh.size(m))  # type: ignore[arg-type]
    return tuple(sizes)


def _shapes_from_sizes(
    placements: tuple[Placement, ...], sizes: tuple[Sizes | None, ...], local: Shape | None
) -> dict[int, tuple[Shape, ...]]:
    if local is None:
        return {}
    return {
        m: tuple((*local[: p.dim], s, *local[p.dim + 1 :]) for s in along)
        for m, (p, along) in enumerate(zip(placements, sizes))
        if isinstance(p, Shard) and along is not None
    }


def _check_sizes(mesh_dim: int, dim: int, sizes: Sizes, shape: Shape, parts: int) -> None:
    if not 0 <= dim < len(shape):
        raise ValueError(
            f"mesh dim {mesh_dim} shards tensor dim {dim}, out of range for global shape {shape}"
        )
    if len(sizes) != parts or sum(sizes) != shape[dim] or min(sizes, default=0) < 0:
        raise ValueError(
            f"mesh dim {mesh_dim} has {parts} coordinates sharing tensor dim {dim} of size {shape[dim]}, "
            f"but its shard sizes are {sizes}"
        )


def make_spec(
    mesh: DeviceMesh,
    placements: tuple[Placement, ...],
    shape: Sequence[int],
    dtype: torch.dtype,
    sizes: Mapping[int, Sequence[int]],
    stride: Sequence[int] | None = None,
    coordinate: tuple[int, ...] | None = None,
) -> ShardTensorSpec:
    """A spec from per-mesh-dim sizes; ``sizes`` has a key for every ``Shard`` mesh dim.

    The stride defaults to C-contiguous; ``coordinate`` (this rank's, when the
    caller already has it) saves a mesh lookup.
    """
    shape = tuple(shape)
    shard_sizes: list[Sizes | None] = []
    for m, p in enumerate(placements):
        if isinstance(p, Shard):
            along = tuple(sizes[m])
            _check_sizes(m, p.dim, along, shape, mesh.size(m))
            shard_sizes.append(along)
        else:
            shard_sizes.append(None)
    if coordinate is None:
        found = mesh.get_coordinate()
        if found is None:
            raise ValueError(f"this rank is not part of the mesh {mesh}")
        coordinate = tuple(found)
    meta = TensorMeta(shape, tuple(stride) if stride is not None else contiguous_stride(shape), dtype)
    return ShardTensorSpec._from_sizes(mesh, tuple(placements), meta, tuple(shard_sizes), coordinate)


def chunk_layout(
    mesh: DeviceMesh, placements: Sequence[Placement], shape: Sequence[int]
) -> dict[int, tuple[int, ...]]:
    """The shard sizes torch.chunk gives every ``Shard`` mesh dim of ``placements``."""
    return {
        m: chunk_sizes(shape[p.dim], mesh.size(m)) for m, p in enumerate(placements) if isinstance(p, Shard)
    }


def chunk_sharding_shapes(
    mesh: DeviceMesh, placements: Sequence[Placement], global_shape: Sequence[int]
) -> dict[int, tuple[tuple[int, ...], ...]]:
    """The per-rank shapes of torch.chunk's layout, as ``sharding_shapes`` gives them.

    What ``from_local(..., "chunk", global_shape)`` records, computed without a
    tensor: ``{mesh_dim: (local shape of coordinate 0, ...)}`` for every ``Shard``
    mesh dim, each a cross-section through this rank.

    Args:
        mesh: the device mesh (this rank must be in it).
        placements: one per mesh dim.
        global_shape: the global shape.

    Returns:
        a dict with a key per ``Shard`` mesh dim (empty if nothing is sharded).

    Raises:
        ValueError: placements that do not fit the mesh or the shape.
    """
    placements = tuple(placements)
    if len(placements) != mesh.ndim:
        raise ValueError(f"one placement per mesh dim ({mesh.ndim}) is needed, got {list(placements)}")
    shape = tuple(global_shape)
    spec = make_spec(mesh, placements, shape, torch.float32, chunk_layout(mesh, placements, shape))
    shapes = spec._sharding_shapes
    return dict(shapes) if shapes is not None else {}


def resolve_chunk_layout(spec: ShardTensorSpec, local_shape: Shape) -> ShardTensorSpec:
    """``spec`` with torch.chunk's sizes where they are unknown, checked against ``local_shape``.

    Raises:
        RuntimeError: the local shape is not the one torch.chunk's layout gives this
            rank, i.e. the tensor is unevenly sharded and its spec lost its shapes.
    """
    if spec.is_resolved:
        return spec
    chunks = chunk_layout(spec.mesh, spec.placements, spec.shape)
    sizes = tuple(
        (known if known is not None else chunks[m]) if isinstance(p, Shard) else None
        for m, (p, known) in enumerate(zip(spec.placements, spec.shard_sizes))
    )
    resolved = ShardTensorSpec._from_sizes(
        spec.mesh, spec.placements, spec.tensor_meta, sizes, spec.coordinate
    )
    if resolved.local_shape != tuple(local_shape):
        raise RuntimeError(
            f"a spec without sharding shapes ({spec}) was given a local tensor of shape "
            f"{tuple(local_shape)}, but torch.chunk's layout gives this rank {resolved.local_shape}: the "
            "tensor is unevenly sharded and its spec lost the per-rank shapes; build the spec with "
            "_sharding_shapes (or from_local with 'infer' or a dict) instead"
        )
    return resolved


def without_partial(spec: ShardTensorSpec) -> ShardTensorSpec:
    """``spec`` with every ``Partial`` mesh dim made ``Replicate`` (the placement of a gradient)."""
    if not any(isinstance(p, Partial) for p in spec.placements):
        return spec
    placements = tuple(Replicate() if isinstance(p, Partial) else p for p in spec.placements)
    return ShardTensorSpec._from_sizes(
        spec.mesh, placements, spec.tensor_meta, spec.shard_sizes, spec.coordinate
    )


def with_placements(
    spec: ShardTensorSpec, placements: tuple[Placement, ...], meta: TensorMeta | None = None
) -> ShardTensorSpec:
    """``spec`` with new non-Shard placements (Shard mesh dims must stay as they are)."""
    return ShardTensorSpec._from_sizes(
        spec.mesh, placements, meta or spec.tensor_meta, spec.shard_sizes, spec.coordinate
    )


def numel(shape: Sequence[int]) -> int:
    """The number of elements of ``shape``."""
    return math.prod(shape)
