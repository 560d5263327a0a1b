"""Generated SPMD programs for meshsim's property tests (issue 5): what they are, how a rank
runs one, and what every rank must get.

A :class:`Program` is plain data: the groups every rank creates, then :class:`Step` s
that every rank runs identically. :func:`run_rank` runs a program on the calling rank
(inside ``meshsim.run``), optionally with a :class:`Fault` that changes what one rank
does at one step; every input is a function of (global rank, step, salt).
:func:`reference` computes every rank's outputs with plain torch in one thread, and
:func:`expected_ledger` every rank's exact ledger; neither calls meshsim. Every call
is issued on a line of its own, marked ``# site:NAME``, so the expected call sites
(:data:`SITES`) are read from this file.

Generators take a :class:`Source` of choices: :class:`RandomSource` wraps
``random.Random(seed)`` (the soak script), :class:`HypothesisSource` wraps hypothesis'
``draw`` (the tests), so both make the same kinds of programs. What a fault must
produce is :mod:`faults`' business.
"""

from __future__ import annotations

import ast
import functools
import io
import math
import operator
import os
import pickle
import random
import re
import time
import tokenize
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from typing import Any, Protocol, TypeVar

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol

import meshsim

Tensor = torch.Tensor
T = TypeVar("T")

# -- vocabulary ------------------------------------------------------------------------

KINDS = (
    "all_reduce",
    "all_reduce_coalesced",
    "all_gather",
    "all_gather_into_tensor",
    "reduce_scatter",
    "reduce_scatter_tensor",
    "all_to_all_single",
    "all_to_all",
    "broadcast",
    "scatter",
    "gather",
    "reduce",
    "barrier",
    "p2p",
    "all_gather_object",
    "broadcast_object_list",
)
REDUCING = ("all_reduce", "all_reduce_coalesced", "reduce_scatter", "reduce_scatter_tensor", "reduce")
ROOTED = ("broadcast", "scatter", "gather", "reduce", "broadcast_object_list")
OBJECT_KINDS = ("all_gather_object", "broadcast_object_list")
FUNCOL_KINDS = (
    "all_reduce",
    "all_gather_into_tensor",
    "reduce_scatter_tensor",
    "all_to_all_single",
    "broadcast",
)
# Kinds whose arguments do not depend on the group's size, so a rank can issue them on another group.
REGROUPABLE = (
    "all_reduce",
    "all_reduce_coalesced",
    "all_gather_into_tensor",
    "reduce_scatter_tensor",
    "broadcast",
    "reduce",
    "barrier",
    "all_gather_object",
    "broadcast_object_list",
)

FLOATS = (torch.float32, torch.float64, torch.bfloat16, torch.float16)
INTS = (torch.int8, torch.uint8, torch.int32, torch.int64)
DTYPES = (*FLOATS, torch.complex64, *INTS, torch.bool)

FAULT_KINDS = ("raise", "return", "skip", "swap", "dtype", "shape", "op", "root", "group", "split", "sleep")
# What a gloo world can observe as meshsim defines it: a rank's own exception. gloo
# cannot see a skipped or mismatched collective the way the simulator does.
GLOO_FAULT_KINDS = ("raise",)


LEDGER_FIELDS = ("op", "api", "group", "dtype", "bytes_in", "bytes_out", "reduce_op", "seq", "peer", "site")


def ops_for(dtype: torch.dtype, *, gloo: bool = False) -> tuple[str, ...]:
    """The reduce ops the backend accepts for ``dtype`` (gloo: no PREMUL_SUM)."""
    if dtype == torch.bool or dtype in INTS:
        return ("SUM", "PRODUCT", "MIN", "MAX", "BAND", "BOR", "BXOR")
    premul = () if gloo else ("PREMUL_SUM",)
    if dtype.is_complex:
        return ("SUM", "AVG", *premul)  # torch rejects PRODUCT, MIN and MAX of complex tensors
    return ("SUM", "AVG", "PRODUCT", "MIN", "MAX", *premul)


def dtypes_for(kind: str, *, gloo: bool = False) -> tuple[torch.dtype, ...]:
    if kind in ("barrier", *OBJECT_KINDS):
        return (torch.float32,)  # unused
    if gloo and kind == "gather":
        return tuple(d for d in DTYPES if not d.is_complex)  # gloo: "Invalid scalar type"
    return DTYPES


def _name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


# -- programs ----------------------------------------------------------------------------


@dataclass(frozen=True)
class GroupRef:
    """Where a step runs: the world, ``new_group`` number ``index``, or 2-D mesh dimension ``index``."""

    kind: str  # "world" | "new" | "mesh"
    index: int = 0

    def __str__(self) -> str:
        return "world" if self.kind == "world" else f"{self.kind}{self.index}"


WORLD = GroupRef("world")


@dataclass(frozen=True)
class Step:
    """One collective (or one round of point-to-point pairs) that every member runs.

    Attributes:
        kind: one of :data:`KINDS`.
        group: where it runs; on a mesh dimension, every sub-group runs it at once.
        dtype, shape: the element type and shape of each tensor (``all_to_all_single``:
            the shape of one row; ``all_gather``/``reduce_scatter``/``all_to_all``: unused,
            see ``sizes``/``splits``).
        shape2: the second tensor of ``all_reduce_coalesced``.
        op: the reduce op name for reducing kinds.
        root: the root's group rank for rooted kinds.
        sizes: per group rank, the element count it contributes (``all_gather``) or
            receives (``reduce_scatter``).
        splits: ``splits[src][dst]``: rows (``all_to_all_single``) or elements
            (``all_to_all``) that group rank ``src`` sends to ``dst``.
        pairs: ``(src, dst)`` group ranks of the messages of a ``p2p`` step.
        style: ``sync``, ``async`` (``async_op=True``, waited at the end) or ``funcol``
            for collectives; ``blocking``, ``isend`` or ``batch`` for ``p2p``.
    """

    kind: str
    group: GroupRef = WORLD
    dtype: torch.dtype = torch.float32
    shape: tuple[int, ...] = (2,)
    shape2: tuple[int, ...] = ()
    op: str | None = None
    root: int = 0
    sizes: tuple[int, ...] = ()
    splits: tuple[tuple[int, ...], ...] = ()
    pairs: tuple[tuple[int, int], ...] = ()
    style: str = "sync"

    def __str__(self) -> str:
        parts = [self.kind, str(self.group)]
        if self.kind not in ("barrier", *OBJECT_KINDS):
            parts.append(f"{_name(self.dtype)}{list(self.shape)}")
        extras = {
            "shape2": self.shape2,
            "op": self.op,
            "sizes": self.sizes,
            "splits": self.splits,
            "pairs": self.pairs,
        }
        parts += [f"{k}={v}" for k, v in extras.items() if v]
        if self.kind in ROOTED:
            parts.append(f"root={self.root}")
        if self.style != "sync":
            parts.append(self.style)
        return " ".join(parts)


