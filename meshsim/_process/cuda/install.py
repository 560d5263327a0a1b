"""The emulation installed process-wide (and undone), in the threads that emulate, in child processes."""

from __future__ import annotations

import atexit
import functools
import os
import sys
import threading
import traceback
from collections.abc import Callable
from typing import Any, NoReturn

import torch

from meshsim._base.context import current
from meshsim._process.cuda import api, compiler, rank, runtime, tensors
from meshsim._process.cuda.spec import ACTIVE, Spec, parse

__all__ = ["acquire", "emulate_in_process", "enter_rank", "leave_rank", "release", "run_spawned"]

# -- install and undo -----------------------------------------------------------------------


def acquire(spec: Spec) -> None:
    """Install the emulation (the first user), or check that ``spec`` is the one installed.

    Raises:
        ValueError: another emulation is installed (worlds overlapping with different ones).
    """
    with ACTIVE.lock:
        if ACTIVE.users:
            assert ACTIVE.spec is not None
            if ACTIVE.spec.storage != spec.storage:
                raise ValueError(
                    f"CUDA is emulated as {ACTIVE.spec} already; a world cannot emulate {spec} "
                    "at the same time"
                )
            ACTIVE.users += 1
            return
        _install(spec)
        ACTIVE.users = 1


def release() -> None:
    """Undo one :func:`acquire`; the last one out puts torch back as it was."""
    with ACTIVE.lock:
        ACTIVE.users -= 1
        if ACTIVE.users == 0:
            while ACTIVE.undo:
                ACTIVE.undo.pop()()
            ACTIVE.spec = None


def _install(spec: Spec) -> None:
    undo = ACTIVE.undo
    compiler.import_before_stand_ins()
    try:
        if spec.storage.type == "cuda":
            ACTIVE.real_generators = tuple(torch.cuda.default_generators)
        ACTIVE.spec = spec
        for name, value in api.stand_ins(spec).items():
            undo.append(_set_attr(torch.cuda, name, value))
        rank.declare_per_rank()
        tensors.register_higher_order_ops()
        for owner, name, value in (
            *tensors.patches(),
            *compiler.patches(spec, emulating),
            *runtime.patches(spec),
        ):
            undo.append(_set_attr(owner, name, value))
        undo.append(compiler.forget_cached_answers())
        undo.append(_children_emulate(spec))
        if spec.storage.type == "cpu":
            undo.extend(_groups_on_the_storage())
    except BaseException:
        while undo:
            undo.pop()()
        ACTIVE.spec = None
        raise


_MISSING: Any = object()


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


def _children_emulate(spec: Spec) -> Callable[[], None]:
    """Processes started with multiprocessing's ``spawn`` (``torch.multiprocessing.spawn``) emulate too.

    Such a child is a new interpreter that runs ``-c "...spawn_main(...)"``: the program
    runs inside :func:`run_spawned`, which emulates first. Checked with Python 3.10-3.13's
    ``multiprocessing.spawn.get_command_line``.
    """
    import multiprocessing.spawn as mp_spawn

    original = mp_spawn.get_command_line
    storage = "cpu" if spec.storage.type == "cpu" else str(spec.storage)

    def get_command_line(**kwds: Any) -> list[str]:
        line = list(original(**kwds))
        if "-c" in line:
            at = line.index("-c") + 1
            cpus = current().child_cpus  # started from a rank pinned to one CPU: the caller's CPUs
            line[at] = (
                "import meshsim._process.cuda.install as _c; "
                f"_c.run_spawned({storage!r}, {spec.devices}, {line[at]!r}, "
                f"{sorted(cpus) if cpus is not None else None!r})"
            )
        return line

    return _set_attr(mp_spawn, "get_command_line", get_command_line)


def emulate_in_process(storage: str, devices: int) -> None:
    """Emulate CUDA in this whole process (a child user code started); not undone: the child owns it."""
    spec = parse(storage, devices=devices)
    if spec is not None:
        acquire(spec)
        enter_rank()


def run_spawned(storage: str, devices: int, program: str, cpus: list[int] | None = None) -> NoReturn:
    """Run a spawned child's ``-c`` program with CUDA emulated; end the process without finalizing it.

    ``cpus``: where the child runs, when a rank pinned to one CPU started it (as a forked
    child does, see :mod:`meshsim._engine.affinity`).

    The child ends as multiprocessing's ``fork`` children do (``os._exit``), once its
    atexit handlers have run and its output is flushed, with the status the program
    exited with. Why not a normal interpreter exit: a process group the child made
    outlives ``destroy_process_group`` under emulation (torch keeps the group of a c10d
    op that passed through a Python dispatch mode, checked torch 2.11-2.14), so its gloo
    worker threads still run while the interpreter tears down and C++ static destructors
    run. Such a child was seen to abort (SIGABRT, "terminate called without an
    active exception"); meshsim's own spawned ranks end with ``os._exit`` for the same
    reason (:mod:`meshsim._modes.spawn`).
    """
    import __main__

    if cpus is not None:
        try:
            os.sched_setaffinity(0, cpus)
        except OSError:
            pass  # the child keeps the rank's CPU: slower, not wrong
    emulate_in_process(storage, devices)
    try:
        exec(compile(program, "<string>", "exec"), vars(__main__))  # what ``python -c`` does
        status = 0
    except SystemExit as stop:
        status = _exit_status(stop.code)
    except BaseException:
        traceback.print_exc()
        status = 1
    atexit._run_exitfuncs()  # what finalizing would have run first (CPython 3.10-3.13)
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (AttributeError, OSError, ValueError):
            pass
    os._exit(status)


def _exit_status(code: object) -> int:
    """The process status ``SystemExit(code)`` ends a program with, as the interpreter reckons it."""
    if code is None:
        return 0
    if isinstance(code, int):
        return code & 0xFF
    print(code, file=sys.stderr)
    return 1


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

_modes = threading.local()


def enter_rank() -> None:
    """Emulate CUDA in the calling thread (a rank, or a pytest process that emulates): push the mode."""
    spec = ACTIVE.spec
    if spec is None:
        return
    mode = tensors.CudaMode(spec)
    mode.__enter__()  # type: ignore[no-untyped-call]
    stack = getattr(_modes, "stack", None)
    if stack is None:
        stack = _modes.stack = []
    stack.append(mode)


def emulating() -> bool:
    """Whether the calling thread emulates CUDA (between :func:`enter_rank` and :func:`leave_rank`)."""
    return bool(getattr(_modes, "stack", None))


def leave_rank() -> None:
    """Undo :func:`enter_rank` in the calling thread."""
    stack = getattr(_modes, "stack", None)
    if stack:
        stack.pop().__exit__(None, None, None)
