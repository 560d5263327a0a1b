"""Plain tensors meeting ShardTensors: TensorPromotionMode and the two promotion paths.

A plain tensor with dims that appears in an op beside a ShardTensor is typically a
replicated model weight. By the promotion mode it becomes a ``Replicate``
ShardTensor on the ShardTensor's mesh (``SILENT``, the default, and ``WARN``), or
the op is refused (``DISABLED``). 0-dim tensors are scalars and need no promotion,
as in DTensor.

Two paths, so that gradients stay where they belong:

- above autograd (``__torch_function__``), a plain tensor that requires grad is
  promoted through the differentiable ``from_local``: its gradient comes back as a
  plain tensor, any pending ``Partial`` sum reduced first (a learnable scalar gate
  included);
- below autograd (``__torch_dispatch__``), every other plain tensor is wrapped
  directly.
"""

from __future__ import annotations

import enum
from typing import Any

import torch

__all__ = ["TensorPromotionMode", "coerce_mode", "needs_bridge"]


class TensorPromotionMode(enum.Enum):
    """What happens to a plain ``torch.Tensor`` that meets a ShardTensor in an op.

    Attributes:
        DISABLED: no promotion; an op mixing a plain tensor with dims and a
            ShardTensor raises (DTensor's behaviour).
        WARN: promote to a ``Replicate`` ShardTensor, warning each time.
        SILENT: promote without a warning (the default).
    """

    DISABLED = "disabled"
    WARN = "warn"
    SILENT = "silent"


def coerce_mode(mode: object) -> TensorPromotionMode:
    """``mode`` as a TensorPromotionMode (its value, e.g. ``"warn"``, is accepted).

    Raises:
        ValueError: anything else, naming the accepted values.
    """
    if isinstance(mode, TensorPromotionMode):
        return mode
    try:
        return TensorPromotionMode(mode)
    except ValueError:
        choices = ", ".join(repr(m.value) for m in TensorPromotionMode)
        raise ValueError(
            f"promotion mode must be a TensorPromotionMode or one of {choices}, got {mode!r}"
        ) from None


def _is_plain(value: object) -> bool:
    # Exact types: other subclasses (DTensor, functional wrappers) have their own dispatch.
    return type(value) is torch.Tensor or type(value) is torch.nn.Parameter


def needs_bridge(args: tuple[Any, ...], kwargs: dict[str, Any]) -> bool:
    """Whether a top-level argument is a plain tensor that requires grad."""
    for a in args:
        if _is_plain(a) and a.requires_grad:
            return True
    for v in kwargs.values():
        if _is_plain(v) and v.requires_grad:
            return True
    return False


def bridge(
    args: tuple[Any, ...], kwargs: dict[str, Any], from_local: Any, mesh: Any, *, every_plain: bool
) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """Top-level plain tensors as Replicate ShardTensors via the differentiable ``from_local``.

    Args:
        every_plain: promote plain tensors that do not require grad too (what a
            registered function handler gets); otherwise only those that do.
    """

    def one(a: Any) -> Any:
        if _is_plain(a) and (a.requires_grad or (every_plain and a.ndim > 0)):
            return from_local(a, mesh, [_replicate()] * mesh.ndim, "chunk", tuple(a.shape))
        return a

    return tuple(one(a) for a in args), {k: one(v) for k, v in kwargs.items()}


def _replicate() -> Any:
    from torch.distributed.tensor import Replicate

    return Replicate()
