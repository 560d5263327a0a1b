"""scatter_tensor (a tensor on one rank, distributed) and sync_module_over_mesh (replicas made equal)."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch.distributed.tensor import Replicate, Shard, distribute_tensor

import meshsim
from shardtensor import ShardTensor, chunk_sizes, scatter_tensor, sync_module_over_mesh

from .shardtensor_cases import global_tensor, shard

SCATTER_1D = {"S0": [Shard(0)], "S1": [Shard(1)], "R": [Replicate()]}
SCATTER_2D = {"S0,S1": [Shard(0), Shard(1)], "R,S0": [Replicate(), Shard(0)], "S1,R": [Shard(1), Replicate()]}


@pytest.mark.world(4)
@pytest.mark.parametrize("source", [0, 3])
@pytest.mark.parametrize("placements", list(SCATTER_1D))
def test_scatter_1d(distributed_mesh, rank, source, placements) -> None:
    full = global_tensor((9, 5), torch.float32, distributed_mesh.device_type)  # 9 rows: 3, 3, 3, 0
    given = full if rank == source else None
    with meshsim.record() as ledger:
        st = scatter_tensor(given, source, distributed_mesh, SCATTER_1D[placements])
    assert ledger.counts() == {"broadcast": 3}  # metadata (2, as broadcast_object_list) + data
    assert st.placements == tuple(SCATTER_1D[placements])
    assert torch.equal(st.to_local(), shard(full, distributed_mesh, SCATTER_1D[placements]))
    assert st.is_leaf and not st.requires_grad


@pytest.mark.world(4)
@pytest.mark.parametrize("source", [0, 2, 3])
@pytest.mark.parametrize("placements", list(SCATTER_2D))
def test_scatter_2d(distributed_mesh_2d, rank, source, placements) -> None:
    mesh = distributed_mesh_2d
    full = global_tensor((5, 7), torch.float32, mesh.device_type)
    with meshsim.record() as ledger:
        st = scatter_tensor(
            full if rank == source else None, source, mesh, SCATTER_2D[placements], full.shape, full.dtype
        )
    # Shape and dtype given: no metadata travels. One broadcast along mesh dim 0 among the
    # ranks that share the source's column, then one along mesh dim 1 on every row.
    holds_column = mesh.get_coordinate()[1] == [[0, 1], [2, 3]][source // 2].index(source)
    assert ledger.counts() == {"broadcast": 2 if holds_column else 1}
    assert torch.equal(st.full_tensor(), full)
    assert torch.equal(st.to_local(), shard(full, mesh, SCATTER_2D[placements]))


@pytest.mark.world(4)
def test_scatter_with_requires_grad_makes_a_leaf_with_gradients_in_its_layout(
    distributed_mesh_2d, rank
) -> None:
    full = global_tensor((6, 10, 3), torch.float32, distributed_mesh_2d.device_type)
    st = scatter_tensor(
        full if rank == 0 else None, 0, distributed_mesh_2d, [Shard(0), Shard(1)], requires_grad=True
    )
    assert st.is_leaf and st.requires_grad
    (st**2).sum().backward()
    assert st.grad.spec == st.spec
    torch.testing.assert_close(st.grad.full_tensor(), 2 * full)


@pytest.mark.world(2)
def test_scatter_checks_its_arguments(distributed_mesh, rank) -> None:
    full = torch.zeros(4, 2, device=distributed_mesh.device_type)
    with pytest.raises(ValueError, match=r"Global source must be an integer rank, got '0'"):
        scatter_tensor(full, "0", distributed_mesh, [Shard(0)])  # type: ignore[arg-type]
    with pytest.raises(
        ValueError, match=r"Please specify a tensor source in this mesh: 5 is not in \[0, 1\]"
    ):
        scatter_tensor(full, 5, distributed_mesh, [Shard(0)])
    if rank == 0:
        with pytest.raises(
            ValueError, match=r"the source's tensor has shape \(4, 2\), but global_shape is \(3, 2\)"
        ):
            scatter_tensor(full, 0, distributed_mesh, [Shard(0)], (3, 2), torch.float32)


@pytest.mark.world(4)
def test_scatter_matches_distribute_tensor(distributed_mesh) -> None:
    full = global_tensor((10, 840, 4), torch.float32, distributed_mesh.device_type)
    st = scatter_tensor(full, 0, distributed_mesh, [Shard(1)], full.shape, full.dtype)
    dt = distribute_tensor(full, distributed_mesh, [Shard(1)])
    assert st.spec == ShardTensor.from_dtensor(dt).spec
    assert torch.equal(st.to_local(), dt.to_local())
    assert st.spec.shard_sizes == (chunk_sizes(840, 4),)


class _Model(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = torch.nn.Linear(4, 4)
        self.norm = torch.nn.BatchNorm1d(4)
        self.steps = torch.nn.Parameter(torch.zeros(2, dtype=torch.float64))


def _desynced(rank: int, device: str) -> _Model:
    """The same model on every rank (a fixed seed), then offset by ``rank + 1``.

    The seed is a generator's own: gloo thread ranks run at once and share torch's
    global RNG, so a ``torch.manual_seed`` in each would interleave their draws.
    """
    generator = torch.Generator().manual_seed(0)
    model = _Model()
    with torch.no_grad():
        for t in model.fc.parameters():  # the only randomly initialized tensors
            t.copy_(torch.rand(t.shape, generator=generator))
    model = model.to(device)
    with torch.no_grad():
        for t in (*model.parameters(), *model.buffers()):
            t.add_(rank + 1)
    return model


@pytest.mark.world(4)
@pytest.mark.parametrize("source", [0, 3])
def test_sync_makes_every_plain_tensor_the_sources(distributed_mesh, rank, source) -> None:
    model = _desynced(rank, distributed_mesh.device_type)
    expected = _desynced(source, distributed_mesh.device_type)
    with meshsim.record() as ledger:
        sync_module_over_mesh(model, distributed_mesh, src_mesh_rank=source)
    # one broadcast per dtype: float32 (weights, biases, running stats), int64 (the
    # batch counter), float64 (the extra parameter)
    assert ledger.counts() == {"broadcast": 3}
    for (name, got), (_, want) in zip(model.state_dict().items(), expected.state_dict().items()):
        assert torch.equal(got, want), name


@pytest.mark.world(4)
def test_sync_over_one_axis_of_a_2d_mesh(distributed_mesh_2d, rank) -> None:
    model = _desynced(rank, distributed_mesh_2d.device_type)
    sync_module_over_mesh(model, distributed_mesh_2d["axis2"], verify=True)
    source = (rank // 2) * 2  # group rank 0 of this rank's row
    assert torch.equal(model.fc.weight, _desynced(source, distributed_mesh_2d.device_type).fc.weight)


@pytest.mark.world(2)
def test_sync_leaves_distributed_parameters_alone(distributed_mesh, rank) -> None:
    model = _desynced(rank, distributed_mesh.device_type)
    local = model.fc.weight.detach()[2 * rank : 2 * rank + 2].clone()
    model.fc.weight = torch.nn.Parameter(
        ShardTensor.from_local(local, distributed_mesh, [Shard(0)], "chunk", (4, 4))
    )
    sync_module_over_mesh(model, distributed_mesh)
    assert torch.equal(model.fc.weight.to_local(), local)
    assert torch.equal(model.fc.bias, _desynced(0, distributed_mesh.device_type).fc.bias)


@pytest.mark.world(2)
def test_sync_checks_its_arguments(distributed_mesh, make_mesh, rank) -> None:
    model = _Model()
    with pytest.raises(ValueError, match=r"src_mesh_rank must be a position in the mesh, 0 to 1, got 2"):
        sync_module_over_mesh(model, distributed_mesh, src_mesh_rank=2)
    with pytest.raises(ValueError, match=r"expects a 1-D mesh, got a 2-D one of shape \(1, 2\)"):
        sync_module_over_mesh(model, make_mesh((1, 2), ("a", "b")))
    sharded_only = torch.nn.Linear(2, 2, bias=False)
    sharded_only.weight = torch.nn.Parameter(
        distribute_tensor(sharded_only.weight.detach(), distributed_mesh, [Shard(0)])
    )
    with pytest.raises(RuntimeError, match="none of it is plain"):
        sync_module_over_mesh(sharded_only, distributed_mesh)
    sync_module_over_mesh(torch.nn.Identity(), distributed_mesh, verify=True)  # nothing to do


@pytest.mark.world(2)
def test_sync_verify_catches_ranks_whose_modules_differ(distributed_mesh, rank) -> None:
    model = _Model()
    if rank == 1:
        model.extra = torch.nn.Parameter(torch.ones(1))
    with pytest.raises(RuntimeError, match=r"metadata differs across the mesh: group ranks \[1\]"):
        sync_module_over_mesh(model, distributed_mesh, verify=True)
    assert dist.get_world_size() == 2
