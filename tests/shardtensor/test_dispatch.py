"""The operator machinery itself: cached plans, meshes, and the errors it gives."""

from __future__ import annotations

import pytest
import torch
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Replicate, Shard

import meshsim
from shardtensor import ShardTensor

from .op_cases import Layout


def _double_on_a_fresh_mesh() -> tuple[bool, float]:
    mesh = init_device_mesh("cpu", (2,))
    x = ShardTensor.from_local(torch.ones(2, 3), mesh, [Shard(0)])
    y = x * 2
    return y.spec.mesh is mesh, float(y.sum().full_tensor())


def test_a_later_world_never_gets_an_earlier_worlds_mesh() -> None:
    # The two worlds' meshes compare equal (same ranks, reused threads); the second
    # world's results must hold its own mesh, whose process groups are alive.
    first = meshsim.run(_double_on_a_fresh_mesh, 2)
    second = meshsim.run(_double_on_a_fresh_mesh, 2)
    assert first == second == [(True, 24.0), (True, 24.0)]


def _softmax_over_the_sharded_dim() -> list[meshsim.Collective]:
    mesh = init_device_mesh("cpu", (2,))
    local = torch.full((2, 3), float(mesh.get_local_rank()))
    x = ShardTensor.from_local(local, mesh, [Shard(0)], "chunk", (4, 3))
    with meshsim.record() as ledger:
        x.softmax(0)  # aten._softmax reaches __torch_dispatch__, which gathers dim 0
    return ledger.calls


def test_the_collectives_an_operator_issues_are_recorded_on_gloo_as_on_sim() -> None:
    # On gloo a dispatch mode records the ledger; it must let ShardTensor's own
    # __torch_dispatch__ run with the mode still entered, or its gather goes unseen.
    sim = meshsim.run(_softmax_over_the_sharded_dim, 2)
    gloo = meshsim.run(_softmax_over_the_sharded_dim, 2, backend="gloo")
    assert [[call.op for call in calls] for calls in sim] == [["all_gather"]] * 2
    assert gloo == sim


@pytest.mark.world(4)
def test_operands_on_different_meshes_are_refused(distributed_mesh, distributed_mesh_2d) -> None:
    x = Layout("1d-even", distributed_mesh, None).shard(torch.ones(8, 3))
    y = ShardTensor.from_local(
        torch.ones(8, 3), distributed_mesh_2d, [Replicate(), Replicate()], "chunk", (8, 3)
    )
    with pytest.raises(ValueError, match=r"aten.add.Tensor: ShardTensor arguments live on different meshes"):
        x + y


@pytest.mark.world(2)
def test_out_variants_are_refused(distributed_mesh) -> None:
    x = Layout("1d-uneven", distributed_mesh, None).shard(torch.ones(3, 2))
    out = Layout("1d-uneven", distributed_mesh, None).shard(torch.zeros(3, 2))
    with pytest.raises(NotImplementedError, match=r"out= variants are not supported on ShardTensors"):
        torch.add(x, x, out=out)


@pytest.mark.world(2)
def test_the_same_layout_reuses_its_plan(distributed_mesh) -> None:
    layout = Layout("1d-uneven", distributed_mesh, None)
    x = layout.shard(torch.ones(3, 2))
    other = layout.shard(torch.ones(3, 2))  # an equal spec in another object
    first, second = x * x, other * other  # one plan, so one output spec object
    assert first.spec is second.spec
    assert torch.equal(second.to_local(), x.to_local())