@dataclass(frozen=True)
class Program:
    """An SPMD program: every rank creates the same groups, then runs the same steps.

    Attributes:
        world_size: number of ranks.
        new_groups: the ranks of each ``dist.new_group`` call, in the order passed.
        mesh: the shape of a 2-D ``init_device_mesh``, if any.
        steps: what every rank runs, in order.
    """

    world_size: int
    new_groups: tuple[tuple[int, ...], ...] = ()
    mesh: tuple[int, int] | None = None
    steps: tuple[Step, ...] = ()

    def subgroups(self, ref: GroupRef) -> list[tuple[int, ...]]:
        """The disjoint groups a step on ``ref`` runs on, as global ranks in group-rank order."""
        if ref.kind == "world":
            return [tuple(range(self.world_size))]
        if ref.kind == "new":
            return [tuple(sorted(self.new_groups[ref.index]))]  # new_group sorts its ranks
        assert self.mesh is not None
        a, b = self.mesh
        if ref.index == 0:
            return [tuple(i * b + j for i in range(a)) for j in range(b)]
        return [tuple(i * b + j for j in range(b)) for i in range(a)]

    def members(self, ref: GroupRef, rank: int) -> tuple[int, ...] | None:
        """The group ``rank`` is in for a step on ``ref`` (None: it takes no part)."""
        return next((g for g in self.subgroups(ref) if rank in g), None)

    def refs(self) -> list[GroupRef]:
        refs = [WORLD, *(GroupRef("new", i) for i in range(len(self.new_groups)))]
        if self.mesh is not None:
            refs += [GroupRef("mesh", 0), GroupRef("mesh", 1)]
        return refs

    def __str__(self) -> str:
        head = f"world_size={self.world_size} new_groups={list(self.new_groups)} mesh={self.mesh}"
        return "\n".join([head, *(f"  #{i} {s}" for i, s in enumerate(self.steps))])


@dataclass(frozen=True)
class Fault:
    """What one rank does differently at one step.

    Attributes:
        kind: one of :data:`FAULT_KINDS`.
        rank: the faulty global rank.
        step: the step index where it deviates (``swap``: it runs ``step + 1`` first;
            ``raise``: ``len(steps)`` raises after the last step).
        replacement: for dtype/shape/op/root/group/split faults, the step it runs instead.
    """

    kind: str
    rank: int
    step: int
    replacement: Step | None = None

    def __str__(self) -> str:
        instead = f", runs [{self.replacement}] instead" if self.replacement is not None else ""
        return f"{self.kind} on rank {self.rank} at step {self.step}{instead}"


class InjectedFault(RuntimeError):
    """The exception a ``raise`` fault raises in the faulty rank."""


# -- inputs --------------------------------------------------------------------------------

_PRODUCT_FLOATS = (1.0, 2.0, -1.0, 0.5)  # products of these are exact in every float type
_PRODUCT_INTS = (1, 2, -1, 1)
_PRODUCT_UINTS = (1, 2, 3, 1)


def premul_factor(rank: int) -> float:
    """The PREMUL_SUM factor global ``rank`` passes (a power of two: products stay exact)."""
    return (0.5, 1.0, 2.0)[rank % 3]


def data(
    rank: int,
    index: int,
    salt: int,
    dtype: torch.dtype,
    shape: Sequence[int],
    op: str | None = None,
    n: int = 1,
) -> Tensor:
    """Global ``rank``'s input for step ``index``: small values whose reductions are exact.

    Floats are halves in [-3, 3] (AVG: times the group size ``n``, so the mean is exact;
    PRODUCT: from {1, 2, -1, 0.5}), so every sum, mean and product of up to 8 ranks is
    exact even in bfloat16, and results cannot depend on the order of reduction.
    """
    count = math.prod(shape)
    k = (torch.arange(count, dtype=torch.int64) * 7 + rank * 13 + index * 29 + salt * 5) % 13 - 6
    if dtype == torch.bool:
        return ((k % 3) == 0).reshape(tuple(shape))
    if dtype.is_floating_point or dtype.is_complex:
        real = _float_values(k, op, n)
        if dtype.is_complex:
            imag = _float_values((k + 2) % 4, op, n)
            return torch.complex(real, imag).to(dtype).reshape(tuple(shape))
        return real.to(dtype).reshape(tuple(shape))
    if op == "PRODUCT":
        table = _PRODUCT_UINTS if dtype == torch.uint8 else _PRODUCT_INTS
        return torch.tensor(table, dtype=torch.int64)[(k + 6) % 4].to(dtype).reshape(tuple(shape))
    if dtype == torch.uint8:
        k = k + 6
    return k.to(dtype).reshape(tuple(shape))


def _float_values(k: Tensor, op: str | None, n: int) -> Tensor:
    if op == "PRODUCT":
        return torch.tensor(_PRODUCT_FLOATS, dtype=torch.float64)[(k + 6) % 4]
    scale = n if op == "AVG" else 1
    return k.to(torch.float64) / 2 * scale


