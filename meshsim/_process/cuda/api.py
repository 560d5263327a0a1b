"""``torch.cuda`` as a CUDA machine answers it, per rank: devices, streams, events, memory, the RNG."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator
from typing import Any

import torch

from meshsim._base.context import current
from meshsim._process.cuda import compiler
from meshsim._process.cuda.rank import Generator, check_ordinal, device_count, index_of, now
from meshsim._process.cuda.spec import Spec, spec_here
from meshsim._process.cuda.tensors import device_of

__all__ = ["accelerator_stand_ins", "stand_ins"]

_HERE = current()  # one object; its fields are per thread

# -- torch.cuda -------------------------------------------------------------------------------


class _Properties:
    """What ``torch.cuda.get_device_properties`` gives: the emulated GPU's name, capability, memory."""

    def __init__(self, spec: Spec, index: int) -> None:
        self.name = spec.name
        self.major, self.minor = spec.capability
        self.total_memory = spec.memory
        self.multi_processor_count = spec.processors
        self.is_integrated = False
        self.is_multi_gpu_board = False
        self.uuid = f"meshsim-emulated-{index}"
        self.L2_cache_size = 50 * 1024**2
        self.warp_size = 32
        self.gcnArchName = "NVIDIA"

    def __repr__(self) -> str:
        return (
            f"_CudaDeviceProperties(name='{self.name}', major={self.major}, minor={self.minor}, "
            f"total_memory={self.total_memory // 1024**2}MB, "
            f"multi_processor_count={self.multi_processor_count})"
        )


def _set_device(device: Any) -> None:
    index = index_of(device)
    if index >= 0:
        now().current = check_ordinal(index)


class _DeviceContext:
    """``torch.cuda.device(k)``: device ``k`` is current inside the block."""

    def __init__(self, device: Any) -> None:
        self.idx = -1 if device is None else index_of(device)
        self.prev_idx = -1

    def __enter__(self) -> None:
        self.prev_idx = now().current
        if self.idx >= 0:
            now().current = check_ordinal(self.idx)

    def __exit__(self, *exc: object) -> None:
        now().current = self.prev_idx


class _DeviceOf(_DeviceContext):
    def __init__(self, obj: Any) -> None:
        super().__init__(device_of(obj).index if device_of(obj).type == "cuda" else -1)


class _Stream(torch.Stream):
    """A CUDA stream on an emulated device: ordering is kept because every kernel is done at once."""

    def __new__(cls, device: Any = None, priority: int = 0, **kwargs: Any) -> _Stream:
        return super().__new__(cls, "cpu")

    # Not traced: a compiled frame that makes a stream runs this eagerly. Traced (Dynamo
    # compiles each frame it meets after a graph break, such as current_stream's on the CPU
    # build, which has no stream state for Dynamo), its first line made Dynamo wrap ``self``
    # as a stream and read ``device`` before it was set (torch 2.13.0, 2.14.1).
    @torch.compiler.disable  # type: ignore[untyped-decorator,misc]
    def __init__(self, device: Any = None, priority: int = 0, **kwargs: Any) -> None:
        self._meshsim_device = torch.device("cuda", index_of(device))
        self.priority = priority

    @property
    def device(self) -> torch.device:  # type: ignore[override]
        return self._meshsim_device

    @property
    def cuda_stream(self) -> int:
        return 0

    def wait_event(self, event: Any) -> None:
        pass

    def wait_stream(self, stream: Any) -> None:
        pass

    def record_event(self, event: Any = None) -> Any:
        event = event if event is not None else _Event()
        event.record(self)
        return event

    def query(self) -> bool:
        return True

    def synchronize(self) -> None:
        pass

    def __eq__(self, other: object) -> bool:
        return self is other

    def __hash__(self) -> int:
        return id(self)

    def __repr__(self) -> str:
        return f"<torch.cuda.Stream device={self._meshsim_device} (meshsim, emulated)>"


class _Event:
    """A CUDA event: recorded when its stream's work is done, which is at once; times are the host's."""

    def __init__(
        self, enable_timing: bool = False, blocking: bool = False, interprocess: bool = False
    ) -> None:
        self.enable_timing = enable_timing
        self.recorded_at: float | None = None

    def record(self, stream: Any = None) -> None:
        self.recorded_at = time.perf_counter()

    def wait(self, stream: Any = None) -> None:
        pass

    def query(self) -> bool:
        return True

    def synchronize(self) -> None:
        pass

    def elapsed_time(self, end_event: _Event) -> float:
        if not (self.enable_timing and end_event.enable_timing):
            raise RuntimeError("Both events must be created with argument 'enable_timing=True'.")
        if self.recorded_at is None or end_event.recorded_at is None:
            raise RuntimeError("Both events must be recorded before calculating elapsed time.")
        return (end_event.recorded_at - self.recorded_at) * 1000.0


