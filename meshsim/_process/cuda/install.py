"""The emulation's process-wide changes (kept by :mod:`meshsim._process.patches`), and each thread's mode."""

from __future__ import annotations

import functools
import sys
from collections.abc import Callable
from typing import Any

import torch

from meshsim._base.context import current
from meshsim._process.cuda import api, compiler, graphs, rank, tensors
from meshsim._process.cuda.spec import IN_USE, Spec, spec_here

__all__ = ["changes", "emulated_here", "enter_rank", "leave_rank"]

# -- the process-wide changes ---------------------------------------------------------------


def changes(spec: Spec) -> list[Callable[[], None]]:
    """Make the emulation's process-wide changes for ``spec``'s storage; returns their undo steps, in order.

    What is changed does not depend on the GPU count or the name: the stand-ins ask the
    calling thread's spec (:func:`meshsim._process.cuda.spec.spec_here`) when called. The
    caller (:mod:`meshsim._process.patches`, the one list of process-wide changes) keeps
    the steps and undoes them in reverse; on a failure here, what was made is undone.
    """
    undo: list[Callable[[], None]] = []
    compiler.import_before_stand_ins()
    try:
        if spec.storage.type == "cuda":
            IN_USE.real_generators = tuple(torch.cuda.default_generators)
        stand_ins = api.stand_ins()
        for owner, name in _bindings(stand_ins):
            undo.append(_set_attr(owner, name, stand_ins[name]))
        for name, value in _accelerator_stand_ins().items():
            undo.append(_set_attr(torch.accelerator, name, value))
        rank.declare_per_rank()
        tensors.register_higher_order_ops()
        for owner, name, value in (
            *tensors.patches(),
            *graphs.patches(),
            *compiler.patches(spec, emulating),
        ):
            undo.append(_set_attr(owner, name, value))
        undo.append(compiler.forget_cached_answers())
        undo.append(_children_emulate())
        if spec.storage.type == "cpu":
            undo.extend(_groups_on_the_storage())
    except BaseException:
        while undo:
            undo.pop()()
        raise
    return undo


_MISSING: Any = object()


def _bindings(stand_ins: dict[str, Any]) -> list[tuple[Any, str]]:
    """Where ``torch.cuda``'s replaced names are bound: ``torch.cuda`` and each of its submodules
    that imported the same object (``torch.cuda.random`` calls its own ``current_device``:
    Megatron's RNG tracker reaches the real runtime through ``torch.cuda.random.get_rng_state``).
    """
    found = [(torch.cuda, name) for name in stand_ins]
    prefix = "torch.cuda."
    for module_name, module in list(sys.modules.items()):
        if not module_name.startswith(prefix) or module is None:
            continue
        for name in stand_ins:
            original = getattr(torch.cuda, name, _MISSING)
            if original is not _MISSING and getattr(module, name, _MISSING) is original:
                found.append((module, name))
    return found


def _accelerator_stand_ins() -> dict[str, Any]:
    """``torch.accelerator``'s names to replace: where the build's accelerator is CUDA, those it has.

    The CPU build has no accelerator (``current_accelerator()`` is None) and keeps its own.
    """
    accelerator = torch.accelerator.current_accelerator()  # the build's; does not start CUDA
    if accelerator is None or accelerator.type != "cuda":
        return {}
    return {
        name: value for name, value in api.accelerator_stand_ins().items() if hasattr(torch.accelerator, name)
    }


def _set_attr(owner: Any, name: str, value: Any) -> Callable[[], None]:
    before = owner.__dict__.get(name, _MISSING)  # a class's own attribute, not an inherited one
    setattr(owner, name, value)

    def undo() -> None:
        if before is _MISSING:
            delattr(owner, name)
        else:
            setattr(owner, name, before)

    return undo


# -- processes user code starts -------------------------------------------------------------------


def _children_emulate() -> Callable[[], None]:
    """Processes started with multiprocessing's ``spawn`` (``torch.multiprocessing.spawn``) emulate too.

    Such a child is a new interpreter that runs ``-c "...spawn_main(...)"``: the program
    runs inside :func:`meshsim._process.children.run_spawned`, which emulates first, as
    the starting thread does (its spec, sized for its world). Checked with Python
    3.10-3.13's ``multiprocessing.spawn.get_command_line``.
    """
    import multiprocessing.spawn as mp_spawn

    original = mp_spawn.get_command_line

    def get_command_line(**kwds: Any) -> list[str]:
        line = list(original(**kwds))
        spec = spec_here()
        if "-c" in line and spec is not None:
            at = line.index("-c") + 1
            cpus = current().child_cpus  # started from a rank pinned to one CPU: the caller's CPUs
            line[at] = (
                "import meshsim._process.children as _c; "
                f"_c.run_spawned({spec.text!r}, {spec.count}, {line[at]!r}, "
                f"{sorted(cpus) if cpus is not None else None!r})"
            )
        return line

    return _set_attr(mp_spawn, "get_command_line", get_command_line)


