"""Every private torch API shardtensor depends on, in one place.

Checked against the sources of torch 2.11.0, 2.12.0, 2.13.0, 2.14.1 and 2.15.0
(``torch/distributed/tensor/_sharding_prop.py``, ``_op_schema.py``,
``_dtensor_spec.py``, ``placement_types.py``, ``_ops/_math_ops.py``,
``torch/distributed/_functional_collectives.py``, ``device_mesh.py``). Nothing else
in the package touches a ``torch._C`` name or an underscored torch module or
attribute; when torch moves one of these, this is the only file to change.

What lives here and why:

- DTensor's sharding propagation (``ShardingPropagator``, ``OpSchema``,
  ``DTensorSpec``): ShardTensor reuses DTensor's per-op sharding rules instead of
  restating them; there is no public entry point to them.
- Functional collectives (``torch.distributed._functional_collectives``): the only
  collectives torch.compile can trace.
- A ``Partial`` subclass's own reduction (``_NormPartial._reduce_value``).
- The subclass plumbing every wrapper tensor needs (``_make_wrapper_subclass``,
  ``_disabled_torch_function_impl``, ``DisableTorchFunctionSubclass``).
"""

from __future__ import annotations

from typing import Any

import torch
from torch.distributed.device_mesh import DeviceMesh

__all__ = [
    "NoTorchFunction",
    "are_we_tracing",
    "current_mesh",
    "disabled_torch_function",
    "dtensor_spec",
    "has_composite_implicit",
    "is_norm_partial",
    "make_wrapper_subclass",
    "mesh_stable_hash",
    "new_wrapper",
    "no_torch_function",
    "propagate",
    "raw_op",
    "reduce_partial_value",
    "schema_info",
    "scalar_shape_adjusted",
    "shape_arg_index",
    "view_dim_map",
]

# Skips Python-level __torch_function__ for a subclass, so property reads (shape,
# requires_grad, grad_fn) stay in C++ and every operator reaches
# __torch_dispatch__, as DTensor does.
disabled_torch_function: Any = torch._C._disabled_torch_function_impl


def no_torch_function() -> Any:
    """A context in which tensor subclasses' ``__torch_function__`` is skipped."""
    return torch._C.DisableTorchFunctionSubclass()


# The same context as a class, and the wrapper constructor, for the per-op hot path (no frame).
# OpOverload._op is the C++ callable OpOverload.__call__ forwards to.
NoTorchFunction: Any = torch._C.DisableTorchFunctionSubclass
new_wrapper: Any = torch.Tensor._make_wrapper_subclass  # type: ignore[attr-defined]


def raw_op(op: Any) -> Any:
    """The callable behind an OpOverload (saves a Python frame per call), or ``op`` itself."""
    return getattr(op, "_op", op)


def make_wrapper_subclass(
    cls: type[torch.Tensor],
    shape: tuple[int, ...],
    stride: tuple[int, ...],
    *,
    dtype: torch.dtype,
    device: torch.device,
    requires_grad: bool,
) -> Any:
    """A storage-less tensor of ``cls`` whose metadata is the global shape and stride."""
    # The documented way to build a wrapper subclass, but still an underscored API.
    return torch.Tensor._make_wrapper_subclass(  # type: ignore[attr-defined]
        cls, shape, strides=stride, dtype=dtype, device=device, requires_grad=requires_grad
    )


def current_mesh() -> DeviceMesh | None:
    """The mesh of the innermost active ``with mesh:`` block in this thread, or None."""
    from torch.distributed.device_mesh import _mesh_resources

    try:
        mesh: DeviceMesh = _mesh_resources.get_current_mesh()
    except RuntimeError:  # "No device mesh is currently active!"
        return None
    return mesh


def mesh_stable_hash(mesh: DeviceMesh) -> str:
    """A process-independent description of ``mesh`` (DeviceMesh._stable_hash where it exists)."""
    stable = getattr(mesh, "_stable_hash", None)  # torch 2.12+
    if stable is not None:
        return str(stable())
    return repr((mesh.device_type, mesh.mesh.tolist(), mesh.mesh_dim_names))


# -- DTensor's sharding propagation -----------------------------------------------------------


def _propagator() -> Any:
    from torch.distributed.tensor import DTensor

    return DTensor._op_dispatcher.sharding_propagator


def dtensor_spec(
    mesh: DeviceMesh,
    placements: tuple[Any, ...],
    shape: tuple[int, ...],
    stride: tuple[int, ...],
    dtype: torch.dtype,
) -> Any:
    """A DTensorSpec with tensor metadata (the argument type of DTensor's sharding rules)."""
    from torch.distributed.tensor._dtensor_spec import DTensorSpec, TensorMeta

    return DTensorSpec(mesh, placements, tensor_meta=TensorMeta(torch.Size(shape), stride, dtype))


def is_dtensor_spec(obj: object) -> bool:
    from torch.distributed.tensor._dtensor_spec import DTensorSpec

    return isinstance(obj, DTensorSpec)


def _runtime_schema_info(op: Any) -> Any:
    """DTensor's RuntimeSchemaInfo for ``op``, wherever its propagator registered it (None: none).

    torch 2.12+ keeps ops with a single-dim strategy (``_to_copy`` among them) in a second
    table (read with getattr: older torch has only the first); checked on torch 2.13.
    """
    prop = _propagator()
    info = prop.op_to_schema_info.get(op)
    if info is None:
        single = getattr(prop, "op_to_schema_info_for_single_dim_strategy", None)  # 2.12+
        info = single.get(op) if single is not None else None
    return info


