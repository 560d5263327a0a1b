"""Which tensors are CUDA tensors: the tags, the dispatch mode that carries them, torch.Tensor's face."""

from __future__ import annotations

import contextlib
import functools
import weakref
from collections.abc import Callable, Iterator
from typing import Any, cast

import torch
import torch._guards
from torch._subclasses.fake_tensor import FakeTensor as _FakeTensor
from torch.utils._python_dispatch import TorchDispatchMode

from meshsim._base.context import current
from meshsim._process.cuda import hops
from meshsim._process.cuda.rank import Rank, check_ordinal, now
from meshsim._process.cuda.spec import CPU, IN_USE, REAL_CUDA, Spec, spec_here

__all__ = ["CudaMode", "device_of", "patches"]

_TAG = "_meshsim_cuda"  # the attribute a CUDA tensor carries: its torch.device("cuda", k)
_PINNED = "_meshsim_pinned"

# -- tags: which tensors are CUDA tensors -------------------------------------------------

_REAL_DEVICE: Any = torch._C.TensorBase.device
_REAL_TO: Any = torch._C.TensorBase.to
_REAL_CPU: Any = torch._C.TensorBase.cpu
_PLAIN_DISPATCH = torch.Tensor.__torch_dispatch__
_get_dispatch_mode = torch._C._get_dispatch_mode
_FAKE = torch._C._TorchDispatchModeKey.FAKE
_tracing = torch._guards.TracingContext.try_get  # set while Dynamo compiles a frame
_compiling = torch.compiler.is_compiling  # True in the code Dynamo traces; a process-wide flag
_dynamo_tracing = torch.compiler.is_dynamo_compiling  # True only in the code Dynamo traces
_HERE = current()  # one object; its fields (``cuda``: the thread's CudaMode) are per thread


def device_of(tensor: torch.Tensor) -> torch.device:
    """What ``tensor.device`` says under emulation: its tag, a wrapper's inner tensor's, or the real one."""
    if _compiling() and (_dynamo_tracing() or _tracing() is not None):
        # torch holds ``is_compiling()`` True for the whole process while any thread compiles
        # (torch 2.13-2.14): another gloo rank's eager code is not compiling, so this thread's
        # own compile is asked for (Dynamo folds ``is_dynamo_compiling()`` to True as it traces).
        # Dynamo traces this getter where it cannot read ``.device`` itself (a tensor with a
        # ``__torch_function__``, as flex attention's inputs): the storage, as it compiles
        # for, in a form it folds to a constant (torch 2.13-2.14) instead of a graph break.
        return cast(torch.device, _REAL_DEVICE.__get__(tensor))
    tag: torch.device | None = getattr(tensor, _TAG, None)
    mode = _HERE.cuda
    if tag is not None and (mode is None or not mode.depth):
        # While torch.compile compiles (a frame's tracing context or a fake mode on), the
        # compiler sees the storage it compiles for; so does torch's own code that runs
        # with the dispatch modes off (a higher-order operator's autograd making its
        # graph's inputs: torch.empty_strided(..., device=t.device), torch 2.13-2.14).
        shown = _mode_on() or (mode is not None and mode.printing)
        if shown and _get_dispatch_mode(_FAKE) is None and _tracing() is None:
            return tag
        return cast(torch.device, _REAL_DEVICE.__get__(tensor))
    flatten = getattr(type(tensor), "__tensor_flatten__", None)
    if flatten is not None and type(tensor).__torch_dispatch__ is not _PLAIN_DISPATCH:
        names, _ = flatten(tensor)
        if names:
            inner = getattr(tensor, names[0], None)
            if isinstance(inner, torch.Tensor):
                return device_of(inner)
    return cast(torch.device, _REAL_DEVICE.__get__(tensor))


def _mode_on() -> bool:
    """Whether the calling thread's dispatch modes include the emulation's (torch can turn them off)."""
    for depth in range(_stack_len()):
        if isinstance(_stack_at(depth), CudaMode):
            return True
    return False


