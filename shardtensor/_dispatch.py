"""Operators on ShardTensors: DTensor's sharding rules, applied to per-rank (uneven) layouts.

For every aten operator that reaches ``ShardTensor.__torch_dispatch__`` (below
autograd, so backward formulas come here too), a *plan* is made once per layout and
cached:

1. DTensor's sharding propagation (the rules DTensor itself runs) is asked, with
   each ShardTensor's placements and global metadata, which placements the inputs
   need and which the outputs get.
2. Inputs are aligned: DTensor assumes torch.chunk's layout everywhere, so two
   inputs sharded on the same mesh dim are compatible to it whatever their sizes.
   Here every input sharded on a mesh dim takes the sizes of the first input that
   already is (the leader), so uneven shards line up element for element.
3. Output sizes follow the input sharded on the same mesh dim: the same sizes where
   the sharded extents agree (pointwise, reductions over other dims, transposes,
   matmul's free dims), scaled where a view merges or splits the sharded dim.
   Arguments that carry a global shape (view, expand, new_zeros) get this rank's
   local shape.
4. Where a layout cannot be represented this way (DTensor asks for a placement
   shardtensor does not model, such as ``_StridedShard``, or a size does not divide),
   every input is made ``Replicate`` first and the op runs on whole tensors.

``mean`` over a sharded dim is a local sum divided by the global count, a
``Partial("sum")``: DTensor's ``Partial("avg")`` would weight uneven (and empty)
shards wrongly. A plan depends only on specs and the non-tensor arguments DTensor
declares as affecting sharding, so the steady state is one dict lookup per op.
"""

from __future__ import annotations

import dataclasses
import threading
import warnings
from collections.abc import Callable, Sequence
from fractions import Fraction
from typing import Any, cast

import torch
from torch.distributed.tensor import Partial, Replicate, Shard
from torch.distributed.tensor.placement_types import Placement

from shardtensor import _redistribute, _torch_private
from shardtensor._spec import ShardTensorSpec, chunk_sizes, contiguous_stride, make_spec
from shardtensor._views import VIEW_OPS, view_layouts

__all__ = ["dispatch", "plan_cache_clear"]

aten = torch.ops.aten

_MEAN_AS_SUM = {
    aten.mean.default: aten.sum.default,
    aten.mean.dim: aten.sum.dim_IntList,
}


# Uninitialized factories: a result of the input's own shape takes the input's layout
# (shard sizes and pending Partial included), since its memory is about to be
# overwritten. Autograd stores a leaf's gradient that way (``clone_obey_contract``:
# new_empty_strided, then copy_). DTensor's rules in torch 2.13, 2.14 and 2.15 say the
# same; torch 2.11's make new_empty_strided Replicate where the input is Partial or its
# sharded extent does not divide evenly, which turned a leaf's sharded gradient into a
# gathered one, and only on the ranks where autograd could not take the gradient as is.
_UNINITIALIZED_FACTORIES = frozenset({aten.new_empty.default, aten.new_empty_strided.default})


class _Unrepresentable(Exception):
    """DTensor's plan asks for a layout a ShardTensorSpec cannot describe."""


@dataclasses.dataclass(frozen=True, slots=True)
class _Plan:
    """What one op does on one combination of input layouts (cached)."""

    op: Any  # the op run on local tensors (its C++ callable where torch exposes one)
    targets: tuple[ShardTensorSpec | None, ...]  # per tensor slot: the spec it moves to (None: stays)
    outputs: Any  # a ShardTensorSpec, a tuple/list of them (or None), or None
    shape_arg: tuple[int, tuple[int, ...], tuple[int, ...] | None] | None  # (index, local shape, stride)
    positions: tuple[int, ...] | None  # where the tensors are, when all are positional arguments
    rewritten_args: tuple[Any, ...] | None  # DTensor's rewrite of the non-tensor args (squeeze)
    divide_by: int | None  # mean: the global count the local sum is divided by
    inplace: bool
    # A max/min left pending (Partial): what a rank with an empty shard contributes
    # (torch refuses to reduce an empty dim; the reduction's identity is the right value).
    empty_identity: float | int | bool | None = None
    # Nothing but the op: positional shards that stay, one tensor result (the hot path).
    simple: bool = False


