"""Ledger records for real C++ process groups (gloo, NCCL), taken at the dispatcher.

C++ process groups send every ``dist.*`` call through ``c10d::*`` operators, and
functional collectives (funcol, DTensor, FSDP) through ``_c10d_functional::*``.
A :class:`DispatchRecorder` mode, entered in a rank's thread for its whole life,
sees each of them once and produces exactly the :class:`~meshsim.Collective` the
simulated backend records for the same call: same op and api names, group,
dtype, bytes, reduce op and sequence numbers.

Tensor subclasses (DTensor, ShardTensor) are let through first (``NotImplemented``),
so their own ``__torch_dispatch__`` runs with this mode entered and the collectives
they desugar into are seen on plain tensors, as on the simulated backend.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch.utils._python_dispatch import TorchDispatchMode

from meshsim._base import context
from meshsim._process import thread_worlds as _thread_worlds
from meshsim._record import ledger as _ledger
from meshsim._record import sites as _sites
from meshsim._record.ledger import Collective

__all__ = ["DispatchRecorder", "Entered"]

Tensor = torch.Tensor


@dataclass
class _Seen:
    """What a handler extracts from one dispatched collective."""

    op: str
    api: str
    group: Any  # a ProcessGroup, or a group name for functional collectives
    tensors_in: Sequence[Tensor]
    tensors_out: Sequence[Tensor]
    reduce_op: str | None = None
    root: int | None = None  # group rank of the root of a rooted collective
    peer: int | None = None  # group rank of the other end of a send or recv (-1: any)
    functional: bool = False  # a _c10d_functional operator (funcol), not a c10d one (dist.*)


def _count_api(name: str, count: int) -> str:
    return name if count == 1 else f"{name}_coalesced"


def _nbytes(tensors: Sequence[Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def _flat(lists: Sequence[Sequence[Tensor]]) -> list[Tensor]:
    return [t for lst in lists for t in lst]


def _op_name(reduce_op: Any) -> str:
    """The name of a ReduceOp as c10d ops receive it: a ScriptObject whose ``op()`` is the kind's value."""
    return dist.ReduceOp.RedOpType(int(reduce_op.op())).name


# -- c10d::* (plain dist.* calls on a C++ process group) ------------------------------


def _allreduce(a: Sequence[Any], out: Any) -> _Seen:
    return _Seen("all_reduce", _count_api("all_reduce", len(a[0])), a[1], a[0], a[0], _op_name(a[2]))


def _broadcast(a: Sequence[Any], out: Any) -> _Seen:
    return _Seen("broadcast", "broadcast", a[1], a[0], a[0], root=a[2])


def _reduce(a: Sequence[Any], out: Any) -> _Seen:
    return _Seen("reduce", "reduce", a[1], a[0], a[0], _op_name(a[2]), root=a[3])


def _allgather(a: Sequence[Any], out: Any) -> _Seen:
    return _Seen("all_gather", "all_gather", a[2], a[1], _flat(a[0]))


def _allgather_coalesced(a: Sequence[Any], out: Any) -> _Seen:
    return _Seen("all_gather", "all_gather_coalesced", a[2], a[1], _flat(a[0]))


def _allgather_base(a: Sequence[Any], out: Any) -> _Seen:
    return _Seen("all_gather", "all_gather_into_tensor", a[2], [a[1]], [a[0]])


def _allgather_into_tensor_coalesced(a: Sequence[Any], out: Any) -> _Seen:
    return _Seen("all_gather", _count_api("all_gather_into_tensor", len(a[0])), a[2], a[1], a[0])


def _reduce_scatter(a: Sequence[Any], out: Any) -> _Seen:
    return _Seen("reduce_scatter", "reduce_scatter", a[2], _flat(a[1]), a[0], _op_name(a[3]))


def _reduce_scatter_base(a: Sequence[Any], out: Any) -> _Seen:
    return _Seen("reduce_scatter", "reduce_scatter_tensor", a[2], [a[1]], [a[0]], _op_name(a[3]))