_stack_len = torch._C._len_torch_dispatch_stack
_stack_at = torch._C._get_dispatch_stack_at


def _printed_with_tags(original: Callable[..., str]) -> Callable[..., str]:
    """``torch._tensor_str._str`` (a tensor's repr, made with the modes off) says ``device='cuda:k'``."""

    @functools.wraps(original)
    def _str(*args: Any, **kwargs: Any) -> str:
        mode = _HERE.cuda
        if mode is None:
            return original(*args, **kwargs)
        mode.printing += 1
        try:
            return original(*args, **kwargs)
        finally:
            mode.printing -= 1

    return _str


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


def cuda_device(device: Any) -> torch.device | None:
    """``device`` as a full ``cuda:k`` when it names CUDA (a bare ``cuda``: the current device), else None."""
    if device is None:
        return None
    if isinstance(device, int):  # a bare ordinal, as Tensor.cuda(1) and device_id=1 give
        return torch.device("cuda", device)
    if not isinstance(device, torch.device):
        device = torch.device(device)
    if device.type != "cuda":
        return None
    if device.index is None:
        return torch.device("cuda", now().current)
    check_ordinal(device.index)
    return cast("torch.device | None", device)


# -- the dispatch mode: factories, tags, seeded ops, memory -------------------------------

# op -> (allocates new storage, draws random numbers, has a CUDA kernel and no CPU one)
_op_facts: dict[Any, tuple[bool, bool, bool]] = {}
_CUDA_KEYS = torch._C.DispatchKeySet(torch._C.DispatchKey.CUDA)


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
            tag: torch.device | None = getattr(arg, _TAG, None)
            if tag is not None:
                return tag
        elif isinstance(arg, (list, tuple)):
            for item in arg:
                if isinstance(item, torch.Tensor):
                    tag = getattr(item, _TAG, None)
                    if tag is not None:
                        return cast("torch.device | None", tag)
    return None