def obj(rank: int, index: int) -> tuple[object, ...]:
    """Global ``rank``'s object for an object collective (pickles to a rank-dependent size)."""
    return (rank, index, "x" * ((rank + index) % 5))


def root_objects(root: int, index: int) -> list[object]:
    """What the root of a ``broadcast_object_list`` step sends."""
    return [("b", root, index), "y" * (index % 4)]


def _pickled(o: object) -> int:
    return len(pickle.dumps(o))  # torch pickles with the default protocol, as here


# -- where each call is issued ------------------------------------------------------------


def _find_sites() -> dict[str, str]:
    """``file.py:LINE in function`` of every line here marked ``# site:NAME``.

    The ledger and the errors name the first frame outside torch and meshsim: these lines.
    """
    path = __file__
    with open(path, encoding="utf-8") as f:
        source = f.read()
    functions = [
        (node.lineno, node.end_lineno or node.lineno, node.name)
        for node in ast.walk(ast.parse(source))
        if isinstance(node, ast.FunctionDef)
    ]
    sites: dict[str, str] = {}
    for token in tokenize.generate_tokens(io.StringIO(source).readline):
        match = re.fullmatch(r"# site:(\S+)", token.string) if token.type == tokenize.COMMENT else None
        if match:
            line = token.start[0]
            name = min((e - s, n) for s, e, n in functions if s <= line <= e)[1]
            sites[match.group(1)] = f"{os.path.basename(path)}:{line} in {name}"
    return sites


# -- running a program on one rank ----------------------------------------------------------

Out = tuple[Any, ...]


@dataclass(frozen=True)
class RankRun:
    """What one rank returns: its outputs by step index, and its ledger as tuples of LEDGER_FIELDS."""

    outputs: dict[int, Out]
    ledger: tuple[tuple[Any, ...], ...]


@dataclass
class _Rank:
    program: Program
    rank: int
    handles: dict[GroupRef, Any]
    pending: list[Any] = field(default_factory=list)

    def issue(self, work: Any) -> None:
        if work is not None:
            self.pending.append(work)

    def finish(self) -> None:
        for work in self.pending:
            work.wait()
        self.pending.clear()

    def input(self, index: int, salt: int, step: Step, shape: Sequence[int], n: int) -> Tensor:
        return data(self.rank, index, salt, step.dtype, shape, step.op, n)

    def reduce_op(self, op: str | None) -> Any:
        if op == "PREMUL_SUM":
            return dist._make_nccl_premul_sum(premul_factor(self.rank))
        return getattr(dist.ReduceOp, op or "SUM")


def plan(program: Program, rank: int, fault: Fault | None) -> list[tuple[int, Step, str]]:
    """The (index, step, action) list ``rank`` runs; action is run, raise, sleep or return."""
    steps = [(i, s, "run") for i, s in enumerate(program.steps)]
    if fault is None or fault.rank != rank:
        return steps
    k = fault.step
    if fault.kind == "raise" and k == len(steps):  # after the last step
        steps.append((k, program.steps[-1], "raise"))
    elif fault.kind in ("raise", "sleep"):
        steps[k] = (k, program.steps[k], fault.kind)
    elif fault.kind == "return":
        steps[k:] = [(k, program.steps[k], "return")]
    elif fault.kind == "skip":
        del steps[k]
    elif fault.kind == "swap":
        steps[k], steps[k + 1] = steps[k + 1], steps[k]
    else:
        assert fault.replacement is not None
        steps[k] = (k, fault.replacement, "run")
    return steps


# time.monotonic() when the faulty rank reached its fault (the fault's position in its
# plan), appended by that rank: detection time is measured from it, not from the start
# of the world, whose set-up (gloo connections) is not detection.
fault_reached: list[float] = []


def run_rank(program: Program, fault: Fault | None = None, *, sleep_limit: float = 20.0) -> RankRun:
    """Run ``program`` on the calling rank (inside ``meshsim.run``), with ``fault`` if it is this rank's.

    Keyword args:
        sleep_limit: how long a ``sleep`` fault sleeps if nothing stops it.
    """
    rank = dist.get_rank()
    ctx = _Rank(program, rank, _make_groups(program, rank))
    outputs: dict[int, Out] = {}
    faulty_at = fault.step if fault is not None and fault.rank == rank else None
    entries = plan(program, rank, fault)
    with meshsim.record() as ledger:
        for position, (index, step, action) in enumerate(entries):
            if position == faulty_at:
                fault_reached.append(time.monotonic())
            if action == "return":
                break
            if action == "raise":
                _raise_fault(rank, index)
            if action == "sleep":
                _sleep_fault(sleep_limit)
            members = program.members(step.group, rank)
            if members is not None:
                outputs[index] = _RUNNERS[step.kind](ctx, index, step, members)
        if faulty_at is not None and faulty_at >= len(entries):  # skipped its last step
            fault_reached.append(time.monotonic())
        ctx.finish()
    return RankRun(outputs, tuple(ledger.project(*LEDGER_FIELDS)))


def _raise_fault(rank: int, index: int) -> None:
    raise InjectedFault(f"injected fault: rank {rank} raises at step {index}")  # site:raise


def _sleep_fault(limit: float) -> None:
    # Short sleeps in Python, so that meshsim can interrupt the rank between them.
    end = time.monotonic() + limit
    while time.monotonic() < end:
        time.sleep(0.005)  # site:sleep


def _make_groups(program: Program, rank: int) -> dict[GroupRef, Any]:
    from torch.distributed.device_mesh import init_device_mesh

    handles: dict[GroupRef, Any] = {WORLD: dist.group.WORLD}
    for i, ranks in enumerate(program.new_groups):
        group = dist.new_group(list(ranks))  # every rank, members or not, in the same order
        handles[GroupRef("new", i)] = group if rank in ranks else None
    if program.mesh is not None:
        mesh = init_device_mesh("cpu", program.mesh)
        for dim in (0, 1):
            handles[GroupRef("mesh", dim)] = mesh.get_group(dim)
    return handles