def _groups_on_the_storage() -> list[Callable[[], None]]:
    """Process groups made outside meshsim's worlds (a child's, a single-process test's) hold CPU tensors.

    ``init_process_group("nccl")`` and ``new_group(backend="nccl")`` make gloo groups, and
    a CUDA ``device_id`` (torch binds a group to it) is dropped: the emulated tensors
    are CPU tensors. Inside a simulated world's ranks meshsim's own adoption answers first,
    and meshsim's backend serves groups of any name (``patches._subgroups_served_by``).
    """
    import inspect

    import torch.distributed as dist
    import torch.distributed.distributed_c10d as c10d

    undo = []
    for name in ("init_process_group", "new_group"):
        original = getattr(c10d, name)
        signature = inspect.signature(original)

        def call(*args: Any, _original: Any = original, _signature: Any = signature, **kwargs: Any) -> Any:
            bound = _signature.bind_partial(*args, **kwargs)
            backend = bound.arguments.get("backend")
            if backend is not None and "nccl" in str(backend).lower() and not _simulated_rank():
                bound.arguments["backend"] = "gloo"
            device_id = bound.arguments.get("device_id")
            if isinstance(device_id, (torch.device, int)) and tensors.cuda_device(device_id) is not None:
                bound.arguments.pop("device_id")
            return _original(*bound.args, **bound.kwargs)

        functools.update_wrapper(call, original)
        undo.append(_set_attr(c10d, name, call))
        undo.append(_set_attr(dist, name, call))
    return undo


def _simulated_rank() -> bool:
    """A rank of a simulated world: meshsim's backend serves its groups of any backend name."""
    import torch.distributed as dist

    if current().seat is None or not dist.is_initialized():
        return False
    return str(dist.get_backend()) not in ("gloo", "nccl")  # gloo thread ranks: torch's groups


# -- per thread ---------------------------------------------------------------------------------

_HERE = current()  # one object; its fields are per thread


def enter_rank(spec: Spec, asked: Spec | None = None) -> None:
    """Emulate ``spec`` in the calling thread (a rank, the pytest process, a child): push its mode.

    The mode is the thread's emulation in its rank context (``current().cuda``), on top
    of the one it had (restored by :func:`leave_rank`). ``asked``: the spec before a
    world sized it, which worlds this thread starts inherit. Needs the process-wide
    changes in place (:func:`meshsim._process.patches.install_cuda`).
    """
    mode = tensors.CudaMode(spec, asked, outer=_HERE.cuda)
    mode.__enter__()  # type: ignore[no-untyped-call]
    _HERE.cuda = mode


def leave_rank() -> None:
    """Undo the calling thread's last :func:`enter_rank`."""
    mode = _HERE.cuda
    if mode is not None:
        _HERE.cuda = mode.outer
        mode.__exit__(None, None, None)


def emulating() -> bool:
    """Whether the calling thread emulates CUDA (between :func:`enter_rank` and :func:`leave_rank`)."""
    return _HERE.cuda is not None


def take_local_device(global_rank: int) -> None:
    """Make the calling rank's current emulated GPU its local rank (its rank modulo the GPUs per node).

    What meshsim's torchrun ranks do on real GPUs where meshsim makes the default group
    (``torch.cuda.set_device(LOCAL_RANK)``), for the ranks whose group meshsim makes in
    pytest: a test tree's helper that sets the device only before it initializes the group
    (``if not dist.is_initialized(): torch.cuda.set_device(...)``) finds it set. Nothing
    where the thread does not emulate CUDA.
    """
    if _HERE.cuda is not None:
        rank.now().current = global_rank % rank.device_count()


def emulated_here() -> Spec | None:
    """What the calling thread emulates, as it was asked for (before sizing): None where it does not."""
    mode = _HERE.cuda
    return mode.asked if mode is not None else None  # type: ignore[no-any-return]
