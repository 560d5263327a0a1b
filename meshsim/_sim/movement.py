"""What each collective computes: pure functions from every rank's inputs to every rank's outputs.

Nothing here knows about threads, groups or ranks beyond list positions: entry
``r`` of every list belongs to group rank ``r``. The functions never write into
their inputs; the backend copies results into the caller's output tensors.
Checks that need every rank's arguments at once (``compat_*`` functions)
return the :class:`Problem` s they find, each naming the ranks involved.
"""

from __future__ import annotations

import functools
from collections import Counter
from collections.abc import Callable, Sequence
from typing import NamedTuple

import torch

__all__ = [
    "REDUCE_OPS",
    "Problem",
    "all_gather_flat",
    "all_gather_rows",
    "all_to_all",
    "all_to_all_single",
    "check_reduce_dtype",
    "reduce",
    "reduce_scatter_flat",
    "all_same_bytes",
    "same_bytes",
    "surely_differ",
    "split_sizes",
]

Tensor = torch.Tensor

REDUCE_OPS = ("SUM", "AVG", "PRODUCT", "MIN", "MAX", "BAND", "BOR", "BXOR", "PREMUL_SUM")
_BITWISE = {"BAND": torch.bitwise_and, "BOR": torch.bitwise_or, "BXOR": torch.bitwise_xor}


def check_reduce_dtype(op: str, dtype: torch.dtype) -> str | None:
    """Why ``op`` cannot reduce ``dtype`` (as NCCL would refuse it), or None if it can."""
    is_float = dtype.is_floating_point
    is_complex = dtype.is_complex
    if op not in REDUCE_OPS:
        return f"unsupported reduce op {op}; expected one of {', '.join(REDUCE_OPS)}"
    if op in ("AVG", "PREMUL_SUM") and not (is_float or is_complex):
        return f"ReduceOp.{op} needs a floating point or complex tensor, got {dtype}"
    if op in ("MIN", "MAX") and is_complex:
        return f"ReduceOp.{op} is not defined for complex tensors ({dtype})"
    if op in _BITWISE and (is_float or is_complex):
        return f"ReduceOp.{op} needs an integer or bool tensor, got {dtype}"
    return None


def reduce(tensors: list[Tensor], op: str, factors: Sequence[float | Tensor] | None = None) -> Tensor:
    """Reduce equally shaped tensors elementwise; the result has their dtype.

    Floating point sums and means accumulate in at least float32 and round
    once, so the result does not depend on the order of the ranks.

    Args:
        tensors: one tensor per rank.
        op: a name from :data:`REDUCE_OPS`.
        factors: for ``PREMUL_SUM``, each rank's scale factor (NCCL scales each
            rank's input by that rank's factor, then sums).
    """
    dtype = tensors[0].dtype
    if op in _BITWISE:
        return functools.reduce(_BITWISE[op], tensors).clone()
    if dtype == torch.bool:
        return _reduce_bool(tensors, op)
    if op == "PREMUL_SUM":
        if factors is None or len(factors) != len(tensors):
            raise ValueError("PREMUL_SUM needs one factor per rank")
        scaled = [t * _on(f, t) for t, f in zip(tensors, factors)]
        return torch.stack(scaled).sum(0).to(dtype)
    result = _REDUCERS[op](torch.stack(tensors))
    return result if result.dtype == dtype else result.to(dtype)


def _on(factor: float | Tensor, like: Tensor) -> float | Tensor:
    return factor.to(like.device) if isinstance(factor, Tensor) else factor


def _reduce_bool(tensors: Sequence[Tensor], op: str) -> Tensor:
    stacked = torch.stack(list(tensors))
    if op in ("SUM", "MAX"):
        return stacked.any(0)
    return stacked.all(0)  # PRODUCT, MIN


def _sum(stacked: Tensor) -> Tensor:
    if stacked.dtype.is_floating_point or stacked.dtype.is_complex:
        return stacked.sum(0)
    return stacked.sum(0, dtype=stacked.dtype)  # integers wrap as on the wire


