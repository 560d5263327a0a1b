"""Gradients through from_local, redistribute, to_local and full_tensor; autograd plumbing."""

from __future__ import annotations

import contextlib

import pytest
import torch
from torch.distributed.tensor import Partial, Replicate, Shard

import meshsim
from shardtensor import ShardTensor
from shardtensor._redistribute import _negotiate_shapes

from .shardtensor_cases import DTYPE_IDS, DTYPES, KINDS, global_tensor, ramp, shard

HOPS_1D = {"S0-S1": [Shard(1)], "S0-R": [Replicate()], "S0-S0": [Shard(0)]}


@pytest.mark.world(1, 2, 3, 4, 8)
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("kind", ["even", "uneven", "empty"])
@pytest.mark.parametrize("hop", list(HOPS_1D))
def test_to_local_loss_gives_the_analytic_gradient(distributed_mesh, world_size, hop, kind, dtype) -> None:
    mesh, size = distributed_mesh, KINDS[kind](world_size)
    full = global_tensor((size, size + 1), dtype, mesh.device_type)
    leaf = shard(full, mesh, [Shard(0)]).requires_grad_()
    st = ShardTensor.from_local(leaf, mesh, [Shard(0)], "chunk", global_shape=full.shape)
    out = st.redistribute(placements=HOPS_1D[hop]).to_local()
    (out * out).sum().backward()
    # A redistribute moves elements without changing them: d(sum x^2)/dx = 2x. With a
    # Replicate target every rank computes the same loss, and (as in DTensor) the
    # gradient is not summed over the replicas.
    assert leaf.grad is not None and leaf.grad.dtype == dtype
    assert torch.equal(leaf.grad, 2 * leaf.detach())


@pytest.mark.world(1, 2, 3, 4)
@pytest.mark.parametrize("kind", ["even", "uneven", "empty"])
def test_full_tensor_loss_sends_each_rank_its_rows_of_the_gradient(
    distributed_mesh, world_size, kind
) -> None:
    mesh = distributed_mesh
    full = global_tensor((KINDS[kind](world_size), 3), torch.float32, mesh.device_type)
    weights = global_tensor((KINDS[kind](world_size), 3), torch.float32, mesh.device_type) * 10
    leaf = shard(full, mesh, [Shard(0)]).requires_grad_()
    st = ShardTensor.from_local(leaf, mesh, [Shard(0)], "chunk", global_shape=full.shape)
    with meshsim.record() as led:
        (st.redistribute(placements=[Shard(1)]).full_tensor() * weights).sum().backward()
    assert torch.equal(leaf.grad, shard(weights, mesh, [Shard(0)]))
    # forward: all_to_all + all_gather; backward: slice (nothing) + all_to_all
    assert led.counts() == {"all_to_all": 2, "all_gather": 1}


PLACEMENTS_2D = [[Shard(0), Shard(1)], [Shard(1), Replicate()], [Replicate(), Shard(0)]]


@pytest.mark.world(4, 8)
@pytest.mark.parametrize("kind", ["even", "uneven", "empty"])
@pytest.mark.parametrize("placements", PLACEMENTS_2D, ids=["S0,S1", "S1,R", "R,S0"])
def test_2d_gradients(distributed_mesh_2d, placements, kind) -> None:
    mesh = distributed_mesh_2d
    size = KINDS[kind](max(mesh.shape))
    full = global_tensor((size, size, 2), torch.float32, mesh.device_type)
    weights = global_tensor((size, size, 2), torch.float32, mesh.device_type) + 1
    leaf = shard(full, mesh, placements).requires_grad_()
    st = ShardTensor.from_local(leaf, mesh, placements, "chunk", global_shape=full.shape)
    moved = st.redistribute(placements=[Shard(2), Shard(0)])
    (moved.full_tensor() * weights).sum().backward()
    assert torch.equal(leaf.grad, shard(weights, mesh, placements))


@pytest.mark.world(2, 3, 4)
def test_gradients_return_in_the_inferred_uneven_layout(distributed_mesh, world_size) -> None:
    sizes = ramp(world_size)
    mesh = distributed_mesh
    full = global_tensor((sum(sizes), 4), torch.float32, mesh.device_type)
    leaf = shard(full, mesh, [Shard(0)], {0: sizes}).requires_grad_()
    st = ShardTensor.from_local(leaf, mesh, [Shard(0)])
    out = st.redistribute(placements=[Shard(1)]).to_local()
    (3 * out).sum().backward()
    assert torch.equal(leaf.grad, torch.full_like(leaf, 3.0))


