"""Reductions over any dims: values, placements (DTensor's), layouts and gradients.

A reduction over a sharded dim leaves a pending ``Partial`` result (resolved by one
all_reduce in ``full_tensor()``); over other dims the shards keep their sizes. mean
divides each rank's sum by the global count, so uneven and empty shards weigh
right (DTensor's ``Partial("avg")`` averages per-rank means).
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
from torch.distributed.tensor import Partial, Shard, distribute_tensor

import meshsim

from .op_cases import LAYOUTS, Layout, assert_layout_is_true, close
from .shardtensor_cases import DTYPE_IDS, DTYPES

# var and std over an empty shard warn, as torch.var and torch.std do on one process: torch's
# own warning for those cases, expected here
pytestmark = pytest.mark.filterwarnings("ignore:.*degrees of freedom is <= 0:UserWarning")

REDUCTIONS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "sum": lambda x: x.sum(),
    "sum-0": lambda x: x.sum(0),
    "sum-1-keepdim": lambda x: x.sum(1, keepdim=True),
    "sum-last": lambda x: x.sum(-1),
    "sum-0,last": lambda x: torch.sum(x, (0, -1)),
    "mean": lambda x: x.mean(),
    "mean-0": lambda x: x.mean(0),
    "mean-0,1-keepdim": lambda x: x.mean((0, 1), keepdim=True),
    "mean-last": lambda x: torch.mean(x, -1),
    "amax-0": lambda x: x.amax(0),
    "max": lambda x: x.max(),
    "max-dim-0": lambda x: x.max(0).values,
    "min-dim-last-keepdim": lambda x: x.min(-1, keepdim=True).values,
    "norm": lambda x: x.norm(),
    "norm-0": lambda x: torch.linalg.vector_norm(x, dim=0),
    "var-0": lambda x: x.var(0),
    "var": lambda x: x.var(),
    "std-last": lambda x: x.std(-1),
}


@pytest.mark.world(4)
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("layout_id", LAYOUTS)
@pytest.mark.parametrize("name", list(REDUCTIONS))
def test_reduction(distributed_mesh, distributed_mesh_2d, layout_id, dtype, name) -> None:
    op = REDUCTIONS[name]
    layout = Layout(layout_id, distributed_mesh, distributed_mesh_2d)
    full = layout.full(5, dtype=dtype)
    x = layout.shard(full).detach().requires_grad_()
    y = op(x)
    expected = op(full)
    assert tuple(y.shape) == tuple(expected.shape)
    assert_layout_is_true(y)
    close(y.full_tensor(), expected, dtype)

    if dtype is torch.bfloat16 and name.startswith(("max", "min", "amax")):
        return  # ties among bfloat16 values split max's gradient differently
    weights = torch.linspace(0.5, 1.5, max(expected.numel(), 1), device=full.device).reshape(expected.shape)
    (y.full_tensor() * weights.to(dtype)).sum().backward()
    reference = full.clone().requires_grad_()
    (op(reference) * weights.to(dtype)).sum().backward()
    assert x.grad is not None and x.grad.spec == x.spec
    close(x.grad.full_tensor(), reference.grad, dtype)


# Reductions of a leaf straight to a scalar: the gradient expands a Replicate value.
@pytest.mark.world(4)
@pytest.mark.parametrize("layout_id", LAYOUTS)
@pytest.mark.parametrize("name", ["sum", "mean", "sum-0", "mean-0,1-keepdim"])
def test_a_reduced_leaf_gets_its_gradient_in_its_own_layout(
    distributed_mesh, distributed_mesh_2d, layout_id, name
) -> None:
    layout = Layout(layout_id, distributed_mesh, distributed_mesh_2d)
    full = layout.full(5)
    x = layout.shard(full).detach().requires_grad_()
    REDUCTIONS[name](x).sum().backward()
    reference = full.clone().requires_grad_()
    REDUCTIONS[name](reference).sum().backward()
    assert x.grad.spec == x.spec
    torch.testing.assert_close(x.grad.to_local(), layout.shard(reference.grad).to_local())


@pytest.mark.world(4)
@pytest.mark.parametrize(
    "name", ["sum", "sum-0", "sum-last", "amax-0", "max", "norm", "norm-0", "mean-last", "var-0"]
)
def test_placements_are_dtensors_on_even_layouts(distributed_mesh, name) -> None:
    op = REDUCTIONS[name]
    layout = Layout("1d-even", distributed_mesh, None)
    full = layout.full(5)
    dtensor = op(distribute_tensor(full, distributed_mesh, [Shard(0)]))
    assert op(layout.shard(full)).placements == dtensor.placements


@pytest.mark.world(4)
@pytest.mark.parametrize("layout_id", LAYOUTS)
def test_mean_over_a_sharded_dim_is_a_pending_sum(distributed_mesh, distributed_mesh_2d, layout_id) -> None:
    layout = Layout(layout_id, distributed_mesh, distributed_mesh_2d)
    full = layout.full(5)
    x = layout.shard(full)
    with meshsim.record() as ledger:
        m = x.mean(0)
    assert ledger.counts() == {}
    assert m.placements[0] == Partial("sum")
    torch.testing.assert_close(m.full_tensor(), full.mean(0))


@pytest.mark.world(4)
@pytest.mark.parametrize("layout_id", ["1d-even", "1d-uneven", "1d-empty"])
def test_sum_over_the_sharded_dim_then_full_tensor_is_one_all_reduce(distributed_mesh, layout_id) -> None:
    layout = Layout(layout_id, distributed_mesh, None)
    full = layout.full(5, 2)
    x = layout.shard(full)
    with meshsim.record() as ledger:
        total = x.sum(0).full_tensor()
    assert ledger.counts() == {"all_reduce": 1}
    assert ledger.project("op", "bytes_in") == [("all_reduce", 5 * 2 * 4)]
    torch.testing.assert_close(total, full.sum(0))


@pytest.mark.world(4)
def test_reductions_over_unsharded_dims_keep_the_shards(distributed_mesh_2d) -> None:
    layout = Layout("2d-uneven", None, distributed_mesh_2d)
    x = layout.shard(layout.full(3, 5))
    with meshsim.record() as ledger:
        y = x.sum(-1).amax(-1, keepdim=True)
    assert ledger.counts() == {}
    assert y.placements == (Shard(0), Shard(1))
    assert y.spec.shard_sizes == x.spec.shard_sizes


@pytest.mark.world(4)
def test_max_with_indices_is_a_named_tuple_of_shard_tensors(distributed_mesh) -> None:
    layout = Layout("1d-uneven", distributed_mesh, None)
    full = layout.full(6)
    result = torch.max(layout.shard(full), dim=1)
    expected = torch.max(full, dim=1)
    assert type(result) is type(expected)
    torch.testing.assert_close(result.values.full_tensor(), expected.values)
    assert torch.equal(result.indices.full_tensor(), expected.indices)


@pytest.mark.world(4)
def test_item_of_a_pending_sum_is_the_sum(distributed_mesh) -> None:
    layout = Layout("1d-empty", distributed_mesh, None)
    full = layout.full(3)
    total = layout.shard(full).sum()
    assert total.placements == (Partial("sum"),)
    assert total.item() == pytest.approx(full.sum().item(), rel=1e-5)


@pytest.mark.world(4)
@pytest.mark.parametrize("op", ["amax", "amin"])
def test_a_pending_max_or_min_ignores_empty_shards(distributed_mesh, rank, op) -> None:
    layout = Layout("1d-empty", distributed_mesh, None)  # rank 1 holds no rows
    full = layout.full(3)
    x = layout.shard(full)
    result = getattr(x, op)(0)
    assert result.placements == (Partial("max" if op == "amax" else "min"),)
    if rank == 1:  # its contribution is the reduction's identity, not an error
        assert torch.isinf(result.to_local()).all()
    torch.testing.assert_close(result.full_tensor(), getattr(full, op)(0))
