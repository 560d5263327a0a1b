"""The in-memory c10d backend: a ``torch.distributed.ProcessGroup`` whose methods are rendezvous.

c10d calls these methods from plain ``dist.*`` calls (Python) and from functional
collectives, DTensor, DDP and FSDP (C++, through torch's Python trampoline). Each
method is a short adapter from c10d's calling convention to one typed
description (:mod:`meshsim._sim.collectives`): it checks the rank's own arguments
(:mod:`meshsim._sim.checks`) and issues the description, which records the ledger
entry and joins the rendezvous for the group's next sequence number; the call
returns once every rank of the group has arrived and the data has moved, so
``async_op=True`` gives a Work that is already complete (:mod:`meshsim._sim.work`).

Point to point is the exception (:mod:`meshsim._sim.p2p`): sends are buffered and a
receive's Work is pending until its message arrives.

The path of one ``dist.all_reduce``: c10d calls :meth:`SimProcessGroup.allreduce`,
which builds an :class:`~meshsim._sim.collectives.AllReduce` and issues it; issuing
appends the ledger entry and meets the other ranks
(:meth:`meshsim._sim.rendezvous.Rendezvous.meet`); the last to arrive completes the
slot, which runs ``AllReduce.execute`` on every rank's description, computing with
:mod:`meshsim._sim.movement` and writing each rank's tensors.
"""

from __future__ import annotations

import functools
import sys
import threading
from collections.abc import Callable
from types import FrameType
from typing import Any

import torch
import torch.distributed as dist

from meshsim._base.context import Seat, current
from meshsim._process import thread_worlds as _thread_worlds
from meshsim._record import ledger as _ledger
from meshsim._record import sites as _sites
from meshsim._record.ledger import Collective
from meshsim._sim import checks as _checks
from meshsim._sim import dispatch as _dispatch
from meshsim._sim.collectives import (
    AllGather,
    AllGatherIntoTensor,
    AllReduce,
    AllToAll,
    AllToAllSingle,
    Barrier,
    Broadcast,
    Description,
    Gather,
    Reduce,
    ReduceScatter,
    ReduceScatterTensor,
    Scatter,
)
from meshsim._sim.p2p import Endpoint
from meshsim._sim.rendezvous import Call
from meshsim._sim.work import DONE, ReceiveWork, completed

__all__ = [
    "BACKEND_NAME",
    "SimProcessGroup",
    "create_process_group",
    "default_process_group",
    "reduce_op_names_by_hash",
    "reduce_op_of",
    "restart_numbering",
]

BACKEND_NAME = "meshsim"
Tensor = torch.Tensor


def restart_numbering() -> None:
    """Number the calling rank's collectives from 0 again in ledgers, on every group it has.

    The rendezvous keeps its own count; ledgers show each group's calls since this
    call, as a new world's would (a session's next test). On gloo ranks, the rank's
    dispatch recorder starts its count again.
    """
    for group in _thread_worlds.thread_groups():
        if isinstance(group, SimProcessGroup):
            group.restart_numbering()
    recorder = current().recorder
    if recorder is not None:
        recorder.restart_numbering()


def create_process_group(opts: Any, backend_options: Any) -> SimProcessGroup:
    """The c10d backend creator (``register_backend(..., extended_api=True)``)."""
    context = current().seat
    if context is None:
        raise RuntimeError(
            f"the {BACKEND_NAME!r} backend only works inside meshsim.run(); "
            "init_process_group() was called from a thread that is not a simulated rank"
        )
    ranks = tuple(opts.global_ranks_in_group) or tuple(range(opts.group_size))
    group = context.rendezvous.group(str(opts.group_id), ranks, context.rank)
    return SimProcessGroup(context, group, opts.group_rank)


def default_process_group(context: Seat) -> SimProcessGroup:
    """This rank's handle on the world group, named "0" as c10d names the default group."""
    ranks = tuple(range(context.world_size))
    group = context.rendezvous.group("0", ranks, context.rank)
    return SimProcessGroup(context, group, context.rank)


