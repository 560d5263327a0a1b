"""Process-global state: what a world must hand back untouched, and what each rank owns of it.

Real ranks are separate processes: each has its own RNG, environment and default
dtype. Rank threads share one process, so what each rank owns of it (torch's CPU
and CUDA RNGs, the default dtype, ``RANK`` and ``LOCAL_RANK``) is declared here as
entries of the hand-over registry (:mod:`meshsim._process.handover`), swapped per
rank at every hand-over with every other per-rank value. What only the caller owns
(hooks, Python's RNG, thread count, deterministic mode, the environment, forward-AD
levels) :class:`ProcessState` captures before a world and puts back after it.
"""

from __future__ import annotations

import functools
import os
import random
import sys
import threading
from dataclasses import dataclass
from typing import Any

import torch
from torch.autograd import forward_ad

from meshsim._process import rng as _rng
from meshsim._process.handover import WorldSlots, declare_accessor

__all__ = ["ProcessState", "rank_environment", "set_world_environment", "torchrun_environment"]


def _set_dtype(dtype: torch.dtype) -> None:
    if torch.get_default_dtype() != dtype:  # setting it costs more than the check
        torch.set_default_dtype(dtype)


def _declare_rank_state() -> None:
    """Each rank's torch RNGs, default dtype and rank variables: entries of the hand-over registry."""
    generator = torch.default_generator
    declare_accessor(
        "torch's CPU RNG",
        get=generator.get_state,
        set=generator.set_state,
        moved=lambda before, now: not torch.equal(before, now),
    )
    # Without CUDA in the build there is no CUDA RNG: no entry, nothing to swap at hand-overs.
    if torch.backends.cuda.is_built():  # type: ignore[no-untyped-call]
        declare_accessor("torch's CUDA RNGs", get=_cuda_rng, set=_set_cuda_rng, moved=_cuda_rng_moved)
    declare_accessor("the default dtype", get=torch.get_default_dtype, set=_set_dtype)
    # The node layout comes from LOCAL_WORLD_SIZE, which the world sets just before its ranks'
    # starting values are taken (set_world_environment).
    declare_accessor(
        "RANK, LOCAL_RANK, GROUP_RANK and ROLE_RANK",
        get=None,
        set=_set_environ,
        start=lambda _, rank: rank_environment(rank, _local_world_size()),
    )


def _cuda_rng() -> list[torch.Tensor] | None:
    """Every CUDA device's RNG state, once CUDA is in use (None before: nothing to swap)."""
    if torch.cuda.is_available() and torch.cuda.is_initialized():  # type: ignore[no-untyped-call]
        return torch.cuda.get_rng_state_all()
    return None


def _set_cuda_rng(states: list[torch.Tensor] | None) -> None:
    if states is not None:
        torch.cuda.set_rng_state_all(states)


def _cuda_rng_moved(before: list[torch.Tensor] | None, now: list[torch.Tensor] | None) -> bool:
    if now is None:
        return False
    return before is None or any(not torch.equal(a, b) for a, b in zip(before, now))


def set_world_environment(world_size: int, nnodes: int = 1) -> None:
    """Set the environment every rank of a world shares (at its start, and at a session's calls).

    As torchrun sets it for ``nnodes`` nodes of ``world_size // nnodes`` ranks:
    ``WORLD_SIZE``, ``LOCAL_WORLD_SIZE``, ``GROUP_WORLD_SIZE``, ``ROLE_WORLD_SIZE``, and
    ``MASTER_ADDR`` / ``MASTER_PORT`` where the caller has none (code written for torchrun
    reads them before its ``init_process_group``, which a rank adopts).
    """
    _set_environ(_world_env(world_size, nnodes))
    if "MASTER_ADDR" not in os.environ and "MASTER_PORT" not in os.environ:
        _set_environ(_MASTER_ENV)


def torchrun_environment(rank: int, world_size: int) -> dict[str, str]:
    """What torchrun sets in rank ``rank``'s process of a one-node ``world_size``-rank job.

    With ``MASTER_ADDR`` / ``MASTER_PORT`` (meshsim's, never connected to).
    """
    return dict((*_world_env(world_size), *rank_environment(rank, world_size), *_MASTER_ENV))


@dataclass
class ProcessState:
    """The caller's process-global state, captured before a world (or a session's call) and restored after it.

    ``slots`` holds the caller's values of every hand-over entry (its RNGs and dtype
    among them) and each rank's.
    """

    excepthook: Any
    threading_excepthook: Any
    py_random: Any
    num_threads: int
    deterministic: tuple[bool, bool]
    environ: dict[Any, Any]
    forward_ad_level: int
    slots: WorldSlots
    numpy_rng: Any = None  # a fingerprint of NumPy's global RNG (None: NumPy not loaded)

    @classmethod
    def capture(cls, slots: WorldSlots | None = None) -> ProcessState:
        """The caller's state now; ``slots``: a session's, whose caller values are taken anew.

        Taken anew, the caller's values that changed since the last call go to every
        rank (see :meth:`meshsim._process.handover.WorldSlots.recapture`).
        """
        if slots is None:
            slots = WorldSlots()
        else:
            slots.recapture()
        return cls(
            sys.excepthook,
            threading.excepthook,
            random.getstate(),
            torch.get_num_threads(),
            _deterministic(),
            _environ_snapshot(),
            _forward_ad_level(),
            slots,
            _rng.numpy_fingerprint(),
        )

    def restore(self) -> None:
        self.slots.restore_caller()
        # init_process_group wraps sys.excepthook on every call and never unwraps it;
        # hundreds of worlds would nest it past the recursion limit.
        sys.excepthook = self.excepthook
        threading.excepthook = self.threading_excepthook
        random.setstate(self.py_random)
        # A rank thread's set_num_threads also changes the default of threads
        # created later in the process; setting it here restores both.
        torch.set_num_threads(self.num_threads)
        if self.deterministic != _deterministic():
            enabled, warn_only = self.deterministic
            torch.use_deterministic_algorithms(enabled, warn_only=warn_only)
        _restore_environ(self.environ)
        # dual levels a rank entered and never exited (the level is process-wide)
        while _forward_ad_level() > self.forward_ad_level:
            forward_ad.exit_dual_level()  # type: ignore[no-untyped-call]

    def reseeds(self, previous: ProcessState) -> bool:
        """Whether Python's or NumPy's global RNG changed in the caller since ``previous`` was put back.

        Each rank then draws afresh from it (see :func:`meshsim._process.rng.enter_rank`).
        """
        return bool(self.py_random != previous.py_random or self.numpy_rng != previous.numpy_rng)