class CudaMode(TorchDispatchMode):  # type: ignore[no-untyped-call]
    """Every aten op of a thread that emulates CUDA; the thread's emulation (its rank context's ``cuda``).

    Attributes:
        spec: what the thread emulates, sized for its world (``torch.cuda`` answers from it).
        asked: the spec as asked for, before sizing: what a world the thread starts inherits.
        depth: how many ops the mode runs now in this thread (inside one, kernels see storage).
        nvtx_depth: the thread's open ``torch.cuda.nvtx`` ranges.
        capture: the CUDA graph the thread captures now, its ops recorded as they run
            (None: no capture; a :class:`meshsim._process.cuda.graphs.Capture`).
        outer: the thread's emulation before this one (None: it did not emulate).
    """

    # higher-order operators (flex attention, cond, while_loop...) come here too: see .hops
    supports_higher_order_operators = True

    def __init__(self, spec: Spec, asked: Spec | None = None, outer: CudaMode | None = None) -> None:
        super().__init__()  # type: ignore[no-untyped-call]
        self.spec = spec
        self.asked = asked if asked is not None else spec
        self.depth = 0
        self.nvtx_depth = 0
        self.capture: Any = None  # graphs.Capture
        self.outer = outer
        self.printing = 0  # a tensor's repr runs with the modes off, and says its tag

    @classmethod
    def ignore_compile_internals(cls) -> bool:
        # Dynamo skips frames while a dispatch mode is on unless the mode says this:
        # torch.compile then compiles with the mode off and runs its code under it.
        return True

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        if hops.is_higher_order(func):
            return hops.run(
                self,
                func,
                args,
                kwargs or {},
                first_tag=_first_tag,
                tag=_tag,
                kernel=_in_kernel,
                user_code=_out_of_kernel,
            )
        for kind in types:
            if kind.__torch_dispatch__ is not _PLAIN_DISPATCH:
                if issubclass(kind, _FakeTensor):
                    # shape propagation (DTensor's, torch.compile's): fake tensors answer in
                    # their own mode, on whatever device they claim
                    return func(*args, **(kwargs or {}))
                # A subclass (DTensor, ShardTensor) handles the op; this mode stays on for
                # the ops its handler runs on the inner tensors, which carry the tags.
                return NotImplemented
        kwargs = given = kwargs or {}
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
            target = cuda_device(kwargs.get("device"))
            if target is not None:
                kwargs["device"] = self.spec.storage
            elif kwargs.get("device") is None:
                target = _first_tag(args)
        else:
            target = _first_tag(args)
        if target is not None and func in _BY_ELEMENT_COUNT:
            args = _flat_on_gloo(args)
        allocates, seeded, cuda_only = _facts(func)
        # Python kernels the op runs (a torch.library custom op's) see the storage device,
        # as kernels do: what they make is tagged on the way out.
        depth = self.depth
        self.depth = depth + 1
        capture = self.capture
        recorded = 0
        step = func
        if capture is not None:  # a CUDA graph's capture: see meshsim._process.cuda.graphs
            recorded = len(capture.steps)
            capture.before_write(self, func, args, kwargs)
            if seeded and target is not None and kwargs.get("generator") is None:
                step = capture.drawing(func, target.index or 0)
        try:
            if target is not None and func in _ON_CPU:
                out = _ON_CPU[func](*args, **kwargs)  # a CUDA-only kernel, computed by the CPU's
            elif seeded and target is not None and kwargs.get("generator") is None:
                out = _seeded(self.spec, func, args, kwargs, target)
            elif cuda_only and target is not None:
                out = func.redispatch(_CUDA_KEYS, *args, **kwargs)  # its CUDA kernel, on the storage
            else:
                out = func(*args, **kwargs)
        finally:
            self.depth = depth
        if target is not None:
            _tag(out, target)
            if allocates:
                _count(out, target)
        elif pinned:
            setattr(out, _PINNED, True)
        if capture is not None and len(capture.steps) == recorded:
            # replay runs the op again (or what it noted running, if anything)
            capture.record(step, args, given, out)
        return out


@contextlib.contextmanager
def _in_kernel() -> Iterator[None]:
    """Code that runs as a kernel (a higher-order operator's own): tensors say their storage device."""
    mode = _HERE.cuda
    if mode is None:
        yield
        return
    mode.depth += 1
    try:
        yield
    finally:
        mode.depth -= 1


@contextlib.contextmanager
def _out_of_kernel() -> Iterator[None]:
    """User code a kernel calls back (a higher-order operator's function): tensors say their tag."""
    mode = _HERE.cuda
    if mode is None:
        yield
        return
    depth, mode.depth = mode.depth, 0
    try:
        yield
    finally:
        mode.depth = depth


def _efficient_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attn_bias: torch.Tensor | None,
    compute_log_sumexp: bool,
    dropout_p: float = 0.0,
    is_causal: bool = False,
    *,
    scale: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """CUDA's memory-efficient attention, by the CPU's flash attention: the output and the log-sum-exp."""
    out, log_sumexp = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default(
        query, key, value, dropout_p, is_causal, attn_mask=attn_bias, scale=scale
    )
    seed = torch.zeros((), dtype=torch.int64)  # no Philox draw: dropout is the CPU kernel's
    return out, log_sumexp, seed, seed.clone()


