"""GPU code on simulated ranks: CUDA emulated on the CPU, or every rank's ``cuda:k`` on one real GPU.

Code written for GPUs says ``device="cuda"``, ``torch.cuda.set_device(k)``,
``init_process_group("nccl")``, pins memory, seeds ``torch.cuda.manual_seed`` and
makes streams and events. :func:`acquire` makes such code run unchanged, with one
device story:

- **Storage is on the storage device, Python sees CUDA.** Every tensor's bytes live
  where ``spec`` says (the CPU for ``"cpu"``; the one real GPU for ``"cuda:0"``). A
  tensor made or moved to ``cuda:k`` carries a tag, and Python's view of it says
  ``cuda:k``: ``tensor.device``, ``is_cuda``, ``get_device()``, its repr, and a wrapper
  subclass (DTensor, ShardTensor) built over it. C++ sees the storage device, so
  kernels, wrapper subclasses made in C++ and process groups work on real storage.
  Code that compares devices (a parameter's against a mesh's, ``assert_close``)
  behaves as on a GPU machine.
- **Tags follow the data.** A dispatch mode in every rank thread (and in the caller
  while a pytest session emulates) sees every aten op, those that autograd's backward,
  DTensor's handlers and other subclasses run included: a factory asked for
  ``cuda:k`` makes its tensor on the storage device and tags it; an op's outputs take
  the tag of its first tagged input; ``.cpu()`` and ``.to("cpu")`` copy, untagged.
  ``torch.compile`` compiles with the mode off and runs its compiled code under it
  (torch's ``ignore_compile_internals``); the outputs of a compiled function take
  the device of its first CUDA input.
- **``torch.cuda`` answers as a CUDA machine** with ``devices`` GPUs (at least the
  world's ranks per node): availability, count, the current device (per rank, 0 until
  ``set_device``, as in a new process), names, properties and capability, streams
  and events (ordering kept, every kernel already done), per-rank memory statistics,
  and the CUDA RNG per rank and device (seed and offset, as CUDA's Philox state:
  16 bytes, so DTensor's offset-based RNG tracker works).

The per-rank part (the current device, each device's generator, the memory counters)
is one entry of the hand-over registry (:mod:`meshsim._process.handover`). What is
changed process-wide (``torch.cuda``'s functions, ``torch.Tensor``'s device
properties, ``.to``/``.cuda``/``.cpu``/``pin_memory``, ``_make_wrapper_subclass``) is
made by the first :func:`acquire` and undone by the last :func:`release`.

Private torch names used, checked in torch 2.13: ``torch._C.TensorBase``'s ``device``,
``is_cuda`` and ``to`` descriptors, ``torch.Tensor._make_wrapper_subclass``,
``torch.cuda._lazy_init``, ``TorchDispatchMode.ignore_compile_internals`` (absent in
older releases: torch.compile then runs its function eagerly under emulation).
"""

from __future__ import annotations

import contextlib
import functools
import os
import threading
import time
import weakref
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
import torch._guards
from torch._subclasses.fake_tensor import FakeTensor as _FakeTensor
from torch.utils._python_dispatch import TorchDispatchMode

from meshsim._process.handover import declare_accessor

__all__ = ["Spec", "acquire", "active", "devices_wanted", "emulate_in_process", "enter_rank", "from_environment", "leave_rank", "parse", "release"]

_TAG = "_meshsim_cuda"  # the attribute a CUDA tensor carries: its torch.device("cuda", k)
_PINNED = "_meshsim_pinned"
_CPU = torch.device("cpu")
_DEFAULT_SEED = 67280421310721  # what a new process's generators start from (torch's default seed)


# -- what is emulated ---------------------------------------------------------------------


@dataclass(frozen=True)
class Spec:
    """An emulation: where storage lives, how many GPUs ``torch.cuda`` reports and what they are called.

    Attributes:
        storage: ``cpu``, or the one real GPU every rank's ``cuda:k`` lives on.
        devices: the GPUs each rank sees (at least the ranks per node, as torchrun gives).
        name: what ``get_device_name`` says; ``capability`` and ``memory`` (bytes) as
            ``get_device_properties`` reports them.
    """

    storage: torch.device
    devices: int = 8
    name: str = "NVIDIA H100 80GB HBM3 (meshsim, emulated)"
    capability: tuple[int, int] = (9, 0)
    memory: int = 80 * 1024**3
    processors: int = 132


def from_environment(world_size: int = 1) -> Spec | None:
    """The emulation ``MESHSIM_CUDA`` asks for (``MESHSIM_CUDA_DEVICES`` GPUs, default max(8, world_size))."""
    return parse(os.environ.get("MESHSIM_CUDA"), devices=devices_wanted(world_size))


def devices_wanted(world_size: int) -> int:
    """How many GPUs ranks see: ``MESHSIM_CUDA_DEVICES``, else a node's 8, or one per rank beyond that."""
    raw = os.environ.get("MESHSIM_CUDA_DEVICES")
    if raw is None:
        return max(8, world_size)
    try:
        return int(raw)
    except ValueError:
        raise ValueError(f"MESHSIM_CUDA_DEVICES must be a positive int, got {raw!r}") from None


