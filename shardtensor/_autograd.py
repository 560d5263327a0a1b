"""ShardTensor's autograd: from_local, to_local, redistribute, from_dtensor, and where gradients land.

Each crossing between a ShardTensor and something else is an autograd Function whose
backward puts the gradient in the layout the forward came from (a pending
``Partial`` made ``Replicate``): ``_FromLocal`` hands a plain tensor this rank's
shard, ``_ToLocal`` wraps a plain gradient in the recorded (or declared,
``grad_placements``) layout, ``_Redistribute`` runs the reverse redistribute.
Leaves made with ``requires_grad_()`` get a hook that moves arriving gradients into
their own layout (see :func:`keep_leaf_gradient_layout`).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Sequence
from typing import Any, Protocol, cast

import torch
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard
from torch.distributed.tensor.placement_types import Placement

from shardtensor import _redistribute
from shardtensor._collectives import all_gather_shapes
from shardtensor._from_local import build_spec
from shardtensor._placements import check_placements
from shardtensor._spec import ShardTensorSpec, chunk_layout, make_spec, without_partial


class ShardLike(Protocol):
    """What this module reads of a ShardTensor (shardtensor._tensor defines the class and imports
    this module, so the Functions make their results of the class they are given)."""

    _spec: ShardTensorSpec
    _local_tensor: torch.Tensor

    @property
    def placements(self) -> tuple[Placement, ...]: ...

    @property
    def is_leaf(self) -> bool: ...

    def register_hook(self, hook: Callable[[torch.Tensor], torch.Tensor | None]) -> Any: ...


# The Function classes keep their underscored names: autograd shows them (``_FromLocalBackward``).
__all__ = [
    "InferLater",
    "dtensor_layout",
    "gradient_spec",
    "keep_leaf_gradient_layout",
    "move",
]


def move(tensor: ShardLike, target: ShardTensorSpec) -> Any:
    """``tensor`` in exactly ``target``'s layout (differentiable): a tensor of ``tensor``'s class."""
    return _Redistribute.apply(tensor, target)  # type: ignore[no-untyped-call]


def gradient_spec(tensor: ShardLike, grad_placements: Sequence[Placement] | None) -> ShardTensorSpec:
    """The layout of the gradient that ``to_local`` hands back to ``tensor``."""
    spec = tensor._spec
    if grad_placements is None:
        return without_partial(spec)
    placements = tuple(grad_placements)
    if len(placements) != spec.mesh.ndim or not all(isinstance(p, Placement) for p in placements):
        raise ValueError(
            f"grad_placements must be one Placement per mesh dim ({spec.mesh.ndim}), got {list(placements)}"
        )
    placements = tuple(
        Shard(p.dim % spec.ndim) if isinstance(p, Shard) and spec.ndim else p for p in placements
    )
    if placements == spec.placements:
        return spec
    sizes: dict[int, tuple[int, ...]] = {}
    unknown: list[int] = []
    for m, p in enumerate(placements):
        if isinstance(p, Shard):
            kept = spec.shard_sizes[m] if spec.placements[m] == p else None
            if kept is not None:
                sizes[m] = kept
            else:
                unknown.append(m)
    if unknown:
        # A layout the forward did not have: every rank's size comes from its local
        # shape, one all_gather per such mesh dim (as from_local's "infer"), in backward.
        return InferLater(spec, placements, sizes, tuple(unknown))  # type: ignore[return-value]
    return make_spec(spec.mesh, placements, spec.shape, spec.dtype, sizes, spec.stride, spec.coordinate)


class InferLater:
    """A gradient layout whose newly sharded mesh dims learn their sizes from the gradient itself."""

    def __init__(
        self,
        spec: ShardTensorSpec,
        placements: tuple[Placement, ...],
        sizes: dict[int, tuple[int, ...]],
        unknown: tuple[int, ...],
    ) -> None:
        self.spec, self.placements, self.sizes, self.unknown = spec, placements, sizes, unknown

    def for_gradient(self, grad: torch.Tensor) -> ShardTensorSpec:
        spec = self.spec
        sizes = dict(self.sizes)
        for m in self.unknown:
            dim = self.placements[m].dim  # type: ignore[attr-defined]
            shapes = all_gather_shapes(tuple(grad.shape), spec.mesh.get_group(m), spec.mesh.device_type)
            sizes[m] = tuple(s[dim] for s in shapes)
            if sum(sizes[m]) != spec.shape[dim]:
                raise ValueError(
                    f"grad_placements {list(self.placements)}: the gradients of the local tensors have "
                    f"sizes {sizes[m]} along tensor dim {dim} on the coordinates of mesh dim {m}, which do "
                    f"not add up to the tensor's {spec.shape[dim]}; a Shard grad placement needs each "
                    "rank's gradient to be its shard"
                )
        return make_spec(
            spec.mesh, self.placements, spec.shape, grad.dtype, sizes, spec.stride, spec.coordinate
        )


# -- gradients of leaves ------------------------------------------------------------------------


def keep_leaf_gradient_layout(tensor: ShardLike) -> None:
    """Gradients reaching this leaf take its layout on the mesh dims where it is sharded.

    A reduction's backward expands the gradient of its result back to the input's
    global shape, so a leaf reduced directly (``x.sum()``) would receive a
    ``Replicate`` gradient of its full size: the hook slices it to the leaf's shards
    (no collective), reduce-scatters a pending ``Partial`` sum, and realigns shard
    sizes. Where the leaf is replicated, the gradient keeps its placement: a pending
    ``Partial`` sum stays pending (DTensor's semantics, and what lets a data-parallel
    reduction batch it), and so does a ``Shard`` gradient.
    """
    if not tensor.is_leaf or getattr(tensor, "_shardtensor_grad_hook", False):
        return
    spec = tensor._spec
    cls = type(tensor)

    def to_leaf_layout(grad: torch.Tensor) -> torch.Tensor | None:
        if not isinstance(grad, cls) or grad._spec == spec:
            return None
        target = _leaf_gradient_target(grad._spec, spec)
        return None if target == grad._spec else move(grad, target)

    tensor.register_hook(to_leaf_layout)  # type: ignore[no-untyped-call]
    object.__setattr__(tensor, "_shardtensor_grad_hook", True)


def _leaf_gradient_target(grad: ShardTensorSpec, leaf: ShardTensorSpec) -> ShardTensorSpec:
    placements: list[Placement] = []
    sizes: dict[int, tuple[int, ...]] = {}
    for m, (g, p) in enumerate(zip(grad.placements, leaf.placements)):
        if isinstance(p, Shard) and (isinstance(g, (Replicate, Partial)) or g == p):
            placements.append(p)
            sizes[m] = leaf.shard_sizes[m]  # type: ignore[assignment]
        else:
            placements.append(g)
            if isinstance(g, Shard):
                sizes[m] = grad.shard_sizes[m]  # type: ignore[assignment]
    if tuple(placements) == grad.placements and all(grad.shard_sizes[m] == s for m, s in sizes.items()):
        return grad
    return make_spec(
        grad.mesh, tuple(placements), grad.shape, grad.dtype, sizes, grad.stride, grad.coordinate
    )


# -- autograd functions -------------------------------------------------------------------------


# ctx is filled in forward rather than in a setup_context staticmethod: with
# setup_context, Function.apply binds arguments through inspect.signature on every
# call (torch 2.11-2.14), which tripled the cost of a "chunk" from_local.


# Each Function makes its ShardTensors of the class it is given (``cls``) or of its
# input's type: this module is imported by shardtensor._tensor, which defines the class.


class _FromLocal(torch.autograd.Function):
    """local tensor -> ShardTensor (of ``cls``); backward returns one gradient per input (six)."""

    @staticmethod
    def forward(
        ctx: Any,
        local: torch.Tensor,
        mesh: DeviceMesh,
        placements: Any,
        sharding_shapes: Any,
        global_shape: Any,
        cls: type,
    ) -> Any:
        spec = build_spec(local, mesh, placements, sharding_shapes, global_shape)
        ctx.spec = spec
        ctx.cls = cls
        ctx.set_materialize_grads(False)
        # A detached alias: the shard shares the input's storage, the autograd
        # history lives on the wrapper.
        return cls(local.detach(), spec)

    @staticmethod
    def backward(
        ctx: Any, grad: torch.Tensor | None
    ) -> tuple[torch.Tensor | None, None, None, None, None, None]:
        return _local_gradient(grad, without_partial(ctx.spec), ctx.cls), None, None, None, None, None


def _local_gradient(grad: torch.Tensor | None, spec: ShardTensorSpec, cls: type) -> torch.Tensor | None:
    """``grad`` as this rank's shard of ``spec`` (redistributed if it arrives in another layout)."""
    if grad is None or not isinstance(grad, cls):
        return grad  # a plain gradient can only be the local shard's: autograd checked its shape
    shard = cast(ShardLike, grad)
    return _redistribute.redistribute_local(shard._local_tensor, shard._spec, spec)


