"""DTensor interop: from_dtensor and to_dtensor, without communication, with gradients."""

from __future__ import annotations

import pytest
import torch
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor

import meshsim
from shardtensor import ShardTensor

from .shardtensor_cases import KINDS, global_tensor, ramp, shard


@pytest.mark.world(1, 2, 3, 4)
@pytest.mark.parametrize("kind", list(KINDS))
def test_from_dtensor_takes_every_torch_chunk_layout(distributed_mesh, world_size, kind) -> None:
    # Upstream rejected 9 or 6 rows over 4 ranks here (two chunking rules).
    mesh = distributed_mesh
    full = global_tensor((KINDS[kind](world_size), 3), torch.float32, mesh.device_type)
    dtensor = distribute_tensor(full, mesh, [Shard(0)])
    with meshsim.record() as led:
        st = ShardTensor.from_dtensor(dtensor)
    assert led.counts() == {}
    assert st.spec == ShardTensor.from_local(dtensor.to_local(), mesh, [Shard(0)]).spec
    assert torch.equal(st.full_tensor(), full)


@pytest.mark.world(4)
@pytest.mark.parametrize("placements", [[Shard(0), Shard(1)], [Replicate(), Shard(1)]], ids=["S0,S1", "R,S1"])
def test_to_dtensor_and_back(distributed_mesh_2d, placements, ledger) -> None:
    mesh = distributed_mesh_2d
    full = global_tensor((5, 3), torch.float32, mesh.device_type)
    st = ShardTensor.from_local(shard(full, mesh, placements), mesh, placements, "chunk", full.shape)
    dtensor = st.to_dtensor()
    assert isinstance(dtensor, DTensor) and dtensor.shape == full.shape
    assert tuple(dtensor.placements) == tuple(placements)
    again = ShardTensor.from_dtensor(dtensor)
    assert again.spec == st.spec
    assert ledger.counts() == {}
    assert torch.equal(dtensor.full_tensor(), full)


@pytest.mark.world(2, 4)
def test_gradients_cross_both_conversions(distributed_mesh) -> None:
    mesh = distributed_mesh
    full = global_tensor((7, 2), torch.float32, mesh.device_type)
    leaf = shard(full, mesh, [Shard(0)]).requires_grad_()
    dtensor = ShardTensor.from_local(leaf, mesh, [Shard(0)], "chunk", full.shape).to_dtensor()
    back = ShardTensor.from_dtensor(dtensor)
    (back.to_local() * 6).sum().backward()
    assert torch.equal(leaf.grad, torch.full_like(leaf, 6.0))


@pytest.mark.world(2)
def test_to_dtensor_refuses_a_layout_dtensor_cannot_describe(distributed_mesh, rank) -> None:
    sizes = ramp(2, (1, 3))
    local = shard(
        global_tensor((4, 2), torch.float32, distributed_mesh.device_type),
        distributed_mesh,
        [Shard(0)],
        {0: sizes},
    )
    st = ShardTensor.from_local(local, distributed_mesh, [Shard(0)])
    with pytest.raises(
        ValueError,
        match=r"mesh dim 0 \(S\(0\)\) has shard sizes \(1, 3\), but a DTensor needs torch.chunk's \(2, 2\)",
    ):
        st.to_dtensor()


@pytest.mark.world(2)
def test_from_dtensor_needs_a_dtensor(distributed_mesh) -> None:
    with pytest.raises(TypeError, match=r"from_dtensor needs a DTensor, got Tensor"):
        ShardTensor.from_dtensor(torch.zeros(2))
