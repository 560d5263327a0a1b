"""Child processes started from a process that emulates CUDA: they emulate as their parent's thread did.

Two kinds: a spawned rank of meshsim's spawn mode (:mod:`meshsim._modes.spawn`), which
is handed its world's :class:`~meshsim._process.cuda.spec.Spec` as an argument, and a
process user code starts with multiprocessing's ``spawn`` (``torch.multiprocessing.spawn``),
whose command line the emulation rewrites to run :func:`run_spawned` with the starting
thread's spec (:mod:`meshsim._process.cuda.install`).
"""

from __future__ import annotations

import atexit
import os
import sys
import traceback
from typing import NoReturn

from meshsim._process.cuda import Spec, enter_rank, parse
from meshsim._process.patches import install_cuda

__all__ = ["emulate_in_process", "run_spawned"]


def emulate_in_process(spec: Spec | None) -> None:
    """Emulate ``spec`` in this whole process (a child meshsim or user code started); never undone."""
    if spec is not None:
        install_cuda(spec)
        enter_rank(spec)


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
    emulate_in_process(parse(storage, devices=devices))
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