def _reduce_scatter_tensor_coalesced(a: Sequence[Any], out: Any) -> _Seen:
    api = _count_api("reduce_scatter_tensor", len(a[0]))
    return _Seen("reduce_scatter", api, a[2], a[1], a[0], _op_name(a[3]))


def _alltoall_base(a: Sequence[Any], out: Any) -> _Seen:
    return _Seen("all_to_all", "all_to_all_single", a[2], [a[1]], [a[0]])


def _alltoall(a: Sequence[Any], out: Any) -> _Seen:
    return _Seen("all_to_all", "all_to_all", a[2], a[1], a[0])


def _gather(a: Sequence[Any], out: Any) -> _Seen:
    return _Seen("gather", "gather", a[2], a[1], _flat(a[0]), root=a[3])


def _scatter(a: Sequence[Any], out: Any) -> _Seen:
    return _Seen("scatter", "scatter", a[2], _flat(a[1]), a[0], root=a[3])


def _barrier(a: Sequence[Any], out: Any) -> _Seen:
    return _Seen("barrier", "barrier", a[1], [], [])


def _send(a: Sequence[Any], out: Any) -> _Seen:
    return _Seen("send", "send", a[1], a[0], [], peer=a[2])


def _recv(a: Sequence[Any], out: Any) -> _Seen:
    return _Seen("recv", "recv", a[1], [], a[0], peer=a[2])


def _recv_any(a: Sequence[Any], out: Any) -> _Seen:
    return _Seen("recv", "recv", a[1], [], a[0], peer=-1)


# -- _c10d_functional::* (funcol, DTensor, FSDP) ----------------------------------------


def _f_all_gather(a: Sequence[Any], out: Any) -> _Seen:
    return _Seen("all_gather", "all_gather_into_tensor", a[2], [a[0]], [out])


def _f_all_gather_coalesced(a: Sequence[Any], out: Any) -> _Seen:
    api = _count_api("all_gather_into_tensor", len(a[0]))
    return _Seen("all_gather", api, a[2], a[0], out)


def _f_all_reduce(a: Sequence[Any], out: Any) -> _Seen:
    return _Seen("all_reduce", "all_reduce", a[2], [a[0]], [a[0]], a[1].upper())


def _f_all_reduce_coalesced(a: Sequence[Any], out: Any) -> _Seen:
    return _Seen("all_reduce", _count_api("all_reduce", len(a[0])), a[2], a[0], a[0], a[1].upper())


def _f_reduce_scatter(a: Sequence[Any], out: Any) -> _Seen:
    return _Seen("reduce_scatter", "reduce_scatter_tensor", a[3], [a[0]], [out], a[1].upper())


def _f_reduce_scatter_coalesced(a: Sequence[Any], out: Any) -> _Seen:
    api = _count_api("reduce_scatter_tensor", len(a[0]))
    return _Seen("reduce_scatter", api, a[3], a[0], out, a[1].upper())


def _f_all_to_all(a: Sequence[Any], out: Any) -> _Seen:
    return _Seen("all_to_all", "all_to_all_single", a[3], [a[0]], [out])


def _f_shard_dim_alltoall(a: Sequence[Any], out: Any) -> _Seen:
    return _Seen("all_to_all", "all_to_all_single", a[3], [a[0]], [out])


def _f_broadcast(a: Sequence[Any], out: Any) -> _Seen:
    return _Seen("broadcast", "broadcast", a[2], [a[0]], [a[0]], root=a[1])


def _f_isend(a: Sequence[Any], out: Any) -> _Seen:
    return _Seen("send", "send", a[3], [a[0]], [], peer=a[1])


def _f_irecv(a: Sequence[Any], out: Any) -> _Seen:
    return _Seen("recv", "recv", a[3], [], [a[0]], peer=a[1])


def _f_batch_p2p(a: Sequence[Any], out: Any) -> list[_Seen]:
    seen = []
    for kind, peer, tensor in zip(a[0], a[1], a[3]):
        if "send" in kind:
            seen.append(_Seen("send", "send", a[4], [tensor], [], peer=peer))
        else:
            seen.append(_Seen("recv", "recv", a[4], [], [tensor], peer=peer))
    return seen