@dataclasses.dataclass(frozen=True)
class _Decompose:
    """``op`` has no sharding rule but decomposes into ops that have."""


_PLANS: dict[Any, _Plan | _Decompose] = {}
_PLANS_LIMIT = 8192
_plans_lock = threading.Lock()


def plan_cache_clear() -> None:
    """Forget every cached plan (specs hold meshes; tests that make many meshes may call this)."""
    with _plans_lock:
        _PLANS.clear()


# -- arguments: where the tensors are -----------------------------------------------------------


def _leaves(args: tuple[Any, ...], kwargs: dict[str, Any]) -> list[Any]:
    """Every argument, with lists/tuples that hold tensors opened one level (DTensor's order)."""
    out: list[Any] = []
    for a in (*args, *kwargs.values()):
        if isinstance(a, (list, tuple)) and any(isinstance(x, torch.Tensor) for x in a):
            out.extend(a)
        else:
            out.append(a)
    return out


def _rebuild(args: tuple[Any, ...], kwargs: dict[str, Any], fn: Callable[[Any], Any]) -> tuple[Any, Any]:
    """``args``/``kwargs`` with every tensor (one list level deep) replaced by ``fn(tensor)``."""

    def one(a: Any) -> Any:
        if isinstance(a, torch.Tensor):
            return fn(a)
        if isinstance(a, (list, tuple)) and any(isinstance(x, torch.Tensor) for x in a):
            return type(a)(fn(x) if isinstance(x, torch.Tensor) else x for x in a)
        return a

    return tuple(one(a) for a in args), {k: one(v) for k, v in kwargs.items()}


def _hashable(value: Any) -> Any:
    """A static argument as part of a plan key: scalars with their type (``2`` and ``2.0`` are
    equal keys but promote differently), lists and tuples as tuples of their parts."""
    kind = type(value)
    if kind in _SCALARS:
        return (kind, value)
    if kind is list or kind is tuple:
        if _INTS.issuperset(map(type, value)):
            return tuple(value)  # dims and sizes: the common case
        return tuple(_hashable(v) for v in value)
    if isinstance(value, torch.Tensor):  # a tensor inside a constant list: only its shape matters
        return ("tensor", tuple(value.shape), value.dtype)
    return value


_SCHEMA_INFO: dict[int, tuple[int, frozenset[str] | None]] = {}


def _static_args(op: Any) -> tuple[int, frozenset[str] | None]:
    """DTensor's (static_argnum, static_kwargkey) for ``op``, looked up once per op."""
    found = _SCHEMA_INFO.get(id(op))
    if found is None:
        info = _torch_private.schema_info(op)
        found = info if info is not None else (0, None)
        _SCHEMA_INFO[id(op)] = found
    return found


class _Plain(Exception):
    """A plain tensor with dims among the arguments: promote it, then make the key again."""


_SCALARS = (int, float, bool, type(None), str)
_INTS = frozenset({int})


def _key(op: Any, args: tuple[Any, ...], kwargs: dict[str, Any], cls: type) -> tuple[Any, ...]:
    """The plan cache key: specs, plus the non-tensor arguments that can change a plan.

    Raises:
        _Plain: a plain tensor with dims is an argument (it must be promoted first).
    """
    info = _SCHEMA_INFO.get(id(op))
    static_argnum, static_keys = info if info is not None else _static_args(op)
    # The mesh object itself is part of the key, not just an equal one: a plan's output
    # specs hold the mesh they were made with, and an equal mesh of an earlier world
    # (simulated ranks reuse threads) would hand back its process groups. The cache keeps
    # the object alive, so its id cannot be reused by another mesh while the plan exists.
    mesh_id = None
    parts: list[Any] = [id(op)]  # ops live as long as the process; an int hashes in C
    for i, a in enumerate(args):
        kind = type(a)
        if kind is cls:
            spec = a._spec  # type: ignore[attr-defined]
            if mesh_id is None:
                mesh_id = id(spec.mesh)
            parts.append(spec)
        elif kind in _SCALARS:
            # the type always: 2 and 2.0 (or True and 1) are equal keys but promote differently
            parts.append((kind, a) if i >= static_argnum else kind)
        elif kind is list and i >= static_argnum and _INTS.issuperset(map(type, a)):
            parts.append(tuple(a))  # dims and sizes: the common non-tensor argument
        else:
            parts.append(_key_part(a, cls, i >= static_argnum))
    for k, v in kwargs.items():
        parts.append((k, _key_part(v, cls, static_keys is None or k in static_keys)))
    parts.append(mesh_id if mesh_id is not None else _first_mesh_id(parts))
    return tuple(parts)


