"""Higher-order operators under the emulation's dispatch mode: one rule for all of them.

A higher-order operator (``flex_attention`` and its backward, ``cond``, ``while_loop``,
``invoke_subgraph``, ``map``, ``scan``...) takes functions as well as tensors. Torch hands
it to a dispatch mode whose class says ``supports_higher_order_operators`` (with the mode
popped), after autograd has taken its part. The rule: run the operator's own dense
kernel (its ``CompositeExplicitAutograd`` implementation, what runs on a plain CPU
tensor) with the mode back on, so every aten op inside it (the functions it calls
included) keeps the device story; then give its outputs the device of its first CUDA
input, as any op's. Operators whose ``__call__`` runs the function directly
(``wrap``, ``wrap_with_set_grad_enabled``, ``tag_activation_checkpoint``) never
reach a mode: their ops do, one by one.

An operator with no dense kernel runs as torch would run it with the mode off, and its
outputs are tagged the same way. One with a rule of its own for this mode
(``run_dtensor_rng_op``) keeps it: torch looks that up first.

Private torch names used, checked in torch 2.13.0 and 2.14.1:
``HigherOrderOperator.dispatch`` and ``.py_kernels``, and
``TorchDispatchMode.supports_higher_order_operators``.
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import AbstractContextManager
from typing import Any

import torch
from torch._ops import HigherOrderOperator

__all__ = ["is_higher_order", "run"]

_DENSE = torch._C.DispatchKey.CompositeExplicitAutograd
_PLAIN_DISPATCH = torch.Tensor.__torch_dispatch__


def is_higher_order(func: Any) -> bool:
    return isinstance(func, HigherOrderOperator)


def run(
    mode: Any,
    hop: HigherOrderOperator,
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    *,
    first_tag: Callable[[Any], torch.device | None],
    tag: Callable[[Any, torch.device], None],
    kernel: Callable[[], AbstractContextManager[None]],
    user_code: Callable[[], AbstractContextManager[None]],
) -> Any:
    """Run ``hop`` on the storage, its ops under ``mode``; its outputs take its first CUDA input's device.

    Returns NotImplemented where a tensor subclass (DTensor, a fake tensor) is among the
    inputs: torch then asks the subclass, as it does for an aten op.
    """
    flat = torch.utils._pytree.tree_leaves((args, kwargs))
    if any(isinstance(x, torch.Tensor) and type(x).__torch_dispatch__ is not _PLAIN_DISPATCH for x in flat):
        return NotImplemented
    target = first_tag(flat)
    args, kwargs = torch.utils._pytree.tree_map(lambda x: _under(mode, x, user_code), (tuple(args), kwargs))
    with kernel():  # the kernel's own ops see the storage device, as a kernel does
        if _DENSE in hop.py_kernels:
            out = hop.dispatch(_DENSE, *args, **kwargs)  # type: ignore[no-untyped-call]
        else:
            out = hop(*args, **kwargs)  # the mode is off here: torch's next handler
    if target is not None:
        tag(torch.utils._pytree.tree_leaves(out), target)
    return out


def _under(mode: Any, value: Any, user_code: Callable[[], AbstractContextManager[None]]) -> Any:
    """A function the operator calls (a branch, a body, a score_mod) runs with the mode on."""
    if isinstance(value, torch.Tensor) or not callable(value):
        return value

    def call(*args: Any, **kwargs: Any) -> Any:
        with user_code(), mode:
            return value(*args, **kwargs)

    return call