@pytest.mark.world(2, 4)
def test_negotiated_backward_matches_the_fast_path(distributed_mesh, world_size) -> None:
    mesh = distributed_mesh
    full = global_tensor((KINDS["empty"](world_size), 5), torch.float32, mesh.device_type)
    grads = []
    for negotiate in (False, True):
        leaf = shard(full, mesh, [Shard(0)]).requires_grad_()
        st = ShardTensor.from_local(leaf, mesh, [Shard(0)], "chunk", global_shape=full.shape)
        with _negotiate_shapes() if negotiate else contextlib.nullcontext(), meshsim.record() as led:
            (st.redistribute(placements=[Shard(1)]).to_local() ** 3).sum().backward()
        assert led.counts() == {"all_to_all": 4 if negotiate else 2}
        grads.append(leaf.grad)
    assert torch.equal(grads[0], grads[1])


@pytest.mark.world(2, 4)
def test_a_partial_input_gets_the_replicated_gradient(distributed_mesh, world_size, rank) -> None:
    # PhysicsNeMo's test_from_local_partial_grad_boundary: global = sum of the partials.
    mesh = distributed_mesh
    weights = global_tensor((3, 2), torch.float32, mesh.device_type)
    leaf = torch.full((3, 2), float(rank), device=mesh.device_type, requires_grad=True)
    st = ShardTensor.from_local(leaf, mesh, [Partial()], "chunk", global_shape=(3, 2))
    (st.full_tensor() * weights).sum().backward()
    assert torch.equal(leaf.grad, weights)


@pytest.mark.world(2)
def test_backward_on_a_partial_shard_tensor_resolves_it_first(distributed_mesh, rank) -> None:
    leaf = torch.full((2,), float(rank + 1), device=distributed_mesh.device_type, requires_grad=True)
    st = ShardTensor.from_local(leaf, distributed_mesh, [Partial()], "chunk", global_shape=(2,))
    st.backward(torch.ones(2, device=distributed_mesh.device_type))
    assert torch.equal(leaf.grad, torch.ones(2, device=distributed_mesh.device_type))


@pytest.mark.world(2)
def test_from_local_backward_returns_one_gradient_per_input(distributed_mesh) -> None:
    leaf = torch.ones(2, 3, device=distributed_mesh.device_type, requires_grad=True)
    st = ShardTensor.from_local(leaf, distributed_mesh, [Shard(0)], "chunk", global_shape=(4, 3))
    assert type(st.grad_fn).__name__ == "_FromLocalBackward"
    grads = st.grad_fn.apply(ShardTensor(torch.ones(2, 3, device=leaf.device), st.spec))
    # one per input: the local tensor's, then None for the mesh, placements, sharding_shapes,
    # global_shape (upstream's five) and the ShardTensor class the result is made of
    assert len(grads) == 6
    assert torch.equal(grads[0], torch.ones_like(leaf)) and grads[1:] == (None,) * 5


@pytest.mark.world(2)
def test_autograd_flags_and_detach(distributed_mesh) -> None:
    leaf = torch.ones(2, 3, device=distributed_mesh.device_type, requires_grad=True)
    st = ShardTensor.from_local(leaf, distributed_mesh, [Shard(0)], "chunk", global_shape=(4, 3))
    assert st.requires_grad and not st.is_leaf and st.grad_fn is not None
    detached = st.detach()
    assert isinstance(detached, ShardTensor) and detached.spec == st.spec
    assert not detached.requires_grad and detached.is_leaf and detached.grad_fn is None
    assert detached.to_local().data_ptr() == leaf.data_ptr()
    with torch.no_grad():
        assert st.to_local() is st._local_tensor
        assert not st.redistribute(placements=[Replicate()]).requires_grad


