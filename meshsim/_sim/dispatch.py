"""How dispatch modes see a simulated collective: as the c10d op gloo and NCCL issue.

On gloo and NCCL, ``dist.all_reduce`` calls the C++ ``ProcessGroup.allreduce``,
which calls the dispatcher op (``c10d.allreduce_``) that dispatch modes such as
``CommDebugMode`` see. A Python process group's methods are called directly
instead, so while the calling thread has a mode, the backend routes the call
through a C++ twin of its group to that op (:func:`through_dispatcher`), and a
mode at the bottom of the stack carries it out.

Private torch names used here, checked in torch 2.11, 2.12, 2.13, 2.14 and 2.15:
``torch._C._len_torch_dispatch_stack``, ``_pop_torch_dispatch_stack``,
``_push_on_torch_dispatch_stack``, a C++ ``ProcessGroup`` built from a ``HashStore``
with ``_set_group_name`` and ``_set_group_desc``, and ``Work.boxed``.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, cast

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from meshsim._process.cuda.graphs import note_call, note_writes

__all__ = ["dispatch_modes_active", "dispatcher_twin", "through_dispatcher"]

dispatch_modes_active: Callable[[], int] = torch._C._len_torch_dispatch_stack
"""How many TorchDispatchModes the calling thread has entered (0: none; one C call)."""


def dispatcher_twin(rank: int, size: int, name: str, description: str) -> Any:
    """A C++ ``ProcessGroup`` whose methods reach c10d's dispatcher ops (``c10d.allreduce_``, ...).

    It has no backend: :func:`through_dispatcher` carries its ops out.
    """
    twin = torch._C._distributed_c10d.ProcessGroup(  # type: ignore[attr-defined]
        torch._C._distributed_c10d.HashStore(),
        rank,
        size,  # type: ignore[attr-defined]
    )
    twin._set_group_name(cast(Any, name))  # a GroupName in the stubs, a str at run time
    twin._set_group_desc(description)
    return twin


def through_dispatcher(
    twin: Any, names: Sequence[str], args: Sequence[Any], kwargs: dict[str, Any], run: Callable[[], Any]
) -> Any:
    """Call the twin's method (the first of ``names`` it has) so the c10d op reaches the modes.

    A mode put beneath the calling thread's dispatch modes receives the op last, runs
    ``run()`` (the simulated collective, with the original arguments) and answers as
    the op's kernel would: ``(the op's first argument, Work)`` or the Work alone.
    """
    method = next((getattr(twin, name) for name in names if hasattr(twin, name)), None)
    if method is None:
        return run()
    beneath = _CarryOut(run)
    above = [torch._C._pop_torch_dispatch_stack(None) for _ in range(dispatch_modes_active())]
    torch._C._push_on_torch_dispatch_stack(beneath)
    for mode in reversed(above):
        torch._C._push_on_torch_dispatch_stack(mode)
    try:
        returned = method(*args, **kwargs)
    finally:
        for _ in above:
            torch._C._pop_torch_dispatch_stack(None)
        torch._C._pop_torch_dispatch_stack(None)  # beneath
        for mode in reversed(above):
            torch._C._push_on_torch_dispatch_stack(mode)
    # The Work itself, not the twin's copy: a boxed Python Work comes back from C++
    # without its Python methods (a pending recv's cooperative wait among them).
    return beneath.work if beneath.work is not None else returned


class _CarryOut(TorchDispatchMode):  # type: ignore[misc]
    """The bottom of the mode stack during one routed call: carries out its c10d op."""

    def __init__(self, run: Callable[[], Any]) -> None:
        super().__init__()  # type: ignore[no-untyped-call]
        self._run: Callable[[], Any] | None = run
        self.work: Any = None

    @classmethod
    def ignore_compile_internals(cls) -> bool:
        return True

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        run, kwargs = self._run, kwargs or {}
        if run is None or func.namespace != "c10d":
            return func(*args, **kwargs)  # anything else the modes above ran
        self._run = None
        note_writes(func, args, kwargs)  # a capture launches nothing: it puts back what this writes
        self.work = work = run()
        note_call(run)  # a CUDA graph's capture under emulation: its replay runs the collective again
        boxed = work.boxed()
        return (args[0], boxed) if len(func._schema.returns) == 2 else boxed
