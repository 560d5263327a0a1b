"""Each rank's GPUs: the current device, each device's CUDA generator and memory counters.

One entry of the hand-over registry (:mod:`meshsim._process.handover`): every rank of a
serialized world has its own, as every process has; :func:`now` is the calling rank's.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import torch

from meshsim._process.cuda.spec import CPU, spec_here
from meshsim._process.handover import declare_accessor

__all__ = ["Generator", "Rank", "check_ordinal", "declare_per_rank", "device_count", "index_of", "now"]

DEFAULT_SEED = 67280421310721  # what a new process's generators start from (torch's default seed)


class _State:
    """A CUDA generator's state: a seed and an offset, as CUDA's Philox generator keeps them."""

    __slots__ = ("offset", "seed")

    def __init__(self, seed: int, offset: int = 0) -> None:
        self.seed = seed
        self.offset = offset


class Generator:
    """One emulated device's CUDA generator.

    Its state is an object of its own, as CUDA's is: ``graphsafe_get_state()`` hands out a
    generator holding this one's state (draws through either move both), and
    ``graphsafe_set_state(g)`` makes this generator use ``g``'s, as Megatron's RNG tracker
    does around CUDA graphs; ``clone_state()`` is a generator with a copy.
    """

    __slots__ = ("_state", "device")

    def __init__(self, device: torch.device, seed: int = DEFAULT_SEED) -> None:
        self.device = device
        self._state = _State(seed)

    @property
    def seed(self) -> int:
        return self._state.seed

    @seed.setter
    def seed(self, value: int) -> None:
        self._state.seed = value

    @property
    def offset(self) -> int:
        return self._state.offset

    @offset.setter
    def offset(self, value: int) -> None:
        self._state.offset = value

    def manual_seed(self, seed: int) -> Generator:
        self.seed = int(seed) & 0xFFFF_FFFF_FFFF_FFFF
        self.offset = 0
        return self

    def seed_(self) -> int:
        self.manual_seed(int.from_bytes(torch.randint(0, 2**62, (1,)).numpy().tobytes(), "little"))
        return self.seed

    def initial_seed(self) -> int:
        return self.seed

    def get_state(self) -> torch.Tensor:
        # CUDA's layout: the seed, then the offset, 8 bytes each (DTensor's RNG tracker reads both)
        return torch.tensor([_signed(self.seed), self.offset], dtype=torch.int64).view(torch.uint8)

    def set_state(self, state: torch.Tensor) -> Generator:
        if not isinstance(state, torch.Tensor) or state.dtype != torch.uint8 or state.numel() != 16:
            raise ValueError(
                f"a CUDA RNG state is a uint8 tensor of 16 bytes (seed, offset), got {_describe(state)}"
            )
        seed, offset = state.detach().to(CPU, copy=True).view(torch.int64).tolist()
        self.seed, self.offset = seed & 0xFFFF_FFFF_FFFF_FFFF, offset
        return self

    def get_offset(self) -> int:
        return self.offset

    def set_offset(self, offset: int) -> None:
        self.offset = int(offset)

    def clone_state(self) -> Generator:
        copy = Generator(self.device, self.seed)
        copy.offset = self.offset
        return copy

    def graphsafe_get_state(self) -> Generator:
        shared = Generator(self.device)
        shared._state = self._state
        return shared

    def graphsafe_set_state(self, state: Generator) -> Generator:
        if not isinstance(state, Generator):
            raise TypeError(
                "graphsafe_set_state takes a CUDA generator from graphsafe_get_state() or clone_state(), "
                f"got {_describe(state)}"
            )
        self._state = state._state
        return self

    def shared(self) -> object:
        """The state object this generator draws from now (what ``graphsafe_set_state`` swaps).

        A CUDA graph's capture notes it for each random op, so that the replay draws from
        the same state, as a captured kernel reads its registered generator's seed and offset.
        """
        return self._state

    @contextlib.contextmanager
    def drawing_from(self, shared: object) -> Iterator[None]:
        """Draw from ``shared`` (a :meth:`shared` of this or another generator) inside the block."""
        if not isinstance(shared, _State):
            raise TypeError(f"drawing_from() takes what a generator's shared() returned, got {shared!r}")
        before, self._state = self._state, shared
        try:
            yield
        finally:
            self._state = before

    def __repr__(self) -> str:
        return f"<emulated CUDA generator of {self.device}: seed {self.seed}, offset {self.offset}>"


def _signed(value: int) -> int:
    return value - (1 << 64) if value >= 1 << 63 else value


def _describe(value: Any) -> str:
    if isinstance(value, torch.Tensor):
        return f"a {value.dtype} tensor of {value.numel()} elements"
    return repr(value)


@dataclass
class Rank:
    """A rank's (or the caller's) GPUs: the current device, generators and memory counters per device."""

    current: int = 0
    generators: dict[int, Generator] = field(default_factory=dict)
    allocated: dict[int, int] = field(default_factory=dict)
    peak: dict[int, int] = field(default_factory=dict)
    streams: dict[int, Any] = field(default_factory=dict)  # the current stream per device

    def generator(self, index: int) -> Generator:
        gen = self.generators.get(index)
        if gen is None:
            gen = self.generators[index] = Generator(torch.device("cuda", index))
        return gen


_state = Rank()


def _get_state() -> Rank:
    return _state


def _set_state(value: Rank) -> None:
    global _state
    _state = value


_declared = False


def declare_per_rank() -> None:
    """Make each rank's GPUs an entry of the hand-over registry, when the emulation is first installed.

    Not before: a process that never emulates CUDA swaps nothing more at its hand-overs.
    """
    global _declared
    if not _declared:
        _declared = True
        declare_accessor(
            "the emulated CUDA device, RNGs and memory counters",
            get=_get_state,
            set=_set_state,
            start=lambda caller, rank: Rank(),  # as a new process: device 0, default seeds, nothing allocated
            moved=lambda before, now: now is not before,
        )


def now() -> Rank:
    """The calling rank's GPUs (the caller's outside worlds)."""
    return _state


def index_of(device: Any = None) -> int:
    if device is None:
        return now().current
    if isinstance(device, int):
        return now().current if device < 0 else device
    if isinstance(device, str):
        device = torch.device(device)
    if isinstance(device, torch.device):
        if device.type != "cuda":
            raise ValueError(f"expected a CUDA device, got {device!r}")
        return now().current if device.index is None else device.index
    index = getattr(device, "idx", getattr(device, "device_index", None))
    if isinstance(index, int):
        return index
    raise ValueError(f"expected a CUDA device (an int, 'cuda:N' or torch.device), got {device!r}")


def check_ordinal(index: int) -> int:
    count = device_count()
    if not 0 <= index < count:
        raise RuntimeError(
            f"CUDA error: invalid device ordinal {index}: meshsim emulates {count} GPUs per rank "
            "(MESHSIM_CUDA_DEVICES or the number of ranks per node sets how many)"
        )
    return index


def device_count() -> int:
    """The GPUs the calling thread's emulation has (its world's: see :meth:`Spec.sized`)."""
    spec = spec_here()
    return spec.count if spec is not None else 0
