"""Shape operators that keep a valid layout: views, transposes, permutes, unbind, slicing.

Tensors are ``(*sharded, 4, 3)``: on the 1-D mesh dim 0 is sharded, on the 2x2 mesh
dims 0 and 1. Operations on the unsharded trailing dims keep every shard as it is;
a view that merges the last sharded dim with the dim after it keeps it sharded
(each rank's rows times the merged extent), whatever the sizes; transposes and
permutes move the placements with the dims.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
from torch.distributed.tensor import Replicate, Shard

import meshsim

from .op_cases import LAYOUTS, Layout, assert_layout_is_true, close
from .shardtensor_cases import DTYPE_IDS, DTYPES

# name: (op given the tensor and the number of sharded dims, where the sharded dims go)
SHAPE_OPS: dict[str, Callable[[torch.Tensor, int], torch.Tensor]] = {
    "transpose-trailing": lambda x, k: x.transpose(-1, -2),
    "flatten-trailing": lambda x, k: x.flatten(-2),
    "view-split-trailing": lambda x, k: x.view(*x.shape[:k], 2, 2, 3),
    "reshape-merge-sharded": lambda x, k: x.reshape(*x.shape[: k - 1], -1, 3),
    "permute-sharded-last": lambda x, k: x.permute(*range(k, x.ndim), *range(k)),
    "transpose-sharded": lambda x, k: x.transpose(0, -1),
    "unbind-trailing": lambda x, k: torch.unbind(x, -1)[1],
    "select-trailing": lambda x, k: x[..., 2],
    "slice-trailing": lambda x, k: x[..., 1:3, :],
    "slice-step": lambda x, k: x[..., ::2],
    "unsqueeze-squeeze": lambda x, k: x.unsqueeze(k).squeeze(k),
    "unsqueeze-front": lambda x, k: x.unsqueeze(0),
    "expand": lambda x, k: x.unsqueeze(-1).expand(*x.shape, 2),
    "contiguous-after-transpose": lambda x, k: x.transpose(-1, -2).contiguous().view(*x.shape[:k], 12),
}


@pytest.mark.world(4)
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("layout_id", LAYOUTS)
@pytest.mark.parametrize("name", list(SHAPE_OPS))
def test_shape_op(distributed_mesh, distributed_mesh_2d, layout_id, dtype, name) -> None:
    op = SHAPE_OPS[name]
    layout = Layout(layout_id, distributed_mesh, distributed_mesh_2d)
    k = layout.mesh.ndim
    full = layout.full(4, 3, dtype=dtype)
    x = layout.shard(full).detach().requires_grad_()
    with meshsim.record() as ledger:
        y = op(x, k)
    assert ledger.counts() == {}  # every op here keeps the layout: no data moves
    expected = op(full, k)
    assert tuple(y.shape) == tuple(expected.shape)
    assert all(isinstance(p, Shard) for p in y.placements)
    assert_layout_is_true(y)
    close(y.full_tensor(), expected, dtype)

    weights = torch.linspace(0.5, 1.5, expected.numel(), device=full.device).reshape(expected.shape)
    (y.full_tensor() * weights.to(dtype)).sum().backward()
    reference = full.clone().requires_grad_()
    (op(reference, k) * weights.to(dtype)).sum().backward()
    assert x.grad is not None and x.grad.spec.shard_sizes == x.spec.shard_sizes
    close(x.grad.full_tensor(), reference.grad, dtype)


@pytest.mark.world(4)
@pytest.mark.parametrize("layout_id", ["1d-uneven", "1d-empty", "2d-uneven"])
def test_a_merged_sharded_dim_keeps_each_ranks_rows(distributed_mesh, distributed_mesh_2d, layout_id) -> None:
    layout = Layout(layout_id, distributed_mesh, distributed_mesh_2d)
    k = layout.mesh.ndim
    x = layout.shard(layout.full(4, 3))
    y = x.flatten(k - 1, k)  # the last sharded dim with the 4 after it
    assert y.placements == x.placements
    assert y.spec.shard_sizes[k - 1] == tuple(4 * s for s in layout.sizes[k - 1])
    back = y.view(x.shape)
    assert back.spec == x.spec


@pytest.mark.world(4)
def test_permute_moves_the_placements_with_the_dims(distributed_mesh_2d) -> None:
    layout = Layout("2d-uneven", None, distributed_mesh_2d)
    x = layout.shard(layout.full(4, 3))
    y = x.permute(3, 1, 2, 0)
    assert y.placements == (Shard(3), Shard(1))
    assert y.spec.shard_sizes == x.spec.shard_sizes


@pytest.mark.world(4)
def test_a_view_the_layout_cannot_follow_gathers_first(distributed_mesh) -> None:
    # (R, 4) sharded along R = 1+2+3+4, viewed as (5, 8): rows of 1, 2, 3, 4 do not
    # split into whole rows of 8 elements, so the sharded mesh dim is gathered.
    layout = Layout("1d-uneven", distributed_mesh, None)
    full = layout.full(4)
    x = layout.shard(full)
    with meshsim.record() as ledger:
        y = x.view(5, 8)
    assert ledger.counts() == {"all_gather": 1}
    assert y.placements == (Replicate(),)
    torch.testing.assert_close(y.full_tensor(), full.view(5, 8))
