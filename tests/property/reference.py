"""The single-process reference: every rank's outputs of a generated program, computed with
plain torch in one thread, without meshsim."""

from __future__ import annotations

import functools
import math
import operator
from collections.abc import Callable, Sequence
from typing import Any

import torch
from programs import Out, Program, Step, a2a_shapes, data, obj, premul_factor, root_objects

Tensor = torch.Tensor


# -- the single-process reference -------------------------------------------------------

_ELEMENTWISE: dict[str, Callable[[Tensor, Tensor], Tensor]] = {
    "SUM": operator.add,
    "AVG": operator.add,
    "PREMUL_SUM": operator.add,
    "PRODUCT": operator.mul,
    "MIN": torch.minimum,
    "MAX": torch.maximum,
    "BAND": operator.and_,
    "BOR": operator.or_,
    "BXOR": operator.xor,
}
_BOOL_OPS = {"SUM": "BOR", "MAX": "BOR", "PRODUCT": "BAND", "MIN": "BAND"}


def reference_reduce(tensors: Sequence[Tensor], op: str, ranks: Sequence[int]) -> Tensor:
    """Combine one rank after another, as on the wire, in a type wide enough to be exact."""
    dtype = tensors[0].dtype
    if dtype == torch.bool:
        op = _BOOL_OPS.get(op, op)
    wide = {torch.float32: torch.float64, torch.bfloat16: torch.float64, torch.float16: torch.float64}
    wide_dtype = torch.complex128 if dtype.is_complex else wide.get(dtype, dtype)
    values = [t.to(wide_dtype) for t in tensors]
    if op == "PREMUL_SUM":
        values = [v * premul_factor(r) for v, r in zip(values, ranks)]
    total = functools.reduce(_ELEMENTWISE[op], values)
    if op == "AVG":
        total = total / len(values)
    return total.to(dtype)


def _inputs(members: Sequence[int], index: int, salt: int, step: Step, shape: Sequence[int]) -> list[Tensor]:
    return [data(r, index, salt, step.dtype, shape, step.op, len(members)) for r in members]


Reference = Callable[[int, Step, tuple[int, ...]], dict[int, Out]]


def _ref_all_reduce(index: int, step: Step, members: tuple[int, ...]) -> dict[int, Out]:
    assert step.op is not None
    shapes = [step.shape] if step.kind == "all_reduce" else [step.shape, step.shape2]
    result = tuple(
        reference_reduce(_inputs(members, index, salt, step, shape), step.op, members)
        for salt, shape in enumerate(shapes)
    )
    return {r: result for r in members}


def _ref_all_gather(index: int, step: Step, members: tuple[int, ...]) -> dict[int, Out]:
    n = len(members)
    pieces = tuple(data(r, index, 0, step.dtype, (size,), None, n) for r, size in zip(members, step.sizes))
    return {r: pieces for r in members}


def _ref_all_gather_into_tensor(index: int, step: Step, members: tuple[int, ...]) -> dict[int, Out]:
    stacked = torch.cat(_inputs(members, index, 0, step, step.shape))
    return {r: (stacked,) for r in members}


def _ref_reduce_scatter(index: int, step: Step, members: tuple[int, ...]) -> dict[int, Out]:
    assert step.op is not None
    return {
        r: (reference_reduce(_inputs(members, index, dst, step, (step.sizes[dst],)), step.op, members),)
        for dst, r in enumerate(members)
    }


def _ref_reduce_scatter_tensor(index: int, step: Step, members: tuple[int, ...]) -> dict[int, Out]:
    assert step.op is not None
    m = math.prod(step.shape)
    total = reference_reduce(_inputs(members, index, 0, step, (len(members) * m,)), step.op, members)
    return {r: (total[i * m : (i + 1) * m],) for i, r in enumerate(members)}


def _ref_all_to_all_single(index: int, step: Step, members: tuple[int, ...]) -> dict[int, Out]:
    n = len(members)
    sent = [
        torch.split(data(r, index, 0, step.dtype, a2a_shapes(step, i)[3], step.op, n), list(step.splits[i]))
        for i, r in enumerate(members)
    ]
    return {
        r: (torch.cat([sent[src][dst] for src in range(n)]).reshape(a2a_shapes(step, dst)[2]),)
        for dst, r in enumerate(members)
    }


