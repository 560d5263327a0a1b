"""How one rank runs a generated program (inside ``meshsim.run``), and where each call is issued.

Every call is issued on a line of its own, marked ``# site:NAME``, so the expected call
sites (:data:`SITES`) are read from this file.
"""

from __future__ import annotations

import ast
import io
import math
import os
import re
import time
import tokenize
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
from programs import (
    LEDGER_FIELDS,
    WORLD,
    Fault,
    GroupRef,
    InjectedFault,
    Out,
    Program,
    Step,
    a2a_shapes,
    data,
    obj,
    plan,
    premul_factor,
    root_objects,
)

import meshsim

Tensor = torch.Tensor


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


# A sleep fault naps this long at a time, in Python, so that meshsim can interrupt the
# rank between naps (well within the stopped world's one-second grace). Naps of 5 ms
# used about 0.5% of a CPU: neither computing (2%) nor blocked (0.1%) to the world's
# probe, which then looked again over longer windows, and each case took 4 s instead
# of about 1 (tests/meshsim/test_progress.py checks that in-between share on its own).
SLEEP_NAP = 0.1


def _sleep_fault(limit: float) -> None:
    end = time.monotonic() + limit
    while time.monotonic() < end:
        time.sleep(SLEEP_NAP)  # site:sleep


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


def _run_all_to_all_single(ctx: _Rank, index: int, step: Step, members: tuple[int, ...]) -> Out:
    pg, n, me = ctx.handles[step.group], len(members), members.index(ctx.rank)
    out_splits, in_splits, out_shape, in_shape = a2a_shapes(step, me)
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