def parse(value: str | None, *, devices: int = 8) -> Spec | None:
    """``--mesh-cuda``'s, ``cuda=``'s and ``MESHSIM_CUDA``'s value as a :class:`Spec` (None: off).

    Raises:
        ValueError: not ``off``, ``cpu`` or ``cuda:N``; or ``cuda:N`` where this
            process has no such GPU.
    """
    if value is None or value in ("", "off", "0", "none"):
        return None
    if not isinstance(value, str):
        raise TypeError(f"cuda must be 'cpu', 'cuda:N' or None, got {value!r}")
    if isinstance(devices, bool) or not isinstance(devices, int) or devices < 1:
        raise ValueError(f"the number of emulated GPUs must be a positive int, got {devices!r}")
    if value == "cpu":
        return Spec(_CPU, devices)
    if value.startswith("cuda"):
        try:
            device = torch.device(value)
        except RuntimeError:
            device = None
        if device is not None and device.type == "cuda":
            index = 0 if device.index is None else device.index
            available = _REAL_CUDA["device_count"]() if _REAL_CUDA["is_available"]() else 0
            if index >= available:
                raise ValueError(
                    f"cuda={value!r} puts every rank on that GPU, but this process sees {available} "
                    "CUDA device(s). On a machine without a GPU use cuda='cpu' (--mesh-cuda=cpu)."
                )
            return Spec(torch.device("cuda", index), devices)
    raise ValueError(
        f"cuda must be 'cpu' (CUDA emulated on the CPU), 'cuda:N' (every rank on that one GPU) or "
        f"'off', got {value!r}"
    )


# -- each rank's GPUs: an entry of the hand-over registry ---------------------------------


class _Generator:
    """One emulated device's CUDA generator: a seed and an offset, as CUDA's Philox generator keeps them."""

    __slots__ = ("device", "offset", "seed")

    def __init__(self, device: torch.device, seed: int = _DEFAULT_SEED) -> None:
        self.device = device
        self.seed = seed
        self.offset = 0

    def manual_seed(self, seed: int) -> _Generator:
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

    def set_state(self, state: torch.Tensor) -> _Generator:
        if not isinstance(state, torch.Tensor) or state.dtype != torch.uint8 or state.numel() != 16:
            raise ValueError(
                f"a CUDA RNG state is a uint8 tensor of 16 bytes (seed, offset), got {_describe(state)}"
            )
        seed, offset = state.detach().to(_CPU, copy=True).view(torch.int64).tolist()
        self.seed, self.offset = seed & 0xFFFF_FFFF_FFFF_FFFF, offset
        return self

    def get_offset(self) -> int:
        return self.offset

    def set_offset(self, offset: int) -> None:
        self.offset = int(offset)


def _signed(value: int) -> int:
    return value - (1 << 64) if value >= 1 << 63 else value


def _describe(value: Any) -> str:
    if isinstance(value, torch.Tensor):
        return f"a {value.dtype} tensor of {value.numel()} elements"
    return repr(value)


@dataclass
class _Rank:
    """A rank's (or the caller's) GPUs: the current device, generators and memory counters per device."""

    current: int = 0
    generators: dict[int, _Generator] = field(default_factory=dict)
    allocated: dict[int, int] = field(default_factory=dict)
    peak: dict[int, int] = field(default_factory=dict)
    streams: dict[int, Any] = field(default_factory=dict)  # the current stream per device

    def generator(self, index: int) -> _Generator:
        gen = self.generators.get(index)
        if gen is None:
            gen = self.generators[index] = _Generator(torch.device("cuda", index))
        return gen


_state = _Rank()


def _get_state() -> _Rank:
    return _state


def _set_state(value: _Rank) -> None:
    global _state
    _state = value


declare_accessor(
    "the emulated CUDA device, RNGs and memory counters",
    get=_get_state,
    set=_set_state,
    start=lambda caller, rank: _Rank(),  # as a new process: device 0, default seeds, nothing allocated
    moved=lambda before, now: now is not before,
)


# -- tags: which tensors are CUDA tensors -------------------------------------------------

_REAL_DEVICE = torch._C.TensorBase.device
_REAL_IS_CUDA = torch._C.TensorBase.is_cuda
_REAL_GET_DEVICE = torch._C.TensorBase.get_device
_REAL_TO = torch._C.TensorBase.to
_REAL_CPU = torch._C.TensorBase.cpu
_REAL_PIN = torch._C.TensorBase.pin_memory
_REAL_IS_PINNED = torch._C.TensorBase.is_pinned
_REAL_CUDA: dict[str, Any] = {name: getattr(torch.cuda, name) for name in ("is_available", "device_count")}
_PLAIN_DISPATCH = torch.Tensor.__torch_dispatch__
_get_dispatch_mode = torch._C._get_dispatch_mode
_FAKE = torch._C._TorchDispatchModeKey.FAKE
_tracing = torch._guards.TracingContext.try_get  # set while Dynamo compiles a frame


