"""ShardTensor: a torch.Tensor wrapper holding this rank's shard and a ShardTensorSpec.

Why a wrapper subclass of ``torch.Tensor`` (``_make_wrapper_subclass``) and not a
DTensor subclass: DTensor's metadata and its C++ dispatch assume torch.chunk
layouts, so a subclass would carry a second, even-only description of every
uneven tensor and hand every operator to a dispatcher that cannot see per-rank
shapes (and would silently run it). A wrapper keeps exactly one description (the
spec), lets autograd take a ShardTensor as a Function's input and output, and is
what PhysicsNeMo moved to in its PR #1556. What DTensor knows is still reused where
it is right: its per-operator sharding rules decide placements (see
``_dispatch``), and layouts DTensor can describe convert both ways without
communication (``from_dtensor``, ``to_dtensor``).

Operators run at two levels:

- ``__torch_function__`` (above autograd) runs handlers registered with
  :meth:`ShardTensor.register_function_handler`, and promotes plain tensors that
  require grad through the differentiable ``from_local`` (see ``_promotion``);
  everything else goes straight down;
- ``__torch_dispatch__`` (below autograd, so backward formulas come here too) runs
  handlers registered with :meth:`ShardTensor.register_dispatch_handler`, then
  ``_dispatch.dispatch``: DTensor's sharding rules applied to per-rank layouts.
"""

from __future__ import annotations

import contextlib
import hashlib
from collections.abc import Callable, Iterator, Sequence
from typing import Any, ClassVar

import torch
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Partial, Replicate
from torch.distributed.tensor.placement_types import Placement

from shardtensor import _autograd, _compile, _dispatch, _promotion, _redistribute, _torch_private
from shardtensor._placements import check_placements
from shardtensor._promotion import TensorPromotionMode
from shardtensor._spec import (
    ShardTensorSpec,
    chunk_layout,
    make_spec,
    resolve_chunk_layout,
    without_partial,
)

__all__ = ["ShardTensor"]

aten = torch.ops.aten