_Handler = Callable[[Sequence[Any], Any], "_Seen | list[_Seen]"]

_HANDLERS: dict[tuple[str, str], _Handler] = {
    ("c10d", "allreduce_"): _allreduce,
    ("c10d", "allreduce_coalesced_"): _allreduce,
    ("c10d", "broadcast_"): _broadcast,
    ("c10d", "reduce_"): _reduce,
    ("c10d", "allgather_"): _allgather,
    ("c10d", "allgather_coalesced_"): _allgather_coalesced,
    ("c10d", "_allgather_base_"): _allgather_base,
    ("c10d", "allgather_into_tensor_coalesced_"): _allgather_into_tensor_coalesced,
    ("c10d", "reduce_scatter_"): _reduce_scatter,
    ("c10d", "_reduce_scatter_base_"): _reduce_scatter_base,
    ("c10d", "reduce_scatter_tensor_coalesced_"): _reduce_scatter_tensor_coalesced,
    ("c10d", "alltoall_base_"): _alltoall_base,
    ("c10d", "alltoall_"): _alltoall,
    ("c10d", "gather_"): _gather,
    ("c10d", "scatter_"): _scatter,
    ("c10d", "barrier"): _barrier,
    ("c10d", "send"): _send,
    ("c10d", "recv_"): _recv,
    ("c10d", "recv_any_source_"): _recv_any,
    ("_c10d_functional", "all_gather_into_tensor"): _f_all_gather,
    ("_c10d_functional", "all_gather_into_tensor_out"): _f_all_gather,
    ("_c10d_functional", "all_gather_into_tensor_coalesced"): _f_all_gather_coalesced,
    ("_c10d_functional", "all_reduce"): _f_all_reduce,
    ("_c10d_functional", "all_reduce_"): _f_all_reduce,
    ("_c10d_functional", "all_reduce_coalesced"): _f_all_reduce_coalesced,
    ("_c10d_functional", "all_reduce_coalesced_"): _f_all_reduce_coalesced,
    ("_c10d_functional", "reduce_scatter_tensor"): _f_reduce_scatter,
    ("_c10d_functional", "reduce_scatter_tensor_out"): _f_reduce_scatter,
    ("_c10d_functional", "reduce_scatter_tensor_coalesced"): _f_reduce_scatter_coalesced,
    ("_c10d_functional", "all_to_all_single"): _f_all_to_all,
    ("_c10d_functional", "broadcast"): _f_broadcast,
    ("_c10d_functional", "broadcast_"): _f_broadcast,
    ("_c10d_functional", "isend"): _f_isend,
    ("_c10d_functional", "irecv"): _f_irecv,
    ("_c10d_functional", "batch_p2p_ops"): _f_batch_p2p,
    ("_dtensor", "shard_dim_alltoall"): _f_shard_dim_alltoall,
}