def _mean(stacked: Tensor) -> Tensor:
    # Complex means divide the real and imaginary sums by n, as they do when torch hands a
    # complex tensor over as real pairs: a complex division could be an ulp off.
    if stacked.dtype.is_complex:
        return torch.view_as_complex(torch.view_as_real(stacked).mean(0))
    return stacked.mean(0)


_REDUCERS: dict[str, Callable[[Tensor], Tensor]] = {
    "SUM": _sum,
    "AVG": _mean,
    "PRODUCT": lambda s: s.prod(0, dtype=s.dtype),
    "MIN": lambda s: s.amin(0),
    "MAX": lambda s: s.amax(0),
}


def all_gather_flat(inputs: Sequence[Tensor]) -> Tensor:
    """Every rank's input, flattened and concatenated in rank order."""
    return torch.cat([t if t.dim() == 1 else t.reshape(-1) for t in inputs])  # flat inputs: the usual case


def all_gather_rows(inputs: list[Tensor]) -> Tensor:
    """Inputs of one shape (at least 1-D) concatenated along dim 0 in rank order.

    Its elements in order are :func:`all_gather_flat`'s: without a reshape per input, and
    in the rows' shape, which is the output's own when it stacks the inputs' rows
    (DTensor's and FSDP's all_gather_into_tensor).
    """
    return torch.cat(inputs)


def reduce_scatter_flat(
    inputs: Sequence[Tensor], op: str, factors: Sequence[float | Tensor] | None = None
) -> list[Tensor]:
    """Reduce the flattened inputs, then give rank ``r`` the ``r``-th equal chunk."""
    total = reduce([t if t.dim() == 1 else t.reshape(-1) for t in inputs], op, factors)
    return list(total.chunk(len(inputs)))