def _first_mesh_id(parts: Any) -> int | None:
    """The id of the first spec's mesh, ShardTensors being only in lists or keyword arguments."""
    for p in parts:
        if isinstance(p, ShardTensorSpec):
            return id(p.mesh)
        if isinstance(p, tuple):
            found = _first_mesh_id(p)
            if found is not None:
                return found
    return None


def _key_part(a: Any, cls: type, static: bool) -> Any:
    kind = type(a)
    if kind in _SCALARS:
        return (kind, a) if static else kind
    if isinstance(a, cls):
        return a._spec  # type: ignore[attr-defined]
    if isinstance(a, torch.Tensor):
        if a.ndim:
            raise _Plain
        return ("scalar", a.dtype)
    if kind is list or kind is tuple:
        for x in a:
            if isinstance(x, torch.Tensor):
                return tuple(_key_part(y, cls, static) for y in a)
    if static:
        return _hashable(a)
    return kind


# -- the entry point ----------------------------------------------------------------------------


def dispatch(
    op: Any,
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    cls: type,
    promote: Callable[[torch.Tensor, Any, Any], Any],
) -> Any:
    """Run ``op`` on ShardTensor arguments; returns ShardTensors with correct per-rank specs.

    ``cls`` is the ShardTensor class and ``promote(tensor, mesh, op)`` makes a plain
    tensor one (by the promotion mode): shardtensor._tensor, which defines both,
    passes them (it imports this module).
    """
    try:
        key = _key(op, args, kwargs, cls)
    except _Plain:
        args, kwargs = _promote_plain(op, args, kwargs, cls, promote)
        key = _key(op, args, kwargs, cls)
    plan = _PLANS.get(key)
    if plan is None:
        if op is aten._local_scalar_dense.default:
            return _local_scalar(args[0])
        plan = _make_plan(op, args, kwargs, cls)
        with _plans_lock:
            if len(_PLANS) >= _PLANS_LIMIT:
                _PLANS.clear()
            _PLANS[key] = plan
    if type(plan) is _Decompose:
        return op.decompose(*args, **kwargs)
    plan = cast(_Plan, plan)
    if plan.simple:  # the common case: shards in place, one result in a known layout
        local_args = list(args)
        for i in plan.positions:  # type: ignore[union-attr]
            a = args[i]
            if isinstance(a, cls):
                local_args[i] = a._local_tensor  # type: ignore[attr-defined]
        result = plan.op(*local_args, **kwargs)
        out = plan.outputs
        if result.shape != out.local_shape or result.dtype != out.dtype:
            _wrong_layout(op, result, out)
        return _wrap_local(cls, result, out)
    return _run(plan, args, kwargs, cls)


_new_wrapper = _torch_private.new_wrapper


def _wrap_local(cls: type, local: torch.Tensor, spec: ShardTensorSpec) -> Any:
    """``cls(local, spec)`` for a result whose local shape the caller has checked (the op hot path)."""
    wrapped = _new_wrapper(cls, spec.shape, strides=spec.stride, dtype=spec.dtype, device=local.device)
    wrapped._local_tensor = local
    wrapped._spec = spec
    return wrapped