class DispatchRecorder(TorchDispatchMode):  # type: ignore[no-untyped-call,misc]
    """Feeds :func:`meshsim.record` from the dispatcher; enter it in each rank's thread.

    Sequence numbers count every collective seen since the mode was entered,
    recorded or not, so that they match the simulated backend's, which counts
    from the creation of each group (a world, or a test, starts the count).
    """

    def __init__(self) -> None:
        super().__init__()  # type: ignore[no-untyped-call]
        self._seq: dict[str, int] = {}
        self._ranks: dict[str, tuple[int, ...]] = {}
        self.entered = 0.0  # time.monotonic() when this rank last entered a collective
        self._outer: DispatchRecorder | None = None
        # the call this rank is in (or that raised), and the last one that returned, for
        # the per-rank report of a failed world (:mod:`meshsim._record.standing`)
        self.pending: Entered | None = None
        self.last: Entered | None = None

    def __enter__(self) -> DispatchRecorder:
        here = context.current()
        self._outer, here.recorder = here.recorder, self
        entered: DispatchRecorder = super().__enter__()  # type: ignore[no-untyped-call]
        return entered

    def __exit__(self, *exc_info: Any) -> None:
        super().__exit__(*exc_info)  # type: ignore[no-untyped-call]
        context.current().recorder = self._outer

    @classmethod
    def ignore_compile_internals(cls) -> bool:
        """Stay out of torch.compile's tracing, and see the compiled code's collectives when it runs.

        A mode that answers False here makes dynamo refuse to compile anything
        ("non-infra torch dispatch mode present") while it is entered, and this mode
        is entered in every gloo, spawned and torchrun rank. torch 2.11-2.15 consult it.
        """
        return True

    def restart_numbering(self) -> None:
        """Count every group's calls from 0 again (a session's next test)."""
        self._seq.clear()

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        handler = _HANDLERS.get((func.namespace, func._overloadpacket.__name__))
        if handler is None:
            if any(_runs_own_dispatch(t) for t in types):
                # A user subclass (ShardTensor): calling ``func`` here would run its
                # __torch_dispatch__ with this mode off (a mode is off inside its own
                # handler), and the collectives it issues would go unrecorded. Declining
                # lets torch call the subclass with this mode still entered.
                return NotImplemented
            return func(*args, **kwargs)
        if any(t is not Tensor and issubclass(t, Tensor) for t in types):
            # A collective on a subclass (DTensor): let it desugar first, then see the
            # plain-tensor collectives it issues.
            return NotImplemented
        where = _sites.call_where(2)
        self.entered = time.monotonic()
        pending = self.pending = self._entered(handler(args, None), where)
        out = func(*args, **kwargs)  # raising, it leaves ``pending`` set: the call it failed in
        self.pending = None
        self.last = pending
        seen = handler(args, kwargs.get("out", out))
        for one in seen if isinstance(seen, list) else [seen]:
            one.functional = func.namespace == "_c10d_functional"
            self._note(one, where)
        return out

    def _entered(self, seen: _Seen | list[_Seen], where: tuple[str, str | None]) -> Entered:
        """The call being entered, as the report names it (its outputs may not exist yet)."""
        first = seen[0] if isinstance(seen, list) else seen
        name, ranks, _ = self._group(first.group)
        key = f"{name}/{first.op}/{first.peer}" if first.op in ("send", "recv") else name
        return Entered(_call_text(first), name, ranks, self._seq.get(key, 0), where[0])

    def counts(self) -> dict[str, tuple[tuple[int, ...], int]]:
        """Each group's name: its global ranks and the collectives this rank issued on it (no send/recv)."""
        seq = dict(self._seq)  # one C-level copy: another rank thread may read while this one records
        return {name: (ranks, seq[name]) for name, ranks in dict(self._ranks).items() if name in seq}

    def _note(self, seen: _Seen, where: tuple[str, str | None]) -> None:
        name, ranks, me = self._group(seen.group)
        if seen.op in ("send", "recv"):
            key = f"{name}/{seen.op}/{seen.peer}"
        else:
            key = name
        seq = self._seq.get(key, 0)
        self._seq[key] = seq + 1
        if not _ledger.is_recording():
            return
        _ledger.append(self._collective(seen, ranks, me, seq, where))

    def _collective(
        self, seen: _Seen, ranks: tuple[int, ...], me: int, seq: int, where: tuple[str, str | None]
    ) -> Collective:
        bytes_in, bytes_out = _nbytes(seen.tensors_in), _nbytes(seen.tensors_out)
        other = seen.root if seen.root is not None else seen.peer
        peer = None if other is None or other < 0 else ranks[other]
        if seen.root is not None:
            bytes_in, bytes_out = _rooted_bytes(seen, me, bytes_in, bytes_out)
        tensors = list(seen.tensors_in) or list(seen.tensors_out)
        dtypes = {t.dtype for t in tensors}
        dtype = dtypes.pop() if len(dtypes) == 1 else None
        if dtype is not None and dtype.is_complex and _viewed_as_real(seen):
            dtype = dtype.to_real()
        site, via = where
        return Collective(
            seen.op, seen.api, ranks, dtype, bytes_in, bytes_out, seen.reduce_op, seq, site, peer, via=via
        )

    def _group(self, group: Any) -> tuple[str, tuple[int, ...], int]:
        pg = _thread_worlds.as_process_group(group)
        name = pg.group_name
        ranks = self._ranks.get(name)
        if ranks is None:
            ranks = self._ranks[name] = tuple(dist.get_process_group_ranks(pg))
        return name, ranks, pg.rank()