class _BackendTraits:
    """The backend traits c10d's Python code looks up: no coalescing, no splitting."""

    supports_coalescing = False
    supports_splitting = False
    supports_time_estimate = False
    _supports_time_estimate = False

    def name(self) -> str:
        return BACKEND_NAME


_BACKEND_TRAITS = _BackendTraits()


def reduce_op_of(opts: Any) -> tuple[str, Any]:
    """The reduce op's name and, for PREMUL_SUM, its factor."""
    if opts is None:
        return "SUM", None
    op = opts.reduceOp
    name = reduce_op_names_by_hash().get(hash(op))  # runs once per rank per call
    if name is not None:
        return name, None
    name = getattr(op, "op", op).name
    return name, (_premul_factor(op) if name == "PREMUL_SUM" else None)


def _premul_factor(op: Any) -> Any:
    """A PREMUL_SUM op's factor: ``op.factor`` in torch 2.12-2.15; torch 2.11's ReduceOp exposes
    it only through its pickling state, ``(kind, factor)``."""
    try:
        return op.factor
    except AttributeError:
        return op.__getstate__()[1]


@functools.cache
def reduce_op_names_by_hash() -> dict[int, str]:
    """The names of the ReduceOp kinds, keyed by ``hash(ReduceOp)``; empty if hashes do not tell them apart.

    A ReduceOp read from a collective's options is a fresh object each call, and
    comparing it (or reading ``.op``) goes through pybind where ``hash`` does not
    (benchmarks/bench_tricks.py measures the difference): c10d hashes a ReduceOp as
    its kind's value (checked in torch 2.11-2.15). The table is built from the kinds
    themselves and used only while every kind, and a PREMUL_SUM op (not in the
    table: its factor must be read), hashes differently.
    """
    kinds = {name: kind for name, kind in dist.ReduceOp.RedOpType.__members__.items() if name != "PREMUL_SUM"}
    table = {hash(dist.ReduceOp(kind)): name for name, kind in kinds.items()}
    premul = hash(dist._make_nccl_premul_sum(1.0))  # type: ignore[attr-defined]
    if len(table) != len(kinds) or premul in table:
        return {}
    return table


def _listed(tensors: Any) -> list[Tensor]:
    return [tensors] if isinstance(tensors, Tensor) else list(tensors)


_Method = Callable[..., dist.Work]


def _observable(*names: str) -> Callable[[_Method], _Method]:
    """Let dispatch modes see the call as the c10d op gloo and NCCL issue (see ``dispatcher_twin``).

    ``names``: the C++ ``ProcessGroup`` methods that issue the op, newest name first.
    Without a dispatch mode in the calling thread (the common case) the method runs
    as it is; with one, it runs beneath the modes, from the op they see.
    """

    def decorate(method: _Method) -> _Method:
        @functools.wraps(method)
        def observable(self: SimProcessGroup, *args: Any, **kwargs: Any) -> dist.Work:
            if _dispatch.dispatch_modes_active():
                run = functools.partial(method, self, *args, **kwargs)
                work: dist.Work = _dispatch.through_dispatcher(self._twin(), names, args, kwargs, run)
                return work
            return method(self, *args, **kwargs)

        return observable

    return decorate