def _run(plan: _Plan, args: tuple[Any, ...], kwargs: dict[str, Any], cls: type) -> Any:
    if plan.positions is not None:  # every tensor is a positional argument: no rebuilding
        local_list = list(args)
        for i, target in zip(plan.positions, plan.targets):
            a = args[i]
            if isinstance(a, cls):
                value = a._local_tensor  # type: ignore[attr-defined]
                local_list[i] = (
                    value if target is None else _redistribute.redistribute_local(value, a._spec, target)  # type: ignore[attr-defined]
                )
        local_args, local_kwargs = tuple(local_list), kwargs
    else:
        local_args, local_kwargs = _localize(plan, args, kwargs, cls)
    if plan.rewritten_args is not None:
        local_args = _with_tensors(plan.rewritten_args, local_args)
    if plan.shape_arg is not None:
        index, shape, stride = plan.shape_arg
        replaced = list(local_args)
        replaced[index] = list(shape)
        if stride is not None:
            replaced[index + 1] = list(stride)
        local_args = tuple(replaced)
    if plan.empty_identity is not None and local_args[0].numel() == 0:
        out_spec = plan.outputs
        result = torch.full(
            out_spec.local_shape, plan.empty_identity, dtype=out_spec.dtype, device=local_args[0].device
        )
    else:
        result = plan.op(*local_args, **local_kwargs)
    if plan.divide_by is not None:
        result = result / plan.divide_by if plan.divide_by else result * float("nan")
    if plan.inplace:
        return args[0]
    out = plan.outputs
    if isinstance(result, torch.Tensor) and isinstance(out, ShardTensorSpec):
        if result.shape != out.local_shape or result.dtype != out.dtype:
            _wrong_layout(plan.op, result, out)
        return _wrap_local(cls, result, out)
    return _wrap(result, out, cls, plan.op)


def _localize(
    plan: _Plan, args: tuple[Any, ...], kwargs: dict[str, Any], cls: type
) -> tuple[tuple[Any, ...], dict[str, Any]]:
    targets = iter(plan.targets)

    def local(t: torch.Tensor) -> torch.Tensor:
        target = next(targets)
        if not isinstance(t, cls):
            return t
        value = t._local_tensor  # type: ignore[attr-defined]
        if target is None:
            return value  # type: ignore[no-any-return]
        return _redistribute.redistribute_local(value, t._spec, target)  # type: ignore[attr-defined]

    return _rebuild(args, kwargs, local)


def _wrong_layout(op: Any, result: torch.Tensor, spec: ShardTensorSpec) -> None:
    name = getattr(op, "__name__", "") or str(op)  # a C++ callable's repr names no op
    raise RuntimeError(
        f"shardtensor: {name} gave a local result of shape {tuple(result.shape)} and dtype {result.dtype} "
        f"on this rank, but the output layout {spec} expects {spec.local_shape} and {spec.dtype}; this "
        "is a bug in shardtensor's plan for this op, please report it with the input layouts"
    )


def _with_tensors(rewritten: tuple[Any, ...], local_args: tuple[Any, ...]) -> tuple[Any, ...]:
    """DTensor's rewritten non-tensor arguments, with this call's local tensors in place."""
    tensors = iter(a for a in _leaves(local_args, {}) if isinstance(a, torch.Tensor))
    return tuple(next(tensors) if _torch_private.is_dtensor_spec(a) else a for a in rewritten)


def _wrap(result: Any, spec: Any, cls: type, op: Any) -> Any:
    if isinstance(result, torch.Tensor):
        if spec is None:
            return result
        if result.shape != spec.local_shape or result.dtype != spec.dtype:
            _wrong_layout(op, result, spec)
        return _wrap_local(cls, result, spec)
    if isinstance(result, (list, tuple)):
        specs = spec if isinstance(spec, (list, tuple)) else [spec] * len(result)
        wrapped = [_wrap(r, s, cls, op) for r, s in zip(result, specs)]
        return tuple(wrapped) if isinstance(result, tuple) else wrapped
    return result


def _local_scalar(tensor: Any) -> Any:
    """``.item()``: the value every rank agrees on (a Partial scalar is reduced first)."""
    spec = tensor._spec
    if any(not isinstance(p, Replicate) for p in spec.placements):
        replicated = make_spec(spec.mesh, (Replicate(),) * spec.mesh.ndim, spec.shape, spec.dtype, {})
        return _redistribute.redistribute_local(tensor._local_tensor, spec, replicated).item()
    return tensor._local_tensor.item()


# -- plain tensors meeting ShardTensors ---------------------------------------------------------


def _promote_plain(
    op: Any,
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    cls: type,
    promote: Callable[[torch.Tensor, Any, Any], Any],
) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """Plain tensors with dims become Replicate ShardTensors (by the promotion mode); 0-dim ones stay."""
    leaves = _leaves(args, kwargs)
    plain = [a for a in leaves if isinstance(a, torch.Tensor) and not isinstance(a, cls) and a.ndim > 0]
    if not plain:
        return args, kwargs
    mesh = next(_spec_of(a) for a in leaves if isinstance(a, cls)).mesh
    return _rebuild(args, kwargs, lambda t: t if isinstance(t, cls) or t.ndim == 0 else promote(t, mesh, op))


