"""Process-global state: what a world must hand back untouched, and what each rank owns.

Real ranks are separate processes: each has its own RNG, environment and
default dtype. Rank threads share one process, so with cooperative scheduling
the world swaps these per rank at every hand-over (:class:`RankState`), and
puts the caller's values back when the world ends (:class:`ProcessState`).
"""

from __future__ import annotations

import functools
import os
import random
import sys
import threading
from dataclasses import dataclass, field
from typing import Any

import torch

from meshsim import _rng, _torch_private
from meshsim._perrank import WorldSlots

__all__ = ["ProcessState", "RankState"]

# Without CUDA in the build there is no CUDA RNG to swap: spares a check at every hand-over.
_CUDA_BUILT = bool(torch.backends.cuda.is_built())  # type: ignore[no-untyped-call]


def _cuda_rng() -> list[torch.Tensor] | None:
    if _CUDA_BUILT and torch.cuda.is_available() and torch.cuda.is_initialized():  # type: ignore[no-untyped-call]
        return torch.cuda.get_rng_state_all()
    return None


@dataclass
class RankState:
    """The per-process state of one simulated rank while it does not run."""

    rank: int
    world_size: int
    rng: torch.Tensor
    cuda_rng: list[torch.Tensor] | None
    default_dtype: torch.dtype
    rank_env: list[tuple[Any, Any]] = field(default_factory=list)  # RANK, LOCAL_RANK, encoded
    slots: WorldSlots | None = None  # the values declared per rank (meshsim.per_rank), if any
    declared: list[Any] = field(default_factory=list)  # this rank's values of them

    @classmethod
    def fresh(cls, world_size: int, caller: ProcessState) -> list[RankState]:
        """Every rank's starting state: the caller's RNG and dtype (as captured), as after a fork."""
        rng, cuda_rng, dtype = caller.rng, caller.cuda_rng, caller.default_dtype
        slots = caller.slots
        declared = slots.start(world_size)
        return [
            cls(rank, world_size, rng, cuda_rng, dtype, _rank_env(rank), slots, declared[rank])
            for rank in range(world_size)
        ]

    def save(self) -> None:
        """Remember the process's current values as this rank's (runs at every hand-over)."""
        self.rng = torch.default_generator.get_state()
        if self.cuda_rng is not None or (_CUDA_BUILT and torch.cuda.is_initialized()):  # type: ignore[no-untyped-call]
            self.cuda_rng = _cuda_rng()
        self.default_dtype = torch.get_default_dtype()
        if self.slots is not None:
            self.slots.save(self.declared)

    def load(self) -> None:
        """Make this rank's values the process's current ones (runs at every hand-over)."""
        torch.default_generator.set_state(self.rng)
        if self.cuda_rng is not None:
            torch.cuda.set_rng_state_all(self.cuda_rng)
        if torch.get_default_dtype() != self.default_dtype:
            torch.set_default_dtype(self.default_dtype)
        _set_encoded(self.rank_env)  # WORLD_SIZE and LOCAL_WORLD_SIZE are set once per world
        if self.slots is not None:
            self.slots.load(self.declared)

    def load_world_env(self) -> None:
        """Set the environment every rank shares (once, before any rank runs).

        As torchrun sets it: ``WORLD_SIZE``, ``LOCAL_WORLD_SIZE``, and ``MASTER_ADDR`` /
        ``MASTER_PORT`` where the caller has none (code written for torchrun reads them
        before its ``init_process_group``, which a rank adopts).
        """
        _set_encoded(_world_env(self.world_size))
        if "MASTER_ADDR" not in os.environ and "MASTER_PORT" not in os.environ:
            _set_encoded(_MASTER_ENV)


@dataclass
class ProcessState:
    """The caller's process-global state, captured before a world and restored after it."""

    excepthook: Any
    threading_excepthook: Any
    rng: torch.Tensor
    cuda_rng: list[torch.Tensor] | None
    py_random: Any
    num_threads: int
    deterministic: tuple[bool, bool]
    default_dtype: torch.dtype
    environ: dict[Any, Any]
    forward_ad_level: int
    slots: WorldSlots
    numpy_rng: Any = None  # a fingerprint of NumPy's global RNG (None: NumPy not loaded)

    @classmethod
    def capture(cls, slots: WorldSlots | None = None) -> ProcessState:
        """The caller's state now; ``slots``: a session's, whose caller values are taken anew."""
        if slots is None:
            slots = WorldSlots()
        else:
            slots.recapture()
        return cls(
            sys.excepthook,
            threading.excepthook,
            torch.get_rng_state(),
            _cuda_rng(),
            random.getstate(),
            torch.get_num_threads(),
            _deterministic(),
            torch.get_default_dtype(),
            _environ_snapshot(),
            _torch_private.forward_ad_level(),
            slots,
            _rng.numpy_fingerprint(),
        )

    def restore(self) -> None:
        self.slots.restore_caller()
        # init_process_group wraps sys.excepthook on every call and never unwraps it;
        # hundreds of worlds would nest it past the recursion limit.
        sys.excepthook = self.excepthook
        threading.excepthook = self.threading_excepthook
        torch.set_rng_state(self.rng)
        if self.cuda_rng is not None:
            torch.cuda.set_rng_state_all(self.cuda_rng)
        random.setstate(self.py_random)
        # A rank thread's set_num_threads also changes the default of threads
        # created later in the process; setting it here restores both.
        torch.set_num_threads(self.num_threads)
        if self.deterministic != _deterministic():
            enabled, warn_only = self.deterministic
            torch.use_deterministic_algorithms(enabled, warn_only=warn_only)
        if torch.get_default_dtype() != self.default_dtype:
            torch.set_default_dtype(self.default_dtype)
        _restore_environ(self.environ)
        # dual levels a rank entered and never exited (the level is process-wide)
        _torch_private.exit_forward_ad_levels(self.forward_ad_level)

    def hand_to_ranks(self, previous: ProcessState, states: list[RankState]) -> bool:
        """Give every rank what the caller changed since ``previous`` was put back.

        Between a session's calls the pytest process runs function-scoped fixtures;
        what they do to per-process state (seed the RNGs, set the default dtype),
        torchrun would have done in every process: each rank takes it. Declared
        per-rank values are handed on by :meth:`WorldSlots.recapture`.

        Returns:
            whether Python's or NumPy's global RNG changed: each rank then draws
            afresh from it (see :func:`meshsim._rng.enter_rank`).
        """
        rng = not torch.equal(self.rng, previous.rng)
        cuda = self.cuda_rng is not None and (
            previous.cuda_rng is None
            or any(not torch.equal(a, b) for a, b in zip(self.cuda_rng, previous.cuda_rng))
        )
        for state in states:
            if rng:
                state.rng = self.rng
            if cuda:
                state.cuda_rng = self.cuda_rng
            if self.default_dtype != previous.default_dtype:
                state.default_dtype = self.default_dtype
        return bool(self.py_random != previous.py_random or self.numpy_rng != previous.numpy_rng)


