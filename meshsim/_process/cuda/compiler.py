"""``torch.compile`` under the emulation: the compiler asks the real machine, the program sees CUDA.

Dynamo traces a frame with the dispatch modes off and fake tensors made from the
inputs' storage (:func:`meshsim._process.cuda.tensors.device_of` answers the storage
device while a frame compiles), so its graph, AOTAutograd's and Inductor's are on
the storage device, factories taking ``device=x.device`` included.

What went wrong before (issue 38): Inductor also asks the *machine* what it can
compile for, through ``torch.cuda`` (Dynamo's device interface for ``cuda`` and
``torch.utils._triton.has_triton``), and the emulated answers (an H100, capability
9.0) told it a Triton GPU was there. With triton installed it then opened triton's
CUDA driver (``libcuda.so cannot found``) while generating the CPU graph's code.
Here the compiler's questions get the real runtime's answers, and the answers torch
caches (``has_triton`` and its kin are ``functools.cache``'d) are forgotten when the
emulation starts and when it ends, so neither side keeps the other's.

Private torch names used, checked in torch 2.13.0 and 2.14.1:
``torch._dynamo.device_interface.CudaInterface.is_available`` and
``torch.utils._triton``'s cached ``has_triton*`` functions.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import Any

import torch

from meshsim._process.cuda.spec import REAL_CUDA, Spec

__all__ = ["forget_cached_answers", "import_before_stand_ins", "is_available", "patches"]

# Modules whose questions are the compiler's about the machine it compiles for (torch 2.13-2.14):
# Inductor's code generation, AOTAutograd, triton's probes, Dynamo's device interfaces.
_COMPILER = ("torch._inductor", "torch._functorch", "torch.utils._triton", "torch._dynamo.device_interface")

# torch's answers about the machine, cached for the process (torch 2.13-2.14): forgotten
# when the emulation starts and ends. Dynamo's rule map holds the torch.cuda functions
# it loaded by name (the stand-ins, while emulated).
_CACHED = (
    ("torch.utils._triton", "has_triton"),
    ("torch.utils._triton", "has_triton_tma"),
    ("torch.utils._triton", "has_triton_tma_device"),
    ("torch.utils._triton", "has_triton_experimental_host_tma"),
    ("torch.utils._triton", "has_triton_tensor_descriptor_host_tma"),
    ("torch.utils._triton", "has_datacenter_blackwell_tma_device"),
    ("torch.utils._triton", "has_triton_stable_tma_api"),
    ("torch.utils._triton", "_device_supports_tma"),
    ("torch.utils._triton", "triton_backend"),
    ("torch.utils._triton", "triton_hash_with_backend"),
    ("torch._dynamo.trace_rules", "get_torch_obj_rule_map"),
    ("torch._dynamo.variables.torch", "TorchInGraphFunctionVariable._get_handlers"),
)


def import_before_stand_ins() -> None:
    """Import the compiler's modules that copy ``torch.cuda``'s functions when first imported.

    Dynamo's constant-folding tables (``torch._dynamo.variables.torch``) and its CUDA device
    interface (``CudaInterface.current_device = staticmethod(torch.cuda.current_device)``)
    take the functions ``torch.cuda`` has at their import: imported first under emulation
    they would keep the stand-ins of that one emulation for the life of the process.
    """
    import torch._dynamo.device_interface
    import torch._dynamo.variables.torch  # noqa: F401


def is_available() -> bool:
    """``torch.cuda.is_available`` under emulation: True, but the compiler is told the truth.

    With CPU storage the compiler compiles for the CPU; an emulated "yes" made Inductor
    probe triton's CUDA driver (``libcuda.so cannot found``) and, with ``reduce-overhead``,
    CUDA's allocator (issue 38).
    """
    caller = sys._getframe(1).f_globals.get("__name__", "")
    if caller.startswith(_COMPILER):
        return bool(REAL_CUDA["is_available"]())
    return True


def patches(spec: Spec, emulating: Callable[[], bool]) -> list[tuple[Any, str, Any]]:
    """What the emulation sets so that compiled code is on the storage, as (owner, name, value).

    ``emulating``: whether the calling thread emulates CUDA.
    """
    import torch._dynamo.utils as dynamo_utils

    return [
        (dynamo_utils, "run_node", _run_node_for(dynamo_utils.run_node, spec, emulating)),
        *_folded_as_torch_folds_them(),
    ]


def _folded_as_torch_folds_them() -> list[tuple[Any, str, Any]]:
    """Dynamo calls ``torch.cuda.is_available()``, ``current_device()``... as it traces; keeps the answer.

    It knows them by identity (``constant_fold_functions``, torch 2.13-2.14): the
    stand-ins the emulation puts in their place (set before these patches) get the
    same treatment, so compiled code sees the emulated machine's answers.
    """
    import torch._dynamo.variables.torch as dynamo_torch

    out: list[tuple[Any, str, Any]] = []
    for name in ("constant_fold_functions", "constant_fold_functions_need_guards"):
        folded = getattr(dynamo_torch, name, None)
        if not isinstance(folded, dict):
            continue
        more = dict(folded)
        for fn in folded:
            if getattr(fn, "__module__", None) == "torch.cuda":
                stand_in = getattr(torch.cuda, getattr(fn, "__name__", ""), fn)
                more.setdefault(stand_in, None)
        out.append((dynamo_torch, name, more))
    return out


def _run_node_for(
    original: Callable[..., Any], spec: Spec, emulating: Callable[[], bool]
) -> Callable[..., Any]:
    """Dynamo's ``run_node`` (each traced call, on fake tensors) with ``cuda:k`` as the storage device.

    Dynamo sees an input's storage device (its fake tensors are made from the storage),
    so ``device=x.device`` is the storage already; a literal ``device="cuda"`` in the
    compiled function is rewritten here, in the graph's node too, so that AOTAutograd
    and Inductor compile it for the storage device.
    """

    def run_node(tracer: Any, node: Any, args: Any, kwargs: Any, *rest: Any, **kw: Any) -> Any:
        if emulating():
            if node.op == "call_method" and node.target == "cuda":  # x.cuda(): x.to(the storage)
                node.target, node.args, node.kwargs = "to", (node.args[0], spec.storage), {}
                args, kwargs = (args[0], spec.storage), {}
            args, kwargs = _on_storage(args, spec.storage), _on_storage(kwargs, spec.storage)
            node.args, node.kwargs = (
                _on_storage(node.args, spec.storage),
                _on_storage(node.kwargs, spec.storage),
            )
        return original(tracer, node, args, kwargs, *rest, **kw)

    return run_node


def _on_storage(value: Any, storage: torch.device) -> Any:
    if isinstance(value, torch.device):
        return storage if value.type == "cuda" else value
    if isinstance(value, str) and (value == "cuda" or value.startswith("cuda:")):
        return str(storage)
    if isinstance(value, tuple):
        return tuple(_on_storage(item, storage) for item in value)
    if isinstance(value, list):
        return [_on_storage(item, storage) for item in value]
    if isinstance(value, dict):
        return {key: _on_storage(item, storage) for key, item in value.items()}
    return value


def forget_cached_answers() -> Callable[[], None]:
    """Forget torch's cached answers about the machine now, and again when the returned undo runs."""
    _forget()
    return _forget


def _forget() -> None:
    import importlib

    for module, name in _CACHED:
        owner: Any = importlib.import_module(module)
        for part in name.split("."):
            owner = getattr(owner, part, None)  # not every name in every release
        cached = owner
        clear = getattr(cached, "cache_clear", None)
        if clear is not None:
            clear()