def split_sizes(dim0: int, splits: Sequence[int], parts: int) -> list[int]:
    """All_to_all split sizes along dim 0: ``splits`` itself, or equal parts when empty."""
    if splits:
        return list(splits)
    return [dim0 // parts] * parts


def all_to_all_single(inputs: Sequence[Tensor], input_splits: Sequence[Sequence[int]]) -> list[Tensor]:
    """Rank ``r`` receives, in sender order, the ``r``-th dim-0 piece of every input."""
    pieces = [list(torch.split(t, list(s), dim=0)) for t, s in zip(inputs, input_splits)]
    return [torch.cat([pieces[src][dst] for src in range(len(inputs))]) for dst in range(len(inputs))]


def all_to_all(inputs: Sequence[Sequence[Tensor]]) -> list[list[Tensor]]:
    """Rank ``r`` receives entry ``r`` of every rank's input list, in sender order."""
    n = len(inputs)
    return [[inputs[src][dst] for src in range(n)] for dst in range(n)]


# -- comparing what ranks contributed ---------------------------------------------------------

_BITS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
_PREFILTER = 4096  # elements: above this, a few leading elements are compared first


def same_bytes(a: Tensor, b: Tensor) -> bool:
    """Whether ``a`` and ``b`` hold the same bytes: same dtype, shape and device, bitwise equal.

    ``-0.0`` and ``0.0`` differ; NaNs of the same bits are the same. Long tensors compare
    a few leading elements before all of them.
    """
    return all_same_bytes((a, b))


def surely_differ(a: Sequence[Tensor], b: Sequence[Tensor]) -> bool:
    """Whether two ranks' tensors surely hold different bytes, found with one comparison.

    False means "maybe the same" (several tensors, or equal values whose bits may differ):
    :func:`all_same_bytes` decides. Values are compared (the cheaper check), so tensors
    holding a NaN, which differs from itself, surely differ here even where their bits do
    not: the findings then miss such a call, never flag one wrongly.
    """
    if len(a) != 1 or len(b) != 1:
        return len(a) != len(b)
    x, y = a[0], b[0]
    if x.dtype != y.dtype:
        return True
    try:
        return not torch.equal(x, y)
    except RuntimeError:  # tensors on different devices
        return True


def all_same_bytes(tensors: Sequence[Tensor]) -> bool:
    """Whether every tensor in ``tensors`` holds the bytes the first holds (as :func:`same_bytes`).

    Compared bit for bit (floating point tensors viewed as integers of their width), one
    comparison per tensor; long tensors compare a few leading elements first.
    """
    first = tensors[0]
    dtype = first.dtype
    for other in tensors[1:]:
        if other.dtype != dtype:  # torch.equal compares values across dtypes
            return False
    bits = [_as_bits(t) for t in tensors]
    mine = bits[0]
    try:
        if first.numel() > _PREFILTER:
            head = mine.reshape(-1)[:64]
            for other in bits[1:]:
                if not torch.equal(head, other.reshape(-1)[:64]):
                    return False
        for other in bits[1:]:
            if not torch.equal(mine, other):  # False for other shapes
                return False
    except RuntimeError:  # tensors on different devices
        return False
    return True


def _as_bits(t: Tensor) -> Tensor:
    """``t`` viewed as integers of the same width (any strides), for bitwise comparison.

    Floating point numbers become integers of their width (-0.0 is not 0.0), complex ones
    pairs of them; other tensors are returned as they are.
    """
    if t.dtype.is_complex:
        t = torch.view_as_real(t)
    if t.dtype.is_floating_point:
        return t.view(_BITS[t.element_size()])
    return t


class Problem(NamedTuple):
    """One way in which ranks' arguments do not fit together."""

    text: str
    ranks: tuple[int, ...]  # group ranks involved


def compat_all_to_all_single(
    input_shapes: Sequence[tuple[int, ...]],
    input_splits: Sequence[Sequence[int]],
    output_shapes: Sequence[tuple[int, ...]],
    output_splits: Sequence[Sequence[int]],
) -> list[Problem]:
    """Whether every sender's piece matches what its receiver expects."""
    n = len(input_shapes)
    problems = []
    for dst in range(n):
        for src in range(n):
            sent, expected = input_splits[src][dst], output_splits[dst][src]
            if sent != expected:
                text = f"rank {dst} expects {expected} rows from rank {src}, which sends {sent}"
                problems.append(Problem(text, (dst, src)))
    # The odd ones out are the ranks whose rows differ from most ranks' (not from rank 0's:
    # rank 0 may be the odd one). Ties go to rank 0's input rows.
    seen = [input_shapes[r][1:] for r in range(n)] + [output_shapes[r][1:] for r in range(n)]
    tally = Counter(seen)
    rows = max(tally, key=lambda shape: (tally[shape], shape == seen[0]))
    for r in range(n):
        for what, shape in (("sends", input_shapes[r][1:]), ("receives", output_shapes[r][1:])):
            if shape != rows:
                text = (
                    f"rank {r} {what} rows of shape {list(shape)}, most ranks' rows have shape {list(rows)}"
                )
                problems.append(Problem(text, (r,)))
    return problems


def compat_exchange(
    sent: Sequence[Sequence[tuple[int, ...] | None]],
    expected: Sequence[Sequence[tuple[int, ...] | None]],
    what: str,
) -> list[Problem]:
    """Whether ``sent[src][dst]`` (a shape, or None when nothing moves) matches ``expected[dst][src]``."""
    problems = []
    for src, row in enumerate(sent):
        for dst, shape in enumerate(row):
            want = expected[dst][src]
            if shape is not None and want is not None and shape != want:
                text = (
                    f"rank {dst} expects {what} of shape {list(want)} from rank {src}, "
                    f"which sends shape {list(shape)}"
                )
                problems.append(Problem(text, (dst, src)))
    return problems


def culprits(problems: Sequence[Problem]) -> tuple[int, ...]:
    """The ranks most often involved in ``problems``: the likely odd ones out."""
    counts: dict[int, int] = {}
    for problem in problems:
        for rank in problem.ranks:
            counts[rank] = counts.get(rank, 0) + 1
    if not counts:
        return ()
    most = max(counts.values())
    return tuple(sorted(r for r, c in counts.items() if c == most))