def device_of(tensor: torch.Tensor) -> torch.device:
    """What ``tensor.device`` says under emulation: its tag, a wrapper's inner tensor's, or the real one."""
    tag = getattr(tensor, _TAG, None)
    if tag is not None and not getattr(_kernel, "depth", 0):
        # While torch.compile compiles (a frame's tracing context or a fake mode on), the
        # compiler sees the storage it compiles for.
        if _get_dispatch_mode(_FAKE) is None and _tracing() is None:
            return tag
        return _REAL_DEVICE.__get__(tensor)
    flatten = getattr(type(tensor), "__tensor_flatten__", None)
    if flatten is not None and type(tensor).__torch_dispatch__ is not _PLAIN_DISPATCH:
        names, _ = flatten(tensor)
        if names:
            inner = getattr(tensor, names[0], None)
            if isinstance(inner, torch.Tensor):
                return device_of(inner)
    return _REAL_DEVICE.__get__(tensor)


def _tag(value: Any, device: torch.device) -> None:
    """Tag every tensor in ``value`` (and a wrapper subclass's inner tensors) as living on ``device``."""
    if isinstance(value, torch.Tensor):
        try:
            setattr(value, _TAG, device)
        except (AttributeError, TypeError):
            return
        flatten = getattr(type(value), "__tensor_flatten__", None)
        if flatten is not None and type(value).__torch_dispatch__ is not _PLAIN_DISPATCH:
            for name in flatten(value)[0]:
                _tag(getattr(value, name, None), device)
    elif isinstance(value, (list, tuple)):
        for item in value:
            _tag(item, device)


def _untag(value: Any) -> None:
    if isinstance(value, torch.Tensor) and getattr(value, _TAG, None) is not None:
        setattr(value, _TAG, None)


def _cuda_device(device: Any) -> torch.device | None:
    """``device`` as a full ``cuda:k`` when it names CUDA (a bare ``cuda`` is the current device), else None."""
    if device is None:
        return None
    if isinstance(device, int):  # a bare ordinal, as Tensor.cuda(1) and device_id=1 give
        return torch.device("cuda", device)
    if not isinstance(device, torch.device):
        device = torch.device(device)
    if device.type != "cuda":
        return None
    if device.index is None:
        return torch.device("cuda", _state.current)
    _checked(device.index)
    return device


def _storage(spec: Spec) -> torch.device:
    return spec.storage


# -- the dispatch mode: factories, tags, seeded ops, memory -------------------------------

# op -> (allocates new storage, draws random numbers, has a CUDA kernel and no CPU one)
_op_facts: dict[Any, tuple[bool, bool, bool]] = {}
_CUDA_KEYS = torch._C.DispatchKeySet(torch._C.DispatchKey.CUDA)
_kernel = threading.local()  # depth: how many ops this thread's mode is running now


def _facts(func: Any) -> tuple[bool, bool, bool]:
    facts = _op_facts.get(func)
    if facts is None:
        schema = func._schema
        allocates = not any(r.alias_info is not None for r in schema.returns) and bool(schema.returns)
        seeded = torch.Tag.nondeterministic_seeded in getattr(func, "tags", ())
        name = func.name()
        has = torch._C._dispatch_has_kernel_for_dispatch_key
        cuda_only = (
            func.namespace not in ("aten", "prims")
            and has(name, "CUDA")
            and not has(name, "CPU")
            and not has(name, "CompositeExplicitAutograd")
            and not has(name, "CompositeImplicitAutograd")
        )
        facts = _op_facts[func] = (allocates, seeded, cuda_only)
    return facts


def _first_tag(args: Any) -> torch.device | None:
    for arg in args:
        if isinstance(arg, torch.Tensor):
            tag = getattr(arg, _TAG, None)
            if tag is not None:
                return tag
        elif isinstance(arg, (list, tuple)):
            for item in arg:
                if isinstance(item, torch.Tensor):
                    tag = getattr(item, _TAG, None)
                    if tag is not None:
                        return tag
    return None


class _CudaMode(TorchDispatchMode):
    """Every aten op of a thread that emulates CUDA: see the module docstring."""

    def __init__(self, spec: Spec) -> None:
        super().__init__()
        self.spec = spec

    @classmethod
    def ignore_compile_internals(cls) -> bool:
        # Dynamo skips frames while a dispatch mode is on unless the mode says this:
        # torch.compile then compiles with the mode off and runs its code under it.
        return True

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        for kind in types:
            if kind.__torch_dispatch__ is not _PLAIN_DISPATCH:
                if issubclass(kind, _FakeTensor):
                    # shape propagation (DTensor's, torch.compile's): fake tensors answer in
                    # their own mode, on whatever device they claim
                    return func(*args, **(kwargs or {}))
                # A subclass (DTensor, ShardTensor) handles the op; this mode stays on for
                # the ops its handler runs on the inner tensors, which carry the tags.
                return NotImplemented
        kwargs = kwargs or {}
        if func is _RECORD_STREAM:
            return None  # every kernel is done already: nothing to keep alive
        if func is _IS_PINNED:
            return bool(getattr(args[0], _PINNED, False)) or func(*args, **kwargs)
        if func is _PIN_MEMORY:
            out = args[0].clone()
            setattr(out, _PINNED, True)
            return out
        target: torch.device | None
        pinned = False
        if "device" in kwargs or "pin_memory" in kwargs:
            kwargs = dict(kwargs)
            pinned = bool(kwargs.pop("pin_memory", None))
            target = _cuda_device(kwargs.get("device"))
            if target is not None:
                kwargs["device"] = self.spec.storage
            elif kwargs.get("device") is None:
                target = _first_tag(args)
        else:
            target = _first_tag(args)
        allocates, seeded, cuda_only = _facts(func)
        # Python kernels the op runs (a torch.library custom op's) see the storage device,
        # as kernels do: what they make is tagged on the way out.
        _kernel.depth = depth = getattr(_kernel, "depth", 0) + 1
        try:
            if seeded and target is not None and kwargs.get("generator") is None:
                out = _seeded(self.spec, func, args, kwargs, target)
            elif cuda_only and target is not None:
                out = func.redispatch(_CUDA_KEYS, *args, **kwargs)  # its CUDA kernel, on the storage
            else:
                out = func(*args, **kwargs)
        finally:
            _kernel.depth = depth - 1
        if target is not None:
            _tag(out, target)
            if allocates:
                _count(out, target)
        elif pinned:
            setattr(out, _PINNED, True)
        return out