def schema_info(op: Any) -> tuple[int, frozenset[str] | None] | None:
    """DTensor's ``(static_argnum, static_kwargkey)`` for ``op``: which non-tensor arguments
    can change its sharding (None: all of them)."""
    info = _runtime_schema_info(op)
    if info is None:
        return None
    keys = info.static_kwargkey
    return info.static_argnum, (frozenset(keys) if keys is not None else None)


def propagate(op: Any, args_schema: tuple[Any, ...], kwargs_schema: dict[str, Any]) -> Any:
    """DTensor's OutputSharding for ``op`` on arguments whose tensors are DTensorSpecs.

    Raises:
        NotImplementedError: DTensor has no sharding rule for ``op``.
    """
    from torch.distributed.tensor._op_schema import OpSchema

    prop = _propagator()
    # The schema info from either table: without it DTensor's cache key leaves out the
    # static keyword arguments, so x.to(float32) and then x.to(bfloat16) on one layout
    # met one entry and the second got the first's output dtype (its cache is per
    # thread: seen where one thread runs many tests, torchrun and kept spawned ranks).
    schema = OpSchema(op, args_schema, kwargs_schema, schema_info=_runtime_schema_info(op))
    # Skip DTensor's cache where it could answer for another call: symbolic shapes are not
    # hashable, and its key leaves out non-static arguments, so ``x * 2`` and ``x * 2.0``
    # meet one entry and the second gets the first's output dtype (DTensor itself takes
    # the dtype from the local result; a plan takes it from here). Callers cache plans.
    if are_we_tracing() or any(type(a) in _NUMBERS for a in (*args_schema, *kwargs_schema.values())):
        return prop.propagate_op_sharding_non_cached(schema)
    return prop.propagate_op_sharding(schema)


_NUMBERS = (int, float, bool, complex)


def shape_arg_index(op: Any) -> int | tuple[int, int] | None:
    """Where ``op`` takes a global shape (and stride) that must become local (view, expand, new_*)."""
    index: int | tuple[int, int] | None = _propagator().op_to_shape_and_stride_idx.get(op)
    return index


def scalar_shape_adjusted(op: Any) -> bool:
    """Whether DTensor rewrites scalar size arguments of ``op`` (group_norm's N, C, HxW; 2.12+)."""
    adjusters = getattr(_propagator(), "op_to_scalar_shape_adjuster", {})
    return op in adjusters


def has_composite_implicit(op: Any) -> bool:
    """Whether ``op`` decomposes into other ops (``op.decompose`` then works)."""
    return bool(
        torch._C._dispatch_has_kernel_for_dispatch_key(
            op.name(), torch._C.DispatchKey.CompositeImplicitAutograd
        )
    )


# -- placements -------------------------------------------------------------------------------


def is_norm_partial(placement: object) -> bool:
    """Whether ``placement`` is DTensor's pending p-norm (``_NormPartial``)."""
    from torch.distributed.tensor._ops._math_ops import _NormPartial

    return isinstance(placement, _NormPartial)


def reduce_partial_value(
    placement: Any, tensor: torch.Tensor, mesh: DeviceMesh, mesh_dim: int
) -> torch.Tensor:
    """A Partial subclass's own reduction over ``mesh_dim`` (one all_reduce)."""
    result: torch.Tensor = placement._reduce_value(tensor, mesh, mesh_dim)
    return result


# -- tracing and functional collectives -------------------------------------------------------


def are_we_tracing() -> bool:
    """Whether torch.compile (Dynamo, AOTAutograd) or make_fx is tracing the current code."""
    from torch.distributed._functional_collectives import _are_we_tracing

    return bool(_are_we_tracing())


def view_dim_map(from_shape: tuple[int, ...], to_shape: tuple[int, ...]) -> list[tuple[Any, ...]]:
    """For each output dim of a view, where it comes from (DTensor's ``view_groups``), as tuples:

    ``("in", d)``: input dim ``d``; ``("flat", (d0, d1, ...))``: those input dims
    flattened; ``("split", source, group_shape, index)``: piece ``index`` of
    ``source`` (an "in" or "flat" tuple) split into ``group_shape``; ``("one",)``: a new
    size-1 dim.
    """
    from torch.distributed.tensor._ops import _view_ops as views

    def convert(spec: Any) -> tuple[Any, ...]:
        if isinstance(spec, views.InputDim):
            return ("in", spec.input_dim)
        if isinstance(spec, views.Flatten):
            inner = [convert(s) for s in spec.input_dims]
            dims = tuple(d for kind, *rest in inner if kind == "in" for d in rest)
            if len(dims) != len(inner):
                return ("other",)
            return ("flat", dims)
        if isinstance(spec, views.Split):
            return ("split", convert(spec.input_dim), tuple(spec.group_shape), spec.split_id)
        if isinstance(spec, views.Singleton):
            return ("one",)
        return ("other",)

    return [convert(s) for s in views.view_groups(from_shape, to_shape)]


def funcol() -> Any:
    """torch's functional collectives (traceable by torch.compile), as a module."""
    import torch.distributed._functional_collectives as functional

    return functional