def _efficient_attention_backward(
    grad_out: torch.Tensor,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attn_bias: torch.Tensor | None,
    out: torch.Tensor,
    log_sumexp: torch.Tensor,
    philox_seed: torch.Tensor,
    philox_offset: torch.Tensor,
    dropout_p: float,
    grad_input_mask: list[bool],
    is_causal: bool = False,
    *,
    scale: float | None = None,
) -> tuple[torch.Tensor | None, ...]:
    """Its backward, from the given output and log-sum-exp (ring attention passes the global ones)."""
    lse = log_sumexp[..., : query.shape[-2]].contiguous()  # CUDA pads the query dim; the CPU does not
    grad_q, grad_k, grad_v = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward.default(
        grad_out, query, key, value, out, lse, dropout_p, is_causal, attn_mask=attn_bias, scale=scale
    )
    grad_bias = None
    if attn_bias is not None and len(grad_input_mask) > 3 and grad_input_mask[3]:
        factor = scale if scale is not None else query.shape[-1] ** -0.5
        probs = torch.exp(query @ key.transpose(-2, -1) * factor + attn_bias - lse.unsqueeze(-1))
        delta = (grad_out * out).sum(-1, keepdim=True)
        grad_scores = probs * (grad_out @ value.transpose(-2, -1) - delta)
        grad_bias = grad_scores.sum_to_size(attn_bias.shape)
    return grad_q, grad_k, grad_v, grad_bias


# CUDA-only aten kernels that code written for GPUs calls by name, and the CPU's stand-ins
_ON_CPU: dict[Any, Callable[..., Any]] = {
    torch.ops.aten._scaled_dot_product_efficient_attention.default: _efficient_attention,
    torch.ops.aten._scaled_dot_product_efficient_attention_backward.default: _efficient_attention_backward,
}


# Collectives whose tensors NCCL matches by element count only (all_gather_into_tensor,
# reduce_scatter_tensor): gloo, which serves "nccl" groups outside simulated worlds under
# emulation, checks their shapes (a 1-D output of a (2, 4) input fails there, as Megatron's
# gather_split_1d_tensor does). Absent where torch.distributed is not built.
_BY_ELEMENT_COUNT = frozenset(
    getattr(getattr(torch.ops.c10d, name, None), "default", None)
    for name in ("_allgather_base_", "_reduce_scatter_base_")
) - {None}


def _flat_on_gloo(args: Any) -> Any:
    """A gloo group's call with flat views of its two tensors, where their shapes differ beyond the first dim.

    The op's result is the output tensor the caller passed in (the view writes into it).
    """
    output, given, group = args[0], args[1], args[2]
    if output.shape[1:] == given.shape[1:] or not (output.is_contiguous() and given.is_contiguous()):
        return args
    unbox = getattr(torch.distributed.ProcessGroup, "unbox", None)  # torch 2.11-2.15
    if unbox is None or unbox(group).name() != "gloo":
        return args
    return (output.view(-1), given.view(-1), *args[2:])


def _dtensor_rng(mode: CudaMode, start: int, end: int, op: Any, *args: Any, **kwargs: Any) -> Any:
    """DTensor's random ops on CUDA meshes (``run_dtensor_rng_op``): the rank's generator, DTensor's offsets.

    As torch's CUDA implementation: the op draws from the generator's offset moved
    by ``start``, and leaves it at the old offset plus ``end``.
    """
    first = args[0] if args and isinstance(args[0], torch.Tensor) else None
    # the mode is off here: device_of would say the storage
    tag = getattr(first, _TAG, None) if first is not None else None
    device = tag if tag is not None else torch.device("cuda", now().current)
    generator = now().generator(device.index or 0)
    old = generator.offset
    generator.offset = old + start
    try:
        with mode:
            return op(*args, **kwargs)
    finally:
        generator.offset = old + end


def register_higher_order_ops() -> None:
    """Teach torch's higher-order ops that need a rule per mode (checked in torch 2.13) about this mode."""
    rng_prims = __import__("torch._prims.rng_prims", fromlist=["run_dtensor_rng_op"])
    hop = getattr(rng_prims, "run_dtensor_rng_op", None)  # not in every release of the range
    if hop is not None and CudaMode not in hop.python_key_table:
        hop.py_impl(CudaMode)(_dtensor_rng)


