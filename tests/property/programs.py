"""Generated SPMD programs for meshsim's property tests (issue 5): the vocabulary, the
program model, every rank's inputs, and the generators.

A :class:`Program` is plain data: the groups every rank creates, then :class:`Step` s
that every rank runs identically; a :class:`Fault` changes what one rank does at one
step (:func:`plan`). Every input is a function of (global rank, step, salt). The rest of
the machinery lives beside this module: :mod:`runs` (how a rank runs a program inside
``meshsim.run``, and where each call is issued), :mod:`reference` (every rank's outputs,
computed with plain torch in one thread), :mod:`calls` (every rank's exact ledger) and
:mod:`faults` (what meshsim must report for a fault).

Generators take a :class:`Source` of choices: :class:`RandomSource` wraps
``random.Random(seed)`` (the soak script), :class:`HypothesisSource` wraps hypothesis'
``draw`` (the tests), so both make the same kinds of programs.
"""

from __future__ import annotations

import functools
import math
import pickle
import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import Any, Protocol, TypeVar

import torch
import torch.distributed as dist

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


Out = tuple[Any, ...]  # what one step gives one rank


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


def a2a_shapes(step: Step, me: int) -> tuple[list[int], list[int], tuple[int, ...], tuple[int, ...]]:
    """all_to_all_single: (output splits, input splits, output shape, input shape) of group rank ``me``."""
    out_splits = [row[me] for row in step.splits]
    in_splits = list(step.splits[me])
    return out_splits, in_splits, (sum(out_splits), *step.shape), (sum(in_splits), *step.shape)


def pickled_size(o: object) -> int:
    return len(pickle.dumps(o))  # torch pickles with the default protocol, as here


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


# ProcessGroupGloo's own complex AVG in these is an ulp off (seven 3.5+10.5j average to
# 3.5000002+10.5j; its all_reduce, handed real pairs, is exact, as is meshsim's sim backend):
# the exact reference cannot judge it.
_GLOO_INEXACT_COMPLEX_AVG = ("reduce_scatter", "reduce_scatter_tensor", "reduce")


@functools.cache
def _gloo_lacks() -> tuple[str, ...]:
    """Collectives this torch's ProcessGroupGloo refuses (torch 2.11: the list-form all_to_all)."""

    def all_to_all() -> None:
        dist.all_to_all([torch.empty(1) for _ in range(2)], [torch.ones(1) for _ in range(2)])

    try:
        meshsim.run(all_to_all, 2, backend="gloo", timeout=30)
    except meshsim.RankError as error:
        if "does not support alltoall" in str(error.__cause__):
            return ("all_to_all",)
        raise
    return ()


def _draw_step(src: Source, program: Program, gloo: bool) -> Step:
    ref = choose(src, program.refs())
    n = len(program.subgroups(ref)[0])
    kinds = [k for k in KINDS if not (k == "p2p" and n < 2) and not (gloo and k in _gloo_lacks())]
    kind = choose(src, kinds)
    dtype = choose(src, dtypes_for(kind, gloo=gloo))
    op = choose(src, ops_for(dtype, gloo=gloo)) if kind in REDUCING else None
    if gloo and dtype.is_complex and op == "AVG" and kind in _GLOO_INEXACT_COMPLEX_AVG:
        op = "SUM"
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