class _FromDTensor(torch.autograd.Function):
    """DTensor -> ShardTensor of the same (torch.chunk) layout; the gradient goes back as a DTensor."""

    @staticmethod
    def forward(ctx: Any, dtensor: DTensor, cls: type) -> Any:
        local = dtensor._local_tensor
        ctx.dtensor_spec = dtensor._spec
        ctx.cls = cls
        return cls(local.view_as(local), dtensor_layout(dtensor))

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[DTensor, None]:
        if isinstance(grad, ctx.cls):
            local, placements = grad._local_tensor, grad.placements
        else:
            local, placements = grad, without_partial_placements(ctx.dtensor_spec.placements)
        spec = ctx.dtensor_spec
        dtensor = DTensor.from_local(
            local, spec.mesh, placements, run_check=False, shape=spec.shape, stride=spec.stride
        )
        return dtensor, None


def dtensor_layout(dtensor: DTensor) -> ShardTensorSpec:
    """The spec of a DTensor's (torch.chunk) layout, checked against its local tensor."""
    local = dtensor._local_tensor
    placements = check_placements(tuple(dtensor.placements), dtensor.device_mesh, dtensor.ndim)
    shape = tuple(dtensor.shape)
    sizes = chunk_layout(dtensor.device_mesh, placements, shape)
    spec = make_spec(dtensor.device_mesh, placements, shape, local.dtype, sizes, tuple(dtensor.stride()))
    if spec.local_shape != tuple(local.shape):
        raise ValueError(
            f"the DTensor's local shape {tuple(local.shape)} is not torch.chunk's {spec.local_shape} "
            f"for {spec}"
        )
    return spec


