"""The in-memory c10d backend: a ``torch.distributed.ProcessGroup`` whose methods are rendezvous.

c10d calls these methods from plain ``dist.*`` calls (Python) and from functional
collectives, DTensor, DDP and FSDP (C++, through torch's Python trampoline). Each
method checks its own arguments as torch would, records a ledger entry, joins the
rendezvous for its sequence number, and returns once every rank of the group has
arrived and the data has moved. ``async_op=True`` therefore returns a Work that is
already complete: the program's collective order is the one every backend sees.

Receives are the exception: ``irecv`` returns a pending Work, so that
``batch_isend_irecv`` and irecv-before-isend patterns work. Sends are buffered.
"""

from __future__ import annotations

import functools
import sys
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from types import FrameType
from typing import Any

import torch
import torch.distributed as dist

from meshsim import _ledger, _ops, _recorder, _sites, _torch_private
from meshsim import _movement as mv
from meshsim._ledger import Collective
from meshsim._rendezvous import Call, Message, PostedRecv, Rendezvous
from meshsim._scheduler import Scheduler
from meshsim._torch_private import completed_work

__all__ = [
    "BACKEND_NAME",
    "RankContext",
    "SimProcessGroup",
    "bind_rank",
    "create_process_group",
    "current_context",
    "current_rank",
    "default_process_group",
]

BACKEND_NAME = "meshsim"
Tensor = torch.Tensor


@dataclass
class RankContext:
    """What a rank thread's process groups need from their world."""

    rank: int
    world_size: int
    scheduler: Scheduler
    rendezvous: Rendezvous
    # makes this rank's default group again, after user code destroyed it
    init_default: Callable[[RankContext], None] | None = None
    inits: int = 0  # default groups made so far (gloo: each meets on keys of its own)


_local = threading.local()


def bind_rank(context: RankContext | None) -> None:
    """Make ``context`` the calling thread's world for groups it creates."""
    _local.context = context


def current_context() -> RankContext | None:
    """The calling thread's rank in its world, or None outside a simulated or gloo rank thread."""
    context: RankContext | None = getattr(_local, "context", None)
    return context


def restart_numbering() -> None:
    """Number the calling rank's collectives from 0 again in ledgers, on every group it has.

    The rendezvous keeps its own count; ledgers show each group's calls since this
    call, as a new world's would (a session's next test). On gloo ranks, the rank's
    dispatch recorder starts its count again.
    """
    for group in _torch_private.thread_groups():
        if isinstance(group, SimProcessGroup):
            group.restart_numbering()
    recorder = _recorder.current()
    if recorder is not None:
        recorder.restart_numbering()


def current_rank() -> int | None:
    """The global rank of the calling thread, or None outside a simulated rank."""
    context: RankContext | None = getattr(_local, "context", None)
    return None if context is None else context.rank


def create_process_group(opts: Any, backend_options: Any) -> SimProcessGroup:
    """The c10d backend creator (``register_backend(..., extended_api=True)``)."""
    context: RankContext | None = getattr(_local, "context", None)
    if context is None:
        raise RuntimeError(
            f"the {BACKEND_NAME!r} backend only works inside meshsim.run(); "
            "init_process_group() was called from a thread that is not a simulated rank"
        )
    ranks = tuple(opts.global_ranks_in_group) or tuple(range(opts.group_size))
    group = context.rendezvous.group(str(opts.group_id), ranks, context.rank)
    return SimProcessGroup(context, group, opts.group_rank)


def default_process_group(context: RankContext) -> SimProcessGroup:
    """This rank's handle on the world group, named "0" as c10d names the default group."""
    ranks = tuple(range(context.world_size))
    group = context.rendezvous.group("0", ranks, context.rank)
    return SimProcessGroup(context, group, context.rank)


class SimWork(dist.Work):
    """A pending receive; ``wait()`` blocks cooperatively until its message arrives."""

    def __init__(self, context: RankContext, recv: PostedRecv) -> None:
        super().__init__()
        self._context = context
        self._recv = recv

    def wait(self, timeout: object = None) -> bool:
        self._context.scheduler.wait(self._context.rank, self._recv)
        return True

    def is_completed(self) -> bool:
        return self._recv.done

    def is_success(self) -> bool:
        return self._recv.done and self._recv.error is None

    def exception(self) -> BaseException | None:
        return self._recv.error

    def result(self) -> list[Tensor]:
        return self._recv.tensors

    def synchronize(self) -> None:
        self.wait()

    def get_future(self) -> torch.futures.Future[list[Tensor]]:
        self.wait()
        fut: torch.futures.Future[list[Tensor]] = torch.futures.Future()
        fut.set_result(self._recv.tensors)
        return fut

    def _source_rank(self) -> int:
        self.wait()
        assert self._recv.source is not None  # set when the message was delivered
        return self._recv.source

    source_rank = _source_rank