@dataclass(frozen=True)
class Entered:
    """A collective a rank entered, as a per-rank report shows it.

    Attributes:
        text: the call, e.g. ``all_reduce(float32[4], SUM)``.
        group: the group's name (the same on every rank).
        ranks: the group's global ranks.
        seq: the call's position in the group's sequence (0 is the first).
        site: ``file.py:LINE in function`` of the user's call.
    """

    text: str
    group: str
    ranks: tuple[int, ...]
    seq: int
    site: str

    def where(self) -> str:
        return f"call #{self.seq} of group {list(self.ranks)}"


def _desc(tensors: Sequence[Tensor | None] | None) -> str:
    return ", ".join(
        f"{str(t.dtype).removeprefix('torch.')}{list(t.shape)}" for t in tensors or () if t is not None
    )


def _call_text(seen: _Seen) -> str:
    """``all_reduce(float32[4], SUM)``, as the simulated backend's tables write a call."""
    parts = [_desc(seen.tensors_in) or _desc(seen.tensors_out)]
    if seen.reduce_op is not None:
        parts.append(seen.reduce_op)
    if seen.root is not None:
        parts.append(f"root={seen.root}")
    if seen.peer is not None:
        parts.append(f"peer={seen.peer}")
    return f"{seen.api}({', '.join(p for p in parts if p)})"


def _refusing_subclasses() -> tuple[type, ...]:
    """torch's own subclasses that answer NotImplemented to a foreign mode's ops.

    FakeTensor (DTensor's sharding propagation, torch.compile's tracing) and
    FunctionalTensor (AOTAutograd) decline an op while their mode is entered or when
    another mode's type is present; were this mode to decline too, nobody would take
    the op and torch would raise. Their ops run here as on plain tensors. Private
    module paths: checked on torch 2.11, 2.13, 2.14 and 2.15.
    """
    from torch._subclasses.fake_tensor import FakeTensor
    from torch._subclasses.functional_tensor import FunctionalTensor

    return (FakeTensor, FunctionalTensor)


_REFUSING: tuple[type, ...] = _refusing_subclasses()


def _runs_own_dispatch(t: type) -> bool:
    """Whether a tensor subclass should run its own __torch_dispatch__ under this mode."""
    return t is not Tensor and issubclass(t, Tensor) and not issubclass(t, _REFUSING)


# Single-tensor functional collectives whose complex tensors c10d's C++ layer hands to
# the backend as real pairs (c10d::isComplexViewAsRealAllowed: no reduce op, SUM, AVG,
# PREMUL_SUM), below the dispatcher: their dtype is translated here to match what
# reaches the wire (and the simulated backend's record). ``dist.all_reduce`` and
# friends view as real in Python, before the dispatcher; ``dist.reduce_scatter_tensor``
# does not, and its complex tensors reach the wire as they are. Checked on torch 2.13.
_VIEW_AS_REAL_APIS = frozenset({"all_reduce", "broadcast", "all_gather_into_tensor", "reduce_scatter_tensor"})


def _viewed_as_real(seen: _Seen) -> bool:
    return (
        seen.functional
        and seen.api in _VIEW_AS_REAL_APIS
        and seen.reduce_op in (None, "SUM", "AVG", "PREMUL_SUM")
    )


def _rooted_bytes(seen: _Seen, me: int, bytes_in: int, bytes_out: int) -> tuple[int, int]:
    """What this rank sends and receives in a rooted collective, as the sim backend counts it."""
    root = seen.root
    if seen.op == "broadcast":
        return (bytes_in, 0) if me == root else (0, bytes_out)
    if seen.op == "reduce":
        return bytes_in, bytes_out if me == root else 0
    if seen.op == "gather":
        return bytes_in, bytes_out if me == root else 0
    if seen.op == "scatter":
        return (bytes_in if me == root else 0), bytes_out
    return bytes_in, bytes_out
