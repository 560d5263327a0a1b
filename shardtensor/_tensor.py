"""ShardTensor: a torch.Tensor wrapper holding this rank's shard and a ShardTensorSpec.

Why a wrapper subclass of ``torch.Tensor`` (``_make_wrapper_subclass``) and not a
DTensor subclass: DTensor's own metadata and operators assume torch.chunk layouts,
so a subclass would carry a second, even-only description of every uneven tensor
and route every operator through sharding rules that cannot see per-rank shapes.
A wrapper keeps exactly one description (the spec), lets autograd take a
ShardTensor as a Function's input and output, and is what PhysicsNeMo moved to in
its PR #1556. Layouts DTensor can describe convert both ways (``from_dtensor``,
``to_dtensor``) without communication.

Operators are not implemented: outside the methods below, a ShardTensor supports
only what autograd needs (detach, clone, gradient accumulation, ``*_like``), and
any other operator raises NotImplementedError pointing at ``full_tensor()``,
``to_local()`` and ``to_dtensor()``.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Partial, Replicate
from torch.distributed.tensor.placement_types import Placement

from shardtensor import _redistribute, _torch_private
from shardtensor._from_local import build_spec
from shardtensor._placements import check_placements
from shardtensor._spec import ShardTensorSpec, chunk_layout, make_spec, without_partial

__all__ = ["ShardTensor"]

aten = torch.ops.aten


class ShardTensor(torch.Tensor):
    """A distributed tensor whose shards may have any per-rank sizes, even empty.

    ``.shape`` is the global shape; ``._spec`` holds the mesh, placements and every
    rank's shard sizes, so no operation needs a collective to learn shapes.
    Build one with :meth:`from_local` or :meth:`from_dtensor`.
    """

    _local_tensor: torch.Tensor
    _spec: ShardTensorSpec
    __slots__ = ["_local_tensor", "_spec"]

    # Property reads stay in C++; every operator reaches __torch_dispatch__.
    __torch_function__ = _torch_private.disabled_torch_function

    @staticmethod
    def __new__(
        cls, local_tensor: torch.Tensor, spec: ShardTensorSpec, *, requires_grad: bool = False
    ) -> ShardTensor:
        """Wrap ``local_tensor`` as this rank's shard of ``spec`` (no checks across ranks).

        Args:
            local_tensor: this rank's shard; its shape and dtype must match ``spec``.
            spec: the layout.

        Keyword args:
            requires_grad: make the result an autograd leaf that requires grad.

        Raises:
            ValueError: ``local_tensor`` does not have ``spec``'s local shape or dtype.
        """
        if tuple(local_tensor.shape) != spec.local_shape or local_tensor.dtype != spec.dtype:
            raise ValueError(
                f"local_tensor has shape {tuple(local_tensor.shape)} and dtype {local_tensor.dtype}, but "
                f"the spec expects {spec.local_shape} and {spec.dtype} on this rank (spec: {spec})"
            )
        tensor: ShardTensor = _torch_private.make_wrapper_subclass(
            cls,
            spec.shape,
            spec.stride,
            dtype=spec.dtype,
            device=local_tensor.device,
            requires_grad=requires_grad,
        )
        tensor._local_tensor = local_tensor
        tensor._spec = spec
        return tensor

    def __repr__(self) -> str:  # type: ignore[override]
        grad = f", grad_fn={self.grad_fn.name()}" if self.grad_fn is not None else ""
        grad += ", requires_grad=True" if self.requires_grad and self.grad_fn is None else ""
        return (
            f"ShardTensor(local_tensor={self._local_tensor}, device_mesh={self.device_mesh}, "
            f"placements={self.placements}{grad})"
        )

    @property
    def device_mesh(self) -> DeviceMesh:
        """The mesh the tensor is distributed over."""
        return self._spec.mesh

    @property
    def placements(self) -> tuple[Placement, ...]:
        """One placement per mesh dim."""
        return self._spec.placements

    @staticmethod
    def from_local(
        local_tensor: torch.Tensor,
        device_mesh: DeviceMesh | None = None,
        placements: Sequence[Placement] | None = None,
        sharding_shapes: str | dict[int, Sequence[Sequence[int]]] = "infer",
        global_shape: Sequence[int] | None = None,
    ) -> ShardTensor:
        """A ShardTensor whose shard on this rank is ``local_tensor`` (shares its storage).

        Args:
            local_tensor: this rank's shard.
            device_mesh: the mesh; defaults to the one of an enclosing ``with mesh:``.
            placements: one per mesh dim; defaults to all ``Replicate()``.
            sharding_shapes: how every rank's shard shape is known:
                ``"infer"`` (default): one all_gather of the local shape per ``Shard``
                mesh dim; any concatenable layout, uneven or with empty shards.
                ``"chunk"``: no communication; shards are laid out as torch.chunk
                lays out ``global_shape`` (trailing shards may be empty).
                ``{mesh_dim: [shape per coordinate]}``: no communication; one
                entry per ``Shard`` mesh dim, the same on every rank.
            global_shape: the global shape; required by ``"chunk"``, checked
                against the result otherwise.

        Returns:
            a ShardTensor; differentiable with respect to ``local_tensor``.

        Raises:
            TypeError: ``local_tensor`` is not a plain tensor, ``device_mesh`` not a
                DeviceMesh, or ``placements``, ``sharding_shapes`` or ``global_shape``
                of the wrong type.
            ValueError: inconsistent arguments (each message names the values), e.g.
                ``"If sharding_shapes is 'chunk', global_shape must be provided"``.
        """
        if not isinstance(local_tensor, torch.Tensor) or isinstance(local_tensor, (ShardTensor, DTensor)):
            raise TypeError(
                f"local_tensor must be a plain torch.Tensor (this rank's shard), got "
                f"{type(local_tensor).__name__}; use ShardTensor.from_dtensor for a DTensor"
            )
        mesh = _resolve_mesh(device_mesh)
        result: ShardTensor = _FromLocal.apply(  # type: ignore[no-untyped-call]
            local_tensor, mesh, placements, sharding_shapes, global_shape
        )
        return result

    @classmethod
    def from_dtensor(cls, dtensor: DTensor) -> ShardTensor:
        """The ShardTensor of ``dtensor``'s layout, without communication (differentiable).

        Raises:
            TypeError: ``dtensor`` is not a DTensor.
            ValueError: a placement shardtensor does not support (e.g. ``_StridedShard``).
        """
        if not isinstance(dtensor, DTensor):
            raise TypeError(f"from_dtensor needs a DTensor, got {type(dtensor).__name__}")
        return cls.from_local(
            dtensor.to_local(), dtensor.device_mesh, dtensor.placements, "chunk", tuple(dtensor.shape)
        )

    def to_dtensor(self) -> DTensor:
        """This tensor as a DTensor, without communication (differentiable).

        Raises:
            ValueError: the layout is not torch.chunk's, which is all DTensor can
                describe; redistribute first (e.g. to ``Replicate()`` and back).
        """
        spec = self._spec
        expected = chunk_layout(spec.mesh, spec.placements, spec.shape)
        for m, sizes in expected.items():
            if spec.shard_sizes[m] != sizes:
                raise ValueError(
                    f"mesh dim {m} ({spec.placements[m]}) has shard sizes {spec.shard_sizes[m]}, but a "
                    f"DTensor needs torch.chunk's {sizes}; redistribute "
                    "through Replicate() to get that layout first"
                )
        return DTensor.from_local(
            self.to_local(),
            spec.mesh,
            spec.placements,
            run_check=False,
            shape=torch.Size(spec.shape),
            stride=spec.stride,
        )

    def to_local(self) -> torch.Tensor:
        """This rank's shard; differentiable (the gradient arrives as a ShardTensor)."""
        if not torch.is_grad_enabled():
            return self._local_tensor
        result: torch.Tensor = _ToLocal.apply(self)  # type: ignore[no-untyped-call]
        return result

    def redistribute(
        self, device_mesh: DeviceMesh | None = None, placements: Sequence[Placement] | None = None
    ) -> ShardTensor:
        """This tensor with new placements on the same mesh (differentiable).

        Args:
            device_mesh: must be this tensor's mesh (or None).
            placements: the target placements; ``Partial`` is not a valid target.

        Returns:
            a ShardTensor whose spec records every rank's new shard sizes: dims that
            stay sharded by the same mesh dim keep theirs, newly sharded dims are
            chunked as torch.chunk does.

        Raises:
            ValueError: no placements, invalid placements, or a ``Partial`` target.
            NotImplementedError: a different mesh.
        """
        if device_mesh is not None and device_mesh != self.device_mesh:
            raise NotImplementedError(
                f"redistribute across meshes is not supported: the tensor is on {self.device_mesh}, "
                f"the target is {device_mesh}"
            )
        if placements is None:
            raise ValueError("placements is needed for redistribute!")  # DTensor's message
        checked = check_placements(placements, self.device_mesh, self.ndim)
        if any(isinstance(p, Partial) for p in checked):
            raise ValueError(
                "Can not redistribute to Partial, redistributing to Partial is for internal use only! "
                f"(got placements {list(placements)})"
            )
        target = _redistribute.target_spec(self._spec, checked)
        result: ShardTensor = _Redistribute.apply(self, target)  # type: ignore[no-untyped-call]
        return result

    def full_tensor(self) -> torch.Tensor:
        """The global tensor on every rank: redistribute to all ``Replicate()``, then ``to_local()``."""
        replicated = self.redistribute(placements=[Replicate()] * self.device_mesh.ndim)
        return replicated.to_local()

    def offsets(self, mesh_dim: int | None = None) -> tuple[int, ...] | int:
        """Where this rank's shard starts, per mesh dim (see ``ShardTensorSpec.offsets``)."""
        return self._spec.offsets(mesh_dim)

    def backward(  # type: ignore[override]
        self,
        gradient: torch.Tensor | None = None,
        retain_graph: bool | None = None,
        create_graph: bool = False,
        inputs: Sequence[torch.Tensor] | None = None,
    ) -> None:
        """``torch.Tensor.backward``, after resolving ``Partial`` placements to ``Replicate``.

        ``gradient`` may be a ShardTensor, or a plain tensor of the global shape
        holding the whole gradient (the same on every rank).
        """
        target = without_partial(self._spec)
        tensor = self if target is self._spec else self.redistribute(placements=target.placements)
        if gradient is not None and not isinstance(gradient, ShardTensor):
            gradient = _from_full(gradient, target)
        torch.Tensor.backward(tensor, gradient, retain_graph, create_graph, inputs)  # type: ignore[no-untyped-call]

    @classmethod
    def __torch_dispatch__(  # type: ignore[override]
        cls,
        func: Any,
        types: Any,
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> Any:
        handler = _DISPATCH.get(func)
        if handler is None:
            raise _unsupported(str(func))
        return handler(*args, **(kwargs or {}))


def _from_full(full: torch.Tensor, spec: ShardTensorSpec) -> ShardTensor:
    """This rank's shard of ``full`` (the whole tensor, on every rank) in ``spec``'s layout."""
    if tuple(full.shape) != spec.shape:
        raise ValueError(
            f"a plain gradient must have the global shape {spec.shape}, got {tuple(full.shape)}; "
            "or pass a ShardTensor"
        )
    replicated = make_spec(spec.mesh, (Replicate(),) * spec.mesh.ndim, spec.shape, spec.dtype, {})
    return ShardTensor(_redistribute.redistribute_local(full, replicated, spec), spec)


def _unsupported(what: str) -> NotImplementedError:
    return NotImplementedError(
        f"ShardTensor does not implement {what}; convert first: .full_tensor() for the global "
        "tensor, .to_local() for this rank's shard, or .to_dtensor() to use DTensor's operators"
    )


def _resolve_mesh(device_mesh: object) -> DeviceMesh:
    if device_mesh is None:
        current = _torch_private.current_mesh()
        if current is None:
            raise ValueError("device_mesh is None and no DeviceMesh is active; pass device_mesh=...")
        return current
    if not isinstance(device_mesh, DeviceMesh):
        raise TypeError(
            f"device_mesh must be a DeviceMesh, got {device_mesh!r} of type {type(device_mesh).__name__}"
        )
    return device_mesh


# -- autograd functions -----------------------------------------------------------------------


# ctx is filled in forward rather than in a setup_context staticmethod: with
# setup_context, Function.apply binds arguments through inspect.signature on every
# call (torch 2.11-2.14), which tripled the cost of a "chunk" from_local.


class _FromLocal(torch.autograd.Function):
    """local tensor -> ShardTensor; backward returns one gradient per input (five)."""

    @staticmethod
    def forward(
        ctx: Any,
        local: torch.Tensor,
        mesh: DeviceMesh,
        placements: Any,
        sharding_shapes: Any,
        global_shape: Any,
    ) -> ShardTensor:
        spec = build_spec(local, mesh, placements, sharding_shapes, global_shape)
        ctx.spec = spec
        ctx.set_materialize_grads(False)
        # A detached alias: the shard shares the input's storage, the autograd
        # history lives on the wrapper.
        return ShardTensor(local.detach(), spec)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor | None) -> tuple[torch.Tensor | None, None, None, None, None]:
        return _local_gradient(grad, without_partial(ctx.spec)), None, None, None, None