def environ_changes(since: dict[Any, Any]) -> dict[Any, Any]:
    """The variables set (value) or removed (None) since the ``since`` snapshot, but the ranks' own."""
    now = _environ_snapshot()
    changes: dict[Any, Any] = {k: v for k, v in now.items() if since.get(k) != v}
    changes.update({k: None for k in since.keys() - now.keys()})
    for key in _RANK_KEYS:
        changes.pop(key, None)
    return changes


def apply_environ_changes(changes: dict[Any, Any]) -> None:
    """Set and remove what :func:`environ_changes` found."""
    if not changes:
        return
    current = _environ_snapshot()
    wanted = {k: v for k, v in current.items() if changes.get(k, v) is not None}
    wanted.update({k: v for k, v in changes.items() if v is not None})
    _restore_environ(wanted)


@functools.lru_cache(maxsize=1024)
def _rank_env(rank: int) -> list[tuple[Any, Any]]:
    """A rank's own variables, RANK and LOCAL_RANK, encoded (read-only: shared)."""
    return _encoded({"RANK": str(rank), "LOCAL_RANK": str(rank)})


@functools.lru_cache(maxsize=64)
def _master_env() -> list[tuple[Any, Any]]:
    # Never connected to: a rank's init_process_group adopts its group (see _patches).
    return _encoded({"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29500"})


def _world_env(world_size: int) -> list[tuple[Any, Any]]:
    """The variables every rank of a world shares, encoded (read-only: shared)."""
    return _encoded({"WORLD_SIZE": str(world_size), "LOCAL_WORLD_SIZE": str(world_size)})


def _deterministic() -> tuple[bool, bool]:
    return (
        torch.are_deterministic_algorithms_enabled(),
        torch.is_deterministic_algorithms_warn_only_enabled(),
    )


def _environ_data() -> dict[bytes, bytes] | None:
    """os.environ's encoded backing dict, where it has one (CPython on POSIX)."""
    environ = os.environ
    data = getattr(environ, "_data", None)
    if not isinstance(data, dict) or not hasattr(environ, "encodekey") or not hasattr(environ, "encodevalue"):
        return None
    return data


# Setting RANK and LOCAL_RANK runs at every hand-over: with the encoding done once,
# writing the backing dict and putenv directly costs half of os.environ[key] = value.
_ENVIRON_DATA = _environ_data()


def _encoded(values: dict[str, str]) -> list[tuple[Any, Any]]:
    environ: Any = os.environ
    if _ENVIRON_DATA is None:
        return list(values.items())
    return [(environ.encodekey(k), environ.encodevalue(v)) for k, v in values.items()]


def _environ_snapshot() -> dict[Any, Any]:
    # os.environ's encoded backing dict copies in ~1 us; decoding every variable
    # (dict(os.environ)) costs ~30 us, a noticeable part of a world's set-up. Encoded
    # exactly where _restore_environ works on encoded keys, decoded where it does not.
    data = _ENVIRON_DATA
    return dict(data) if data is not None else dict(os.environ)


def _set_encoded(items: list[tuple[Any, Any]]) -> None:
    """Set environment variables given as :func:`_encoded` pairs (runs at every hand-over)."""
    data = _ENVIRON_DATA
    if data is None:
        for key, value in items:
            os.environ[key] = value
        return
    for key, value in items:
        if data.get(key) != value:  # what os.environ[key] = value does, without the encoding
            os.putenv(key, value)
            data[key] = value


def _restore_environ(saved: dict[Any, Any]) -> None:
    data = _ENVIRON_DATA
    if data is None:
        _restore_decoded(saved)
        return
    if data == saved:
        return
    # what os.environ's __delitem__ and __setitem__ do, on keys and values already encoded
    for key in data.keys() - saved.keys():
        os.unsetenv(key)
        del data[key]
    _set_encoded(list(saved.items()))


def _restore_decoded(saved: dict[Any, Any]) -> None:
    current = _environ_snapshot()
    if current == saved:
        return
    environ = os.environ
    for key in current.keys() - saved.keys():
        del environ[key]
    for key, value in saved.items():
        if current.get(key) != value:
            environ[key] = value


_MASTER_ENV = _master_env()

# What a rank's own environment holds (set at hand-overs and at the world's start).
_RANK_KEYS = [key for pairs in (_rank_env(0), _world_env(1), _MASTER_ENV) for key, _ in pairs]