# -- making a plan ------------------------------------------------------------------------------


def _spec_of(tensor: Any) -> ShardTensorSpec:
    spec: ShardTensorSpec = tensor._spec
    return spec


def _make_plan(op: Any, args: tuple[Any, ...], kwargs: dict[str, Any], cls: type) -> _Plan | _Decompose:
    specs = [_spec_of(a) if isinstance(a, cls) else None for a in _leaves(args, kwargs)]
    tensors = [a for a in _leaves(args, kwargs) if isinstance(a, torch.Tensor)]
    mesh = next(s.mesh for s in specs if s is not None)
    for s in specs:
        if s is not None and s.mesh != mesh:
            raise ValueError(
                f"{op}: ShardTensor arguments live on different meshes ({mesh} and {s.mesh}); "
                "redistribute them onto one mesh first"
            )
    in_specs = [_spec_of(a) if isinstance(a, cls) else None for a in tensors]
    try:
        return _plan_for(op, args, kwargs, in_specs, replicate=False)
    except _Unrepresentable:
        return _plan_for(op, args, kwargs, in_specs, replicate=True)
    except NotImplementedError:
        if _torch_private.has_composite_implicit(op):
            return _Decompose()
        raise


def _plan_for(
    op: Any,
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    in_specs: list[ShardTensorSpec | None],
    *,
    replicate: bool,
) -> _Plan:
    mesh = next(s.mesh for s in in_specs if s is not None)
    coordinate = next(s.coordinate for s in in_specs if s is not None)
    starting = [_replicated(s) if (replicate and s is not None) else s for s in in_specs]
    prop_op = _MEAN_AS_SUM.get(op, op) if _mean_is_float(op, in_specs, kwargs) else op
    tensors = iter(a for a in _leaves(args, kwargs) if isinstance(a, torch.Tensor))
    start_iter = iter(starting)

    def to_dspec(t: torch.Tensor) -> Any:
        next(tensors)
        s = next(start_iter)
        if s is None:  # a 0-dim plain tensor: a replicated scalar, as DTensor treats it
            return _torch_private.dtensor_spec(
                mesh, (Replicate(),) * mesh.ndim, tuple(t.shape), tuple(t.stride()), t.dtype
            )
        return _torch_private.dtensor_spec(mesh, s.placements, s.shape, s.stride, s.dtype)

    run_op, rewritten = prop_op, None
    if op in VIEW_OPS and starting[0] is not None:
        source, outputs = view_layouts(starting[0], args[1])
        targets: list[ShardTensorSpec | None] = [in_specs[0] if in_specs[0] == source else source]
    elif op in _UNINITIALIZED_FACTORIES and starting[0] is not None and _same_shape(args[1], starting[0]):
        targets = [starting[0]]
        outputs = _uninitialized_like(op, args, kwargs, starting[0])
    else:
        args_schema, kwargs_schema = _rebuild(args, kwargs, to_dspec)
        sharding = _torch_private.propagate(prop_op, args_schema, kwargs_schema)
        suggested = sharding.redistribute_schema if sharding.needs_redistribute else None
        wanted = _suggested_placements(suggested, starting)
        targets = _align(starting, wanted, in_specs)
        if suggested is not None and suggested.op is not prop_op:  # e.g. squeeze -> squeeze.dims
            run_op, rewritten = suggested.op, tuple(suggested.args_schema)
        if _torch_private.scalar_shape_adjusted(op) and any(t is not None and _is_uneven(t) for t in targets):
            raise _Unrepresentable(f"{op} rewrites size arguments for torch.chunk layouts only")
        _check_no_pending_indices(op, sharding.output_spec)
        outputs = _output_specs(sharding.output_spec, targets, mesh, coordinate, op)
    shape_arg = _local_shape_arg(prop_op, outputs, args)
    inplace = _is_inplace(op)
    if inplace:
        _check_inplace(op, in_specs, targets, outputs)
    if _is_out_variant(op):
        raise NotImplementedError(f"{op}: out= variants are not supported on ShardTensors")
    divide_by = _mean_count(op, args, kwargs, in_specs[0]) if prop_op is not op else None
    moves = tuple(None if t is None or t == s else t for t, s in zip(targets, in_specs))
    positions = _positions(args, kwargs)
    identity = _empty_identity(outputs)
    simple = (
        positions is not None
        and all(t is None for t in moves)
        and (rewritten, shape_arg, divide_by, identity) == (None, None, None, None)
        and not inplace
        and isinstance(outputs, ShardTensorSpec)
        and _returns_one_tensor(run_op)
    )
    return _Plan(
        _torch_private.raw_op(run_op),
        moves,
        outputs,
        shape_arg,
        positions,
        rewritten,
        divide_by,
        inplace,
        identity,
        simple,
    )