@pytest.mark.world(2)
def test_a_shard_tensor_leaf_accumulates_its_grad_across_layouts(distributed_mesh, rank) -> None:
    mesh = distributed_mesh
    local = torch.arange(6.0, device=mesh.device_type).reshape(2, 3) + 6 * rank
    leaf = ShardTensor.from_local(local, mesh, [Shard(0)], "chunk", global_shape=(4, 3)).requires_grad_()
    assert leaf.is_leaf and leaf.requires_grad
    (2 * leaf.to_local()).sum().backward(retain_graph=True)
    first = leaf.grad
    assert isinstance(first, ShardTensor) and first.spec == leaf.spec
    leaf.redistribute(placements=[Replicate()]).to_local().sum().backward()
    assert isinstance(leaf.grad, ShardTensor) and leaf.grad.spec == leaf.spec
    assert torch.equal(leaf.grad.to_local(), torch.full((2, 3), 2.0 + 1, device=mesh.device_type))


@pytest.mark.world(2, 4)
@pytest.mark.parametrize("kind", ["even", "uneven", "empty"])
def test_a_leaf_gradient_autograd_copies_keeps_the_leaf_layout(distributed_mesh, world_size, kind) -> None:
    # A hook that keeps the gradient makes autograd store a copy of it
    # (new_empty_strided + copy_) instead of the gradient itself.
    mesh = distributed_mesh
    full = global_tensor((KINDS[kind](world_size), 3), torch.float32, mesh.device_type)
    leaf = ShardTensor.from_local(shard(full, mesh, [Shard(0)]), mesh, [Shard(0)], "chunk", full.shape)
    leaf = leaf.detach().requires_grad_()
    kept: list[torch.Tensor] = []
    leaf.register_hook(kept.append)
    with meshsim.record() as led:
        (3 * leaf).to_local().sum().backward()
    assert led.counts() == {}
    assert isinstance(leaf.grad, ShardTensor) and leaf.grad.spec == leaf.spec
    assert leaf.grad is not kept[0]
    assert torch.equal(leaf.grad.to_local(), torch.full_like(leaf.to_local(), 3.0))


SOURCES = {
    "shard": lambda rows: rows,
    "partial": lambda rows: rows.sum(dim=0, keepdim=True),
    "replicate": lambda rows: rows.redistribute(placements=[Replicate()]),
}


@pytest.mark.world(4)
@pytest.mark.parametrize("source", list(SOURCES))
def test_new_empty_of_the_inputs_shape_takes_its_layout(distributed_mesh, rank, source) -> None:
    mesh = distributed_mesh
    local = torch.ones(2 if rank < 3 else 1, 3, device=mesh.device_type)
    rows = ShardTensor.from_local(local, mesh, [Shard(0)], "chunk", (7, 3))  # 2, 2, 2, 1
    x = SOURCES[source](rows)
    shape = tuple(x.shape)
    with meshsim.record() as led:
        strided = x.new_empty_strided(shape, x.stride(), dtype=torch.float64)
        empty = x.new_empty(shape)
        other_shape = x.new_empty((*shape, 2))
    assert led.counts() == {}
    for result in (strided, empty):
        assert result.placements == x.placements and result.spec.shard_sizes == x.spec.shard_sizes
        assert result.to_local().shape == x.to_local().shape
    assert strided.dtype == torch.float64 and empty.dtype == torch.float32
    assert other_shape.placements == (Replicate(),) and other_shape.to_local().shape == (*shape, 2)


@pytest.mark.world(2)
def test_two_paths_to_one_leaf_add_up(distributed_mesh, rank) -> None:
    leaf = torch.ones(2, 3, device=distributed_mesh.device_type, requires_grad=True)
    st = ShardTensor.from_local(leaf, distributed_mesh, [Shard(0)], "chunk", global_shape=(4, 3))
    loss = st.to_local().sum() + st.redistribute(placements=[Shard(1)]).to_local().sum()
    loss.backward()
    assert torch.equal(leaf.grad, torch.full_like(leaf, 2.0))


@pytest.mark.world(2)
def test_gradient_accumulation_aligns_layouts(distributed_mesh) -> None:
    # What autograd's engine calls to add two gradients that arrive in different layouts.
    full = global_tensor((4, 3), torch.float32, distributed_mesh.device_type)
    rows = ShardTensor.from_local(
        shard(full, distributed_mesh, [Shard(0)]), distributed_mesh, [Shard(0)], "chunk", (4, 3)
    )
    columns = rows.redistribute(placements=[Shard(1)])
    total = torch.ops.aten.add.Tensor(rows, columns)
    assert total.spec == rows.spec
    assert torch.equal(total.to_local(), 2 * rows.to_local())
