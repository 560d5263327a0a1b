"""The checks one rank's arguments get before its collective joins the others, as torch's backends make them.

Each raises ``ValueError`` naming the call, the values and what was expected; what
can only be checked across ranks (splits that must agree, shapes a peer sends) is
each description's ``compat`` (:mod:`meshsim._sim.collectives`).
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from typing import Any

import torch

from meshsim._base.context import current
from meshsim._base.errors import ForeignGroupError
from meshsim._sim import movement as mv
from meshsim._sim.collectives import desc

__all__ = ["lists", "own_group", "peer", "reducible", "root", "rooted", "sized", "splits"]

Tensor = torch.Tensor

_PROBLEMS: dict[tuple[str, torch.dtype], str | None] = {}


def reducible(op: str, tensors: Sequence[Tensor], api: str) -> None:
    """Every tensor's dtype can be reduced by ``op`` (as NCCL would allow)."""
    for t in tensors:
        key = (op, t.dtype)
        try:
            problem = _PROBLEMS[key]  # one lookup on the hot path
        except KeyError:
            problem = _PROBLEMS[key] = mv.check_reduce_dtype(op, t.dtype)
        if problem is not None:
            raise ValueError(f"{api}: {problem}")


def root(rank: int, size: int, api: str) -> None:
    """``rank`` (a group rank) is a rank of a ``size``-rank group."""
    if not 0 <= rank < size:
        raise ValueError(f"{api}: root rank {rank} is not a rank of this {size}-rank group")


def peer(rank: int, me: int, size: int, ranks: Sequence[int], api: str) -> None:
    """A point-to-point peer is a rank of the group, and not the caller itself."""
    if not 0 <= rank < size:
        raise ValueError(f"{api}: peer rank {rank} is not a rank of this {size}-rank group")
    if rank == me:
        raise ValueError(f"{api}: rank {ranks[rank]} cannot {api} to or from itself")


def lists(
    tensor_lists: Sequence[Sequence[Tensor]], singles: Sequence[Tensor], size: int, api: str, what: str
) -> None:
    """One list per single tensor, each with one tensor per rank of the group."""
    if len(tensor_lists) != len(singles):
        raise ValueError(f"{api}: got {len(tensor_lists)} {what} lists for {len(singles)} tensors")
    for lst in tensor_lists:
        if len(lst) != size:
            raise ValueError(
                f"{api}: each {what} list must hold one tensor per rank of the {size}-rank group, "
                f"got {len(lst)}"
            )


def sized(
    small: Sequence[Tensor], big: Sequence[Tensor], size: int, api: str, big_name: str, small_name: str
) -> None:
    """Each big tensor holds ``size`` times its small tensor's elements, contiguous and of its dtype."""
    if len(small) != len(big):
        raise ValueError(f"{api}: got {len(big)} {big_name} tensors for {len(small)} {small_name} tensors")
    for s, b in zip(small, big):
        if b.numel() != s.numel() * size:
            raise ValueError(
                f"{api}: the {big_name} tensor {desc(b)} must hold {size} times the elements of the "
                f"{small_name} tensor {desc(s)} ({s.numel() * size}), got {b.numel()}"
            )
        if not b.is_contiguous():
            raise ValueError(f"{api}: the {big_name} tensor must be contiguous")
        if b.dtype != s.dtype:
            raise ValueError(f"{api}: {big_name} dtype {b.dtype} differs from {small_name} dtype {s.dtype}")


def rooted(tensors: Sequence[Tensor] | None, me: int, at: int, size: int, api: str, name: str) -> None:
    """Only the root passes the gather or scatter list, with one tensor per rank."""
    if me == at:
        if tensors is None or len(tensors) != size:
            got = 0 if tensors is None else len(tensors)
            raise ValueError(f"{api}: the root must pass a {name} of {size} tensors, got {got}")
    elif tensors:
        raise ValueError(f"{api}: only the root (rank {at} of the group) may pass a {name}")


def splits(tensor: Tensor, given: Sequence[int] | None, size: int, name: str) -> list[int]:
    """``all_to_all_single``'s split sizes along dim 0, resolved to one per rank."""
    dim0 = tensor.size(0) if tensor.dim() > 0 else 0
    if isinstance(given, Tensor):  # c10d passes it through; torch's threaded test PG takes it
        raise TypeError(
            f"all_to_all_single: {name} split sizes must be a list of ints, got a tensor "
            f"{given.tolist()}: gloo and NCCL process groups refuse one (pass .tolist())"
        )
    if not given:
        if dim0 % size:
            raise ValueError(
                f"all_to_all_single: {name} dim 0 ({dim0}) must divide by the group size "
                f"({size}) when no {name} split sizes are given"
            )
        return mv.split_sizes(dim0, (), size)
    resolved = [int(s) for s in given]
    if len(resolved) != size or sum(resolved) != dim0 or min(resolved) < 0:
        raise ValueError(
            f"all_to_all_single: {name} split sizes {resolved} must be {size} non-negative "
            f"numbers summing to the {name}'s dim 0 ({dim0})"
        )
    return resolved


def own_group(group: Any, maker: Any, api: str) -> None:
    """The calling rank made ``group`` itself (``maker`` is the seat of the rank that did).

    A rank thread that issues a collective on another rank's handle would join the
    rendezvous as that rank and wait for ever; this names the cause at once. Other
    threads (a rank's own helper threads have no seat) are left alone.

    Raises:
        ForeignGroupError: naming the group, the rank that made it, the caller, and the module
            global that holds it, if one does.
    """
    seat = current().seat
    if seat is None or seat is maker:
        return
    ranks = list(group._group.ranks)
    made = f"rank {maker.rank}" + (
        "" if maker.rendezvous is seat.rendezvous else " of a world that has ended"
    )
    member = (
        f"its ranks {ranks} do not include rank {seat.rank}"
        if seat.rank not in ranks
        else f"rank {seat.rank} must use the handle it made itself"
    )
    held = _held_by(group)
    where = (
        f" It is {held}: a module global every rank thread shares, last set by rank {maker.rank}."
        if held
        else ""
    )
    module = held.rsplit(".", 1)[0] if held else "the.module"
    raise ForeignGroupError(
        f"rank {seat.rank} called {api} on a process group that {made} created "
        f"(group {group._group.name!r}, {group!r}); {member}.{where} Each torchrun process has its own "
        "module globals; rank threads share them unless declared per rank. Likely cause: a module "
        "global (or class attribute) that holds process groups is shared by the simulated ranks. Declare "
        f"it per rank: meshsim.per_rank_module({module!r}) (pytest: --mesh-per-rank-modules={module}) "
        "or meshsim.per_rank(owner, 'NAME')."
    )


def _held_by(obj: object) -> str | None:
    """``module.NAME`` of the first module global that is ``obj`` (only when reporting an error)."""
    for name, module in list(sys.modules.items()):
        namespace = getattr(module, "__dict__", None)
        if not isinstance(namespace, dict):
            continue
        for key, value in list(namespace.items()):
            if value is obj:
                return f"{name}.{key}"
    return None
