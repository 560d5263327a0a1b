"""Each collective as one typed description: what a rank passes, what must match, what moves, how.

A rank's side of a collective is an instance of one of the classes below, built
by the backend from c10d's arguments (:mod:`meshsim._sim.backend`). Each class says,
in one place:

- its fields: the tensors and options the rank passed;
- :meth:`Description.signature`: what must be equal on every rank of the group
  (the rendezvous compares it as ranks arrive);
- :meth:`Description.describe`: the call as text, for error tables;
- :meth:`Description.traffic`: the ledger's dtype, bytes in and bytes out for a rank;
- ``execute(payloads)``: given every rank's description in group-rank order,
  compute with :mod:`meshsim._sim.movement` and write each rank's outputs;
- ``compat(payloads)``: for what may differ between ranks (all_to_all splits,
  gathered shapes), the problems that make the ranks' calls not fit together;
- ``wasted(payloads)``: why the call could not tell any rank anything new (every
  rank contributed the same bytes, a broadcast to ranks that hold the root's bytes),
  or None; asked before the data moves.

Every result is computed before any output is written, so inputs that alias
outputs (FSDP's all_gather input is a view of its output) are safe. Outputs are
written as a process group writes them: no autograd version bump
(:func:`write`).
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar

import torch

from meshsim._sim import movement as mv

__all__ = [
    "AllGather",
    "AllGatherIntoTensor",
    "AllReduce",
    "AllToAll",
    "AllToAllSingle",
    "Barrier",
    "Broadcast",
    "Description",
    "Gather",
    "Reduce",
    "ReduceScatter",
    "ReduceScatterTensor",
    "Scatter",
    "copy_to_all",
    "write",
]

Tensor = torch.Tensor
Meta = tuple[tuple[torch.dtype, tuple[int, ...]], ...]
Compat = Callable[[Sequence[Any]], list[mv.Problem]] | None  # a description's cross-rank check
Waste = Callable[[Sequence[Any]], str | None] | None  # its wasted-call rule

# autograd's version counters can be set only through this private call (it takes
# tuples of tensors and versions: checked in torch 2.11-2.15)
_SET_VERSIONS: Callable[[tuple[Tensor, ...], tuple[int, ...]], None] = (
    torch._C._autograd._unsafe_set_version_counter  # type: ignore[attr-defined]
)


def write(out: Tensor, value: Tensor) -> None:
    """``out.copy_(value)``, as a process group writes it: the version counter does not move.

    gloo and NCCL write a collective's output in C++, under autograd's radar; a
    Python ``copy_`` bumps the counter, and a view of a tensor that an in-place
    collective wrote (``torch.chunk(x, n)[r]`` with ``dist.broadcast(x.detach())``)
    would then fail autograd's in-place check in its next use, where on gloo it does
    not. An output without a counter (an inference tensor) is written as
    :func:`_write_uncounted` says.
    """
    # try/except, not an is_inference() check: entering a try costs nothing on
    # Python 3.11+, while the check is one more C call (about 0.1 us) on every write
    try:
        version = out._version
    except RuntimeError:
        _write_uncounted(out, value)
        return
    out.copy_(value)
    _SET_VERSIONS((out,), (version,))


def copy_to_all(outs: Sequence[Tensor], value: Tensor) -> None:
    """:func:`write` ``value`` into every tensor of ``outs`` (all of ``value``'s shape, dtype and device)."""
    outs = tuple(outs)
    try:
        versions = tuple([out._version for out in outs])  # a list first: no generator per call
    except RuntimeError:  # an output without a counter: each written on its own
        for out in outs:
            write(out, value)
        return
    for out in outs:
        out.copy_(value)
    _SET_VERSIONS(outs, versions)


def _write_uncounted(out: Tensor, value: Tensor) -> None:
    """Write an output that has no version counter (an inference tensor), as gloo does.

    Outside ``torch.inference_mode()`` torch refuses an in-place update of an
    inference tensor, and the rank that carries out a collective need not be in
    the mode the output's owner made it in (gloo writes in C++ and never asks):
    inside the mode the copy is allowed, and nothing is recorded (issue 24).
    """
    with torch.inference_mode():
        out.copy_(value)


class Description:
    """What every description answers; subclasses are dataclasses of one rank's arguments.

    Class attributes:
        op: the normalized operation the ledger shows (``all_reduce``, ``all_gather``, ...).
        compat: the cross-rank check for what may differ between ranks, or None.
        wasted: the check for a call that tells no rank anything new, or None. It may flag
            a call only when every rank's ``contributed()`` tensors hold the same bytes (the
            rendezvous skips it when two ranks' differ).
    """

    op: ClassVar[str]
    compat: ClassVar[Compat] = None
    wasted: ClassVar[Waste] = None
    # The fields that hold what the rank puts on the wire, what the Work's future gives,
    # and the root (None: the base's answers, nothing)
    sent: ClassVar[str | None] = None
    written: ClassVar[str | None] = None
    rooted_at: ClassVar[str | None] = None
    api: str

    def contributed(self) -> list[Tensor]:
        """The tensors whose bytes this rank puts on the wire (compared with earlier calls)."""
        return getattr(self, self.sent) if self.sent is not None else []

    def signature(self) -> tuple[Any, ...]:
        raise NotImplementedError

    def describe(self) -> str:
        raise NotImplementedError

    def traffic(self, group_rank: int) -> tuple[torch.dtype | None, int, int]:
        """The ledger's dtype, bytes this rank contributes and bytes it receives."""
        raise NotImplementedError

    def result(self) -> object:
        """What the Work's future holds: the tensors written."""
        return getattr(self, self.written) if self.written is not None else None

    @property
    def reduce_op(self) -> str | None:
        """The reduce op's name, for reducing collectives (their ``op_name`` field)."""
        name: str | None = getattr(self, "op_name", None)
        return name

    @property
    def root(self) -> int | None:
        """The root's group rank, for rooted collectives."""
        return getattr(self, self.rooted_at) if self.rooted_at is not None else None

    @staticmethod
    def execute(payloads: Sequence[Any]) -> None:
        raise NotImplementedError


# -- helpers -----------------------------------------------------------------------------


def meta(tensors: Sequence[Tensor]) -> Meta:
    if len(tensors) == 1:  # the common case, without a generator
        t = tensors[0]
        return ((t.dtype, tuple(t.shape)),)
    return tuple((t.dtype, tuple(t.shape)) for t in tensors)


def desc(t: Tensor) -> str:
    return f"{str(t.dtype).removeprefix('torch.')}{list(t.shape)}"


def descs(tensors: Sequence[Tensor]) -> str:
    return ", ".join(desc(t) for t in tensors)


def nbytes(tensors: Sequence[Tensor]) -> int:
    """The bytes ``tensors`` hold as dense data (elements x element size)."""
    if len(tensors) == 1:  # the common case: one attribute read, no generator
        t = tensors[0]
        if t.layout is torch.strided:  # Tensor.nbytes refuses sparse layouts
            return int(t.nbytes)
    return sum(t.numel() * t.element_size() for t in tensors)


def dtype_of(tensors: Sequence[Tensor]) -> torch.dtype | None:
    dtypes = {t.dtype for t in tensors}
    return dtypes.pop() if len(dtypes) == 1 else None


def _no_grad(execute: Callable[[Sequence[Any]], None]) -> Callable[[Sequence[Any]], None]:
    """Run the decorated ``execute`` with autograd off.

    Switching the mode costs about as much as asking two ranks' tensors whether one
    requires grad, and less from four ranks on (it runs once per collective).
    """

    @functools.wraps(execute)
    def wrapper(payloads: Sequence[Any]) -> None:
        if torch.is_grad_enabled():
            torch.set_grad_enabled(False)
            try:
                execute(payloads)
            finally:
                torch.set_grad_enabled(True)
            return
        execute(payloads)

    return wrapper


def _write(out: Tensor, value: Tensor) -> None:
    # Under no_grad a plain copy is invisible to autograd; reshape only when needed.
    write(out, value if value.shape == out.shape else value.reshape(out.shape))


def _write_all(outs: Sequence[Tensor], value: Tensor) -> None:
    """Copy ``value`` into every tensor of ``outs``, which all have one shape and dtype.

    The ranks' signatures were compared before any data moves, so the first
    output's shape and dtype stand for all of them: ``value`` is reshaped once, not
    once per rank (a gathered flat result into 2-D outputs, DTensor's case).
    """
    shape = outs[0].shape  # copy_ converts dtypes and moves across devices
    copy_to_all(outs, value if value.shape == shape else value.reshape(shape))


def _numel(shape: Sequence[int]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def _numel_shapes(table: Sequence[Sequence[Any]]) -> list[list[tuple[int, ...] | None]]:
    """Compare only element counts: pieces of equal size but other shape fit on the wire."""
    return [[None if s is None else (_numel(s),) for s in row] for row in table]


# -- wasted calls ----------------------------------------------------------------------------


def _same_everywhere(per_rank: Sequence[Sequence[Tensor]]) -> bool:
    """Whether every rank's tensors hold the bytes rank 0's hold (stops at the first difference)."""
    count = len(per_rank[0])
    firsts = []
    for tensors in per_rank:
        if len(tensors) != count:
            return False
        if count:
            firsts.append(tensors[0])
    if count == 0:
        return True
    if not mv.all_same_bytes(firsts):
        return False
    return all(mv.all_same_bytes([tensors[j] for tensors in per_rank]) for j in range(1, count))


def _plural(n: int, what: str) -> str:
    return f"{n} {what}" if n == 1 else f"{n} {what}s"


_NOTHING = "every rank's input is empty (0 bytes): the call moves nothing"


def _same_contribution(per_rank: Sequence[Sequence[Tensor]], who: str) -> str | None:
    if not _same_everywhere(per_rank):
        return None
    return _contribution_reason(nbytes(per_rank[0]), who)


# A program that wastes a call usually does so in a loop: its reasons are made once each.
@functools.lru_cache(maxsize=256)
def _contribution_reason(size: int, who: str) -> str:
    if size == 0:  # the same shapes everywhere, all empty
        return _NOTHING
    return (
        f"every rank contributed the same {_plural(size, 'byte')}: "
        f"{who} could build the result from its own input"
    )


def _local_reduction(op: str, ranks: int) -> str | None:
    """What reducing ``ranks`` equal inputs with ``op`` gives, in words; None when it is not local."""
    if op in ("AVG", "MAX", "MIN", "BAND", "BOR"):
        return "the input itself"
    if op == "SUM":
        return f"{ranks} x the input"
    if op == "PRODUCT":
        return f"the input to the power {ranks}"
    if op == "BXOR":
        return "the input itself" if ranks % 2 else "zero"
    return None  # PREMUL_SUM: each rank's factor is its own


def _same_reduction(op: str, per_rank: Sequence[Sequence[Tensor]], who: str) -> str | None:
    if not _same_everywhere(per_rank):
        return None
    return _reduction_reason(op, nbytes(per_rank[0]), len(per_rank), who)


@functools.lru_cache(maxsize=256)
def _reduction_reason(op: str, size: int, ranks: int, who: str) -> str | None:
    if size == 0:  # the same shapes everywhere, all empty
        return _NOTHING
    local = _local_reduction(op, ranks)
    if local is None:
        return None
    return (
        f"every rank's input is the same {_plural(size, 'byte')}: the {op} is {local}, "
        f"which {who} could compute locally"
    )


# -- reductions --------------------------------------------------------------------------


def _all_reduce_wasted(payloads: Sequence[AllReduce]) -> str | None:
    return _same_reduction(payloads[0].op_name, [p.tensors for p in payloads], "each rank")


@dataclass(slots=True, eq=False)
class AllReduce(Description):
    """``dist.all_reduce``: every rank's tensors become the reduction of every rank's."""

    tensors: list[Tensor]
    op_name: str
    factor: Any  # PREMUL_SUM's scale factor
    api: str = "all_reduce"

    op: ClassVar[str] = "all_reduce"
    sent: ClassVar[str | None] = "tensors"
    written: ClassVar[str | None] = "tensors"
    wasted: ClassVar[Waste] = _all_reduce_wasted

    def signature(self) -> tuple[Any, ...]:
        return (self.op_name, meta(self.tensors))

    def describe(self) -> str:
        return f"{self.api}({descs(self.tensors)}, {self.op_name})"

    def traffic(self, group_rank: int) -> tuple[torch.dtype | None, int, int]:
        n = nbytes(self.tensors)
        return dtype_of(self.tensors), n, n

    @staticmethod
    @_no_grad
    def execute(payloads: Sequence[AllReduce]) -> None:
        op = payloads[0].op_name
        if len(payloads) == 1 and op != "PREMUL_SUM":
            return  # every op of one rank's tensor is that tensor (a mesh dimension of size 1)
        factors = [p.factor for p in payloads] if op == "PREMUL_SUM" else None
        count = len(payloads[0].tensors)
        if count == 1:  # the common case: a reduction keeps the shape, so no reshape to check
            tensors = [p.tensors[0] for p in payloads]
            copy_to_all(tensors, mv.reduce(tensors, op, factors))
            return
        # every result before any write: a rank's tensors may alias each other
        results = [mv.reduce([p.tensors[i] for p in payloads], op, factors) for i in range(count)]
        for i, result in enumerate(results):
            _write_all([p.tensors[i] for p in payloads], result)


def _reduce_wasted(payloads: Sequence[Reduce]) -> str | None:
    return _same_reduction(payloads[0].op_name, [p.tensors for p in payloads], "the root")


@dataclass(slots=True, eq=False)
class Reduce(Description):
    """``dist.reduce``: the root's tensors become the reduction of every rank's."""

    tensors: list[Tensor]
    dst: int  # group rank of the root
    op_name: str
    factor: Any
    api: str = "reduce"

    op: ClassVar[str] = "reduce"
    sent: ClassVar[str | None] = "tensors"
    written: ClassVar[str | None] = "tensors"
    rooted_at: ClassVar[str | None] = "dst"
    wasted: ClassVar[Waste] = _reduce_wasted

    def signature(self) -> tuple[Any, ...]:
        return (self.op_name, self.dst, meta(self.tensors))

    def describe(self) -> str:
        return f"reduce({descs(self.tensors)}, {self.op_name}, dst={self.dst})"

    def traffic(self, group_rank: int) -> tuple[torch.dtype | None, int, int]:
        n = nbytes(self.tensors)
        return dtype_of(self.tensors), n, n if group_rank == self.dst else 0

    @staticmethod
    @_no_grad
    def execute(payloads: Sequence[Reduce]) -> None:
        root, op = payloads[0].dst, payloads[0].op_name
        factors = [p.factor for p in payloads]
        outs = payloads[root].tensors
        results = [mv.reduce([p.tensors[i] for p in payloads], op, factors) for i in range(len(outs))]
        for out, result in zip(outs, results):
            _write(out, result)


def _reduce_scatter_compat(payloads: Sequence[ReduceScatter]) -> list[mv.Problem]:
    problems = []
    for j in range(len(payloads[0].outputs)):
        for r, receiver in enumerate(payloads):
            want = receiver.outputs[j].numel()
            for s, sender in enumerate(payloads):
                got = sender.input_lists[j][r]
                if got.numel() != want:
                    text = (
                        f"rank {s} contributes shape {list(got.shape)} to rank {r}, "
                        f"whose output holds {want} elements"
                    )
                    problems.append(mv.Problem(text, (s, r)))
    return problems


def _reduce_scatter_wasted(payloads: Sequence[ReduceScatter]) -> str | None:
    return _same_reduction(payloads[0].op_name, [p._inputs() for p in payloads], "each rank")


@dataclass(slots=True, eq=False)
class ReduceScatter(Description):
    """``dist.reduce_scatter``: rank r's ``outputs[j]`` reduces every rank's ``input_lists[j][r]``."""

    outputs: list[Tensor]
    input_lists: list[list[Tensor]]
    op_name: str
    factor: Any
    api: str = "reduce_scatter"

    op: ClassVar[str] = "reduce_scatter"
    written: ClassVar[str | None] = "outputs"
    compat: ClassVar[Compat] = _reduce_scatter_compat
    wasted: ClassVar[Waste] = _reduce_scatter_wasted

    def contributed(self) -> list[Tensor]:
        return self._inputs()

    def _inputs(self) -> list[Tensor]:
        return [t for lst in self.input_lists for t in lst]

    def signature(self) -> tuple[Any, ...]:
        return (self.op_name, tuple(t.dtype for t in self._inputs() + self.outputs))

    def describe(self) -> str:
        return f"reduce_scatter({descs(self.outputs)} <- {len(self._inputs())} tensors, {self.op_name})"

    def traffic(self, group_rank: int) -> tuple[torch.dtype | None, int, int]:
        return dtype_of(self.outputs), nbytes(self._inputs()), nbytes(self.outputs)

    @staticmethod
    @_no_grad
    def execute(payloads: Sequence[ReduceScatter]) -> None:
        op = payloads[0].op_name
        factors = [p.factor for p in payloads]
        count = len(payloads[0].outputs)
        results = [
            [mv.reduce([p.input_lists[j][r] for p in payloads], op, factors) for j in range(count)]
            for r in range(len(payloads))
        ]
        for payload, rank_results in zip(payloads, results):
            for out, result in zip(payload.outputs, rank_results):
                _write(out, result)


def _reduce_scatter_tensor_wasted(payloads: Sequence[ReduceScatterTensor]) -> str | None:
    return _same_reduction(payloads[0].op_name, [p.inputs for p in payloads], "each rank")


@dataclass(slots=True, eq=False)
class ReduceScatterTensor(Description):
    """``dist.reduce_scatter_tensor``: rank r gets the r-th chunk of each reduced ``inputs[j]``."""

    outputs: list[Tensor]
    inputs: list[Tensor]
    op_name: str
    factor: Any
    api: str = "reduce_scatter_tensor"

    op: ClassVar[str] = "reduce_scatter"
    sent: ClassVar[str | None] = "inputs"
    written: ClassVar[str | None] = "outputs"
    wasted: ClassVar[Waste] = _reduce_scatter_tensor_wasted

    def signature(self) -> tuple[Any, ...]:
        return (self.op_name, meta(self.inputs), meta(self.outputs))

    def describe(self) -> str:
        return f"{self.api}({descs(self.inputs)} -> {descs(self.outputs)}, {self.op_name})"

    def traffic(self, group_rank: int) -> tuple[torch.dtype | None, int, int]:
        return dtype_of(self.inputs), nbytes(self.inputs), nbytes(self.outputs)

    @staticmethod
    @_no_grad
    def execute(payloads: Sequence[ReduceScatterTensor]) -> None:
        op = payloads[0].op_name
        factors = [p.factor for p in payloads]
        for j in range(len(payloads[0].outputs)):
            chunks = mv.reduce_scatter_flat([p.inputs[j] for p in payloads], op, factors)
            for payload, chunk in zip(payloads, chunks):
                _write(payload.outputs[j], chunk)


# -- gathers ----------------------------------------------------------------------------------


def _all_gather_compat(payloads: Sequence[AllGather]) -> list[mv.Problem]:
    sent = [[tuple(p.inputs[j].shape) for p in payloads] for j in range(len(payloads[0].inputs))]
    problems = []
    for j, shapes in enumerate(sent):
        for r, p in enumerate(payloads):
            for s, out in enumerate(p.output_lists[j]):
                if out.numel() != _numel(shapes[s]):
                    text = (
                        f"rank {r} gathers {out.numel()} elements from rank {s}, "
                        f"which contributes shape {list(shapes[s])}"
                    )
                    problems.append(mv.Problem(text, (r, s)))
    return problems


def _all_gather_wasted(payloads: Sequence[AllGather]) -> str | None:
    return _same_contribution([p.inputs for p in payloads], "each rank")


@dataclass(slots=True, eq=False)
class AllGather(Description):
    """``dist.all_gather`` (list form): ``output_lists[j][s]`` receives rank s's ``inputs[j]``."""

    output_lists: list[list[Tensor]]
    inputs: list[Tensor]
    api: str = "all_gather"

    op: ClassVar[str] = "all_gather"
    sent: ClassVar[str | None] = "inputs"
    written: ClassVar[str | None] = "output_lists"
    compat: ClassVar[Compat] = _all_gather_compat
    wasted: ClassVar[Waste] = _all_gather_wasted

    def _outputs(self) -> list[Tensor]:
        return [t for lst in self.output_lists for t in lst]

    def signature(self) -> tuple[Any, ...]:
        return (tuple(t.dtype for t in self.inputs + self._outputs()), len(self.inputs))

    def describe(self) -> str:
        return f"{self.api}({descs(self.inputs)} -> {len(self._outputs())} tensors)"

    def traffic(self, group_rank: int) -> tuple[torch.dtype | None, int, int]:
        return dtype_of(self.inputs), nbytes(self.inputs), nbytes(self._outputs())

    @staticmethod
    @_no_grad
    def execute(payloads: Sequence[AllGather]) -> None:
        for j in range(len(payloads[0].inputs)):
            sources = [p.inputs[j].clone() for p in payloads]
            for payload in payloads:
                for out, src in zip(payload.output_lists[j], sources):
                    _write(out, src)


def _all_gather_into_tensor_wasted(payloads: Sequence[AllGatherIntoTensor]) -> str | None:
    return _same_contribution([p.inputs for p in payloads], "each rank")


@dataclass(slots=True, eq=False)
class AllGatherIntoTensor(Description):
    """``dist.all_gather_into_tensor``: ``outputs[j]`` concatenates every rank's flat ``inputs[j]``."""

    outputs: list[Tensor]
    inputs: list[Tensor]
    api: str = "all_gather_into_tensor"

    op: ClassVar[str] = "all_gather"
    sent: ClassVar[str | None] = "inputs"
    written: ClassVar[str | None] = "outputs"
    wasted: ClassVar[Waste] = _all_gather_into_tensor_wasted

    def signature(self) -> tuple[Any, ...]:
        return (meta(self.inputs), meta(self.outputs))

    def describe(self) -> str:
        return f"{self.api}({descs(self.inputs)} -> {descs(self.outputs)})"

    def traffic(self, group_rank: int) -> tuple[torch.dtype | None, int, int]:
        return dtype_of(self.inputs), nbytes(self.inputs), nbytes(self.outputs)

    @staticmethod
    @_no_grad
    def execute(payloads: Sequence[AllGatherIntoTensor]) -> None:
        for j in range(len(payloads[0].inputs)):
            inputs = [p.inputs[j] for p in payloads]  # one shape on every rank: the signatures matched
            gathered = mv.all_gather_rows(inputs) if inputs[0].dim() else mv.all_gather_flat(inputs)
            _write_all([p.outputs[j] for p in payloads], gathered)


def _gather_compat(payloads: Sequence[Gather]) -> list[mv.Problem]:
    root = payloads[0].dst
    outputs = payloads[root].outputs or []
    sent: list[list[tuple[int, ...] | None]] = [[None] * len(payloads) for _ in payloads]
    for s, p in enumerate(payloads):
        sent[s][root] = tuple(p.input.shape)
    expected: list[list[tuple[int, ...] | None]] = [[None] * len(payloads) for _ in payloads]
    expected[root] = [tuple(t.shape) for t in outputs]
    return mv.compat_exchange(_numel_shapes(sent), _numel_shapes(expected), "a tensor")


def _gather_wasted(payloads: Sequence[Gather]) -> str | None:
    return _same_contribution([[p.input] for p in payloads], "the root")


@dataclass(slots=True, eq=False)
class Gather(Description):
    """``dist.gather``: the root's ``outputs[s]`` receives rank s's ``input``."""

    outputs: list[Tensor] | None  # the root's gather_list; None elsewhere
    input: Tensor
    dst: int
    api: str = "gather"

    op: ClassVar[str] = "gather"
    written: ClassVar[str | None] = "outputs"
    rooted_at: ClassVar[str | None] = "dst"
    compat: ClassVar[Compat] = _gather_compat
    wasted: ClassVar[Waste] = _gather_wasted

    def contributed(self) -> list[Tensor]:
        return [self.input]

    def signature(self) -> tuple[Any, ...]:
        return (self.dst, self.input.dtype)

    def describe(self) -> str:
        return f"gather({desc(self.input)}, dst={self.dst})"

    def traffic(self, group_rank: int) -> tuple[torch.dtype | None, int, int]:
        return self.input.dtype, nbytes([self.input]), nbytes(self.outputs) if self.outputs else 0

    @staticmethod
    @_no_grad
    def execute(payloads: Sequence[Gather]) -> None:
        root = payloads[0].dst
        sources = [p.input.clone() for p in payloads]
        for out, src in zip(payloads[root].outputs or [], sources):
            _write(out, src)


def _scatter_compat(payloads: Sequence[Scatter]) -> list[mv.Problem]:
    root = payloads[0].src
    sent: list[list[Any]] = [[None] * len(payloads) for _ in payloads]
    sent[root] = [tuple(t.shape) for t in payloads[root].inputs or []]
    expected = [[tuple(p.output.shape)] * len(payloads) for p in payloads]
    return mv.compat_exchange(_numel_shapes(sent), _numel_shapes(expected), "a piece")


@dataclass(slots=True, eq=False)
class Scatter(Description):
    """``dist.scatter``: rank r's ``output`` receives the root's ``inputs[r]``."""

    output: Tensor
    inputs: list[Tensor] | None  # the root's scatter_list; None elsewhere
    src: int
    api: str = "scatter"

    op: ClassVar[str] = "scatter"
    rooted_at: ClassVar[str | None] = "src"
    compat: ClassVar[Compat] = _scatter_compat

    def signature(self) -> tuple[Any, ...]:
        return (self.src, self.output.dtype)

    def describe(self) -> str:
        return f"scatter(-> {desc(self.output)}, src={self.src})"

    def traffic(self, group_rank: int) -> tuple[torch.dtype | None, int, int]:
        return self.output.dtype, nbytes(self.inputs) if self.inputs else 0, nbytes([self.output])

    def result(self) -> object:
        return [self.output]

    @staticmethod
    @_no_grad
    def execute(payloads: Sequence[Scatter]) -> None:
        pieces = [t.clone() for t in payloads[payloads[0].src].inputs or []]
        for payload, piece in zip(payloads, pieces):
            _write(payload.output, piece)


def _broadcast_wasted(payloads: Sequence[Broadcast]) -> str | None:
    if not _same_everywhere([p.tensors for p in payloads]):
        return None
    if nbytes(payloads[0].tensors) == 0:
        return _NOTHING
    n = nbytes(payloads[0].tensors)
    return f"every rank already held the root's {_plural(n, 'byte')}"


@dataclass(slots=True, eq=False)
class Broadcast(Description):
    """``dist.broadcast``: every rank's tensors become the root's."""

    tensors: list[Tensor]
    src: int
    api: str = "broadcast"

    op: ClassVar[str] = "broadcast"
    sent: ClassVar[str | None] = "tensors"
    written: ClassVar[str | None] = "tensors"
    rooted_at: ClassVar[str | None] = "src"
    wasted: ClassVar[Waste] = _broadcast_wasted

    def signature(self) -> tuple[Any, ...]:
        return (self.src, meta(self.tensors))

    def describe(self) -> str:
        return f"broadcast({descs(self.tensors)}, src={self.src})"

    def traffic(self, group_rank: int) -> tuple[torch.dtype | None, int, int]:
        n = nbytes(self.tensors)
        is_root = group_rank == self.src
        return dtype_of(self.tensors), n if is_root else 0, 0 if is_root else n

    @staticmethod
    @_no_grad
    def execute(payloads: Sequence[Broadcast]) -> None:
        root = payloads[0].src
        sources = [t.clone() for t in payloads[root].tensors]
        for i, payload in enumerate(payloads):
            if i != root:
                for out, src in zip(payload.tensors, sources):
                    _write(out, src)


# -- all to all ---------------------------------------------------------------------------


def _all_to_all_single_compat(payloads: Sequence[AllToAllSingle]) -> list[mv.Problem]:
    if len(payloads) == 1:
        return []
    return mv.compat_all_to_all_single(
        [tuple(p.input.shape) for p in payloads],
        [p.input_splits for p in payloads],
        [tuple(p.output.shape) for p in payloads],
        [p.output_splits for p in payloads],
    )


def _all_to_all_single_wasted(payloads: Sequence[AllToAllSingle]) -> str | None:
    # Rank d receives every sender's piece for d. Those pieces all equal d's own piece exactly
    # when every rank's whole input is the same bytes cut the same way, so that is the whole rule.
    if any(list(p.input_splits) != list(payloads[0].input_splits) for p in payloads):
        return None
    return _same_contribution([[p.input] for p in payloads], "each rank")


@dataclass(slots=True, eq=False)
class AllToAllSingle(Description):
    """``dist.all_to_all_single``: rank r receives the r-th dim-0 piece of every rank's ``input``."""

    output: Tensor
    input: Tensor
    output_splits: list[int]  # resolved: one per rank
    input_splits: list[int]
    api: str = "all_to_all_single"

    op: ClassVar[str] = "all_to_all"
    compat: ClassVar[Compat] = _all_to_all_single_compat
    wasted: ClassVar[Waste] = _all_to_all_single_wasted

    def contributed(self) -> list[Tensor]:
        return [self.input]

    def signature(self) -> tuple[Any, ...]:
        return (self.input.dtype, self.output.dtype)

    def describe(self) -> str:
        return (
            f"all_to_all_single({desc(self.input)} split {self.input_splits} -> "
            f"{desc(self.output)} split {self.output_splits})"
        )

    def traffic(self, group_rank: int) -> tuple[torch.dtype | None, int, int]:
        return self.input.dtype, nbytes([self.input]), nbytes([self.output])

    def result(self) -> object:
        return [self.output]

    @staticmethod
    @_no_grad
    def execute(payloads: Sequence[AllToAllSingle]) -> None:
        results = mv.all_to_all_single([p.input for p in payloads], [p.input_splits for p in payloads])
        for payload, result in zip(payloads, results):
            _write(payload.output, result)


def _all_to_all_compat(payloads: Sequence[AllToAll]) -> list[mv.Problem]:
    sent = [[tuple(t.shape) for t in p.inputs] for p in payloads]
    expected = [[tuple(t.shape) for t in p.outputs] for p in payloads]
    return mv.compat_exchange(sent, expected, "a tensor")


def _all_to_all_wasted(payloads: Sequence[AllToAll]) -> str | None:
    # as for all_to_all_single: equal pieces for every destination means equal inputs
    return _same_contribution([p.inputs for p in payloads], "each rank")


@dataclass(slots=True, eq=False)
class AllToAll(Description):
    """``dist.all_to_all``: rank r's ``outputs[s]`` receives rank s's ``inputs[r]``."""

    outputs: list[Tensor]
    inputs: list[Tensor]
    api: str = "all_to_all"

    op: ClassVar[str] = "all_to_all"
    sent: ClassVar[str | None] = "inputs"
    written: ClassVar[str | None] = "outputs"
    compat: ClassVar[Compat] = _all_to_all_compat
    wasted: ClassVar[Waste] = _all_to_all_wasted

    def signature(self) -> tuple[Any, ...]:
        return (tuple(t.dtype for t in self.inputs + self.outputs),)

    def describe(self) -> str:
        return f"all_to_all({descs(self.inputs)} -> {descs(self.outputs)})"

    def traffic(self, group_rank: int) -> tuple[torch.dtype | None, int, int]:
        return dtype_of(self.inputs), nbytes(self.inputs), nbytes(self.outputs)

    @staticmethod
    @_no_grad
    def execute(payloads: Sequence[AllToAll]) -> None:
        received = mv.all_to_all([[t.clone() for t in p.inputs] for p in payloads])
        for payload, pieces in zip(payloads, received):
            for out, piece in zip(payload.outputs, pieces):
                _write(out, piece)


@dataclass(slots=True, eq=False)
class Barrier(Description):
    """``dist.barrier``: nothing moves; meeting is the whole point."""

    api: str = "barrier"

    op: ClassVar[str] = "barrier"

    def signature(self) -> tuple[Any, ...]:
        return ()

    def describe(self) -> str:
        return "barrier()"

    def traffic(self, group_rank: int) -> tuple[torch.dtype | None, int, int]:
        return None, 0, 0

    @staticmethod
    def execute(payloads: Sequence[Barrier]) -> None:
        """Nothing moves."""