def _current_stream(device: Any = None) -> _Stream:
    index = index_of(device)
    stream: _Stream | None = now().streams.get(index)
    if stream is None:
        stream = now().streams[index] = _Stream(index)
    return stream


@contextlib.contextmanager
def _stream(stream: Any) -> Iterator[None]:
    if stream is None:
        yield
        return
    index = stream.device.index if isinstance(stream, _Stream) else now().current
    before = now().streams.get(index)
    now().streams[index] = stream
    try:
        yield
    finally:
        if before is None:
            now().streams.pop(index, None)
        else:
            now().streams[index] = before


def _set_stream(stream: Any) -> None:
    if stream is not None:
        index = stream.device.index if isinstance(stream, _Stream) else now().current
        now().streams[index] = stream


def _memory_allocated(device: Any = None) -> int:
    return now().allocated.get(index_of(device), 0)


def _max_memory_allocated(device: Any = None) -> int:
    return now().peak.get(index_of(device), 0)


def _reset_peak(device: Any = None) -> None:
    index = index_of(device)
    now().peak[index] = now().allocated.get(index, 0)


def _memory_stats(device: Any = None) -> dict[str, int]:
    index = index_of(device)
    rank = now()
    held, peak = rank.allocated.get(index, 0), rank.peak.get(index, 0)
    return {
        "allocated_bytes.all.current": held,
        "allocated_bytes.all.peak": peak,
        "reserved_bytes.all.current": held,
        "reserved_bytes.all.peak": peak,
        "active_bytes.all.current": held,
        "active_bytes.all.peak": peak,
    }


def _mem_get_info(device: Any = None) -> tuple[int, int]:
    spec = spec_here()
    total = spec.memory if spec is not None else 0
    return max(0, total - _memory_allocated(device)), total


def _generator_of(device: Any = "cuda") -> Generator:
    return now().generator(index_of(device))


def _manual_seed(seed: int) -> None:
    now().generator(now().current).manual_seed(seed)


def _manual_seed_all(seed: int) -> None:
    for index in range(device_count()):
        now().generator(index).manual_seed(seed)


def _seed() -> None:
    now().generator(now().current).seed_()


def _seed_all() -> None:
    seed = now().generator(now().current).seed_()
    _manual_seed_all(seed)


class _Generators:
    """``torch.cuda.default_generators``: the calling rank's generator of each device."""

    def __getitem__(self, index: int) -> Generator:
        return now().generator(check_ordinal(index))

    def __len__(self) -> int:
        return device_count()

    def __iter__(self) -> Iterator[Generator]:
        return (self[i] for i in range(len(self)))


class _Nvtx:
    """``torch.cuda.nvtx``: ranges and marks have nowhere to go without a profiler: accepted, dropped.

    The depth of open ranges is the calling thread's (kept on its emulation, in the rank context).
    """

    def range_push(self, msg: str) -> int:
        mode = _HERE.cuda
        if mode is None:
            return 0
        depth: int = mode.nvtx_depth
        mode.nvtx_depth = depth + 1
        return depth

    def range_pop(self) -> int:
        mode = _HERE.cuda
        if mode is None:
            return -1
        depth: int = mode.nvtx_depth
        mode.nvtx_depth = max(0, depth - 1)
        return depth - 1

    def range_start(self, msg: str) -> int:
        return 0

    def range_end(self, range_id: int) -> None:
        pass

    def mark(self, msg: str) -> None:
        pass

    @contextlib.contextmanager
    def range(self, msg: str, *args: Any, **kwargs: Any) -> Iterator[None]:
        self.range_push(msg)
        try:
            yield
        finally:
            self.range_pop()


def _spec() -> Spec:
    spec = spec_here()
    if spec is None:  # a stand-in called after the emulation was undone (a reference kept)
        raise RuntimeError("torch.cuda is not emulated in this thread: meshsim's CUDA emulation has ended")
    return spec


