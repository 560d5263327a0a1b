"""The calls each rank of a generated program issues: their exact ledger entries, and the
keys the fault model compares (what must match between ranks)."""

from __future__ import annotations

import inspect
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import Any

import torch
import torch.distributed as dist
from programs import WORLD, Fault, Program, Step, a2a_shapes, obj, pickled_size, plan, root_objects
from runs import SITES

Tensor = torch.Tensor


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
    _, _, out_shape, in_shape = a2a_shapes(step, members.index(rank))
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
# all_gather_object gathers into a list of tensors up to torch 2.14, into one tensor
# (all_gather_single, recorded as all_gather_into_tensor) from 2.15.
_GATHERS_INTO_ONE = "all_gather_single(" in inspect.getsource(dist.all_gather_object)
_AG_OBJECT_API = "all_gather_into_tensor" if _GATHERS_INTO_ONE else "all_gather"


def _calls_all_gather_object(index: int, step: Step, members: tuple[int, ...], rank: int) -> list[CallSpec]:
    n, site = len(members), SITES["ag_object"]
    biggest = max(pickled_size(obj(r, index)) for r in members)
    return [
        _call(
            step,
            members,
            index,
            op="all_gather",
            api=_AG_OBJECT_API,
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
            api=_AG_OBJECT_API,
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
    total = sum(pickled_size(o) for o in root_objects(members[step.root], index))
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