def _same_shape(size: Sequence[int], spec: ShardTensorSpec) -> bool:
    return tuple(size) == tuple(spec.shape)


def _uninitialized_like(
    op: Any, args: tuple[Any, ...], kwargs: dict[str, Any], spec: ShardTensorSpec
) -> ShardTensorSpec:
    """The spec of ``new_empty``/``new_empty_strided`` of ``spec``'s own shape: its layout."""
    dtype = kwargs.get("dtype") or spec.dtype
    stride = tuple(args[2]) if op is aten.new_empty_strided.default else contiguous_stride(spec.shape)
    sizes = {m: s for m, s in enumerate(spec.shard_sizes) if s is not None}
    return make_spec(spec.mesh, spec.placements, spec.shape, dtype, sizes, stride, spec.coordinate)


def _returns_one_tensor(op: Any) -> bool:
    returns = op._schema.returns
    return len(returns) == 1 and str(returns[0].type) == "Tensor"


def _empty_identity(outputs: Any) -> float | int | bool | None:
    """The identity of a pending max or min (its value on a rank whose shard is empty)."""
    if not isinstance(outputs, ShardTensorSpec):
        return None
    ops = {p.reduce_op for p in outputs.placements if type(p) is Partial}
    if ops not in ({"max"}, {"min"}):
        return None
    largest = "min" in ops
    dtype = outputs.dtype
    if dtype is torch.bool:
        return largest
    if dtype.is_floating_point:
        return float("inf") if largest else float("-inf")
    info = torch.iinfo(dtype)
    return info.max if largest else info.min


