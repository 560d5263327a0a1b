"""torch.compile's tensor-subclass protocol for ShardTensor: unflatten and tangent coercion.

``__tensor_flatten__`` hands AOTAutograd the local tensor and a context of
``(spec, requires_grad)``; the spec carries every rank's shard sizes, so a
compiled graph is specialized to (and guarded on) the exact per-rank layout, uneven
ones included. ``__tensor_unflatten__`` rebuilds the wrapper from them.

At run time, AOTAutograd compares each backward tangent with the metadata it
recorded at trace time and calls ``__coerce_same_metadata_as_tangent__`` where they
differ: the tangent is then moved to the recorded layout, its shard sizes included
(an even-chunk default would mis-shape uneven shards).
"""

from __future__ import annotations

from typing import Any

import torch
from torch.distributed.tensor import Partial, Replicate

from shardtensor import _redistribute
from shardtensor._spec import ShardTensorSpec, resolve_chunk_layout

__all__ = ["base_context", "coerce_to_recorded", "unflatten"]


def base_context(flatten_spec: Any) -> tuple[ShardTensorSpec, bool]:
    """``(spec, requires_grad)``, also out of a subclass's nested ``(base, extra)`` context."""
    base = flatten_spec[0] if isinstance(flatten_spec[0], tuple) else flatten_spec
    spec, requires_grad = base
    if not isinstance(spec, ShardTensorSpec):
        raise TypeError(f"a ShardTensor flatten context holds (ShardTensorSpec, bool), got {flatten_spec!r}")
    return spec, bool(requires_grad)


def unflatten(
    cls: type, inner_tensors: dict[str, torch.Tensor], flatten_spec: Any, outer_size: Any, outer_stride: Any
) -> Any:
    """The ShardTensor of ``inner_tensors["_local_tensor"]`` in the recorded spec.

    Raises:
        RuntimeError: the spec lost its sharding shapes and the local shard is not
            torch.chunk's (an unevenly sharded tensor: compiling would bake wrong
            sizes into the graph).
    """
    spec, requires_grad = base_context(flatten_spec)
    local = inner_tensors["_local_tensor"]
    if not all(type(d) is int for d in (*local.shape, *outer_size)):
        raise NotImplementedError(
            f"ShardTensor under torch.compile needs static shapes, but a shard of {spec} arrived with "
            f"symbolic sizes {tuple(local.shape)}; compile with dynamic=False (simulated ranks share one "
            "process, so ranks with different shard shapes look like a shape change to Dynamo, which "
            "then makes the sizes dynamic)"
        )
    if not spec.is_resolved:
        try:
            spec = resolve_chunk_layout(spec, tuple(local.shape))
        except RuntimeError as error:
            raise RuntimeError(
                f"a ShardTensor crossed a torch.compile boundary unevenly sharded with a spec that lost "
                f"its sharding shapes: {error}"
            ) from None
    out = cls(local, spec, requires_grad=requires_grad)
    for name in cls._extra_inner_tensors:  # type: ignore[attr-defined]
        if name in inner_tensors:
            setattr(out, name, inner_tensors[name])
    if isinstance(flatten_spec[0], tuple):
        out.__subclass_unflatten__(flatten_spec[1])
    return out


def coerce_to_recorded(
    tensor: Any, flatten_spec: Any, expected_type: type | None, base: type
) -> torch.Tensor | None:
    """``tensor`` (a runtime tangent) in the layout of the recorded ``flatten_spec``.

    Raises:
        RuntimeError: the recorded layout is ``Partial``, which a tangent never has
            (``__coerce_tangent_metadata__`` resolves it at trace time).
    """
    spec, _ = base_context(flatten_spec)
    if any(isinstance(p, Partial) for p in spec.placements):
        raise RuntimeError(
            "AOTAutograd recorded a Partial tangent target for ShardTensor "
            f"({spec}); __coerce_tangent_metadata__ must have resolved it to Replicate"
        )
    cls = type(tensor)
    if spec == tensor._spec or (spec.placements == tensor._spec.placements and not spec.is_resolved):
        coerced = tensor
    else:
        target = spec if spec.is_resolved else resolve_chunk_layout(spec, _chunk_local(spec))
        local = _redistribute.redistribute_local(tensor._local_tensor, tensor._spec, target)
        coerced = cls(local.contiguous(), target, requires_grad=tensor.requires_grad)
    if expected_type is None or expected_type is type(coerced):
        result: torch.Tensor = coerced
        return result
    if isinstance(expected_type, type) and issubclass(expected_type, base):
        rebuilt: torch.Tensor = expected_type.__tensor_unflatten__(  # type: ignore[attr-defined]
            {"_local_tensor": coerced._local_tensor}, flatten_spec, tuple(coerced.shape), coerced.stride()
        )
        return rebuilt
    if expected_type is torch.Tensor and all(isinstance(p, Replicate) for p in coerced._spec.placements):
        local_value: torch.Tensor = coerced._local_tensor
        return local_value
    return None


def _chunk_local(spec: ShardTensorSpec) -> tuple[int, ...]:
    from shardtensor._spec import chunk_layout, make_spec

    sizes = chunk_layout(spec.mesh, spec.placements, spec.shape)
    chunked = make_spec(
        spec.mesh, spec.placements, spec.shape, spec.dtype, sizes, spec.stride, spec.coordinate
    )
    return tuple(chunked.local_shape or ())