class ShardTensor(torch.Tensor):
    """A distributed tensor whose shards may have any per-rank sizes, even empty.

    ``.shape`` is the global shape; ``._spec`` holds the mesh, placements and every
    rank's shard sizes, so no operation needs a collective to learn shapes.
    Build one with :meth:`from_local`, :meth:`from_dtensor` or
    :func:`shardtensor.scatter_tensor`; operators give ShardTensors whose specs
    are right on every rank.
    """

    _local_tensor: torch.Tensor
    _spec: ShardTensorSpec
    __slots__ = ["_local_tensor", "_spec"]

    # Handlers by aten OpOverload (below autograd) and by Python function (above it).
    _dispatch_registry: ClassVar[dict[Any, Callable[..., Any]]] = {}
    _function_registry: ClassVar[dict[Any, Callable[..., Any]]] = {}
    _promotion_mode: ClassVar[TensorPromotionMode] = TensorPromotionMode.SILENT

    @staticmethod
    def __new__(
        cls, local_tensor: torch.Tensor, spec: ShardTensorSpec, *, requires_grad: bool = False
    ) -> ShardTensor:
        """Wrap ``local_tensor`` as this rank's shard of ``spec`` (no checks across ranks).

        Args:
            local_tensor: this rank's shard; its shape and dtype must match ``spec``.
            spec: the layout; a spec without sharding shapes assumes torch.chunk's
                layout, checked against ``local_tensor``.

        Keyword args:
            requires_grad: make the result require grad (``requires_grad_()``
                also makes a leaf's gradients arrive in its layout).

        Raises:
            ValueError: ``local_tensor`` does not have ``spec``'s local shape or dtype.
            RuntimeError: a size-less spec whose torch.chunk layout does not fit.
        """
        if not spec.is_resolved:
            spec = resolve_chunk_layout(spec, tuple(local_tensor.shape))
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
    def spec(self) -> ShardTensorSpec:
        """The tensor's layout: mesh, placements, global shape and every rank's shard sizes (read-only).

        ``_spec`` is the same object, under the name PhysicsNeMo's ShardTensor uses.
        """
        return self._spec

    @property
    def device_mesh(self) -> DeviceMesh:
        """The mesh the tensor is distributed over."""
        return self._spec.mesh

    @property
    def placements(self) -> tuple[Placement, ...]:
        """One placement per mesh dim."""
        return self._spec.placements

    # -- construction ---------------------------------------------------------------------------

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
        result: ShardTensor = _autograd._FromLocal.apply(  # type: ignore[no-untyped-call]
            local_tensor, mesh, placements, sharding_shapes, global_shape, ShardTensor
        )
        return result

    @classmethod
    def from_dtensor(cls, dtensor: DTensor) -> ShardTensor:
        """The ShardTensor of ``dtensor``'s layout, without communication.

        As in PhysicsNeMo: a DTensor computed by ops (with a ``grad_fn``) converts
        differentiably, its gradient flowing back as a DTensor; a leaf DTensor gives
        a new leaf that shares its local tensor and ``requires_grad``.

        Raises:
            TypeError: ``dtensor`` is not a DTensor.
            ValueError: a placement shardtensor does not support (e.g. ``_StridedShard``).
        """
        if isinstance(dtensor, ShardTensor):
            return dtensor
        if not isinstance(dtensor, DTensor):
            raise TypeError(f"from_dtensor needs a DTensor, got {type(dtensor).__name__}")
        if dtensor.grad_fn is None:
            leaf = ShardTensor(dtensor._local_tensor.detach(), _autograd.dtensor_layout(dtensor))
            return leaf.requires_grad_(dtensor.requires_grad)
        return _autograd._FromDTensor.apply(dtensor, cls)  # type: ignore[no-untyped-call, no-any-return]

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

    # -- leaving and moving ---------------------------------------------------------------------

    def to_local(self, *, grad_placements: Sequence[Placement] | None = None) -> torch.Tensor:
        """This rank's shard; differentiable (the gradient arrives as a ShardTensor).

        A ``Partial`` tensor's shard is this rank's unreduced contribution.

        Keyword args:
            grad_placements: the placements the gradient of the result has (by
                default this tensor's, ``Partial`` made ``Replicate``); ``Partial()``
                declares each rank's gradient a contribution still to be summed.

        Raises:
            ValueError: invalid ``grad_placements``.
        """
        if not torch.is_grad_enabled():
            return self._local_tensor
        grad_spec = _autograd.gradient_spec(self, grad_placements)
        result: torch.Tensor = _autograd._ToLocal.apply(self, grad_spec)  # type: ignore[no-untyped-call]
        return result

    def redistribute(
        self,
        device_mesh: DeviceMesh | None = None,
        placements: Sequence[Placement] | None = None,
        *,
        async_op: bool = False,
    ) -> ShardTensor:
        """This tensor with new placements on the same mesh (differentiable).

        Args:
            device_mesh: must be this tensor's mesh (or None).
            placements: the target placements; ``Partial`` is not a valid target.

        Keyword args:
            async_op: accepted for DTensor compatibility; collectives complete
                before this returns.

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
        moved: ShardTensor = _autograd.move(self, target)
        return moved

    def full_tensor(self, *, grad_placements: Sequence[Placement] | None = None) -> torch.Tensor:
        """The global tensor on every rank: redistribute to all ``Replicate()``, then ``to_local()``.

        Keyword args:
            grad_placements: as for :meth:`to_local`, for the gradient of the result.
        """
        replicated = self.redistribute(placements=[Replicate()] * self.device_mesh.ndim)
        return replicated.to_local(grad_placements=grad_placements)

    def offsets(self, mesh_dim: int | None = None) -> tuple[int, ...] | int:
        """Where this rank's shard starts, per mesh dim (see ``ShardTensorSpec.offsets``)."""
        return self._spec.offsets(mesh_dim)

    # -- autograd -------------------------------------------------------------------------------

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

    def requires_grad_(self, requires_grad: bool = True) -> ShardTensor:  # type: ignore[override]
        """``torch.Tensor.requires_grad_``; a leaf's gradients then arrive in its layout.

        (On a leaf that is sharded, a gradient arriving ``Replicate`` or ``Partial``
        is moved to the leaf's shards; ``nn.Parameter``, ``scatter_tensor`` and
        ``detach().requires_grad_()`` all make leaves this way.)
        """
        torch.Tensor.requires_grad_(self, requires_grad)
        if requires_grad:
            _autograd.keep_leaf_gradient_layout(self)
        return self

    # -- promotion and handler registration (PhysicsNeMo's API) ---------------------------------

    @classmethod
    def get_promotion_mode(cls) -> TensorPromotionMode:
        """The active plain-tensor promotion mode (``SILENT`` unless set)."""
        return cls._promotion_mode

    @classmethod
    def set_promotion_mode(cls, mode: TensorPromotionMode | str) -> None:
        """Set how plain tensors meeting ShardTensors are treated (for every rank of the process).

        Args:
            mode: a :class:`TensorPromotionMode` or its value: ``"disabled"``,
                ``"warn"`` or ``"silent"``.

        Raises:
            ValueError: any other value.
        """
        ShardTensor._promotion_mode = _promotion.coerce_mode(mode)

    @classmethod
    @contextlib.contextmanager
    def promotion_mode(cls, mode: TensorPromotionMode | str) -> Iterator[None]:
        """Use ``mode`` inside the ``with`` block; the previous mode is back after it, even on error."""
        previous = ShardTensor._promotion_mode
        ShardTensor._promotion_mode = _promotion.coerce_mode(mode)
        try:
            yield
        finally:
            ShardTensor._promotion_mode = previous

    @classmethod
    def register_dispatch_handler(cls, op: Any, handler: Callable[..., Any]) -> None:
        """Run ``handler(*args, **kwargs)`` for the aten operator ``op`` on ShardTensors.

        Handlers run below autograd, before shardtensor's own operator support.

        Raises:
            TypeError: ``handler`` is not callable.
        """
        _check_callable(handler, "register_dispatch_handler")
        cls._dispatch_registry[op] = handler

    @classmethod
    def register_function_handler(cls, func: Callable[..., Any], handler: Callable[..., Any]) -> None:
        """Run ``handler(func, types, args, kwargs)`` when ``func`` is called with a ShardTensor.

        Handlers run above autograd; plain tensors among the top-level arguments
        arrive promoted to ``Replicate`` ShardTensors (by the promotion mode).

        Raises:
            TypeError: ``handler`` is not callable.
        """
        _check_callable(handler, "register_function_handler")
        cls._function_registry[func] = handler

    # -- operators ------------------------------------------------------------------------------

    @classmethod
    def __torch_function__(
        cls,
        func: Any,
        types: Any,
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> Any:
        if kwargs is None:
            kwargs = {}
        if ShardTensor._function_registry or cls._subclass_propagated_attrs:
            return _torch_function_with_handlers(cls, func, types, args, kwargs)
        if torch.is_grad_enabled():
            for a in args:
                if type(a) in _PLAIN and a.requires_grad:
                    return _torch_function_with_handlers(cls, func, types, args, kwargs)
            for a in kwargs.values():
                if type(a) in _PLAIN and a.requires_grad:
                    return _torch_function_with_handlers(cls, func, types, args, kwargs)
        with _NoTorchFunction():
            return func(*args, **kwargs)

    @classmethod
    def __torch_dispatch__(  # type: ignore[override]
        cls,
        func: Any,
        types: Any,
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> Any:
        if kwargs is None:
            kwargs = {}
        if ShardTensor._dispatch_registry:
            handler = ShardTensor._dispatch_registry.get(func)
            if handler is not None:
                return handler(*args, **kwargs)
        fast = _FAST.get(id(func))
        if fast is not None:
            return fast(*args, **kwargs)
        return _dispatch.dispatch(func, args, kwargs, ShardTensor, _promote_in_dispatch)

    # -- torch.compile (see _compile) -----------------------------------------------------------

    def __tensor_flatten__(self) -> tuple[list[str], Any]:
        names = ["_local_tensor", *type(self)._extra_inner_tensors]
        base = (self._spec, self.requires_grad)
        extra = self.__subclass_flatten_context__()
        return names, (base if extra is None else (base, extra))

    @classmethod
    def __tensor_unflatten__(
        cls, inner_tensors: dict[str, torch.Tensor], flatten_spec: Any, outer_size: Any, outer_stride: Any
    ) -> ShardTensor:
        result: ShardTensor = _compile.unflatten(cls, inner_tensors, flatten_spec, outer_size, outer_stride)
        return result

    @classmethod
    def __metadata_guard__(cls, orig: Any, other: Any) -> bool:
        """Dynamo's guard on the flatten context: the layout and requires_grad, not a subclass's extra."""
        return _compile.base_context(orig) == _compile.base_context(other)

    # -- extension points for subclasses (PhysicsNeMo's) -----------------------------------------

    # Names of extra inner tensors a subclass carries through torch.compile (after _local_tensor).
    _extra_inner_tensors: ClassVar[tuple[str, ...]] = ()
    # Attributes copied from an input onto eager op results, which take the subclass's type.
    _subclass_propagated_attrs: ClassVar[tuple[str, ...]] = ()

    def __subclass_flatten_context__(self) -> object | None:
        """A subclass's extra flatten context (a graph constant), nested as ``(base, extra)``; None here."""
        return None

    def __subclass_unflatten__(self, subclass_ctx: object) -> None:
        """Reattach what :meth:`__subclass_flatten_context__` returned; nothing here."""
        return None

    def _stable_inner_sentinel(self, cache_attr: str) -> torch.Tensor:
        """An empty int64 tensor for an unset extra inner tensor, the same object on every call
        (AOTAutograd flattens an input more than once), made on the local tensor's device."""
        cached: torch.Tensor | None = getattr(self, cache_attr, None)
        if cached is None:
            cached = torch.zeros(0, dtype=torch.int64, device=self._local_tensor.device)
            setattr(self, cache_attr, cached)
        return cached

    def __coerce_tangent_metadata__(self) -> ShardTensor:
        """Trace time: a tangent's layout (a pending ``Partial`` sum resolved to ``Replicate``)."""
        target = without_partial(self._spec)
        return self if target is self._spec else self.redistribute(placements=target.placements)

    def __coerce_same_metadata_as_tangent__(
        self, flatten_spec: Any, expected_type: type | None = None
    ) -> torch.Tensor | None:
        """Run time: this tangent moved to the layout AOTAutograd recorded for it."""
        return _compile.coerce_to_recorded(self, flatten_spec, expected_type, ShardTensor)

    def _stable_hash_for_caching(self) -> str:
        """A hash of the layout that is the same in every process (AOTAutograd's cache key)."""
        data = self._spec._stable_hash() + str(self.requires_grad)
        return hashlib.blake2b(data.encode(), digest_size=16).hexdigest()


# -- helpers ------------------------------------------------------------------------------------


_PLAIN = (torch.Tensor, torch.nn.Parameter)
_NoTorchFunction = _torch_private.NoTorchFunction


def _torch_function_with_handlers(
    cls: type, func: Any, types: Any, args: tuple[Any, ...], kwargs: dict[str, Any]
) -> Any:
    """The slow path: a registered handler, differentiable promotion, subclass attributes."""
    registry = ShardTensor._function_registry
    handler = registry.get(func) if registry else None
    if handler is not None:
        args, kwargs = _promote_for_handler(args, kwargs, every_plain=True)
        return handler(func, types, args, kwargs)
    if (
        ShardTensor._promotion_mode is not TensorPromotionMode.DISABLED
        and torch.is_grad_enabled()
        and _promotion.needs_bridge(args, kwargs)
    ):
        args, kwargs = _promote_for_handler(args, kwargs, every_plain=False)
    with _NoTorchFunction():
        result = func(*args, **kwargs)
    if cls._subclass_propagated_attrs and not _torch_private.are_we_tracing():  # type: ignore[attr-defined]
        _propagate_subclass_attrs(cls, result, args, kwargs)
    return result


def _propagate_subclass_attrs(cls: type, result: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
    """Eager op results of a subclass declaring ``_subclass_propagated_attrs`` take its type and attrs."""
    attrs: tuple[str, ...] = cls._subclass_propagated_attrs  # type: ignore[attr-defined]
    sources = [a for a in (*args, *kwargs.values()) if isinstance(a, cls)]
    if not sources:
        return
    source = next((a for a in sources if getattr(a, attrs[0], None) is not None), sources[0])
    for out in result if isinstance(result, (list, tuple)) else (result,):
        if isinstance(out, ShardTensor) and issubclass(cls, type(out)):
            if type(out) is not cls:
                out.__class__ = cls
            if getattr(out, attrs[0], None) is None:
                for name in attrs:
                    setattr(out, name, getattr(source, name))


def _check_callable(handler: object, what: str) -> None:
    if not callable(handler):
        raise TypeError(f"{what} needs a callable handler, got {handler!r}")


def _first_mesh(args: tuple[Any, ...], kwargs: dict[str, Any]) -> DeviceMesh | None:
    for a in (*args, *kwargs.values()):
        if isinstance(a, ShardTensor):
            return a._spec.mesh
        if isinstance(a, (list, tuple)):
            for x in a:
                if isinstance(x, ShardTensor):
                    return x._spec.mesh
    return None


def _promote_for_handler(
    args: tuple[Any, ...], kwargs: dict[str, Any], *, every_plain: bool
) -> tuple[tuple[Any, ...], dict[str, Any]]:
    mode = ShardTensor._promotion_mode
    mesh = _first_mesh(args, kwargs)
    if mesh is None or mode is TensorPromotionMode.DISABLED:
        return args, kwargs
    if mode is TensorPromotionMode.WARN:
        for a in (*args, *kwargs.values()):
            if type(a) in (torch.Tensor, torch.nn.Parameter) and (a.requires_grad or every_plain):
                _dispatch.warn_promotion(a, mesh)
    return _promotion.bridge(args, kwargs, ShardTensor.from_local, mesh, every_plain=every_plain)


def _promote_in_dispatch(tensor: torch.Tensor, mesh: DeviceMesh, op: Any) -> ShardTensor:
    """A plain tensor with dims as a Replicate ShardTensor (below autograd), by the promotion mode."""
    mode = ShardTensor._promotion_mode
    if mode is TensorPromotionMode.DISABLED:
        raise RuntimeError(
            f"{op}: got a plain torch.Tensor of shape {tuple(tensor.shape)} mixed with ShardTensors while "
            "the promotion mode is DISABLED; convert it first (ShardTensor.from_local(t, mesh, "
            "[Replicate()] * mesh.ndim, 'chunk', t.shape)) or set ShardTensor.set_promotion_mode('silent')"
        )
    if mode is TensorPromotionMode.WARN:
        _dispatch.warn_promotion(tensor, mesh)
    placements = (Replicate(),) * mesh.ndim
    coordinate = tuple(mesh.get_coordinate() or ())
    spec = make_spec(
        mesh, placements, tuple(tensor.shape), tensor.dtype, {}, tuple(tensor.stride()), coordinate
    )
    return ShardTensor(tensor, spec)


def _from_full(full: torch.Tensor, spec: ShardTensorSpec) -> ShardTensor:
    """This rank's shard of ``full`` (the whole tensor, on every rank) in ``spec``'s layout."""
    if tuple(full.shape) != spec.shape:
        raise ValueError(
            f"a plain gradient must have the global shape {spec.shape}, got {tuple(full.shape)}; "
            "or pass a ShardTensor"
        )
    replicated = make_spec(spec.mesh, (Replicate(),) * spec.mesh.ndim, spec.shape, spec.dtype, {})
    return ShardTensor(_redistribute.redistribute_local(full, replicated, spec), spec)


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


# -- what needs no sharding rule ---------------------------------------------------------------


def _detach(tensor: ShardTensor) -> ShardTensor:
    return ShardTensor(tensor._local_tensor.detach(), tensor._spec)


def _alias(tensor: ShardTensor) -> ShardTensor:
    return ShardTensor(aten.alias.default(tensor._local_tensor), tensor._spec)


def _is_same_size(a: torch.Tensor, b: torch.Tensor) -> bool:
    return tuple(a.shape) == tuple(b.shape)


# By id: an OpOverload hashes in Python, an int in C (this lookup runs for every op).
_FAST: dict[int, Callable[..., Any]] = {
    id(aten.detach.default): _detach,
    id(aten.alias.default): _alias,
    id(aten.is_same_size.default): _is_same_size,
}