def _positions(args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[int, ...] | None:
    """The indices of tensor arguments, if every tensor is a positional argument (not in a list)."""
    if any(isinstance(v, torch.Tensor) for v in _leaves((), kwargs)):
        return None
    positions = []
    for i, a in enumerate(args):
        if isinstance(a, torch.Tensor):
            positions.append(i)
        elif isinstance(a, (list, tuple)) and any(isinstance(x, torch.Tensor) for x in a):
            return None
    return tuple(positions)


def _replicated(spec: ShardTensorSpec) -> ShardTensorSpec:
    return make_spec(
        spec.mesh, (Replicate(),) * spec.mesh.ndim, spec.shape, spec.dtype, {}, spec.stride, spec.coordinate
    )


def _suggested_placements(
    suggested: Any, starting: list[ShardTensorSpec | None]
) -> list[tuple[Placement, ...] | None]:
    """The placements DTensor wants for each tensor slot (None: a plain scalar, left alone)."""
    if suggested is None:
        return [s.placements if s is not None else None for s in starting]
    found = [
        a
        for a in _leaves(tuple(suggested.args_schema), dict(suggested.kwargs_schema))
        if _torch_private.is_dtensor_spec(a)
    ]
    if len(found) != len(starting):
        raise _Unrepresentable("DTensor's suggestion has a different number of tensors")
    return [tuple(f.placements) if s is not None else None for f, s in zip(found, starting)]


def _check_placement(p: Placement, what: str) -> None:
    if isinstance(p, Replicate):
        return
    if isinstance(p, Shard):
        if type(p) is not Shard:  # _StridedShard: a layout a spec does not describe
            raise _Unrepresentable(f"{what} is {p!r}")
        return
    if isinstance(p, Partial):
        if type(p) is Partial and p.reduce_op in ("sum", "max", "min", "avg"):
            return
        if _torch_private.is_norm_partial(p):
            return
    raise _Unrepresentable(f"{what} is {p!r}")


def _align(
    starting: list[ShardTensorSpec | None],
    wanted: list[tuple[Placement, ...] | None],
    current: list[ShardTensorSpec | None],
) -> list[ShardTensorSpec | None]:
    """Target specs: DTensor's placements, with the sizes of the leader on each Shard mesh dim."""
    present = [(i, s, w) for i, (s, w) in enumerate(zip(starting, wanted)) if s is not None and w is not None]
    if not present:
        return list(starting)
    mesh = present[0][1].mesh
    sizes: dict[int, list[tuple[int, ...] | None]] = {i: [None] * mesh.ndim for i, _, _ in present}
    for m in range(mesh.ndim):
        sharded = [(i, s, w[m]) for i, s, w in present if isinstance(w[m], Shard)]
        for _, _, w in present:
            _check_placement(w[m], f"the placement DTensor asks of an input on mesh dim {m}")
        leader = next(((s, p) for _, s, p in sharded if s.placements[m] == p), None)
        for i, s, p in sharded:
            extent = s.shape[p.dim]  # type: ignore[attr-defined]
            if leader is not None and leader[0].shape[leader[1].dim] == extent:  # type: ignore[attr-defined]
                sizes[i][m] = leader[0].shard_sizes[m]
            elif s.placements[m] == p:
                sizes[i][m] = s.shard_sizes[m]
            else:
                sizes[i][m] = chunk_sizes(extent, mesh.size(m))
    targets = list(starting)
    for i, s, w in present:
        spec = make_spec(
            mesh,
            w,
            s.shape,
            s.dtype,
            {m: v for m, v in enumerate(sizes[i]) if v is not None},
            s.stride,
            s.coordinate,
        )
        original = current[i]
        targets[i] = original if original == spec else spec
    return targets


# Ops returning (values, indices) whose indices index the reduced dim.
_WITH_INDICES = frozenset({aten.max.dim, aten.min.dim})


def _check_no_pending_indices(op: Any, out: Any) -> None:
    """Refuse a plan that leaves indices pending: each rank's are local to its shard.

    torch 2.11's DTensor rule for max.dim and min.dim over a sharded dim gives the
    indices ``Partial("max")`` like the values, which combines positions of different
    shards (and fails on an empty shard); torch 2.13, 2.14 and 2.15 gather the reduced
    dim first, as the replicated plan this raise leads to does.

    Raises:
        _Unrepresentable: ``op`` returns indices and DTensor leaves them pending.
    """
    if op not in _WITH_INDICES or not isinstance(out, (list, tuple)) or len(out) < 2:
        return
    if out[1] is not None and any(isinstance(p, Partial) for p in out[1].placements):
        raise _Unrepresentable(f"{op} leaves its indices pending ({tuple(out[1].placements)})")


def _is_uneven(spec: ShardTensorSpec) -> bool:
    return any(
        sizes is not None and sizes != chunk_sizes(spec.shape[p.dim], spec.mesh.size(m))  # type: ignore[attr-defined]
        for m, (p, sizes) in enumerate(zip(spec.placements, spec.shard_sizes))
    )


def _output_specs(
    out: Any, targets: list[ShardTensorSpec | None], mesh: Any, coordinate: tuple[int, ...], op: Any
) -> Any:
    if out is None:
        return None
    if isinstance(out, (list, tuple)):
        return type(out)(_output_specs(o, targets, mesh, coordinate, op) for o in out)
    placements = tuple(out.placements)
    for m, p in enumerate(placements):
        _check_placement(p, f"the output placement of {op} on mesh dim {m}")
    meta = out.tensor_meta
    shape = tuple(meta.shape)
    sizes: dict[int, tuple[int, ...]] = {}
    for m, p in enumerate(placements):
        if isinstance(p, Shard):
            sizes[m] = _output_sizes(m, shape[p.dim], targets)
    return make_spec(mesh, placements, shape, meta.dtype, sizes, tuple(meta.stride), coordinate)


def _output_sizes(mesh_dim: int, extent: int, targets: list[ShardTensorSpec | None]) -> tuple[int, ...]:
    """The output's sizes on ``mesh_dim``: those of an input sharded there, scaled if the extent changed."""
    sources = [
        (t.shard_sizes[mesh_dim], t.shape[t.placements[mesh_dim].dim])  # type: ignore[attr-defined]
        for t in targets
        if t is not None and isinstance(t.placements[mesh_dim], Shard)
    ]
    for sizes, source_extent in sources:
        if source_extent == extent and sizes is not None:
            return sizes
    if len({s for s, _ in sources}) == 1 and sources[0][0] is not None and sources[0][1] > 0:
        ratio = Fraction(extent, sources[0][1])
        scaled = [s * ratio for s in sources[0][0]]
        if all(x.denominator == 1 for x in scaled):
            return tuple(int(x) for x in scaled)
    raise _Unrepresentable(f"no input's sizes give the output's on mesh dim {mesh_dim}")


def _local_shape_arg(
    op: Any, outputs: Any, args: tuple[Any, ...]
) -> tuple[int, tuple[int, ...], tuple[int, ...] | None] | None:
    """For view/expand/new_*: the shape argument this rank passes (its local shape)."""
    index = _torch_private.shape_arg_index(op)
    if index is None or not isinstance(outputs, ShardTensorSpec):
        return None
    if not any(isinstance(p, Shard) for p in outputs.placements):
        return None
    local = outputs.local_shape
    if local is None:
        raise _Unrepresentable("unknown local shape")
    if isinstance(index, tuple):
        return index[0], local, contiguous_stride(local)
    return index, local, None


def _is_inplace(op: Any) -> bool:
    schema = op._schema
    if not schema.arguments or not schema.returns:
        return False
    first = schema.arguments[0].alias_info
    return bool(first is not None and first.is_write and not schema.arguments[0].kwarg_only)


def _is_out_variant(op: Any) -> bool:
    return any(
        a.kwarg_only and a.alias_info is not None and a.alias_info.is_write for a in op._schema.arguments
    )


def _check_inplace(
    op: Any, in_specs: list[ShardTensorSpec | None], targets: list[ShardTensorSpec | None], outputs: Any
) -> None:
    self_spec, target = in_specs[0], targets[0]
    out = outputs[0] if isinstance(outputs, (list, tuple)) else outputs
    if (
        self_spec is None
        or target != self_spec
        or (out is not None and out.placements != self_spec.placements)
    ):
        raise RuntimeError(
            f"{op}: an in-place op would have to change the layout of the tensor it writes to "
            f"({self_spec}); DTensor's rules need {target.placements if target else None} for it and give "
            f"{out.placements if out is not None else None}. Use the out-of-place op, or redistribute first"
        )


def _mean_is_float(op: Any, in_specs: list[ShardTensorSpec | None], kwargs: dict[str, Any]) -> bool:
    """A mean to compute as a sum: floating or complex (torch refuses other means itself)."""
    if op not in _MEAN_AS_SUM or in_specs[0] is None:
        return False
    dtype = kwargs.get("dtype") or in_specs[0].dtype
    return bool(dtype.is_floating_point or dtype.is_complex)


def _mean_count(
    op: Any, args: tuple[Any, ...], kwargs: dict[str, Any], spec: ShardTensorSpec | None
) -> int | None:
    """The global number of elements each output element of a mean averages."""
    if spec is None:
        return None
    shape = spec.shape
    if op is aten.mean.default:
        dims: Sequence[int] = range(len(shape))
    else:
        given = args[1] if len(args) > 1 else kwargs.get("dim")
        dims = range(len(shape)) if given is None or given == [] else given
        if isinstance(dims, int):
            dims = [dims]
    count = 1
    for d in dims:
        count *= shape[d % len(shape)] if shape else 1
    return count


def warn_promotion(tensor: torch.Tensor, mesh: Any) -> None:
    """The WARN promotion mode's message (upstream's wording starts "ShardTensor auto-promoting")."""
    warnings.warn(
        f"ShardTensor auto-promoting a plain torch.Tensor (shape={tuple(tensor.shape)}, "
        f"dtype={tensor.dtype}) to a Replicate tensor on mesh {mesh}; this usually means a "
        "non-distributed weight met a sharded activation",
        UserWarning,
        stacklevel=4,
    )