Runner = Callable[[_Rank, int, Step, tuple[int, ...]], Out]


def _async(step: Step) -> bool:
    return step.style == "async"


def _run_all_reduce(ctx: _Rank, index: int, step: Step, members: tuple[int, ...]) -> Out:
    pg, n = ctx.handles[step.group], len(members)
    x = ctx.input(index, 0, step, step.shape, n)
    if step.style == "funcol":
        assert step.op is not None
        return (funcol.all_reduce(x, step.op.lower(), pg).wait(),)  # site:all_reduce/funcol
    op = ctx.reduce_op(step.op)
    ctx.issue(dist.all_reduce(x, op=op, group=pg, async_op=_async(step)))  # site:all_reduce
    return (x,)


def _run_all_reduce_coalesced(ctx: _Rank, index: int, step: Step, members: tuple[int, ...]) -> Out:
    pg, n = ctx.handles[step.group], len(members)
    xs = [ctx.input(index, 0, step, step.shape, n), ctx.input(index, 1, step, step.shape2, n)]
    op = ctx.reduce_op(step.op)
    ctx.issue(dist.all_reduce_coalesced(xs, op=op, group=pg, async_op=_async(step)))  # site:coalesced
    return tuple(xs)


def _run_all_gather(ctx: _Rank, index: int, step: Step, members: tuple[int, ...]) -> Out:
    pg, me = ctx.handles[step.group], members.index(ctx.rank)
    x = ctx.input(index, 0, step, (step.sizes[me],), len(members))
    outs = [torch.zeros(size, dtype=step.dtype) for size in step.sizes]
    ctx.issue(dist.all_gather(outs, x, group=pg, async_op=_async(step)))  # site:all_gather
    return tuple(outs)


def _run_all_gather_into_tensor(ctx: _Rank, index: int, step: Step, members: tuple[int, ...]) -> Out:
    pg, n = ctx.handles[step.group], len(members)
    x = ctx.input(index, 0, step, step.shape, n)
    if step.style == "funcol":
        return (funcol.all_gather_tensor(x, 0, pg).wait(),)  # site:agit/funcol
    out = torch.zeros((n * step.shape[0], *step.shape[1:]), dtype=step.dtype)  # gloo: dim 0 only
    ctx.issue(dist.all_gather_into_tensor(out, x, group=pg, async_op=_async(step)))  # site:agit
    return (out,)


def _run_reduce_scatter(ctx: _Rank, index: int, step: Step, members: tuple[int, ...]) -> Out:
    pg, n, me = ctx.handles[step.group], len(members), members.index(ctx.rank)
    inputs = [ctx.input(index, dst, step, (size,), n) for dst, size in enumerate(step.sizes)]
    out = torch.zeros(step.sizes[me], dtype=step.dtype)
    op = ctx.reduce_op(step.op)
    ctx.issue(dist.reduce_scatter(out, inputs, op=op, group=pg, async_op=_async(step)))  # site:rs
    return (out,)


def _run_reduce_scatter_tensor(ctx: _Rank, index: int, step: Step, members: tuple[int, ...]) -> Out:
    pg, n = ctx.handles[step.group], len(members)
    x = ctx.input(index, 0, step, (n * math.prod(step.shape),), n)
    if step.style == "funcol":
        assert step.op is not None
        return (funcol.reduce_scatter_tensor(x, step.op.lower(), 0, pg).wait(),)  # site:rst/funcol
    out = torch.zeros(math.prod(step.shape), dtype=step.dtype)
    op = ctx.reduce_op(step.op)
    ctx.issue(dist.reduce_scatter_tensor(out, x, op=op, group=pg, async_op=_async(step)))  # site:rst
    return (out,)


def _a2a_shapes(step: Step, me: int) -> tuple[list[int], list[int], tuple[int, ...], tuple[int, ...]]:
    """all_to_all_single: (output splits, input splits, output shape, input shape) of group rank ``me``."""
    out_splits = [row[me] for row in step.splits]
    in_splits = list(step.splits[me])
    return out_splits, in_splits, (sum(out_splits), *step.shape), (sum(in_splits), *step.shape)


def _run_all_to_all_single(ctx: _Rank, index: int, step: Step, members: tuple[int, ...]) -> Out:
    pg, n, me = ctx.handles[step.group], len(members), members.index(ctx.rank)
    out_splits, in_splits, out_shape, in_shape = _a2a_shapes(step, me)
    x = ctx.input(index, 0, step, in_shape, n)
    even = len({s for row in step.splits for s in row}) == 1
    o_s, i_s = (None, None) if even else (out_splits, in_splits)
    if step.style == "funcol":
        return (funcol.all_to_all_single(x, o_s, i_s, pg).wait(),)  # site:a2as/funcol
    out = torch.zeros(out_shape, dtype=step.dtype)
    ctx.issue(dist.all_to_all_single(out, x, o_s, i_s, group=pg, async_op=_async(step)))  # site:a2as
    return (out,)


def _run_all_to_all(ctx: _Rank, index: int, step: Step, members: tuple[int, ...]) -> Out:
    pg, n, me = ctx.handles[step.group], len(members), members.index(ctx.rank)
    inputs = [ctx.input(index, dst, step, (size,), n) for dst, size in enumerate(step.splits[me])]
    outs = [torch.zeros(row[me], dtype=step.dtype) for row in step.splits]
    ctx.issue(dist.all_to_all(outs, inputs, group=pg, async_op=_async(step)))  # site:a2a
    return tuple(outs)


def _run_broadcast(ctx: _Rank, index: int, step: Step, members: tuple[int, ...]) -> Out:
    pg = ctx.handles[step.group]
    x = ctx.input(index, 0, step, step.shape, len(members))
    if step.style == "funcol":
        return (funcol.broadcast(x, step.root, pg).wait(),)  # site:broadcast/funcol
    ctx.issue(dist.broadcast(x, group=pg, group_src=step.root, async_op=_async(step)))  # site:broadcast
    return (x,)