_RECORD_STREAM = torch.ops.aten.record_stream.default
_IS_PINNED = torch.ops.aten.is_pinned.default
_PIN_MEMORY = torch.ops.aten._pin_memory.default


def _seeded(spec: Spec, func: Any, args: Any, kwargs: Any, device: torch.device) -> Any:
    """Run a random op on the rank's generator of ``device``: its seed and offset pick the numbers."""
    gen = now().generator(device.index or 0)
    if spec.storage.type == "cuda":
        real = IN_USE.real_generators[spec.storage.index or 0]
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
    rank = now()
    index = device.index or 0
    held = rank.allocated.get(index, 0) + nbytes
    rank.allocated[index] = held
    if held > rank.peak.get(index, 0):
        rank.peak[index] = held
    weakref.finalize(out, _free, rank, index, nbytes)


def _free(rank: Rank, index: int, nbytes: int) -> None:
    rank.allocated[index] = rank.allocated.get(index, 0) - nbytes


# -- torch.Tensor's Python face --------------------------------------------------------------


def _device_property(self: torch.Tensor) -> torch.device:
    return device_of(self)


def _is_cuda_property(self: torch.Tensor) -> bool:
    return device_of(self).type == "cuda"


def _get_device(self: torch.Tensor) -> int:
    device = device_of(self)
    return -1 if device.type == "cpu" else (device.index or 0)


def _parse_to(
    self: torch.Tensor, args: tuple[Any, ...], kwargs: dict[str, Any]
) -> tuple[Any, Any, bool, Any]:
    if args and isinstance(args[0], torch.Tensor):  # t.to(other): other's device and dtype
        other = args[0]
        rest = dict(kwargs)
        non_blocking = bool(args[1] if len(args) > 1 else rest.get("non_blocking", False))
        return device_of(other), other.dtype, non_blocking, None
    kwargs = {k: v for k, v in kwargs.items() if k != "copy"}  # torch's parser knows no copy=
    device, dtype, non_blocking, memory_format = torch._C._nn._parse_to(*args, **kwargs)
    return device, dtype, non_blocking, memory_format


