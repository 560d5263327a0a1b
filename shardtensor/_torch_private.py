"""Every private torch API shardtensor depends on, in one place.

Checked against torch 2.11, 2.12, 2.13 and 2.14 source. Nothing else in the
package touches a ``torch._C`` name or an underscored torch attribute; when torch
moves one of these, this is the only file to change.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.distributed.device_mesh import DeviceMesh

__all__ = ["current_mesh", "disabled_torch_function", "make_wrapper_subclass"]

# Skips Python-level __torch_function__ for a subclass, so property reads (shape,
# requires_grad, grad_fn) stay in C++ and every operator reaches
# __torch_dispatch__, as DTensor does.
disabled_torch_function: Any = torch._C._disabled_torch_function_impl


def make_wrapper_subclass(
    cls: type[torch.Tensor],
    shape: tuple[int, ...],
    stride: tuple[int, ...],
    *,
    dtype: torch.dtype,
    device: torch.device,
    requires_grad: bool,
) -> Any:
    """A storage-less tensor of ``cls`` whose metadata is the global shape and stride."""
    # The documented way to build a wrapper subclass, but still an underscored API.
    return torch.Tensor._make_wrapper_subclass(  # type: ignore[attr-defined]
        cls, shape, strides=stride, dtype=dtype, device=device, requires_grad=requires_grad
    )


def current_mesh() -> DeviceMesh | None:
    """The mesh of the innermost active ``with mesh:`` block in this thread, or None."""
    from torch.distributed.device_mesh import _mesh_resources

    try:
        mesh: DeviceMesh = _mesh_resources.get_current_mesh()
    except RuntimeError:  # "No device mesh is currently active!"
        return None
    return mesh