def without_partial_placements(placements: Sequence[Placement]) -> tuple[Placement, ...]:
    return tuple(Replicate() if isinstance(p, Partial) else p for p in placements)


class _ToLocal(torch.autograd.Function):
    """ShardTensor -> its local tensor; the gradient goes back as a ShardTensor."""

    @staticmethod
    def forward(ctx: Any, tensor: ShardLike, grad_spec: Any) -> torch.Tensor:
        ctx.spec = grad_spec
        ctx.cls = type(tensor)
        # A fresh view: autograd writes its metadata on the output, not on our shard.
        return tensor._local_tensor.view_as(tensor._local_tensor)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[ShardLike, None]:
        spec = ctx.spec
        if isinstance(spec, InferLater):
            spec = spec.for_gradient(grad)
        elif grad.dtype != spec.dtype:
            spec = make_spec(
                spec.mesh,
                spec.placements,
                spec.shape,
                grad.dtype,
                {m: s for m, s in enumerate(spec.shard_sizes) if s is not None},
                spec.stride,
                spec.coordinate,
            )
        return ctx.cls(grad, spec), None


class _Redistribute(torch.autograd.Function):
    """ShardTensor -> the same tensor in ``spec``; backward is the reverse redistribute."""

    @staticmethod
    def forward(ctx: Any, tensor: ShardLike, spec: ShardTensorSpec) -> Any:
        ctx.source = without_partial(tensor._spec)
        ctx.negotiate = _redistribute._negotiating()
        cls: Any = type(tensor)
        ctx.cls = cls
        ctx.set_materialize_grads(False)
        local = _redistribute.redistribute_local(tensor._local_tensor, tensor._spec, spec)
        return cls(local, spec)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor | None) -> tuple[ShardLike | None, None]:
        if grad is None:
            return None, None
        if not isinstance(grad, ctx.cls):
            raise TypeError(
                f"redistribute's backward needs a ShardTensor gradient, got {type(grad).__name__}"
            )
        # The same shape exchange as the forward, so a benchmark compares like with like.
        with _redistribute._negotiate_shapes() if ctx.negotiate else contextlib.nullcontext():
            local = _redistribute.redistribute_local(grad._local_tensor, grad._spec, ctx.source)
        return ctx.cls(local, ctx.source), None