def environ_changes(since: dict[Any, Any]) -> dict[str, str | None]:
    """The variables set (value) or removed (None) since the ``since`` snapshot, but the ranks' own."""
    before, now = _decoded(since), _decoded(_environ_snapshot())
    changes: dict[str, str | None] = {k: v for k, v in now.items() if before.get(k) != v}
    changes.update({k: None for k in before.keys() - now.keys()})
    for key in _RANK_KEYS:
        changes.pop(key, None)
    return changes


def apply_environ_changes(changes: dict[str, str | None]) -> None:
    """Set and remove what :func:`environ_changes` found."""
    environ = os.environ
    for key, value in changes.items():
        if value is None:
            environ.pop(key, None)
        elif environ.get(key) != value:
            environ[key] = value


@functools.lru_cache(maxsize=1024)
def rank_environment(rank: int, local_world_size: int) -> tuple[tuple[str, str], ...]:
    """A rank's own variables, as torchrun sets them: RANK, LOCAL_RANK, GROUP_RANK (its node), ROLE_RANK."""
    local, node = rank % local_world_size, rank // local_world_size
    return (
        ("RANK", str(rank)),
        ("LOCAL_RANK", str(local)),
        ("GROUP_RANK", str(node)),
        ("ROLE_RANK", str(rank)),
    )


def _local_world_size() -> int:
    """The ranks per node of the world starting now (set by :func:`set_world_environment`)."""
    try:
        return max(1, int(os.environ.get("LOCAL_WORLD_SIZE", "1")))
    except ValueError:
        return 1


# Never connected to: a rank's init_process_group adopts its group (see _patches).
_MASTER_ENV = (("MASTER_ADDR", "127.0.0.1"), ("MASTER_PORT", "29500"))


def _world_env(world_size: int, nnodes: int = 1) -> tuple[tuple[str, str], ...]:
    """The variables every rank of a world shares."""
    return (
        ("WORLD_SIZE", str(world_size)),
        ("LOCAL_WORLD_SIZE", str(world_size // nnodes)),
        ("GROUP_WORLD_SIZE", str(nnodes)),
        ("ROLE_WORLD_SIZE", str(world_size)),
    )


def _set_environ(items: tuple[tuple[str, str], ...]) -> None:
    """Set environment variables (runs at every hand-over, for RANK and LOCAL_RANK, which differ then)."""
    environ = os.environ
    for key, value in items:
        environ[key] = value


def _forward_ad_level() -> int:
    """The innermost forward-AD dual level (-1: none).

    ``torch.autograd.forward_ad`` keeps it in the module global ``_current_level``
    and has no getter (checked in torch 2.11-2.15).
    """
    level: int = forward_ad._current_level
    return level


def _deterministic() -> tuple[bool, bool]:
    return (
        torch.are_deterministic_algorithms_enabled(),
        torch.is_deterministic_algorithms_warn_only_enabled(),
    )


def _environ_data() -> dict[Any, Any] | None:
    """os.environ's backing dict, where it has one (CPython keeps ``_data``: checked 3.10-3.13)."""
    data = getattr(os.environ, "_data", None)
    return data if isinstance(data, dict) else None


# A world snapshots the environment when it starts and compares it when it ends.
# os.environ decodes every variable when copied; its backing dict (encoded bytes on
# POSIX) copies without that, a measurable share of a world's set-up and teardown
# (benchmarks/bench_tricks.py). It is only read here; every write goes through os.environ.
_ENVIRON_DATA = _environ_data()


def _environ_snapshot() -> dict[Any, Any]:
    """The environment as it is now, in the backing dict's form (compare with ``==`` only)."""
    data = _ENVIRON_DATA
    return dict(data) if data is not None else dict(os.environ)


def _decoded(snapshot: dict[Any, Any]) -> dict[str, str]:
    """A :func:`_environ_snapshot` as os.environ's keys and values."""
    if _ENVIRON_DATA is None:
        return dict(snapshot)
    return {os.fsdecode(key): os.fsdecode(value) for key, value in snapshot.items()}


def _restore_environ(saved: dict[Any, Any]) -> None:
    now = _environ_snapshot()
    if now == saved:
        return
    # only what differs is decoded (a world's end sets back its ranks' few variables)
    decode = os.fsdecode if _ENVIRON_DATA is not None else str
    environ = os.environ
    for key in now.keys() - saved.keys():
        del environ[decode(key)]
    for key, value in saved.items():
        if now.get(key) != value:
            environ[decode(key)] = decode(value)


# What a rank's own environment holds (set at hand-overs and at the world's start).
_RANK_KEYS = [key for pairs in (rank_environment(0, 1), _world_env(1), _MASTER_ENV) for key, _ in pairs]

_declare_rank_state()