def _ref_all_to_all(index: int, step: Step, members: tuple[int, ...]) -> dict[int, Out]:
    n = len(members)
    sent = [
        [data(r, index, dst, step.dtype, (size,), step.op, n) for dst, size in enumerate(step.splits[i])]
        for i, r in enumerate(members)
    ]
    return {r: tuple(sent[src][dst] for src in range(n)) for dst, r in enumerate(members)}


def _ref_broadcast(index: int, step: Step, members: tuple[int, ...]) -> dict[int, Out]:
    x = data(members[step.root], index, 0, step.dtype, step.shape, step.op, len(members))
    return {r: (x,) for r in members}


def _ref_scatter(index: int, step: Step, members: tuple[int, ...]) -> dict[int, Out]:
    root, n = members[step.root], len(members)
    return {r: (data(root, index, i, step.dtype, step.shape, step.op, n),) for i, r in enumerate(members)}


def _ref_gather(index: int, step: Step, members: tuple[int, ...]) -> dict[int, Out]:
    gathered = tuple(_inputs(members, index, 0, step, step.shape))
    return {r: gathered if i == step.root else () for i, r in enumerate(members)}


def _ref_reduce(index: int, step: Step, members: tuple[int, ...]) -> dict[int, Out]:
    assert step.op is not None
    total = reference_reduce(_inputs(members, index, 0, step, step.shape), step.op, members)
    return {r: (total,) if i == step.root else () for i, r in enumerate(members)}


def _ref_barrier(index: int, step: Step, members: tuple[int, ...]) -> dict[int, Out]:
    return {r: () for r in members}


def _ref_p2p(index: int, step: Step, members: tuple[int, ...]) -> dict[int, Out]:
    return {
        r: tuple(
            data(members[s], index, d, step.dtype, step.shape, step.op, 1) for s, d in step.pairs if d == me
        )
        for me, r in enumerate(members)
    }


def _ref_all_gather_object(index: int, step: Step, members: tuple[int, ...]) -> dict[int, Out]:
    gathered = tuple(obj(r, index) for r in members)
    return {r: gathered for r in members}


def _ref_broadcast_object_list(index: int, step: Step, members: tuple[int, ...]) -> dict[int, Out]:
    objects = tuple(root_objects(members[step.root], index))
    return {r: objects for r in members}


_REFERENCES: dict[str, Reference] = {
    "all_reduce": _ref_all_reduce,
    "all_reduce_coalesced": _ref_all_reduce,
    "all_gather": _ref_all_gather,
    "all_gather_into_tensor": _ref_all_gather_into_tensor,
    "reduce_scatter": _ref_reduce_scatter,
    "reduce_scatter_tensor": _ref_reduce_scatter_tensor,
    "all_to_all_single": _ref_all_to_all_single,
    "all_to_all": _ref_all_to_all,
    "broadcast": _ref_broadcast,
    "scatter": _ref_scatter,
    "gather": _ref_gather,
    "reduce": _ref_reduce,
    "barrier": _ref_barrier,
    "p2p": _ref_p2p,
    "all_gather_object": _ref_all_gather_object,
    "broadcast_object_list": _ref_broadcast_object_list,
}


def reference(program: Program) -> list[dict[int, Out]]:
    """Every rank's outputs, by step index, computed in one thread with plain torch."""
    outputs: list[dict[int, Out]] = [{} for _ in range(program.world_size)]
    for index, step in enumerate(program.steps):
        for members in program.subgroups(step.group):
            for rank, out in _REFERENCES[step.kind](index, step, members).items():
                outputs[rank][index] = out
    return outputs


def compare_outputs(actual: dict[int, Out], expected: dict[int, Out]) -> list[str]:
    """Where one rank's outputs differ from the reference (exactly: values are chosen exact)."""
    problems = []
    if sorted(actual) != sorted(expected):
        return [f"outputs for steps {sorted(actual)}, expected steps {sorted(expected)}"]
    for index in expected:
        got, want = actual[index], expected[index]
        if len(got) != len(want):
            problems.append(f"step {index}: {len(got)} outputs, expected {len(want)}")
            continue
        for j, (a, b) in enumerate(zip(got, want)):
            if not _same(a, b):
                problems.append(f"step {index} output {j}: got {a!r}, expected {b!r}")
    return problems


def _same(a: Any, b: Any) -> bool:
    if isinstance(b, Tensor):
        return (
            isinstance(a, Tensor)
            and a.dtype == b.dtype
            and tuple(a.shape) == tuple(b.shape)
            and bool(torch.equal(a, b))
        )
    return bool(a == b)