def _local_gradient(grad: torch.Tensor | None, spec: ShardTensorSpec) -> torch.Tensor | None:
    """``grad`` as this rank's shard of ``spec`` (redistributed if it arrives in another layout)."""
    if grad is None or not isinstance(grad, ShardTensor):
        return grad  # a plain gradient can only be the local shard's: autograd checked its shape
    return _redistribute.redistribute_local(grad._local_tensor, grad._spec, spec)


class _ToLocal(torch.autograd.Function):
    """ShardTensor -> its local tensor; the gradient goes back as a ShardTensor."""

    @staticmethod
    def forward(ctx: Any, tensor: ShardTensor) -> torch.Tensor:
        ctx.spec = without_partial(tensor._spec)
        # A fresh view: autograd writes its metadata on the output, not on our shard.
        return tensor._local_tensor.view_as(tensor._local_tensor)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> ShardTensor:
        return ShardTensor(grad, ctx.spec)


class _Redistribute(torch.autograd.Function):
    """ShardTensor -> the same tensor in ``spec``; backward is the reverse redistribute."""

    @staticmethod
    def forward(ctx: Any, tensor: ShardTensor, spec: ShardTensorSpec) -> ShardTensor:
        ctx.source = without_partial(tensor._spec)
        ctx.negotiate = _redistribute._negotiating()
        ctx.set_materialize_grads(False)
        return ShardTensor(_redistribute.redistribute_local(tensor._local_tensor, tensor._spec, spec), spec)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor | None) -> tuple[ShardTensor | None, None]:
        if grad is None:
            return None, None
        if not isinstance(grad, ShardTensor):
            raise TypeError(
                f"redistribute's backward needs a ShardTensor gradient, got {type(grad).__name__}"
            )
        # The same shape exchange as the forward, so a benchmark compares like with like.
        with _redistribute._negotiate_shapes() if ctx.negotiate else contextlib.nullcontext():
            local = _redistribute.redistribute_local(grad._local_tensor, grad._spec, ctx.source)
        return ShardTensor(local, ctx.source), None