def _run_scatter(ctx: _Rank, index: int, step: Step, members: tuple[int, ...]) -> Out:
    pg, n = ctx.handles[step.group], len(members)
    out = torch.zeros(step.shape, dtype=step.dtype)
    pieces = None
    if members.index(ctx.rank) == step.root:
        pieces = [ctx.input(index, dst, step, step.shape, n) for dst in range(n)]
    ctx.issue(dist.scatter(out, pieces, group=pg, group_src=step.root, async_op=_async(step)))  # site:scatter
    return (out,)


def _run_gather(ctx: _Rank, index: int, step: Step, members: tuple[int, ...]) -> Out:
    pg, n = ctx.handles[step.group], len(members)
    x = ctx.input(index, 0, step, step.shape, n)
    is_root = members.index(ctx.rank) == step.root
    outs = [torch.zeros(step.shape, dtype=step.dtype) for _ in range(n)] if is_root else None
    ctx.issue(dist.gather(x, outs, group=pg, group_dst=step.root, async_op=_async(step)))  # site:gather
    return tuple(outs or ())


def _run_reduce(ctx: _Rank, index: int, step: Step, members: tuple[int, ...]) -> Out:
    pg = ctx.handles[step.group]
    x = ctx.input(index, 0, step, step.shape, len(members))
    op = ctx.reduce_op(step.op)
    ctx.issue(dist.reduce(x, group=pg, group_dst=step.root, op=op, async_op=_async(step)))  # site:reduce
    # Only the root's buffer is defined afterwards (gloo uses the others as scratch space).
    return (x,) if members.index(ctx.rank) == step.root else ()


def _run_barrier(ctx: _Rank, index: int, step: Step, members: tuple[int, ...]) -> Out:
    ctx.issue(dist.barrier(group=ctx.handles[step.group], async_op=_async(step)))  # site:barrier
    return ()


def _run_p2p(ctx: _Rank, index: int, step: Step, members: tuple[int, ...]) -> Out:
    pg, me = ctx.handles[step.group], members.index(ctx.rank)
    sends = [(members[d], ctx.input(index, d, step, step.shape, 1)) for s, d in step.pairs if s == me]
    recvs = [(members[s], torch.zeros(step.shape, dtype=step.dtype)) for s, d in step.pairs if d == me]
    if step.style == "blocking":
        for peer, t in sends:
            dist.send(t, peer, group=pg)  # site:send
        for peer, t in recvs:
            dist.recv(t, peer, group=pg)  # site:recv
    elif step.style == "isend":
        works = []
        for peer, t in recvs:
            works.append(dist.irecv(t, peer, group=pg))  # site:irecv
        for peer, t in sends:
            works.append(dist.isend(t, peer, group=pg))  # site:isend
        for work in works:
            work.wait()
    else:
        ops = [dist.P2POp(dist.irecv, t, peer, group=pg) for peer, t in recvs]
        ops += [dist.P2POp(dist.isend, t, peer, group=pg) for peer, t in sends]
        for work in dist.batch_isend_irecv(ops) if ops else []:  # site:batch
            work.wait()
    return tuple(t for _, t in recvs)


def _run_all_gather_object(ctx: _Rank, index: int, step: Step, members: tuple[int, ...]) -> Out:
    gathered: list[object] = [None] * len(members)
    dist.all_gather_object(gathered, obj(ctx.rank, index), group=ctx.handles[step.group])  # site:ag_object
    return tuple(gathered)


def _run_broadcast_object_list(ctx: _Rank, index: int, step: Step, members: tuple[int, ...]) -> Out:
    root = members[step.root]
    objects = root_objects(root, index) if ctx.rank == root else [None, None]
    pg = ctx.handles[step.group]
    dist.broadcast_object_list(objects, group=pg, group_src=step.root)  # site:bcast_object
    return tuple(objects)


_RUNNERS: dict[str, Runner] = {
    "all_reduce": _run_all_reduce,
    "all_reduce_coalesced": _run_all_reduce_coalesced,
    "all_gather": _run_all_gather,
    "all_gather_into_tensor": _run_all_gather_into_tensor,
    "reduce_scatter": _run_reduce_scatter,
    "reduce_scatter_tensor": _run_reduce_scatter_tensor,
    "all_to_all_single": _run_all_to_all_single,
    "all_to_all": _run_all_to_all,
    "broadcast": _run_broadcast,
    "scatter": _run_scatter,
    "gather": _run_gather,
    "reduce": _run_reduce,
    "barrier": _run_barrier,
    "p2p": _run_p2p,
    "all_gather_object": _run_all_gather_object,
    "broadcast_object_list": _run_broadcast_object_list,
}