class SimProcessGroup(dist.ProcessGroup):
    """One rank's handle on one simulated process group."""

    def __init__(self, context: Seat, group: Any, group_rank: int) -> None:
        super().__init__(group_rank, group.size)  # type: ignore[call-arg]
        self._context = context
        self._group = group
        self._group_rank = group_rank
        self._size = group.size
        self._seq = 0
        self._seq_base = 0  # what ledgers count from (restart_numbering): the rendezvous keeps counting
        self._p2p = Endpoint(group.mailbox, group.ranks, group_rank, context.scheduler)
        # c10d makes a group in the rank thread that uses it: that thread's open
        # ledgers, held here, spare a thread-local lookup on every collective.
        self._ledgers = current().ledgers
        self._dispatcher_twin: Any = None  # made when a dispatch mode first watches a call
        self._thread = threading.get_ident()  # the rank thread that made it: the one that may use it

    def _twin(self) -> Any:
        if self._dispatcher_twin is None:
            self._dispatcher_twin = _dispatch.dispatcher_twin(
                self._group_rank, self._size, self._group.name, BACKEND_NAME
            )
        return self._dispatcher_twin

    @property
    def group_name(self) -> str:  # type: ignore[override]
        name: str = self._group.name
        return name

    def restart_numbering(self) -> None:
        """Number this group's calls in ledgers from 0 again (see :func:`restart_numbering`)."""
        self._seq_base = self._seq
        self._p2p.restart_numbering()

    def _get_backend(self, device: Any) -> Any:
        """What c10d reads of a group's backend for a device (torch 2.15's batch_isend_irecv asks)."""
        return _BACKEND_TRAITS

    def getBackendName(self) -> str:
        return BACKEND_NAME

    def _get_backend_name(self) -> str:
        return BACKEND_NAME

    def name(self) -> str:
        return BACKEND_NAME

    def shutdown(self) -> None:
        """Nothing to release: the world owns every buffer."""

    def abort(self) -> None:
        """Nothing to release: the world owns every buffer."""

    def __repr__(self) -> str:
        return f"SimProcessGroup(ranks={list(self._group.ranks)}, rank={self._group_rank})"

    # -- issuing a collective -------------------------------------------------------

    def _issue(self, payload: Description, opts: Any) -> dist.Work:
        """Record ``payload`` in the open ledgers, meet the other ranks, and return the Work."""
        if threading.get_ident() != self._thread:  # one C call: the exact check only when it differs
            _checks.own_group(self, self._context, payload.api)
        # The rank stays inside this call until every rank has arrived, which is whenever
        # an error needs the site: keep the adapter's frame, format it only then.
        frame = sys._getframe(1)
        seq = self._seq
        self._seq = seq + 1
        ledgers = self._ledgers
        if ledgers:
            entry = self._record(frame, payload, seq)
            call = Call(self._group_rank, payload, payload.signature(), entry.site, entry, ledgers)
        else:
            call = Call(self._group_rank, payload, payload.signature(), frame)
        context = self._context
        context.rendezvous.meet(self._group, seq, call, context.rank)
        if opts is not None and getattr(opts, "asyncOp", True) is False:
            return DONE  # dist.*(async_op=False) waits on this Work and drops it
        return completed(payload.result())

    def _record(self, frame: FrameType, payload: Description, seq: int) -> Collective:
        """Add the call to the open ledgers; returns the entry."""
        ranks = self._group.ranks
        site, via = _sites.where_of(frame)
        dtype, bytes_in, bytes_out = payload.traffic(self._group_rank)
        root = payload.root
        peer = ranks[root] if root is not None else None
        entry = Collective(
            payload.op,
            payload.api,
            ranks,
            dtype,
            bytes_in,
            bytes_out,
            payload.reduce_op,
            seq - self._seq_base,
            site,
            peer,
            via=via,
        )
        _ledger.append(entry)
        return entry

    # -- reductions -------------------------------------------------------------------

    @_observable("allreduce")
    def allreduce(self, tensors: Any, opts: Any = None) -> dist.Work:  # type: ignore[override]
        tensors = _listed(tensors)
        op, factor = reduce_op_of(opts)
        api = "all_reduce" if len(tensors) == 1 else "all_reduce_coalesced"
        _checks.reducible(op, tensors, api)
        return self._issue(AllReduce(tensors, op, factor, api), opts)

    @_observable("allreduce_coalesced")
    def allreduce_coalesced(self, tensors: list[Tensor], opts: Any = None) -> dist.Work:
        tensors = list(tensors)
        op, factor = reduce_op_of(opts)
        _checks.reducible(op, tensors, "all_reduce_coalesced")
        return self._issue(AllReduce(tensors, op, factor, "all_reduce_coalesced"), opts)

    @_observable("reduce")
    def reduce(self, tensors: list[Tensor], opts: Any = None) -> dist.Work:  # type: ignore[override]
        tensors = list(tensors)
        op, factor = reduce_op_of(opts)
        root = opts.rootRank if opts is not None else 0
        _checks.reducible(op, tensors, "reduce")
        _checks.root(root, self._size, "reduce")
        return self._issue(Reduce(tensors, root, op, factor), opts)

    @_observable("reduce_scatter")
    def reduce_scatter(  # type: ignore[override]
        self, outputs: list[Tensor], input_lists: list[list[Tensor]], opts: Any = None
    ) -> dist.Work:
        outputs, input_lists = list(outputs), [list(x) for x in input_lists]
        op, factor = reduce_op_of(opts)
        _checks.reducible(op, outputs, "reduce_scatter")
        _checks.lists(input_lists, outputs, self._size, "reduce_scatter", "input")
        return self._issue(ReduceScatter(outputs, input_lists, op, factor), opts)

    @_observable("reduce_scatter_single", "_reduce_scatter_base")
    def reduce_scatter_single(self, output: Tensor, input: Tensor, opts: Any = None) -> dist.Work:
        return self._reduce_scatter_tensor([output], [input], opts, "reduce_scatter_tensor")

    _reduce_scatter_base = reduce_scatter_single  # type: ignore[assignment]

    @_observable("reduce_scatter_single_coalesced", "reduce_scatter_tensor_coalesced")
    def reduce_scatter_single_coalesced(
        self, outputs: list[Tensor], inputs: list[Tensor], opts: Any = None
    ) -> dist.Work:
        api = "reduce_scatter_tensor" if len(outputs) == 1 else "reduce_scatter_tensor_coalesced"
        return self._reduce_scatter_tensor(list(outputs), list(inputs), opts, api)

    reduce_scatter_tensor_coalesced = reduce_scatter_single_coalesced  # type: ignore[assignment]

    def _reduce_scatter_tensor(
        self, outputs: list[Tensor], inputs: list[Tensor], opts: Any, api: str
    ) -> dist.Work:
        op, factor = reduce_op_of(opts)
        _checks.reducible(op, inputs, api)
        _checks.sized(outputs, inputs, self._size, api, "input", "output")
        return self._issue(ReduceScatterTensor(outputs, inputs, op, factor, api), opts)

    # -- gathers ------------------------------------------------------------------------

    @_observable("allgather")
    def allgather(  # type: ignore[override]
        self, output_lists: list[list[Tensor]], inputs: list[Tensor], opts: Any = None
    ) -> dist.Work:
        return self._all_gather([list(x) for x in output_lists], list(inputs), "all_gather", opts)

    @_observable("allgather_coalesced")
    def allgather_coalesced(
        self, output_lists: list[list[Tensor]], inputs: list[Tensor], opts: Any = None
    ) -> dist.Work:
        # c10d's all_gather_coalesced passes one list per rank, each with every input;
        # regroup to one list per input, each with every rank, as allgather takes.
        per_input = [[rank_list[j] for rank_list in output_lists] for j in range(len(inputs))]
        return self._all_gather(per_input, list(inputs), "all_gather_coalesced", opts)

    def _all_gather(
        self, output_lists: list[list[Tensor]], inputs: list[Tensor], api: str, opts: Any
    ) -> dist.Work:
        _checks.lists(output_lists, inputs, self._size, api, "output")
        return self._issue(AllGather(output_lists, inputs, api), opts)

    @_observable("all_gather_single", "_allgather_base")
    def all_gather_single(self, output: Tensor, input: Tensor, opts: Any = None) -> dist.Work:
        return self._all_gather_into_tensor([output], [input], "all_gather_into_tensor", opts)

    _allgather_base = all_gather_single

    @_observable("all_gather_single_coalesced", "allgather_into_tensor_coalesced")
    def all_gather_single_coalesced(
        self, outputs: list[Tensor], inputs: list[Tensor], opts: Any = None
    ) -> dist.Work:
        api = "all_gather_into_tensor" if len(outputs) == 1 else "all_gather_into_tensor_coalesced"
        return self._all_gather_into_tensor(list(outputs), list(inputs), api, opts)

    allgather_into_tensor_coalesced = all_gather_single_coalesced  # type: ignore[assignment]

    def _all_gather_into_tensor(
        self, outputs: list[Tensor], inputs: list[Tensor], api: str, opts: Any
    ) -> dist.Work:
        _checks.sized(inputs, outputs, self._size, api, "output", "input")
        return self._issue(AllGatherIntoTensor(outputs, inputs, api), opts)

    @_observable("gather")
    def gather(self, output_lists: list[list[Tensor]], inputs: list[Tensor], opts: Any = None) -> dist.Work:  # type: ignore[override]
        root = opts.rootRank if opts is not None else 0
        _checks.root(root, self._size, "gather")
        inputs = list(inputs)
        outputs = list(output_lists[0]) if output_lists else None
        _checks.rooted(outputs, self._group_rank, root, self._size, "gather", "gather_list")
        return self._issue(Gather(outputs, inputs[0], root), opts)

    @_observable("scatter")
    def scatter(self, outputs: list[Tensor], input_lists: list[list[Tensor]], opts: Any = None) -> dist.Work:  # type: ignore[override]
        root = opts.rootRank if opts is not None else 0
        _checks.root(root, self._size, "scatter")
        outputs = list(outputs)
        inputs = list(input_lists[0]) if input_lists else None
        _checks.rooted(inputs, self._group_rank, root, self._size, "scatter", "scatter_list")
        return self._issue(Scatter(outputs[0], inputs, root), opts)

    @_observable("broadcast")
    def broadcast(self, tensors: Any, opts: Any = None) -> dist.Work:  # type: ignore[override]
        tensors = _listed(tensors)
        root = opts.rootRank if opts is not None else 0
        _checks.root(root, self._size, "broadcast")
        return self._issue(Broadcast(tensors, root), opts)

    # -- all to all -------------------------------------------------------------------------

    @_observable("all_to_all_single", "alltoall_base")
    def all_to_all_single(
        self,
        output: Tensor,
        input: Tensor,
        output_split_sizes: list[int],
        input_split_sizes: list[int],
        opts: Any = None,
    ) -> dist.Work:
        out_splits = _checks.splits(output, output_split_sizes, self._size, "output")
        in_splits = _checks.splits(input, input_split_sizes, self._size, "input")
        return self._issue(AllToAllSingle(output, input, out_splits, in_splits), opts)

    alltoall_base = all_to_all_single  # type: ignore[assignment]

    @_observable("alltoall")
    def alltoall(self, outputs: list[Tensor], inputs: list[Tensor], opts: Any = None) -> dist.Work:
        outputs, inputs = list(outputs), list(inputs)
        for name, lst in (("output", outputs), ("input", inputs)):
            if len(lst) != self._size:
                raise ValueError(
                    f"all_to_all: the {name} list has {len(lst)} tensors; a "
                    f"{self._size}-rank group needs one per rank"
                )
        return self._issue(AllToAll(outputs, inputs), opts)

    @_observable("barrier")
    def barrier(self, opts: Any = None) -> dist.Work:
        return self._issue(Barrier(), opts)

    # -- point to point -------------------------------------------------------------

    @_observable("send")
    def send(self, tensors: list[Tensor], dstRank: int, tag: int = 0) -> dist.Work:
        tensors = list(tensors)
        if threading.get_ident() != self._thread:
            _checks.own_group(self, self._context, "send")
        _checks.peer(dstRank, self._group_rank, self._size, self._group.ranks, "send")
        self._p2p.send(tensors, dstRank, tag, _sites.call_where(2))
        return completed(tensors)

    @_observable("recv")
    def recv(self, tensors: list[Tensor], srcRank: int, tag: int = 0) -> dist.Work:
        _checks.peer(srcRank, self._group_rank, self._size, self._group.ranks, "recv")
        return self._receive(list(tensors), srcRank, tag)

    @_observable("recv_anysource")
    def recv_anysource(self, tensors: list[Tensor], tag: int = 0) -> dist.Work:
        return self._receive(list(tensors), None, tag)

    def _receive(self, tensors: list[Tensor], src: int | None, tag: int) -> dist.Work:
        if threading.get_ident() != self._thread:
            _checks.own_group(self, self._context, "recv")
        recv = self._p2p.receive(tensors, src, tag, _sites.call_where(3))
        return ReceiveWork(self._context.scheduler, self._context.rank, recv)