# -- what autograd needs at the dispatch level ------------------------------------------------


def _like(factory: Callable[..., torch.Tensor]) -> Callable[..., ShardTensor]:
    """``zeros_like`` and friends: same layout (Partial made Replicate), new local values."""

    def handler(tensor: ShardTensor, **kwargs: Any) -> ShardTensor:
        local = factory(tensor._local_tensor, **kwargs)
        base = without_partial(tensor._spec)
        sizes = {m: s for m, s in enumerate(base.shard_sizes) if s is not None}
        spec = make_spec(base.mesh, base.placements, base.shape, local.dtype, sizes, base.stride)
        return ShardTensor(local, spec)

    return handler


def _detach(tensor: ShardTensor) -> ShardTensor:
    return ShardTensor(tensor._local_tensor.detach(), tensor._spec)


def _clone(tensor: ShardTensor, **kwargs: Any) -> ShardTensor:
    return ShardTensor(tensor._local_tensor.clone(**kwargs), tensor._spec)


def _aligned(a: ShardTensor, b: Any, op: str) -> torch.Tensor:
    """``b``'s shard in ``a``'s layout, for adding gradients that arrive in different layouts."""
    if not isinstance(a, ShardTensor) or not isinstance(b, ShardTensor):
        raise _unsupported(f"{op} with {type(b).__name__} (only between two ShardTensors)")
    if a._spec == b._spec:
        return b._local_tensor
    partial = any(isinstance(p, Partial) for p in (*a.placements, *b.placements))
    if partial or a.device_mesh != b.device_mesh or a.shape != b.shape:
        raise _unsupported(f"{op} between layouts {a._spec} and {b._spec}")
    return _redistribute.redistribute_local(b._local_tensor, b._spec, a._spec)


def _add(a: ShardTensor, b: Any, *, alpha: Any = 1) -> ShardTensor:
    return ShardTensor(torch.add(a._local_tensor, _aligned(a, b, "aten.add.Tensor"), alpha=alpha), a._spec)


def _add_(a: ShardTensor, b: Any, *, alpha: Any = 1) -> ShardTensor:
    a._local_tensor.add_(_aligned(a, b, "aten.add_.Tensor"), alpha=alpha)
    return a


_DISPATCH: dict[Any, Callable[..., Any]] = {
    aten.detach.default: _detach,
    aten.alias.default: _detach,
    aten.clone.default: _clone,
    aten.add.Tensor: _add,
    aten.add_.Tensor: _add_,
    aten.zeros_like.default: _like(torch.zeros_like),
    aten.ones_like.default: _like(torch.ones_like),
    aten.empty_like.default: _like(torch.empty_like),
}