SITES = _find_sites()

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
        torch.split(data(r, index, 0, step.dtype, _a2a_shapes(step, i)[3], step.op, n), list(step.splits[i]))
        for i, r in enumerate(members)
    ]
    return {
        r: (torch.cat([sent[src][dst] for src in range(n)]).reshape(_a2a_shapes(step, dst)[2]),)
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


# -- the calls each rank issues: ledger entries and model keys --------------------------------


@dataclass(frozen=True)
class CallSpec:
    """One call a rank issues, as the ledger records it and as the model matches it.

    ``sig`` is what must be equal on every rank of a collective (meshsim's signature is
    at least this fine); ``key`` adds what may differ only in ways that fit together
    (uneven sizes, splits), so equal keys mean the call certainly completes.
    """

    op: str
    api: str
    members: tuple[int, ...]
    inst: tuple[Any, ...]
    dtype: torch.dtype | None
    bytes_in: int
    bytes_out: int
    reduce_op: str | None
    peer: int | None
    site: str
    sig: tuple[Any, ...]
    key: tuple[Any, ...]
    step: int = -1
    direction: str = ""  # "send" or "recv" for point-to-point


def _nbytes(dtype: torch.dtype, count: int) -> int:
    return count * torch.empty((), dtype=dtype).element_size()


# torch hands complex tensors to the backend as real pairs (view_as_real) in these
# collectives, but not in gather, reduce or reduce_scatter; the functional collectives
# do it in all but all_to_all_single.
_VIEWS_AS_REAL = (
    "all_reduce",
    "all_reduce_coalesced",
    "all_gather",
    "all_gather_into_tensor",
    "broadcast",
    "scatter",
    "all_to_all_single",
    "all_to_all",
    "p2p",
)


def _as_real(step: Step) -> bool:
    if not step.dtype.is_complex:
        return False
    if step.style == "funcol":
        return step.kind != "all_to_all_single"
    return step.kind in _VIEWS_AS_REAL


def _wire(step: Step, shape: Sequence[int]) -> tuple[torch.dtype, tuple[int, ...]]:
    """The dtype and shape the backend sees for a tensor of ``shape``."""
    if _as_real(step):
        return torch.float32, (*shape, 2)
    return step.dtype, tuple(shape)


def _wire_counts(step: Step, counts: Sequence[int]) -> tuple[int, ...]:
    return tuple(c * 2 for c in counts) if _as_real(step) else tuple(counts)


def _site(step: Step, name: str) -> str:
    return SITES[f"{name}/funcol" if step.style == "funcol" and f"{name}/funcol" in SITES else name]


Calls = Callable[[int, Step, tuple[int, ...], int], list[CallSpec]]


def _call(step: Step, members: tuple[int, ...], index: int, **kw: Any) -> CallSpec:
    inst = (step.group, members)
    kw.setdefault("dtype", _wire(step, ())[0])
    kw.setdefault("reduce_op", None)
    kw.setdefault("peer", None)
    kw.setdefault("key", kw["sig"])
    return CallSpec(members=members, inst=inst, step=index, **kw)


def _calls_all_reduce(index: int, step: Step, members: tuple[int, ...], rank: int) -> list[CallSpec]:
    shapes = (step.shape,) if step.kind == "all_reduce" else (step.shape, step.shape2)
    nb = sum(_nbytes(step.dtype, math.prod(s)) for s in shapes)
    return [
        _call(
            step,
            members,
            index,
            op="all_reduce",
            api=step.kind,
            bytes_in=nb,
            bytes_out=nb,
            reduce_op=step.op,
            site=_site(step, "all_reduce" if step.kind == "all_reduce" else "coalesced"),
            sig=(step.kind, step.op, *zip(*(_wire(step, s) for s in shapes))),
        )
    ]


def _calls_all_gather(index: int, step: Step, members: tuple[int, ...], rank: int) -> list[CallSpec]:
    me = members.index(rank)
    return [
        _call(
            step,
            members,
            index,
            op="all_gather",
            api="all_gather",
            bytes_in=_nbytes(step.dtype, step.sizes[me]),
            bytes_out=_nbytes(step.dtype, sum(step.sizes)),
            site=_site(step, "all_gather"),
            sig=("all_gather", _wire(step, ())[0]),
            key=("all_gather", _wire(step, ())[0], _wire_counts(step, step.sizes)),
        )
    ]


def _calls_all_gather_into_tensor(
    index: int, step: Step, members: tuple[int, ...], rank: int
) -> list[CallSpec]:
    nb = _nbytes(step.dtype, math.prod(step.shape))
    return [
        _call(
            step,
            members,
            index,
            op="all_gather",
            api="all_gather_into_tensor",
            bytes_in=nb,
            bytes_out=nb * len(members),
            site=_site(step, "agit"),
            sig=("agit", *_wire(step, step.shape)),
        )
    ]


def _calls_reduce_scatter(index: int, step: Step, members: tuple[int, ...], rank: int) -> list[CallSpec]:
    me = members.index(rank)
    return [
        _call(
            step,
            members,
            index,
            op="reduce_scatter",
            api="reduce_scatter",
            bytes_in=_nbytes(step.dtype, sum(step.sizes)),
            bytes_out=_nbytes(step.dtype, step.sizes[me]),
            reduce_op=step.op,
            site=_site(step, "rs"),
            sig=("reduce_scatter", step.op, step.dtype),
            key=("reduce_scatter", step.op, step.dtype, step.sizes),
        )
    ]


def _calls_reduce_scatter_tensor(
    index: int, step: Step, members: tuple[int, ...], rank: int
) -> list[CallSpec]:
    nb = _nbytes(step.dtype, math.prod(step.shape))
    return [
        _call(
            step,
            members,
            index,
            op="reduce_scatter",
            api="reduce_scatter_tensor",
            bytes_in=nb * len(members),
            bytes_out=nb,
            reduce_op=step.op,
            site=_site(step, "rst"),
            sig=("rst", step.op, step.dtype, step.shape),
        )
    ]


def _calls_all_to_all_single(index: int, step: Step, members: tuple[int, ...], rank: int) -> list[CallSpec]:
    _, _, out_shape, in_shape = _a2a_shapes(step, members.index(rank))
    return [
        _call(
            step,
            members,
            index,
            op="all_to_all",
            api="all_to_all_single",
            bytes_in=_nbytes(step.dtype, math.prod(in_shape)),
            bytes_out=_nbytes(step.dtype, math.prod(out_shape)),
            site=_site(step, "a2as"),
            sig=("a2as", _wire(step, ())[0]),
            key=("a2as", *_wire(step, step.shape), step.splits),
        )
    ]


def _calls_all_to_all(index: int, step: Step, members: tuple[int, ...], rank: int) -> list[CallSpec]:
    me = members.index(rank)
    return [
        _call(
            step,
            members,
            index,
            op="all_to_all",
            api="all_to_all",
            bytes_in=_nbytes(step.dtype, sum(step.splits[me])),
            bytes_out=_nbytes(step.dtype, sum(row[me] for row in step.splits)),
            site=_site(step, "a2a"),
            sig=("a2a", _wire(step, ())[0]),
            key=("a2a", _wire(step, ())[0], tuple(_wire_counts(step, row) for row in step.splits)),
        )
    ]


def _rooted(
    step: Step,
    members: tuple[int, ...],
    index: int,
    rank: int,
    name: str,
    root_in: int,
    root_out: int,
    other_in: int,
    other_out: int,
    sig: tuple[Any, ...],
    key: tuple[Any, ...] | None = None,
    dtype: torch.dtype | None = None,
) -> CallSpec:
    is_root = members.index(rank) == step.root
    return _call(
        step,
        members,
        index,
        op=name,
        api=name,
        bytes_in=root_in if is_root else other_in,
        bytes_out=root_out if is_root else other_out,
        peer=members[step.root],
        reduce_op=step.op if name == "reduce" else None,
        site=_site(step, name),
        sig=sig,
        key=key or sig,
        dtype=dtype or _wire(step, ())[0],
    )


def _calls_rooted(index: int, step: Step, members: tuple[int, ...], rank: int) -> list[CallSpec]:
    nb, n, k = _nbytes(step.dtype, math.prod(step.shape)), len(members), step.kind
    wd, wshape = _wire(step, step.shape)
    table = {
        "broadcast": (nb, 0, 0, nb, ("broadcast", step.root, wd, wshape), None),
        "scatter": (n * nb, nb, 0, nb, ("scatter", step.root, wd), ("scatter", step.root, wd, wshape)),
        "gather": (nb, n * nb, nb, 0, ("gather", step.root, wd), ("gather", step.root, wd, wshape)),
        "reduce": (nb, nb, nb, 0, ("reduce", step.op, step.root, wd, wshape), None),
    }
    root_in, root_out, other_in, other_out, sig, key = table[k]
    return [_rooted(step, members, index, rank, k, root_in, root_out, other_in, other_out, sig, key)]


def _calls_barrier(index: int, step: Step, members: tuple[int, ...], rank: int) -> list[CallSpec]:
    return [
        _call(
            step,
            members,
            index,
            op="barrier",
            api="barrier",
            dtype=None,
            bytes_in=0,
            bytes_out=0,
            site=_site(step, "barrier"),
            sig=("barrier",),
        )
    ]


_P2P_SITES = {"blocking": ("send", "recv"), "isend": ("isend", "irecv"), "batch": ("batch", "batch")}


def _calls_p2p(index: int, step: Step, members: tuple[int, ...], rank: int) -> list[CallSpec]:
    me, count = members.index(rank), math.prod(step.shape)
    nb, key = _nbytes(step.dtype, count), ("p2p", _wire(step, ())[0], _wire_counts(step, (count,)))
    send_site, recv_site = (SITES[s] for s in _P2P_SITES[step.style])
    sends = [
        _call(
            step,
            members,
            index,
            op="send",
            api="send",
            bytes_in=nb,
            bytes_out=0,
            peer=members[d],
            site=send_site,
            sig=key,
            direction="send",
        )
        for s, d in step.pairs
        if s == me
    ]
    recvs = [
        _call(
            step,
            members,
            index,
            op="recv",
            api="recv",
            bytes_in=0,
            bytes_out=nb,
            peer=members[s],
            site=recv_site,
            sig=key,
            direction="recv",
        )
        for s, d in step.pairs
        if d == me
    ]
    return sends + recvs if step.style == "blocking" else recvs + sends


# The object collectives first exchange sizes, then size their payload buffers from the
# sizes received: their second call always fits, whatever objects the ranks hold.
def _calls_all_gather_object(index: int, step: Step, members: tuple[int, ...], rank: int) -> list[CallSpec]:
    n, site = len(members), SITES["ag_object"]
    biggest = max(_pickled(obj(r, index)) for r in members)
    return [
        _call(
            step,
            members,
            index,
            op="all_gather",
            api="all_gather",
            dtype=torch.int64,
            bytes_in=8,
            bytes_out=8 * n,
            site=site,
            sig=("all_gather", torch.int64),
            key=("all_gather", torch.int64, (1,) * n),
        ),
        _call(
            step,
            members,
            index,
            op="all_gather",
            api="all_gather",
            dtype=torch.uint8,
            bytes_in=biggest,
            bytes_out=biggest * n,
            site=site,
            sig=("all_gather", torch.uint8),
        ),
    ]


def _calls_broadcast_object_list(
    index: int, step: Step, members: tuple[int, ...], rank: int
) -> list[CallSpec]:
    total = sum(_pickled(o) for o in root_objects(members[step.root], index))
    sizes = replace(step, kind="broadcast", dtype=torch.int64, shape=(2,))
    payload = replace(step, kind="broadcast", dtype=torch.uint8, shape=(total,))
    sizes_call, payload_call = (
        replace(spec, site=SITES["bcast_object"], step=index)
        for part in (sizes, payload)
        for spec in _calls_rooted(index, part, members, rank)
    )
    return [sizes_call, replace(payload_call, sig=payload_call.sig[:3], key=payload_call.sig[:3])]


_CALLS: dict[str, Calls] = {
    "all_reduce": _calls_all_reduce,
    "all_reduce_coalesced": _calls_all_reduce,
    "all_gather": _calls_all_gather,
    "all_gather_into_tensor": _calls_all_gather_into_tensor,
    "reduce_scatter": _calls_reduce_scatter,
    "reduce_scatter_tensor": _calls_reduce_scatter_tensor,
    "all_to_all_single": _calls_all_to_all_single,
    "all_to_all": _calls_all_to_all,
    "broadcast": _calls_rooted,
    "scatter": _calls_rooted,
    "gather": _calls_rooted,
    "reduce": _calls_rooted,
    "barrier": _calls_barrier,
    "p2p": _calls_p2p,
    "all_gather_object": _calls_all_gather_object,
    "broadcast_object_list": _calls_broadcast_object_list,
}


def rank_calls(program: Program, rank: int, fault: Fault | None = None) -> list[CallSpec | str]:
    """Every call ``rank`` issues, in order; a fault's raise/sleep/return is a string marker."""
    calls: list[CallSpec | str] = []
    for index, step, action in plan(program, rank, fault):
        if action != "run":
            calls.append(action)
            if action == "return":
                break
        members = program.members(step.group, rank)
        if members is None:
            continue
        specs = _CALLS[step.kind](index, step, members, rank)
        if step.group.kind == "mesh" and len(members) == program.world_size:
            # A mesh dimension that spans the world is the default group itself (torch's DeviceMesh).
            specs = [replace(c, inst=(WORLD, members)) for c in specs]
        calls += specs
    return calls


def expected_ledger(program: Program, rank: int) -> tuple[tuple[Any, ...], ...]:
    """``rank``'s exact ledger, as tuples of :data:`LEDGER_FIELDS`."""
    counters: dict[tuple[Any, ...], int] = {}
    rows = []
    for call in rank_calls(program, rank):
        assert isinstance(call, CallSpec)
        counter = (call.inst, call.op, call.peer) if call.direction else (call.inst,)
        seq = counters.get(counter, 0)
        counters[counter] = seq + 1
        row = (call.op, call.api, call.members, call.dtype, call.bytes_in, call.bytes_out, call.reduce_op)
        rows.append((*row, seq, call.peer, call.site))
    return tuple(rows)


# -- generators ---------------------------------------------------------------------------


class Source(Protocol):
    """Where a generator's choices come from."""

    def integer(self, lo: int, hi: int) -> int:
        """An integer in [lo, hi]."""
        ...


class RandomSource:
    """Choices from ``random.Random(seed)``: the soak script's cases."""

    def __init__(self, seed: int) -> None:
        self._random = random.Random(seed)

    def integer(self, lo: int, hi: int) -> int:
        return self._random.randint(lo, hi)


class HypothesisSource:
    """Choices drawn through hypothesis (``st.data()``), so failures shrink."""

    def __init__(self, draw: Callable[[Any], Any]) -> None:
        self._draw = draw

    def integer(self, lo: int, hi: int) -> int:
        from hypothesis import strategies as st

        return int(self._draw(st.integers(lo, hi)))


def choose(src: Source, options: Sequence[T]) -> T:
    return options[src.integer(0, len(options) - 1)]


def draw_program(
    src: Source,
    *,
    gloo: bool = False,
    min_world: int = 1,
    max_world: int = 8,
    max_steps: int = 8,
) -> Program:
    """A random valid program: every rank runs it to the end without error.

    Keyword args:
        gloo: only what ProcessGroupGloo supports.
    """
    ws = src.integer(min_world, max_world)
    new_groups = tuple(_draw_new_group(src, ws) for _ in range(src.integer(0, 2)))
    pairs = [(a, ws // a) for a in range(1, ws + 1) if ws % a == 0]
    mesh = choose(src, pairs) if src.integer(0, 1) else None
    program = Program(ws, new_groups, mesh)
    steps = tuple(_draw_step(src, program, gloo) for _ in range(src.integer(1, max_steps)))
    return replace(program, steps=steps)


def _draw_new_group(src: Source, ws: int) -> tuple[int, ...]:
    pool, chosen = list(range(ws)), []
    for _ in range(src.integer(1, ws)):
        chosen.append(pool.pop(src.integer(0, len(pool) - 1)))
    return tuple(chosen)  # in drawn order: new_group sorts them


def _draw_step(src: Source, program: Program, gloo: bool) -> Step:
    ref = choose(src, program.refs())
    n = len(program.subgroups(ref)[0])
    kinds = [k for k in KINDS if not (k == "p2p" and n < 2)]
    kind = choose(src, kinds)
    dtype = choose(src, dtypes_for(kind, gloo=gloo))
    op = choose(src, ops_for(dtype, gloo=gloo)) if kind in REDUCING else None
    styles = ["sync"] if kind in OBJECT_KINDS else ["sync", "async"]
    if (
        kind in FUNCOL_KINDS
        and op != "PREMUL_SUM"
        # gloo rejects complex all_to_all_single ("Invalid scalar type")
        and not (gloo and dtype.is_complex and kind == "all_to_all_single")
    ):
        styles.append("funcol")
    if kind == "p2p":
        styles = ["isend", "batch"] if gloo else ["blocking", "isend", "batch"]
    step = Step(
        kind, ref, dtype, _draw_shape(src), op=op, root=src.integer(0, n - 1), style=choose(src, styles)
    )
    return _draw_layout(src, step, n, gloo)


def _draw_shape(src: Source) -> tuple[int, ...]:
    if src.integer(0, 2):
        return (src.integer(0, 5),)
    return (src.integer(1, 3), src.integer(1, 3))


def _draw_layout(src: Source, step: Step, n: int, gloo: bool) -> Step:
    """Fill in what depends on the group size: sizes, splits, pairs, the coalesced tensor."""
    if step.kind in ("all_gather", "reduce_scatter"):
        sizes = (src.integer(0, 4),) * n if gloo else tuple(src.integer(0, 4) for _ in range(n))
        return replace(step, sizes=sizes)
    if step.kind == "all_to_all" and gloo:  # gloo: only equal sizes
        return replace(step, splits=((src.integer(0, 3),) * n,) * n, shape=())
    if step.kind in ("all_to_all_single", "all_to_all"):
        splits = tuple(tuple(src.integer(0, 3) for _ in range(n)) for _ in range(n))
        shape = step.shape[1:] if step.kind == "all_to_all_single" else ()
        return replace(step, splits=splits, shape=shape)
    if step.kind == "all_reduce_coalesced":
        return replace(step, shape2=(src.integer(1, 4),))
    if step.kind == "p2p":
        candidates = [(s, d) for s in range(n) for d in range(n) if s != d]
        count = src.integer(1, min(4, len(candidates)))
        pairs = [candidates.pop(src.integer(0, len(candidates) - 1)) for _ in range(count)]
        return replace(step, pairs=tuple(pairs))
    return step