_RECORD_STREAM = torch.ops.aten.record_stream.default
_IS_PINNED = torch.ops.aten.is_pinned.default
_PIN_MEMORY = torch.ops.aten._pin_memory.default


def _seeded(spec: Spec, func: Any, args: Any, kwargs: Any, device: torch.device) -> Any:
    """Run a random op on the rank's generator of ``device``: its seed and offset pick the numbers."""
    gen = _state.generator(device.index or 0)
    if spec.storage.type == "cuda":
        real = _REAL_GENERATORS[spec.storage.index or 0]
        saved = real.get_state()
        real.set_state(gen.get_state())
        try:
            return func(*args, **kwargs)
        finally:
            gen.set_state(real.get_state())
            real.set_state(saved)
    cpu = torch.default_generator
    saved = cpu.get_state()
    # The CPU's generator draws the numbers, seeded from the device's seed and offset:
    # the same seed and offset give the same numbers, any other pair others.
    cpu.manual_seed(hash((gen.seed, gen.offset)) & 0x7FFF_FFFF_FFFF_FFFF)
    try:
        out = func(*args, **kwargs)
    finally:
        cpu.set_state(saved)
    gen.offset += _philox_increment(out)
    return out


def _philox_increment(out: Any) -> int:
    """How far a draw moves the offset: CUDA's kernels take 4 numbers per Philox call."""
    numel = 0
    for value in out if isinstance(out, (list, tuple)) else (out,):
        if isinstance(value, torch.Tensor):
            numel += value.numel()
    return max(4, (numel + 3) // 4 * 4)


_REAL_GENERATORS: tuple[Any, ...] = ()


def _count(out: Any, device: torch.device) -> None:
    """Count a new tensor's bytes against its device until the tensor is freed."""
    if not isinstance(out, torch.Tensor):
        if isinstance(out, (list, tuple)):
            for item in out:
                _count(item, device)
        return
    nbytes = out.untyped_storage().nbytes()
    if nbytes == 0:
        return
    rank = _state
    index = device.index or 0
    now = rank.allocated.get(index, 0) + nbytes
    rank.allocated[index] = now
    if now > rank.peak.get(index, 0):
        rank.peak[index] = now
    weakref.finalize(out, _free, rank, index, nbytes)


def _free(rank: _Rank, index: int, nbytes: int) -> None:
    rank.allocated[index] = rank.allocated.get(index, 0) - nbytes


# -- torch.Tensor's Python face --------------------------------------------------------------


def _device_property(self: torch.Tensor) -> torch.device:
    return device_of(self)


def _is_cuda_property(self: torch.Tensor) -> bool:
    return device_of(self).type == "cuda"


def _get_device(self: torch.Tensor) -> int:
    device = device_of(self)
    return -1 if device.type == "cpu" else (device.index or 0)


def _parse_to(self: torch.Tensor, args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[Any, Any, bool, Any]:
    if args and isinstance(args[0], torch.Tensor):  # t.to(other): other's device and dtype
        other = args[0]
        rest = dict(kwargs)
        return device_of(other), other.dtype, bool(args[1] if len(args) > 1 else rest.get("non_blocking", False)), None
    kwargs = {k: v for k, v in kwargs.items() if k != "copy"}  # torch's parser knows no copy=
    device, dtype, non_blocking, memory_format = torch._C._nn._parse_to(*args, **kwargs)
    return device, dtype, non_blocking, memory_format


def _to(self: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
    spec = _ACTIVE.spec
    assert spec is not None
    device, dtype, _non_blocking, memory_format = _parse_to(self, args, kwargs)
    copy = bool(kwargs.get("copy", False))
    options: dict[str, Any] = {"copy": copy}
    if dtype is not None:
        options["dtype"] = dtype
    if memory_format is not None:
        options["memory_format"] = memory_format
    if device is None:
        return _REAL_TO(self, **options)
    here = device_of(self)
    target = _cuda_device(device)
    if target is None:  # to the CPU (or another real device): a copy from a CUDA tensor
        if here.type == "cuda" and spec.storage.type == "cpu":
            out = _REAL_TO(self, device, **{**options, "copy": True})
            _untag(out)
            return out
        return _REAL_TO(self, device, **options)
    if here == target:
        return _REAL_TO(self, **options)
    out = _REAL_TO(self, spec.storage, **{**options, "copy": True})
    _tag(out, target)
    return out


def _cuda(self: torch.Tensor, device: Any = None, non_blocking: bool = False, **kwargs: Any) -> torch.Tensor:
    target = _cuda_device(torch.device("cuda") if device is None else device)
    if target is None:
        raise ValueError(f"Tensor.cuda() takes a CUDA device or its index, got {device!r}")
    return _to(self, target, **kwargs)


def _cpu(self: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
    if device_of(self).type == "cuda" and _ACTIVE.spec is not None and _ACTIVE.spec.storage.type == "cpu":
        out = _REAL_TO(self, _CPU, copy=True)
        _untag(out)
        return out
    return _REAL_CPU(self, *args, **kwargs)


def _pin_memory(self: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
    out = self.clone()
    setattr(out, _PINNED, True)
    return out


def _is_pinned(self: torch.Tensor, *args: Any, **kwargs: Any) -> bool:
    return bool(getattr(self, _PINNED, False))


_REAL_DATA = torch._C.TensorBase.data


def _get_data(self: torch.Tensor) -> torch.Tensor:
    data = _REAL_DATA.__get__(self)
    tag = getattr(self, _TAG, None)
    if tag is not None:
        setattr(data, _TAG, tag)
    return data


def _set_data(self: torch.Tensor, value: torch.Tensor) -> None:
    # nn.Module.cuda() and .to() swap a parameter's data in place: it takes the data's device
    _REAL_DATA.__set__(self, value)
    tag = getattr(value, _TAG, None)
    if tag is not None or getattr(self, _TAG, None) is not None:
        setattr(self, _TAG, tag)


_REAL_GRAD = torch._C.TensorBase.grad


def _get_grad(self: torch.Tensor) -> torch.Tensor | None:
    # A gradient lives where its tensor does; one a compiled backward made on the
    # storage device without an op the mode sees takes its tensor's device here.
    grad = _REAL_GRAD.__get__(self)
    if grad is not None:
        tag = getattr(self, _TAG, None)
        if tag is not None and getattr(grad, _TAG, None) is None:
            _tag_untagged(grad, tag)
    return grad


def _set_grad(self: torch.Tensor, value: torch.Tensor | None) -> None:
    _REAL_GRAD.__set__(self, value)


def _del_grad(self: torch.Tensor) -> None:
    _REAL_GRAD.__delete__(self)


def _autograd_grad_for(original: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(original)
    def grad(outputs: Any, inputs: Any, *args: Any, **kwargs: Any) -> Any:
        grads = original(outputs, inputs, *args, **kwargs)
        tensors = (inputs,) if isinstance(inputs, torch.Tensor) else tuple(inputs)
        for tensor, result in zip(tensors, grads):
            tag = getattr(tensor, _TAG, None) if isinstance(tensor, torch.Tensor) else None
            if tag is not None and result is not None:
                _tag_untagged(result, tag)
        return grads

    return grad


def _made_on(original: Callable[..., torch.Tensor]) -> Callable[..., torch.Tensor]:
    """``torch.tensor`` and its kin, whose ``device=`` torch checks before any op runs."""

    def make(*args: Any, **kwargs: Any) -> torch.Tensor:
        target = _cuda_device(kwargs.get("device"))
        # pinned host memory needs a real GPU's allocator: without one, the tensor says it is pinned
        pinned = bool(kwargs.pop("pin_memory", False)) if _REAL_CUDA["is_available"]() is False else False
        if target is not None:
            kwargs["device"] = _ACTIVE.spec.storage if _ACTIVE.spec is not None else _CPU
        out = original(*args, **kwargs)
        if target is not None:
            _tag(out, target)
        elif pinned:
            setattr(out, _PINNED, True)
        return out

    make.__name__ = getattr(original, "__name__", "make")
    make.__doc__ = getattr(original, "__doc__", None)
    return make


def _compile_for(original: Callable[..., Any]) -> Callable[..., Any]:
    """``torch.compile`` whose compiled callables give their outputs the device of their first CUDA input.

    Compiled code allocates its outputs on the storage device without an op this
    module sees (Inductor's kernels write them directly), so they carry no tag.
    """

    def compile(model: Any = None, **kwargs: Any) -> Any:
        if model is None:
            return lambda fn: compile(fn, **kwargs)
        compiled = original(model, **kwargs)
        if isinstance(compiled, torch.nn.Module):
            compiled.register_forward_hook(_tag_like_inputs, with_kwargs=True)
            return compiled

        @functools.wraps(compiled)
        def run(*args: Any, **kw: Any) -> Any:
            out = compiled(*args, **kw)
            tag = _first_tag((*args, *kw.values()))
            if tag is not None:
                _tag_untagged(out, tag)
            return out

        return run

    compile.__doc__ = original.__doc__
    return compile


def _tag_like_inputs(module: Any, args: Any, kwargs: Any, output: Any) -> None:
    tag = _first_tag((*args, *kwargs.values()))
    if tag is not None:
        _tag_untagged(output, tag)


def _tag_untagged(value: Any, device: torch.device) -> None:
    if isinstance(value, torch.Tensor):
        if device_of(value).type != "cuda":
            _tag(value, device)
    elif isinstance(value, (list, tuple)):
        for item in value:
            _tag_untagged(item, device)
    elif isinstance(value, dict):
        for item in value.values():
            _tag_untagged(item, device)


def _make_wrapper_subclass_for(original: Any) -> Callable[..., Any]:
    def make_wrapper_subclass(cls: Any, *args: Any, **kwargs: Any) -> Any:
        target = _cuda_device(kwargs.get("device"))
        if target is not None:
            kwargs["device"] = _ACTIVE.spec.storage if _ACTIVE.spec is not None else _CPU
        out = original(cls, *args, **kwargs)
        if target is not None:
            setattr(out, _TAG, target)
        return out

    return make_wrapper_subclass


_GeneratorBase = torch._C.Generator


class _GeneratorKind(type(_GeneratorBase)):  # type: ignore[misc]
    # isinstance(torch.default_generator, torch.Generator) stays true while torch.Generator is this
    def __instancecheck__(cls, obj: object) -> bool:
        return isinstance(obj, _GeneratorBase)

    def __subclasscheck__(cls, sub: type) -> bool:
        return issubclass(sub, _GeneratorBase)


class _UserGenerator(_GeneratorBase, metaclass=_GeneratorKind):
    """``torch.Generator(device="cuda")``: a generator of the storage device that says it is CUDA's."""

    def __new__(cls, device: Any = "cpu") -> _UserGenerator:
        target = _cuda_device(device)
        storage = (_ACTIVE.spec.storage if _ACTIVE.spec is not None else _CPU) if target is not None else device
        return _GeneratorBase.__new__(cls, storage)

    def __init__(self, device: Any = "cpu") -> None:
        target = _cuda_device(device)
        self._meshsim_device = target if target is not None else torch.device(device)

    @property
    def device(self) -> torch.device:  # type: ignore[override]
        return self._meshsim_device


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
            f"total_memory={self.total_memory // 1024**2}MB, multi_processor_count={self.multi_processor_count})"
        )


def _index(device: Any = None) -> int:
    if device is None:
        return _state.current
    if isinstance(device, int):
        return _state.current if device < 0 else device
    if isinstance(device, str):
        device = torch.device(device)
    if isinstance(device, torch.device):
        if device.type != "cuda":
            raise ValueError(f"expected a CUDA device, got {device!r}")
        return _state.current if device.index is None else device.index
    index = getattr(device, "idx", getattr(device, "device_index", None))
    if isinstance(index, int):
        return index
    raise ValueError(f"expected a CUDA device (an int, 'cuda:N' or torch.device), got {device!r}")


def _checked(index: int) -> int:
    count = _device_count()
    if not 0 <= index < count:
        raise RuntimeError(
            f"CUDA error: invalid device ordinal {index}: meshsim emulates {count} GPUs per rank "
            "(MESHSIM_CUDA_DEVICES or the number of ranks per node sets how many)"
        )
    return index


def _device_count() -> int:
    spec = _ACTIVE.spec
    return spec.devices if spec is not None else 0


def _set_device(device: Any) -> None:
    index = _index(device)
    if index >= 0:
        _state.current = _checked(index)


class _DeviceContext:
    """``torch.cuda.device(k)``: device ``k`` is current inside the block."""

    def __init__(self, device: Any) -> None:
        self.idx = -1 if device is None else _index(device)
        self.prev_idx = -1

    def __enter__(self) -> None:
        self.prev_idx = _state.current
        if self.idx >= 0:
            _state.current = _checked(self.idx)

    def __exit__(self, *exc: object) -> None:
        _state.current = self.prev_idx


class _DeviceOf(_DeviceContext):
    def __init__(self, obj: Any) -> None:
        super().__init__(device_of(obj).index if device_of(obj).type == "cuda" else -1)


class _Stream(torch.Stream):
    """A CUDA stream on an emulated device: ordering is kept because every kernel is done at once."""

    def __new__(cls, device: Any = None, priority: int = 0, **kwargs: Any) -> _Stream:
        return super().__new__(cls, "cpu")

    def __init__(self, device: Any = None, priority: int = 0, **kwargs: Any) -> None:
        self._meshsim_device = torch.device("cuda", _index(device))
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

    def record_event(self, event: Any = None) -> _Event:
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

    def __init__(self, enable_timing: bool = False, blocking: bool = False, interprocess: bool = False) -> None:
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
    index = _index(device)
    stream = _state.streams.get(index)
    if stream is None:
        stream = _state.streams[index] = _Stream(index)
    return stream


@contextlib.contextmanager
def _stream(stream: Any) -> Iterator[None]:
    if stream is None:
        yield
        return
    index = stream.device.index if isinstance(stream, _Stream) else _state.current
    before = _state.streams.get(index)
    _state.streams[index] = stream
    try:
        yield
    finally:
        if before is None:
            _state.streams.pop(index, None)
        else:
            _state.streams[index] = before


def _set_stream(stream: Any) -> None:
    if stream is not None:
        index = stream.device.index if isinstance(stream, _Stream) else _state.current
        _state.streams[index] = stream


def _memory_allocated(device: Any = None) -> int:
    return _state.allocated.get(_index(device), 0)


def _max_memory_allocated(device: Any = None) -> int:
    return _state.peak.get(_index(device), 0)


def _reset_peak(device: Any = None) -> None:
    index = _index(device)
    _state.peak[index] = _state.allocated.get(index, 0)


def _memory_stats(device: Any = None) -> dict[str, int]:
    index = _index(device)
    now, peak = _state.allocated.get(index, 0), _state.peak.get(index, 0)
    return {
        "allocated_bytes.all.current": now,
        "allocated_bytes.all.peak": peak,
        "reserved_bytes.all.current": now,
        "reserved_bytes.all.peak": peak,
        "active_bytes.all.current": now,
        "active_bytes.all.peak": peak,
    }


def _mem_get_info(device: Any = None) -> tuple[int, int]:
    spec = _ACTIVE.spec
    total = spec.memory if spec is not None else 0
    return max(0, total - _memory_allocated(device)), total


def _generator_of(device: Any = "cuda") -> _Generator:
    return _state.generator(_index(device))


def _manual_seed(seed: int) -> None:
    _state.generator(_state.current).manual_seed(seed)


def _manual_seed_all(seed: int) -> None:
    for index in range(_device_count()):
        _state.generator(index).manual_seed(seed)


def _seed() -> None:
    _state.generator(_state.current).seed_()


def _seed_all() -> None:
    seed = _state.generator(_state.current).seed_()
    _manual_seed_all(seed)


class _Generators:
    """``torch.cuda.default_generators``: the calling rank's generator of each device."""

    def __getitem__(self, index: int) -> _Generator:
        return _state.generator(_checked(index))

    def __len__(self) -> int:
        return _device_count()

    def __iter__(self) -> Iterator[_Generator]:
        return (self[i] for i in range(len(self)))


class _Nvtx:
    """``torch.cuda.nvtx``: ranges and marks have nowhere to go without a profiler: accepted, dropped."""

    def __init__(self) -> None:
        self._depth = threading.local()

    def range_push(self, msg: str) -> int:
        depth = getattr(self._depth, "value", 0)
        self._depth.value = depth + 1
        return depth

    def range_pop(self) -> int:
        depth = getattr(self._depth, "value", 0)
        self._depth.value = max(0, depth - 1)
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


def _stand_ins(spec: Spec) -> dict[str, Any]:
    """``torch.cuda``'s names as a CUDA machine with ``spec.devices`` GPUs answers them, per rank."""

    def get_device_properties(device: Any = None) -> _Properties:
        return _Properties(spec, _checked(_index(device)))

    def get_rng_state(device: Any = "cuda") -> torch.Tensor:
        return _generator_of(device).get_state()

    def set_rng_state(new_state: torch.Tensor, device: Any = "cuda") -> None:
        _generator_of(device).set_state(new_state)

    return {
        "is_available": lambda: True,
        "is_initialized": lambda: True,
        "_lazy_init": lambda: None,
        "init": lambda: None,
        "device_count": _device_count,
        "current_device": lambda: _state.current,
        "set_device": _set_device,
        "device": _DeviceContext,
        "device_of": _DeviceOf,
        "synchronize": lambda device=None: None,
        "get_device_name": lambda device=None: spec.name,
        "get_device_capability": lambda device=None: spec.capability,
        "get_device_properties": get_device_properties,
        "get_arch_list": lambda: [f"sm_{spec.capability[0]}{spec.capability[1]}"],
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
        "initial_seed": lambda: _state.generator(_state.current).initial_seed(),
        "get_rng_state": get_rng_state,
        "set_rng_state": set_rng_state,
        "get_rng_state_all": lambda: [_state.generator(i).get_state() for i in range(_device_count())],
        "set_rng_state_all": lambda states: [_state.generator(i).set_state(s) for i, s in enumerate(states)],
        "default_generators": _Generators(),
        "nvtx": _Nvtx(),
    }


# -- install and undo -----------------------------------------------------------------------


class _Active:
    """The emulation now installed (``spec``), how many worlds and sessions use it, and its undo steps."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.spec: Spec | None = None
        self.users = 0
        self.undo: list[Callable[[], None]] = []


_ACTIVE = _Active()


def active() -> Spec | None:
    """The emulation installed now, or None."""
    return _ACTIVE.spec


def acquire(spec: Spec) -> None:
    """Install the emulation (the first user), or check that ``spec`` is the one installed.

    Raises:
        ValueError: another emulation is installed (worlds overlapping with different ones).
    """
    with _ACTIVE.lock:
        if _ACTIVE.users:
            assert _ACTIVE.spec is not None
            if _ACTIVE.spec.storage != spec.storage:
                raise ValueError(
                    f"CUDA is emulated as {_ACTIVE.spec} already; a world cannot emulate {spec} at the same time"
                )
            _ACTIVE.users += 1
            return
        _install(spec)
        _ACTIVE.users = 1


def release() -> None:
    """Undo one :func:`acquire`; the last one out puts torch back as it was."""
    with _ACTIVE.lock:
        _ACTIVE.users -= 1
        if _ACTIVE.users == 0:
            while _ACTIVE.undo:
                _ACTIVE.undo.pop()()
            _ACTIVE.spec = None


def _install(spec: Spec) -> None:
    global _REAL_GENERATORS
    undo = _ACTIVE.undo
    try:
        if spec.storage.type == "cuda":
            _REAL_GENERATORS = tuple(torch.cuda.default_generators)
        _ACTIVE.spec = spec
        for name, value in _stand_ins(spec).items():
            undo.append(_set_attr(torch.cuda, name, value))
        undo.append(_set_attr(torch.Tensor, _TAG, None))
        undo.append(_set_attr(torch.Tensor, "device", property(_device_property)))
        undo.append(_set_attr(torch.Tensor, "is_cuda", property(_is_cuda_property)))
        undo.append(_set_attr(torch.Tensor, "get_device", _get_device))
        undo.append(_set_attr(torch.Tensor, "to", _to))
        undo.append(_set_attr(torch.Tensor, "cuda", _cuda))
        undo.append(_set_attr(torch.Tensor, "cpu", _cpu))
        undo.append(_set_attr(torch.Tensor, "pin_memory", _pin_memory))
        undo.append(_set_attr(torch.Tensor, "is_pinned", _is_pinned))
        undo.append(_set_attr(torch.Tensor, "data", property(_get_data, _set_data)))
        for name in ("tensor", "as_tensor", "asarray"):
            undo.append(_set_attr(torch, name, _made_on(getattr(torch, name))))
        undo.append(_set_attr(torch.Tensor, "new_tensor", _made_on(torch._C.TensorBase.new_tensor)))
        undo.append(_set_attr(torch, "compile", _compile_for(torch.compile)))
        undo.append(_set_attr(torch, "Generator", _UserGenerator))
        undo.append(_set_attr(torch.Tensor, "grad", property(_get_grad, _set_grad, _del_grad)))
        undo.append(_set_attr(torch.autograd, "grad", _autograd_grad_for(torch.autograd.grad)))
        undo.append(_children_emulate(spec))
        original = torch.Tensor._make_wrapper_subclass
        undo.append(_set_attr(torch.Tensor, "_make_wrapper_subclass", staticmethod(_make_wrapper_subclass_for(original))))
    except BaseException:
        while undo:
            undo.pop()()
        _ACTIVE.spec = None
        raise


_MISSING: Any = object()


def _set_attr(owner: Any, name: str, value: Any) -> Callable[[], None]:
    before = owner.__dict__.get(name, _MISSING) if hasattr(owner, "__dict__") else getattr(owner, name, _MISSING)
    setattr(owner, name, value)

    def undo() -> None:
        if before is _MISSING:
            delattr(owner, name)
        else:
            setattr(owner, name, before)

    return undo


# -- processes user code starts -------------------------------------------------------------------


def _children_emulate(spec: Spec) -> Callable[[], None]:
    """Processes started with multiprocessing's ``spawn`` (``torch.multiprocessing.spawn``) emulate too.

    Such a child is a new interpreter that runs ``-c "...spawn_main(...)"``: the program
    gets :func:`emulate_in_process` in front of it. Checked with Python 3.10-3.13's
    ``multiprocessing.spawn.get_command_line``.
    """
    import multiprocessing.spawn as mp_spawn

    original = mp_spawn.get_command_line
    storage = "cpu" if spec.storage.type == "cpu" else str(spec.storage)

    def get_command_line(**kwds: Any) -> list[str]:
        line = list(original(**kwds))
        if "-c" in line:
            at = line.index("-c") + 1
            line[at] = (
                f"import meshsim._process.cuda as _c; _c.emulate_in_process({storage!r}, {spec.devices}); "
                + line[at]
            )
        return line

    return _set_attr(mp_spawn, "get_command_line", get_command_line)


def emulate_in_process(storage: str, devices: int) -> None:
    """Emulate CUDA in this whole process (a child user code started): NCCL groups are gloo groups.

    The process is a real rank of a real job: its ``init_process_group("nccl", device_id=...)``
    and ``new_group(backend="nccl")`` make gloo groups, whose CPU tensors are what the
    emulated CUDA tensors hold. Not undone: the process is the child's alone.
    """
    spec = parse(storage, devices=devices)
    if spec is None:
        return
    acquire(spec)
    enter_rank()
    import torch.distributed as dist
    import torch.distributed.distributed_c10d as c10d

    for name in ("init_process_group", "new_group"):
        gloo = _nccl_as_gloo(getattr(c10d, name))
        setattr(c10d, name, gloo)
        setattr(dist, name, gloo)


def _nccl_as_gloo(original: Callable[..., Any]) -> Callable[..., Any]:
    import inspect

    signature = inspect.signature(original)

    @functools.wraps(original)
    def call(*args: Any, **kwargs: Any) -> Any:
        bound = signature.bind_partial(*args, **kwargs)
        backend = bound.arguments.get("backend")
        if backend is not None and "nccl" in str(backend).lower():
            bound.arguments["backend"] = "gloo"
            bound.arguments.pop("device_id", None)
        return original(*bound.args, **bound.kwargs)

    return call


# -- per thread ---------------------------------------------------------------------------------

_modes = threading.local()


def enter_rank() -> None:
    """Emulate CUDA in the calling thread (a rank, or a pytest process that emulates): push the mode."""
    spec = _ACTIVE.spec
    if spec is None:
        return
    mode = _CudaMode(spec)
    mode.__enter__()
    stack = getattr(_modes, "stack", None)
    if stack is None:
        stack = _modes.stack = []
    stack.append(mode)


def leave_rank() -> None:
    """Undo :func:`enter_rank` in the calling thread."""
    stack = getattr(_modes, "stack", None)
    if stack:
        stack.pop().__exit__(None, None, None)
