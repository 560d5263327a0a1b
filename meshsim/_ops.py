"""Delivery and cross-rank checks for each collective, given every rank's :class:`Call`.

The backend packs each rank's arguments into ``Call.payload`` (the tuples named
below); these functions read every rank's payload, compute with
:mod:`meshsim._movement`, and copy results into each rank's output tensors.
Every result is computed before any output is written, so inputs that alias
outputs (FSDP's all_gather input is a view of its output) are safe.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import Any

import torch

from meshsim import _movement as mv
from meshsim._rendezvous import Call
from meshsim._torch_private import copy_to_all, write

Tensor = torch.Tensor


_Execute = Callable[[Sequence[Call]], None]


def _no_grad(*indices: int) -> Callable[[_Execute], _Execute]:
    """Run the decorated ``execute`` with autograd off.

    ``indices``: the payload entries holding every tensor the executor reads or
    writes. When none of them requires grad, autograd records nothing anyway and
    its mode is left alone (switching it costs more than the check, and this runs
    once per collective). Without indices the mode is always switched off.
    """

    def decorate(execute: _Execute) -> _Execute:
        @functools.wraps(execute)
        def wrapper(calls: Sequence[Call]) -> None:
            if torch.is_grad_enabled() and (not indices or _requires_grad(calls, indices)):
                torch.set_grad_enabled(False)
                try:
                    execute(calls)
                finally:
                    torch.set_grad_enabled(True)
                return
            execute(calls)

        return wrapper

    return decorate


def _write(out: Tensor, value: Tensor) -> None:
    # Under no_grad a plain copy_ is invisible to autograd; reshape only when needed.
    write(out, value if value.shape == out.shape else value.reshape(out.shape))


def _write_all(outs: Sequence[Tensor], value: Tensor) -> None:
    """Copy ``value`` into every tensor of ``outs``, which all have one shape and dtype.

    The ranks' signatures were compared before any data moves, so the first
    output's shape and dtype stand for all of them.
    """
    if outs[0].shape == value.shape:  # copy_ converts dtypes and moves across devices
        copy_to_all(outs, value)
        return
    for out in outs:
        _write(out, value)


def _requires_grad(calls: Sequence[Call], indices: tuple[int, ...]) -> bool:
    """Whether a tensor of any rank's ``payload[i]``, for ``i`` in ``indices``, requires grad."""
    for c in calls:  # plain loops, no generators: this runs once per collective
        for index in indices:
            for t in c.payload[index]:
                if t.requires_grad:
                    return True
    return False


# payload: (tensors, op, factor)
@_no_grad(0)
def all_reduce(calls: Sequence[Call]) -> None:
    op = calls[0].payload[1]
    if len(calls) == 1 and op != "PREMUL_SUM":
        return  # every op of one rank's tensor is that tensor (a mesh dimension of size 1)
    factors = [c.payload[2] for c in calls] if op == "PREMUL_SUM" else None
    count = len(calls[0].payload[0])
    if count == 1:  # the common case: a reduction keeps the shape, so no reshape to check
        tensors = [c.payload[0][0] for c in calls]
        copy_to_all(tensors, mv.reduce(tensors, op, factors))
        return
    # every result before any write: a rank's tensors may alias each other
    results = [mv.reduce([c.payload[0][i] for c in calls], op, factors) for i in range(count)]
    for i, result in enumerate(results):
        _write_all([c.payload[0][i] for c in calls], result)


# payload: (tensors, root)
@_no_grad()
def broadcast(calls: Sequence[Call]) -> None:
    root = calls[0].payload[1]
    sources = [t.clone() for t in calls[root].payload[0]]
    for i, c in enumerate(calls):
        if i != root:
            for out, src in zip(c.payload[0], sources):
                _write(out, src)


# payload: (tensors, root, op, factor)
@_no_grad()
def reduce(calls: Sequence[Call]) -> None:
    root, op = calls[0].payload[1], calls[0].payload[2]
    factors = [c.payload[3] for c in calls]
    outs = calls[root].payload[0]
    results = [mv.reduce([c.payload[0][i] for c in calls], op, factors) for i in range(len(outs))]
    for out, result in zip(outs, results):
        _write(out, result)


# payload: (output_lists, inputs): output_lists[j][s] receives rank s's inputs[j]
@_no_grad()
def all_gather(calls: Sequence[Call]) -> None:
    for j in range(len(calls[0].payload[1])):
        sources = [c.payload[1][j].clone() for c in calls]
        for c in calls:
            for out, src in zip(c.payload[0][j], sources):
                _write(out, src)


def all_gather_compat(calls: Sequence[Call]) -> list[mv.Problem]:
    sent = [[tuple(c.payload[1][j].shape) for c in calls] for j in range(len(calls[0].payload[1]))]
    problems = []
    for j, shapes in enumerate(sent):
        for r, c in enumerate(calls):
            for s, out in enumerate(c.payload[0][j]):
                if out.numel() != _numel(shapes[s]):
                    text = (
                        f"rank {r} gathers {out.numel()} elements from rank {s}, "
                        f"which contributes shape {list(shapes[s])}"
                    )
                    problems.append(mv.Problem(text, (r, s)))
    return problems