def stand_ins() -> dict[str, Any]:
    """``torch.cuda``'s names as a CUDA machine answers them: the calling thread's spec, its rank's state."""

    def get_device_properties(device: Any = None) -> _Properties:
        return _Properties(_spec(), check_ordinal(index_of(device)))

    def get_rng_state(device: Any = "cuda") -> torch.Tensor:
        return _generator_of(device).get_state()

    def set_rng_state(new_state: torch.Tensor, device: Any = "cuda") -> None:
        _generator_of(device).set_state(new_state)

    def capability(device: Any = None) -> tuple[int, int]:
        return _spec().capability

    return {
        "is_available": compiler.is_available,
        "is_initialized": lambda: True,
        "_lazy_init": lambda: None,
        "init": lambda: None,
        "device_count": device_count,
        "current_device": lambda: now().current,
        "set_device": _set_device,
        "device": _DeviceContext,
        "device_of": _DeviceOf,
        "synchronize": lambda device=None: None,
        "get_device_name": lambda device=None: _spec().name,
        "get_device_capability": capability,
        "get_device_properties": get_device_properties,
        "get_arch_list": lambda: ["sm_{}{}".format(*_spec().capability)],
        "is_bf16_supported": lambda including_emulation=True: True,
        "Stream": _Stream,
        "Event": _Event,
        "current_stream": _current_stream,
        "default_stream": lambda device=None: _Stream(device),
        "stream": _stream,
        "set_stream": _set_stream,
        "memory_allocated": _memory_allocated,
        "max_memory_allocated": _max_memory_allocated,
        "memory_reserved": _memory_allocated,
        "max_memory_reserved": _max_memory_allocated,
        "reset_peak_memory_stats": _reset_peak,
        "reset_max_memory_allocated": _reset_peak,
        "memory_stats": _memory_stats,
        "mem_get_info": _mem_get_info,
        "empty_cache": lambda: None,
        "ipc_collect": lambda: None,
        "manual_seed": _manual_seed,
        "manual_seed_all": _manual_seed_all,
        "seed": _seed,
        "seed_all": _seed_all,
        "initial_seed": lambda: now().generator(now().current).initial_seed(),
        "get_rng_state": get_rng_state,
        "set_rng_state": set_rng_state,
        "get_rng_state_all": lambda: [now().generator(i).get_state() for i in range(device_count())],
        "set_rng_state_all": lambda states: [now().generator(i).set_state(s) for i, s in enumerate(states)],
        "default_generators": _Generators(),
        "nvtx": _Nvtx(),
    }


# -- torch.accelerator ------------------------------------------------------------------------


class _DeviceIndex:
    """``torch.accelerator.device_index(k)``: device ``k`` is current inside the block (None: no change)."""

    def __init__(self, device: int | None, /) -> None:
        if device is not None and not isinstance(device, int):
            raise TypeError(f"torch.accelerator.device_index takes an int or None, got {device!r}")
        self.idx = device
        self.prev_idx = -1

    def __enter__(self) -> None:
        self.prev_idx = now().current
        if self.idx is not None and self.idx >= 0:
            now().current = check_ordinal(self.idx)

    def __exit__(self, *exc: object) -> None:
        now().current = self.prev_idx


def _accelerator_index(device: Any = None) -> int:
    """A device argument of ``torch.accelerator``'s functions as the calling rank's device index."""
    return check_ordinal(index_of(device))


def accelerator_stand_ins() -> dict[str, Any]:
    """``torch.accelerator``'s entries that reach the CUDA runtime, answered by the calling rank's emulation.

    Only on a build whose accelerator is CUDA (PyPI's CUDA build, with or without a GPU):
    the CPU build has no accelerator, and there ``torch.accelerator`` says so under
    emulation too. Dynamo calls ``current_stream`` as it starts tracing each frame
    (torch 2.14.1) and guards on it; the answer is the stream ``torch.cuda.current_stream``
    gives, the same object each time for a rank and device.
    """

    def current_device_index() -> int:
        return now().current

    def set_device_index(device: Any, /) -> None:
        _set_device(device)

    def current_stream(device: Any = None, /) -> _Stream:
        return _current_stream(_accelerator_index(device))

    def set_stream(stream: Any) -> None:
        if not isinstance(stream, torch.Stream):
            raise TypeError(f"torch.accelerator.set_stream takes a torch.Stream, got {stream!r}")
        if isinstance(stream, _Stream):
            now().current = stream.device.index  # as torch's: the stream's device becomes current
        _set_stream(stream)

    def synchronize(device: Any = None, /) -> None:
        _accelerator_index(device)  # every kernel is done at once: only the argument is checked

    return {
        "current_device_index": current_device_index,
        "current_device_idx": current_device_index,
        "set_device_index": set_device_index,
        "set_device_idx": set_device_index,
        "current_stream": current_stream,
        "set_stream": set_stream,
        "synchronize": synchronize,
        "device_index": _DeviceIndex,
    }