def _to(self: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
    spec = spec_here()
    if spec is None:  # the emulation ended while a reference to this stand-in was kept
        return cast(torch.Tensor, _REAL_TO(self, *args, **kwargs))
    device, dtype, _non_blocking, memory_format = _parse_to(self, args, kwargs)
    copy = bool(kwargs.get("copy", False))
    options: dict[str, Any] = {"copy": copy}
    if dtype is not None:
        options["dtype"] = dtype
    if memory_format is not None:
        options["memory_format"] = memory_format
    if device is None:
        return cast(torch.Tensor, _REAL_TO(self, **options))
    here = device_of(self)
    target = cuda_device(device)
    if target is None:  # to the CPU (or another real device): a copy from a CUDA tensor
        if here.type == "cuda" and spec.storage.type == "cpu":
            out = _REAL_TO(self, device, **{**options, "copy": True})
            _untag(out)
            return cast(torch.Tensor, out)
        return cast(torch.Tensor, _REAL_TO(self, device, **options))
    if here == target:
        return cast(torch.Tensor, _REAL_TO(self, **options))
    out = _REAL_TO(self, spec.storage, **{**options, "copy": True})
    _tag(out, target)
    return cast(torch.Tensor, out)


def _cuda(self: torch.Tensor, device: Any = None, non_blocking: bool = False, **kwargs: Any) -> torch.Tensor:
    target = cuda_device(torch.device("cuda") if device is None else device)
    if target is None:
        raise ValueError(f"Tensor.cuda() takes a CUDA device or its index, got {device!r}")
    return _to(self, target, **kwargs)


def _cpu(self: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
    spec = spec_here()
    if device_of(self).type == "cuda" and spec is not None and spec.storage.type == "cpu":
        out = _REAL_TO(self, CPU, copy=True)
        _untag(out)
        return cast(torch.Tensor, out)
    return cast(torch.Tensor, _REAL_CPU(self, *args, **kwargs))


_REAL_TYPE: Any = torch._C.TensorBase.type


def _type(self: torch.Tensor, dtype: Any = None, non_blocking: bool = False, **kwargs: Any) -> Any:
    """``Tensor.type()``: a CUDA tensor's type is ``torch.cuda.<T>Tensor``; ``type(t)`` casts as CUDA does.

    Megatron's optimizer asserts ``param.grad.type() == 'torch.cuda.FloatTensor'``. A
    type named by string or legacy class (``'torch.cuda.HalfTensor'``,
    ``torch.FloatTensor``) casts to its dtype on the CUDA device or the CPU it names;
    a ``torch.dtype`` casts in place (on the tensor's device), as torch does.
    """
    here = device_of(self)
    if dtype is None:
        name = cast(str, _REAL_TYPE(self))
        if here.type == "cuda" and name.startswith("torch.") and not name.startswith("torch.cuda."):
            return "torch.cuda." + name[len("torch.") :]
        return name
    if isinstance(dtype, torch.dtype):
        return self.to(dtype, non_blocking=non_blocking)
    name = (
        dtype
        if isinstance(dtype, str)
        else f"{getattr(dtype, '__module__', '')}.{getattr(dtype, '__name__', '')}"
    )
    if name.startswith("torch.cuda."):
        legacy = getattr(torch, name[len("torch.cuda.") :], None)
        target: Any = here if here.type == "cuda" else torch.device("cuda")
    else:
        legacy = getattr(torch, name[len("torch.") :], None) if name.startswith("torch.") else None
        target = CPU
    cast_to = getattr(legacy, "dtype", None)
    if not isinstance(cast_to, torch.dtype):
        raise ValueError(
            f"Tensor.type() takes a tensor type such as 'torch.cuda.FloatTensor' or a dtype, got {dtype!r}"
        )
    return self.to(target, cast_to, non_blocking=non_blocking)


def _pin_memory(self: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
    out = self.clone()
    setattr(out, _PINNED, True)
    return out


def _is_pinned(self: torch.Tensor, *args: Any, **kwargs: Any) -> bool:
    return bool(getattr(self, _PINNED, False))


_REAL_DATA: Any = torch._C.TensorBase.data


def _get_data(self: torch.Tensor) -> torch.Tensor:
    data = _REAL_DATA.__get__(self)
    tag = getattr(self, _TAG, None)
    if tag is not None:
        setattr(data, _TAG, tag)
    return cast(torch.Tensor, data)


def _set_data(self: torch.Tensor, value: torch.Tensor) -> None:
    # nn.Module.cuda() and .to() swap a parameter's data in place: it takes the data's device
    _REAL_DATA.__set__(self, value)
    tag = getattr(value, _TAG, None)
    if tag is not None or getattr(self, _TAG, None) is not None:
        setattr(self, _TAG, tag)


_REAL_GRAD: Any = torch._C.TensorBase.grad


def _get_grad(self: torch.Tensor) -> torch.Tensor | None:
    # A gradient lives where its tensor does; one a compiled backward made on the
    # storage device without an op the mode sees takes its tensor's device here.
    grad = _REAL_GRAD.__get__(self)
    if grad is not None:
        tag = getattr(self, _TAG, None)
        if tag is not None and getattr(grad, _TAG, None) is None:
            _tag_untagged(grad, tag)
    return cast("torch.Tensor | None", grad)


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


def _storage() -> torch.device:
    """Where the calling thread's CUDA tensors live."""
    spec = spec_here()
    return spec.storage if spec is not None else CPU


def _made_on(original: Callable[..., torch.Tensor]) -> Callable[..., torch.Tensor]:
    """``torch.tensor`` and its kin, whose ``device=`` torch checks before any op runs."""

    def make(*args: Any, **kwargs: Any) -> torch.Tensor:
        target = cuda_device(kwargs.get("device"))
        # pinned host memory needs a real GPU's allocator: without one, the tensor says it is pinned
        pinned = bool(kwargs.pop("pin_memory", False)) if REAL_CUDA["is_available"]() is False else False
        if target is not None:
            kwargs["device"] = _storage()
        out = original(*args, **kwargs)
        if target is not None:
            _tag(out, target)
        elif pinned:
            setattr(out, _PINNED, True)
        return out

    make.__name__ = getattr(original, "__name__", "make")
    make.__doc__ = getattr(original, "__doc__", None)
    return make


def _ordinal_device(original: Callable[..., Any]) -> Callable[..., Any]:
    """A factory (or ``Tensor.new_*``) whose ``device=`` may be a bare GPU ordinal, or a bare ``cuda``.

    Training code writes ``torch.empty(n, device=torch.cuda.current_device())``. A CUDA
    build reads the ordinal as ``cuda:k``; the CPU build asks for its accelerator while
    parsing the arguments, before any mode sees them, and fails with "Cannot access
    accelerator device when none is available". An ``int`` device becomes ``cuda:k`` first.

    A bare ``"cuda"`` becomes the calling rank's ``cuda:k`` too, where the thread
    emulates. Torch's fake tensors cache a factory's output by its arguments in one
    table for the process (``FakeTensorMode.cache``, torch 2.13-2.14), with the default
    device in the key but not the current CUDA device: one process holds one rank
    there, but here every rank is a thread of one process, so a bare ``cuda`` would give
    one rank's fake tensor the device another rank cached (DTensor's sharding
    propagation makes its fake inputs with ``device=mesh.device_type``, and a compiled
    tensor-parallel backward failed: "found at least two devices, cuda:1 and cuda:0").
    Not while Dynamo traces: it compiles ``cuda`` for the storage (:mod:`.compiler`).
    """

    def make(*args: Any, **kwargs: Any) -> Any:
        device = kwargs.get("device")
        if type(device) is int:
            kwargs["device"] = torch.device("cuda", device)
        elif (
            device is not None and not _dynamo_tracing() and _HERE.cuda is not None and _is_bare_cuda(device)
        ):
            kwargs["device"] = torch.device("cuda", now().current)
        return original(*args, **kwargs)

    make.__name__ = getattr(original, "__name__", "make")
    make.__qualname__ = getattr(original, "__qualname__", make.__name__)
    make.__doc__ = getattr(original, "__doc__", None)
    return make


def _is_bare_cuda(device: Any) -> bool:
    """Whether ``device`` names CUDA without an index (``"cuda"``, ``torch.device("cuda")``)."""
    if isinstance(device, str):
        return device == "cuda"
    return isinstance(device, torch.device) and device.type == "cuda" and device.index is None


def _ordinal_parse_to(original: Callable[..., Any]) -> Callable[..., Any]:
    """``torch._C._nn._parse_to``, which ``Tensor.to(1)`` and ``Module.to(1)`` use: an ordinal is a GPU."""

    def parse_to(*args: Any, **kwargs: Any) -> Any:
        if args and type(args[0]) is int:
            args = (torch.device("cuda", args[0]), *args[1:])
        if type(kwargs.get("device")) is int:
            kwargs["device"] = torch.device("cuda", kwargs["device"])
        return original(*args, **kwargs)

    return parse_to


@functools.cache
def _factories_taking_a_device() -> tuple[str, ...]:
    """``torch``'s functions with a ``device=`` argument, read from aten's schemas (torch 2.11-2.15).

    ``tensor``, ``as_tensor`` and ``asarray`` are left out: :func:`_made_on` wraps them.
    """
    found = []
    for name in dir(torch._C._VariableFunctions):
        if name.startswith("_") or name in ("tensor", "as_tensor", "asarray"):
            continue
        packet = getattr(torch.ops.aten, name, None)
        if packet is None or getattr(torch, name, None) is not getattr(torch._C._VariableFunctions, name):
            continue
        overloads = (getattr(packet, overload) for overload in packet.overloads())
        if any(arg.name == "device" for op in overloads for arg in op._schema.arguments):
            found.append(name)
    return tuple(found)


_NEW_METHODS = ("new_empty", "new_empty_strided", "new_full", "new_ones", "new_zeros")


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


def _keeps_device(original: Any, data_at: int) -> Callable[..., Any]:
    """``_make_subclass`` (``nn.Parameter(t)``) and ``as_subclass``: the new object has its data's device."""

    def make(*args: Any, **kwargs: Any) -> Any:
        out = original(*args, **kwargs)
        data = args[data_at] if len(args) > data_at else kwargs.get("data")
        tag = getattr(data, _TAG, None)
        if tag is not None:
            setattr(out, _TAG, tag)
        return out

    return make


def _make_wrapper_subclass_for(original: Any) -> Callable[..., Any]:
    def make_wrapper_subclass(cls: Any, *args: Any, **kwargs: Any) -> Any:
        target = cuda_device(kwargs.get("device"))
        if target is not None:
            kwargs["device"] = _storage()
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
        target = cuda_device(device)
        storage = _storage() if target is not None else device
        return _GeneratorBase.__new__(cls, storage)  # type: ignore[call-arg,no-any-return]

    def __init__(self, device: Any = "cpu") -> None:
        target = cuda_device(device)
        self._meshsim_device = target if target is not None else torch.device(device)

    @property
    def device(self) -> torch.device:  # type: ignore[override]
        return self._meshsim_device


def patches() -> list[tuple[Any, str, Any]]:
    """What the emulation sets process-wide, as (owner, name, value): torch.Tensor's Python face and kin."""
    make_wrapper = torch.Tensor._make_wrapper_subclass
    return [
        (torch.Tensor, _TAG, None),
        (torch.Tensor, "device", property(_device_property)),
        (torch.Tensor, "is_cuda", property(_is_cuda_property)),
        (torch.Tensor, "get_device", _get_device),
        (torch.Tensor, "to", _to),
        (torch.Tensor, "cuda", _cuda),
        (torch.Tensor, "cpu", _cpu),
        (torch.Tensor, "type", _type),
        (torch.Tensor, "pin_memory", _pin_memory),
        (torch.Tensor, "is_pinned", _is_pinned),
        (torch.Tensor, "data", property(_get_data, _set_data)),
        (torch.Tensor, "grad", property(_get_grad, _set_grad, _del_grad)),
        (torch.Tensor, "new_tensor", _made_on(torch._C.TensorBase.new_tensor)),
        (torch.Tensor, "_make_subclass", staticmethod(_keeps_device(torch.Tensor._make_subclass, 1))),
        (torch.Tensor, "as_subclass", _keeps_device(torch._C.TensorBase.as_subclass, 0)),
        (torch.Tensor, "_make_wrapper_subclass", staticmethod(_make_wrapper_subclass_for(make_wrapper))),
        *((torch, name, _made_on(getattr(torch, name))) for name in ("tensor", "as_tensor", "asarray")),
        *((torch, name, _ordinal_device(getattr(torch, name))) for name in _factories_taking_a_device()),
        *((torch.Tensor, name, _ordinal_device(getattr(torch._C.TensorBase, name))) for name in _NEW_METHODS),
        (torch._C._nn, "_parse_to", _ordinal_parse_to(torch._C._nn._parse_to)),
        (torch, "compile", _compile_for(torch.compile)),
        (torch, "Generator", _UserGenerator),
        (torch._tensor_str, "_str", _printed_with_tags(torch._tensor_str._str)),
        (torch.autograd, "grad", _autograd_grad_for(torch.autograd.grad)),
    ]