def _meta(tensors: Sequence[Tensor]) -> tuple[tuple[torch.dtype, tuple[int, ...]], ...]:
    if len(tensors) == 1:  # the common case, without a generator
        t = tensors[0]
        return ((t.dtype, tuple(t.shape)),)
    return tuple((t.dtype, tuple(t.shape)) for t in tensors)


def _desc(t: Tensor) -> str:
    return f"{str(t.dtype).removeprefix('torch.')}{list(t.shape)}"


def _descs(tensors: Sequence[Tensor]) -> str:
    return ", ".join(_desc(t) for t in tensors)


def _nbytes(tensors: Sequence[Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def _dtype(tensors: Sequence[Tensor]) -> torch.dtype | None:
    dtypes = {t.dtype for t in tensors}
    return dtypes.pop() if len(dtypes) == 1 else None


class _DoneWork(dist.Work):
    """The Work a synchronous ``dist.*`` call gets: complete, shared by every call.

    ``dist.*(async_op=False)`` calls ``wait()`` on it and drops it. A Python Work
    answers that ``wait()`` without a trip through C++ (which lets go of the GIL and
    takes it back): ~2% of a 4-rank all_reduce. C++ reaches its methods through
    torch's trampoline, as it reaches :class:`SimWork`'s.
    """

    def wait(self, timeout: object = None) -> bool:
        return True

    def is_completed(self) -> bool:
        return True

    def is_success(self) -> bool:
        return True

    def exception(self) -> BaseException | None:
        return None

    def result(self) -> list[Tensor]:
        return []

    def synchronize(self) -> None:
        """Nothing to wait for."""

    def get_future(self) -> torch.futures.Future[list[Tensor]]:
        fut: torch.futures.Future[list[Tensor]] = torch.futures.Future()
        fut.set_result([])
        return fut


_DONE = _DoneWork()  # shared by every synchronous call of the process


class _BackendTraits:
    """The backend traits c10d's Python code looks up: no coalescing, no splitting."""

    supports_coalescing = False
    supports_splitting = False
    supports_time_estimate = False
    _supports_time_estimate = False

    def name(self) -> str:
        return BACKEND_NAME


_BACKEND_TRAITS = _BackendTraits()


def _reduce_op(opts: Any) -> tuple[str, Any]:
    """The reduce op's name and, for PREMUL_SUM, its factor."""
    if opts is None:
        return "SUM", None
    op = opts.reduceOp
    name = _torch_private.reduce_op_names_by_hash().get(hash(op))  # runs once per rank per call
    if name is not None:
        return name, None
    name = getattr(op, "op", op).name
    return name, (_torch_private.premul_factor(op) if name == "PREMUL_SUM" else None)


_DTYPE_PROBLEMS: dict[tuple[str, torch.dtype], str | None] = {}


def _reduce_problem(op: str, dtype: torch.dtype) -> str | None:
    key = (op, dtype)
    try:
        return _DTYPE_PROBLEMS[key]  # one lookup on the hot path
    except KeyError:
        problem = _DTYPE_PROBLEMS[key] = mv.check_reduce_dtype(op, dtype)
        return problem


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
            if _torch_private.dispatch_modes_active():
                run = functools.partial(method, self, *args, **kwargs)
                work: dist.Work = _torch_private.through_dispatcher(self._twin(), names, args, kwargs, run)
                return work
            return method(self, *args, **kwargs)

        return observable

    return decorate


class SimProcessGroup(dist.ProcessGroup):
    """One rank's handle on one simulated process group."""

    def __init__(self, context: RankContext, group: Any, group_rank: int) -> None:
        super().__init__(group_rank, group.size)  # type: ignore[call-arg]
        self._context = context
        self._group = group
        self._group_rank = group_rank
        self._seq = 0
        self._p2p_seq: dict[tuple[str, int], int] = {}
        # what ledgers count from (restart_numbering): the rendezvous keeps counting
        self._seq_base = 0
        self._p2p_base: dict[tuple[str, int], int] = {}
        # c10d makes a group in the rank thread that uses it: that thread's open
        # ledgers, held here, spare a thread-local lookup on every collective.
        self._ledgers = _ledger.open_ledgers()
        self._dispatcher_twin: Any = None  # made when a dispatch mode first watches a call

    def _twin(self) -> Any:
        if self._dispatcher_twin is None:
            self._dispatcher_twin = _torch_private.dispatcher_twin(
                self._group_rank, self._group.size, self._group.name, BACKEND_NAME
            )
        return self._dispatcher_twin

    @property
    def group_name(self) -> str:  # type: ignore[override]
        name: str = self._group.name
        return name

    def restart_numbering(self) -> None:
        """Number this group's calls in ledgers from 0 again (see :func:`restart_numbering`)."""
        self._seq_base = self._seq
        self._p2p_base = dict(self._p2p_seq)

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

    # -- the common path ----------------------------------------------------------

    def _collective(
        self,
        *,
        op: str,
        api: str,
        signature: tuple[Any, ...],
        describe: Callable[[], str],
        payload: Any,
        execute: Callable[[Sequence[Call]], None],
        compat: Callable[[Sequence[Call]], list[mv.Problem]] | None = None,
        ledger: Callable[[], tuple[torch.dtype | None, int, int]],
        reduce_op: str | None = None,
        root: int | None = None,
        result: object = None,
        opts: Any = None,
    ) -> dist.Work:
        # The rank stays inside this call until every rank has arrived, which is
        # whenever an error needs the site: keep the frame, format it only then.
        frame = sys._getframe(1)
        where: str | FrameType = frame
        seq = self._seq
        self._seq += 1
        if self._ledgers:
            dtype, bytes_in, bytes_out = ledger()
            where = self._record(frame, op, api, dtype, bytes_in, bytes_out, reduce_op, seq, root)
        call = Call(self._group_rank, op, signature, describe, where, payload, execute, compat)
        context = self._context
        context.rendezvous.meet(self._group, seq, call, context.rank)
        if opts is not None and getattr(opts, "asyncOp", True) is False:
            # dist.*(async_op=False) waits on this Work and drops it: one shared,
            # completed Work spares a Future per rank per call
            return _DONE
        return completed_work(result)

    def _record(
        self,
        frame: FrameType,
        op: str,
        api: str,
        dtype: torch.dtype | None,
        bytes_in: int,
        bytes_out: int,
        reduce_op: str | None,
        seq: int,
        root: int | None,
    ) -> str:
        """Add the call to the open ledgers; returns its site."""
        ranks = self._group.ranks
        site = _sites.site_of(frame)
        peer = ranks[root] if root is not None else None
        seq -= self._seq_base
        _ledger.append(Collective(op, api, ranks, dtype, bytes_in, bytes_out, reduce_op, seq, site, peer))
        return site

    def _check_reduce(self, op: str, tensors: Sequence[Tensor], api: str) -> None:
        for t in tensors:
            problem = _reduce_problem(op, t.dtype)
            if problem is not None:
                raise ValueError(f"{api}: {problem}")

    def _check_root(self, root: int, api: str) -> None:
        if not 0 <= root < self._group.size:
            raise ValueError(f"{api}: root rank {root} is not a rank of this {self._group.size}-rank group")

    # -- reductions -------------------------------------------------------------

    def allreduce(self, tensors: Any, opts: Any = None) -> dist.Work:  # type: ignore[override]
        if _torch_private.dispatch_modes_active():  # see _observable, inlined on the hot path
            run = functools.partial(self._allreduce, tensors, opts)
            args = (tensors, opts)
            work: dist.Work = _torch_private.through_dispatcher(self._twin(), ("allreduce",), args, {}, run)
            return work
        return self._allreduce(tensors, opts)

    def _allreduce(self, tensors: Any, opts: Any) -> dist.Work:
        tensors = [tensors] if isinstance(tensors, Tensor) else list(tensors)
        if len(tensors) != 1:
            return self._all_reduce(tensors, opts, "all_reduce_coalesced")
        # One tensor: the hot path of DDP and of most programs. The Call is the one
        # _all_reduce makes, built without _collective's keyword arguments, ledger
        # closure and extra frames: 3-5% of a 4-rank all_reduce (paired in-world A/B).
        t = tensors[0]
        op, factor = _reduce_op(opts)
        problem = _reduce_problem(op, t.dtype)
        if problem is not None:
            raise ValueError(f"all_reduce: {problem}")
        seq = self._seq
        self._seq = seq + 1
        frame = sys._getframe(1)  # not this one, which will hold the call: a reference cycle
        where: str | FrameType = frame
        if self._ledgers:
            nbytes = t.numel() * t.element_size()
            where = self._record(frame, "all_reduce", "all_reduce", t.dtype, nbytes, nbytes, op, seq, None)
        signature = (op, ((t.dtype, tuple(t.shape)),))  # _meta's, for one tensor

        def describe() -> str:  # _all_reduce's text
            return f"all_reduce({_desc(t)}, {op})"

        payload = (tensors, op, factor)
        call = Call(self._group_rank, "all_reduce", signature, describe, where, payload, _ops.all_reduce)
        context = self._context
        context.rendezvous.meet(self._group, seq, call, context.rank)
        if opts is not None and getattr(opts, "asyncOp", True) is False:
            return _DONE  # see _collective
        return completed_work(tensors)

    @_observable(
        "allreduce_coalesced",
    )
    def allreduce_coalesced(self, tensors: list[Tensor], opts: Any = None) -> dist.Work:
        return self.allreduce(tensors, opts)

    def _all_reduce(self, tensors: list[Tensor], opts: Any, api: str) -> dist.Work:
        op, factor = _reduce_op(opts)
        self._check_reduce(op, tensors, api)
        return self._collective(
            op="all_reduce",
            api=api,
            signature=(op, _meta(tensors)),
            describe=lambda: f"{api}({_descs(tensors)}, {op})",
            payload=(tensors, op, factor),
            execute=_ops.all_reduce,
            ledger=lambda: (_dtype(tensors), _nbytes(tensors), _nbytes(tensors)),
            reduce_op=op,
            result=tensors,
            opts=opts,
        )

    @_observable(
        "reduce",
    )
    def reduce(self, tensors: list[Tensor], opts: Any = None) -> dist.Work:  # type: ignore[override]
        tensors = list(tensors)
        op, factor = _reduce_op(opts)
        root = opts.rootRank if opts is not None else 0
        self._check_reduce(op, tensors, "reduce")
        self._check_root(root, "reduce")
        nbytes = _nbytes(tensors)
        return self._collective(
            op="reduce",
            api="reduce",
            signature=(op, root, _meta(tensors)),
            describe=lambda: f"reduce({_descs(tensors)}, {op}, dst={root})",
            payload=(tensors, root, op, factor),
            execute=_ops.reduce,
            ledger=lambda: (_dtype(tensors), nbytes, nbytes if self._group_rank == root else 0),
            reduce_op=op,
            root=root,
            result=tensors,
            opts=opts,
        )

    @_observable(
        "reduce_scatter",
    )
    def reduce_scatter(  # type: ignore[override]
        self, outputs: list[Tensor], input_lists: list[list[Tensor]], opts: Any = None
    ) -> dist.Work:
        outputs, input_lists = list(outputs), [list(x) for x in input_lists]
        op, factor = _reduce_op(opts)
        self._check_reduce(op, outputs, "reduce_scatter")
        self._check_lists(input_lists, outputs, "reduce_scatter", "input")
        flat_in = [t for lst in input_lists for t in lst]
        return self._collective(
            op="reduce_scatter",
            api="reduce_scatter",
            signature=(op, tuple(t.dtype for t in flat_in + outputs)),
            describe=lambda: f"reduce_scatter({_descs(outputs)} <- {len(flat_in)} tensors, {op})",
            payload=(outputs, input_lists, op, factor),
            execute=_ops.reduce_scatter,
            compat=_ops.reduce_scatter_compat,
            ledger=lambda: (_dtype(outputs), _nbytes(flat_in), _nbytes(outputs)),
            reduce_op=op,
            result=outputs,
            opts=opts,
        )

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
        op, factor = _reduce_op(opts)
        self._check_reduce(op, inputs, api)
        self._check_sized(outputs, inputs, api, "input", "output")
        return self._collective(
            op="reduce_scatter",
            api=api,
            signature=(op, _meta(inputs), _meta(outputs)),
            describe=lambda: f"{api}({_descs(inputs)} -> {_descs(outputs)}, {op})",
            payload=(outputs, inputs, op, factor),
            execute=_ops.reduce_scatter_tensor,
            ledger=lambda: (_dtype(inputs), _nbytes(inputs), _nbytes(outputs)),
            reduce_op=op,
            result=outputs,
            opts=opts,
        )

    # -- gathers ------------------------------------------------------------------

    @_observable(
        "allgather",
    )
    def allgather(  # type: ignore[override]
        self, output_lists: list[list[Tensor]], inputs: list[Tensor], opts: Any = None
    ) -> dist.Work:
        output_lists, inputs = [list(x) for x in output_lists], list(inputs)
        return self._all_gather(output_lists, inputs, "all_gather", opts)

    @_observable(
        "allgather_coalesced",
    )
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
        self._check_lists(output_lists, inputs, api, "output")
        flat_out = [t for lst in output_lists for t in lst]
        return self._collective(
            op="all_gather",
            api=api,
            signature=(tuple(t.dtype for t in inputs + flat_out), len(inputs)),
            describe=lambda: f"{api}({_descs(inputs)} -> {len(flat_out)} tensors)",
            payload=(output_lists, inputs),
            execute=_ops.all_gather,
            compat=_ops.all_gather_compat,
            ledger=lambda: (_dtype(inputs), _nbytes(inputs), _nbytes(flat_out)),
            result=output_lists,
            opts=opts,
        )

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
        self._check_sized(inputs, outputs, api, "output", "input")
        return self._collective(
            op="all_gather",
            api=api,
            signature=(_meta(inputs), _meta(outputs)),
            describe=lambda: f"{api}({_descs(inputs)} -> {_descs(outputs)})",
            payload=(outputs, inputs),
            execute=_ops.all_gather_into_tensor,
            ledger=lambda: (_dtype(inputs), _nbytes(inputs), _nbytes(outputs)),
            result=outputs,
            opts=opts,
        )

    @_observable(
        "gather",
    )
    def gather(self, output_lists: list[list[Tensor]], inputs: list[Tensor], opts: Any = None) -> dist.Work:  # type: ignore[override]
        root = opts.rootRank if opts is not None else 0
        self._check_root(root, "gather")
        inputs = list(inputs)
        outputs = list(output_lists[0]) if output_lists else None
        self._check_rooted(outputs, root, inputs[0], "gather", "gather_list")
        return self._collective(
            op="gather",
            api="gather",
            signature=(root, inputs[0].dtype),
            describe=lambda: f"gather({_desc(inputs[0])}, dst={root})",
            payload=(outputs, inputs[0], root),
            execute=_ops.gather,
            compat=_ops.gather_compat,
            ledger=lambda: (inputs[0].dtype, _nbytes(inputs), _nbytes(outputs) if outputs else 0),
            root=root,
            result=outputs,
            opts=opts,
        )

    @_observable(
        "scatter",
    )
    def scatter(self, outputs: list[Tensor], input_lists: list[list[Tensor]], opts: Any = None) -> dist.Work:  # type: ignore[override]
        root = opts.rootRank if opts is not None else 0
        self._check_root(root, "scatter")
        outputs = list(outputs)
        inputs = list(input_lists[0]) if input_lists else None
        self._check_rooted(inputs, root, outputs[0], "scatter", "scatter_list")
        return self._collective(
            op="scatter",
            api="scatter",
            signature=(root, outputs[0].dtype),
            describe=lambda: f"scatter(-> {_desc(outputs[0])}, src={root})",
            payload=(outputs[0], inputs, root),
            execute=_ops.scatter,
            compat=_ops.scatter_compat,
            ledger=lambda: (outputs[0].dtype, _nbytes(inputs) if inputs else 0, _nbytes(outputs)),
            root=root,
            result=outputs,
            opts=opts,
        )

    @_observable(
        "broadcast",
    )
    def broadcast(self, tensors: Any, opts: Any = None) -> dist.Work:  # type: ignore[override]
        tensors = [tensors] if isinstance(tensors, Tensor) else list(tensors)
        root = opts.rootRank if opts is not None else 0
        self._check_root(root, "broadcast")
        nbytes = _nbytes(tensors)
        is_root = self._group_rank == root
        return self._collective(
            op="broadcast",
            api="broadcast",
            signature=(root, _meta(tensors)),
            describe=lambda: f"broadcast({_descs(tensors)}, src={root})",
            payload=(tensors, root),
            execute=_ops.broadcast,
            ledger=lambda: (_dtype(tensors), nbytes if is_root else 0, 0 if is_root else nbytes),
            root=root,
            result=tensors,
            opts=opts,
        )

    # -- all to all -----------------------------------------------------------------

    @_observable("all_to_all_single", "alltoall_base")
    def all_to_all_single(
        self,
        output: Tensor,
        input: Tensor,
        output_split_sizes: list[int],
        input_split_sizes: list[int],
        opts: Any = None,
    ) -> dist.Work:
        size = self._group.size
        out_splits = self._splits(output, output_split_sizes, "output")
        in_splits = self._splits(input, input_split_sizes, "input")
        return self._collective(
            op="all_to_all",
            api="all_to_all_single",
            signature=(input.dtype, output.dtype),
            describe=lambda: (
                f"all_to_all_single({_desc(input)} split {in_splits} -> {_desc(output)} split {out_splits})"
            ),
            payload=(output, input, out_splits, in_splits),
            execute=_ops.all_to_all_single,
            compat=_ops.all_to_all_single_compat if size > 1 else None,
            ledger=lambda: (input.dtype, _nbytes([input]), _nbytes([output])),
            result=[output],
            opts=opts,
        )

    alltoall_base = all_to_all_single  # type: ignore[assignment]

    @_observable(
        "alltoall",
    )
    def alltoall(self, outputs: list[Tensor], inputs: list[Tensor], opts: Any = None) -> dist.Work:
        outputs, inputs = list(outputs), list(inputs)
        for name, lst in (("output", outputs), ("input", inputs)):
            if len(lst) != self._group.size:
                raise ValueError(
                    f"all_to_all: the {name} list has {len(lst)} tensors; a "
                    f"{self._group.size}-rank group needs one per rank"
                )
        return self._collective(
            op="all_to_all",
            api="all_to_all",
            signature=(tuple(t.dtype for t in inputs + outputs),),
            describe=lambda: f"all_to_all({_descs(inputs)} -> {_descs(outputs)})",
            payload=(outputs, inputs),
            execute=_ops.all_to_all,
            compat=_ops.all_to_all_compat,
            ledger=lambda: (_dtype(inputs), _nbytes(inputs), _nbytes(outputs)),
            result=outputs,
            opts=opts,
        )

    @_observable(
        "barrier",
    )
    def barrier(self, opts: Any = None) -> dist.Work:
        return self._collective(
            op="barrier",
            api="barrier",
            signature=(),
            describe=lambda: "barrier()",
            payload=None,
            execute=_ops.barrier,
            ledger=lambda: (None, 0, 0),
            opts=opts,
        )

    # -- point to point -------------------------------------------------------------

    @_observable(
        "send",
    )
    def send(self, tensors: list[Tensor], dstRank: int, tag: int = 0) -> dist.Work:
        tensors = list(tensors)
        self._check_peer(dstRank, "send")
        site = _sites.call_site(2)
        self._record_p2p("send", dstRank, tensors, site)
        text = f"send({_descs(tensors)}, dst={self._group.ranks[dstRank]}, tag={tag})"
        with torch.no_grad():
            copies = [t.detach().clone() for t in tensors]
        message = Message(self._group_rank, dstRank, tag, copies, text, site)
        scheduler = self._context.scheduler
        with scheduler:
            scheduler.raise_if_aborted()
            self._group.mailbox.send(message, scheduler)
        return completed_work(tensors)

    @_observable(
        "recv",
    )
    def recv(self, tensors: list[Tensor], srcRank: int, tag: int = 0) -> dist.Work:
        self._check_peer(srcRank, "recv")
        return self._recv(list(tensors), srcRank, tag)

    @_observable(
        "recv_anysource",
    )
    def recv_anysource(self, tensors: list[Tensor], tag: int = 0) -> dist.Work:
        return self._recv(list(tensors), None, tag)

    def _recv(self, tensors: list[Tensor], src: int | None, tag: int) -> dist.Work:
        site = _sites.call_site(3)
        self._record_p2p("recv", src, tensors, site)
        who = "any rank" if src is None else f"rank {self._group.ranks[src]}"
        text = f"recv({_descs(tensors)}) from {who} (tag {tag})"
        mailbox = self._group.mailbox
        recv = PostedRecv(mailbox, self._group_rank, src, tag, tensors, text, site, _deliver)
        scheduler = self._context.scheduler
        with scheduler:
            scheduler.raise_if_aborted()
            mailbox.post(recv, scheduler)
        return SimWork(self._context, recv)

    def _record_p2p(self, op: str, peer: int | None, tensors: list[Tensor], site: str) -> None:
        key = (op, -1 if peer is None else peer)
        seq = self._p2p_seq.get(key, 0)
        self._p2p_seq[key] = seq + 1
        if _ledger.is_recording():
            seq -= self._p2p_base.get(key, 0)
            nbytes = _nbytes(tensors)
            sent, received = (nbytes, 0) if op == "send" else (0, nbytes)
            ranks = self._group.ranks
            peer_rank = None if peer is None else ranks[peer]
            _ledger.append(
                Collective(op, op, ranks, _dtype(tensors), sent, received, None, seq, site, peer_rank)
            )

    # -- argument checks --------------------------------------------------------------

    def _check_peer(self, peer: int, api: str) -> None:
        if not 0 <= peer < self._group.size:
            raise ValueError(f"{api}: peer rank {peer} is not a rank of this {self._group.size}-rank group")
        if peer == self._group_rank:
            raise ValueError(f"{api}: rank {self._group.ranks[peer]} cannot {api} to or from itself")

    def _check_lists(self, lists: list[list[Tensor]], singles: list[Tensor], api: str, what: str) -> None:
        size = self._group.size
        if len(lists) != len(singles):
            raise ValueError(f"{api}: got {len(lists)} {what} lists for {len(singles)} tensors")
        for lst in lists:
            if len(lst) != size:
                raise ValueError(
                    f"{api}: each {what} list must hold one tensor per rank of the "
                    f"{size}-rank group, got {len(lst)}"
                )

    def _check_sized(
        self, small: list[Tensor], big: list[Tensor], api: str, big_name: str, small_name: str
    ) -> None:
        size = self._group.size
        if len(small) != len(big):
            raise ValueError(
                f"{api}: got {len(big)} {big_name} tensors for {len(small)} {small_name} tensors"
            )
        for s, b in zip(small, big):
            if b.numel() != s.numel() * size:
                raise ValueError(
                    f"{api}: the {big_name} tensor {_desc(b)} must hold {size} times the "
                    f"elements of the {small_name} tensor {_desc(s)} ({s.numel() * size}), "
                    f"got {b.numel()}"
                )
            if not b.is_contiguous():
                raise ValueError(f"{api}: the {big_name} tensor must be contiguous")
            if b.dtype != s.dtype:
                raise ValueError(
                    f"{api}: {big_name} dtype {b.dtype} differs from {small_name} dtype {s.dtype}"
                )

    def _check_rooted(self, lst: list[Tensor] | None, root: int, single: Tensor, api: str, name: str) -> None:
        if self._group_rank == root:
            if lst is None or len(lst) != self._group.size:
                got = 0 if lst is None else len(lst)
                raise ValueError(
                    f"{api}: the root must pass a {name} of {self._group.size} tensors, got {got}"
                )
        elif lst:
            raise ValueError(f"{api}: only the root (rank {root} of the group) may pass a {name}")

    def _splits(self, tensor: Tensor, splits: Sequence[int] | None, name: str) -> list[int]:
        size = self._group.size
        dim0 = tensor.size(0) if tensor.dim() > 0 else 0
        if not splits:
            if dim0 % size:
                raise ValueError(
                    f"all_to_all_single: {name} dim 0 ({dim0}) must divide by the group size "
                    f"({size}) when no {name} split sizes are given"
                )
            return mv.split_sizes(dim0, (), size)
        splits = [int(s) for s in splits]
        if len(splits) != size or sum(splits) != dim0 or min(splits) < 0:
            raise ValueError(
                f"all_to_all_single: {name} split sizes {splits} must be {size} non-negative "
                f"numbers summing to the {name}'s dim 0 ({dim0})"
            )
        return splits


@torch.no_grad()
def _deliver(message: Message, recv: PostedRecv) -> str | None:
    """Copy a message into its receive, or say why they do not fit."""
    if len(message.tensors) != len(recv.tensors):
        return f"{len(message.tensors)} tensors sent, {len(recv.tensors)} expected"
    for sent, into in zip(message.tensors, recv.tensors):
        if sent.dtype != into.dtype or sent.numel() != into.numel():
            return f"sent {_desc(sent)}, receiving into {_desc(into)}"
    for sent, into in zip(message.tensors, recv.tensors):
        _torch_private.write(into.detach(), sent.reshape(into.shape))
    return None