# payload: (outputs, inputs): outputs[j] is the flat concatenation of every rank's inputs[j]
@_no_grad(0, 1)
def all_gather_into_tensor(calls: Sequence[Call]) -> None:
    for j in range(len(calls[0].payload[1])):
        flat = mv.all_gather_flat([c.payload[1][j] for c in calls])
        _write_all([c.payload[0][j] for c in calls], flat)


# payload: (outputs, input_lists, op, factor): rank r's outputs[j] = reduce of input_lists[j][r]
@_no_grad()
def reduce_scatter(calls: Sequence[Call]) -> None:
    op = calls[0].payload[2]
    factors = [c.payload[3] for c in calls]
    count = len(calls[0].payload[0])
    results = [
        [mv.reduce([c.payload[1][j][r] for c in calls], op, factors) for j in range(count)]
        for r in range(len(calls))
    ]
    for c, rank_results in zip(calls, results):
        for out, result in zip(c.payload[0], rank_results):
            _write(out, result)


def reduce_scatter_compat(calls: Sequence[Call]) -> list[mv.Problem]:
    problems = []
    for j in range(len(calls[0].payload[0])):
        for r, receiver in enumerate(calls):
            want = receiver.payload[0][j].numel()
            for s, sender in enumerate(calls):
                got = sender.payload[1][j][r]
                if got.numel() != want:
                    text = (
                        f"rank {s} contributes shape {list(got.shape)} to rank {r}, "
                        f"whose output holds {want} elements"
                    )
                    problems.append(mv.Problem(text, (s, r)))
    return problems


# payload: (outputs, inputs, op, factor): rank r's outputs[j] = r-th chunk of the reduced inputs[j]
@_no_grad()
def reduce_scatter_tensor(calls: Sequence[Call]) -> None:
    op = calls[0].payload[2]
    factors = [c.payload[3] for c in calls]
    for j in range(len(calls[0].payload[0])):
        chunks = mv.reduce_scatter_flat([c.payload[1][j] for c in calls], op, factors)
        for c, chunk in zip(calls, chunks):
            _write(c.payload[0][j], chunk)


# payload: (output, input, output_splits, input_splits), splits already resolved per rank
@_no_grad()
def all_to_all_single(calls: Sequence[Call]) -> None:
    results = mv.all_to_all_single([c.payload[1] for c in calls], [c.payload[3] for c in calls])
    for c, result in zip(calls, results):
        _write(c.payload[0], result)


def all_to_all_single_compat(calls: Sequence[Call]) -> list[mv.Problem]:
    return mv.compat_all_to_all_single(
        [tuple(c.payload[1].shape) for c in calls],
        [c.payload[3] for c in calls],
        [tuple(c.payload[0].shape) for c in calls],
        [c.payload[2] for c in calls],
    )


# payload: (outputs, inputs): rank r's outputs[s] = rank s's inputs[r]
@_no_grad()
def all_to_all(calls: Sequence[Call]) -> None:
    received = mv.all_to_all([[t.clone() for t in c.payload[1]] for c in calls])
    for c, pieces in zip(calls, received):
        for out, piece in zip(c.payload[0], pieces):
            _write(out, piece)


def all_to_all_compat(calls: Sequence[Call]) -> list[mv.Problem]:
    sent = [[tuple(t.shape) for t in c.payload[1]] for c in calls]
    expected = [[tuple(t.shape) for t in c.payload[0]] for c in calls]
    return mv.compat_exchange(sent, expected, "a tensor")


# payload: (output, inputs or None, root)
@_no_grad()
def scatter(calls: Sequence[Call]) -> None:
    root = calls[0].payload[2]
    pieces = [t.clone() for t in calls[root].payload[1]]
    for c, piece in zip(calls, pieces):
        _write(c.payload[0], piece)


def scatter_compat(calls: Sequence[Call]) -> list[mv.Problem]:
    root = calls[0].payload[2]
    sent: list[list[Any]] = [[None] * len(calls) for _ in calls]
    sent[root] = [tuple(t.shape) for t in calls[root].payload[1]]
    expected = [[tuple(c.payload[0].shape)] * len(calls) for c in calls]
    return mv.compat_exchange(_numel_shapes(sent), _numel_shapes(expected), "a piece")


# payload: (outputs or None, input, root)
@_no_grad()
def gather(calls: Sequence[Call]) -> None:
    root = calls[0].payload[2]
    sources = [c.payload[1].clone() for c in calls]
    for out, src in zip(calls[root].payload[0], sources):
        _write(out, src)


def gather_compat(calls: Sequence[Call]) -> list[mv.Problem]:
    root = calls[0].payload[2]
    sent: list[list[tuple[int, ...] | None]] = [[None] * len(calls) for _ in calls]
    for s, c in enumerate(calls):
        sent[s][root] = tuple(c.payload[1].shape)
    expected: list[list[tuple[int, ...] | None]] = [[None] * len(calls) for _ in calls]
    expected[root] = [tuple(t.shape) for t in calls[root].payload[0]]
    return mv.compat_exchange(_numel_shapes(sent), _numel_shapes(expected), "a tensor")


def barrier(calls: Sequence[Call]) -> None:
    """Nothing moves: meeting is the whole point."""


def _numel(shape: Sequence[int]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def _numel_shapes(table: Sequence[Sequence[Any]]) -> list[list[tuple[int, ...] | None]]:
    """Compare only element counts: pieces of equal size but other shape fit on the wire."""
    return [[None if s is None else (_numel(s),) for s in row] for row in table]
