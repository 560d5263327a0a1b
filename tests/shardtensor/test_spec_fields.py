"""ShardTensorSpec under PhysicsNeMo's field names: construction, reading, copies, unknown sizes."""

from __future__ import annotations

import dataclasses
import pickle

import pytest
import torch
from torch.distributed.tensor import Replicate, Shard

from shardtensor import ShardTensor, ShardTensorSpec, TensorMeta, chunk_sharding_shapes
from shardtensor._spec import contiguous_stride

from .op_cases import Layout


def _meta(shape: tuple[int, ...]) -> TensorMeta:
    return TensorMeta(shape, contiguous_stride(shape), torch.float32)


@pytest.mark.world(4)
def test_upstream_field_names_build_and_read_a_spec(distributed_mesh_2d, rank) -> None:
    mesh = distributed_mesh_2d
    row, col = divmod(rank, 2)
    mine = ((4, 3)[row], (3, 2)[col], 6)
    shapes = {0: [(4, mine[1], 6), (3, mine[1], 6)], 1: [(mine[0], 3, 6), (mine[0], 2, 6)]}
    spec = ShardTensorSpec(
        mesh=mesh, placements=[Shard(0), Shard(1)], tensor_meta=_meta((7, 5, 6)), _sharding_shapes=shapes
    )
    assert spec.tensor_meta.shape == (7, 5, 6) and spec.tensor_meta.dtype == torch.float32
    assert spec._local_shape == mine == spec.local_shape
    assert spec._sharding_shapes == {0: tuple(shapes[0]), 1: tuple(shapes[1])}
    assert spec.sharding_shapes() == spec._sharding_shapes
    assert spec.shard_sizes == ((4, 3), (3, 2))
    # what from_local makes from the same shards is the same spec
    local = torch.zeros(mine, device=mesh.device_type)
    assert ShardTensor.from_local(local, mesh, [Shard(0), Shard(1)]).spec == spec


@pytest.mark.world(2)
def test_a_spec_is_immutable_and_replace_copies_it(distributed_mesh, rank) -> None:
    spec = Layout("1d-uneven", distributed_mesh, None).shard(torch.zeros(3, 2)).spec
    with pytest.raises(dataclasses.FrozenInstanceError):
        spec._sharding_shapes = None  # type: ignore[misc]
    replicated = dataclasses.replace(
        spec, placements=(Replicate(),), _sharding_shapes=None, _local_shape=None
    )
    assert replicated.placements == (Replicate(),) and replicated.local_shape == (3, 2)
    assert dataclasses.replace(spec) == spec
    assert dataclasses.replace(spec, _sharding_shapes=dict(spec._sharding_shapes)) == spec


@pytest.mark.world(2)
def test_a_local_shape_that_contradicts_the_sharding_shapes_is_refused(distributed_mesh, rank) -> None:
    with pytest.raises(ValueError, match=r"_local_shape \(9, 2\) does not match the local shape"):
        ShardTensorSpec(
            distributed_mesh,
            [Shard(0)],
            _meta((3, 2)),
            _local_shape=(9, 2),
            _sharding_shapes={0: [(1, 2), (2, 2)]},
        )
    with pytest.raises(ValueError, match=r"_sharding_shapes has keys \[1\] but the Shard placements"):
        ShardTensorSpec(distributed_mesh, [Shard(0)], _meta((3, 2)), _sharding_shapes={1: [(1, 2), (2, 2)]})


@pytest.mark.world(4)
def test_a_spec_without_sizes_assumes_torch_chunk_when_it_wraps_a_shard(distributed_mesh, rank) -> None:
    unknown = ShardTensorSpec(distributed_mesh, [Shard(0)], _meta((9, 2)), _sharding_shapes=None)
    assert not unknown.is_resolved and unknown.local_shape is None
    with pytest.raises(ValueError, match="records no sharding shapes"):
        unknown.sharding_shapes()
    rows = (3, 3, 3, 0)[rank]  # torch.chunk's layout of 9 rows over 4 ranks
    wrapped = ShardTensor(torch.zeros(rows, 2, device=distributed_mesh.device_type), unknown)
    assert wrapped.spec.shard_sizes == ((3, 3, 3, 0),)
    with pytest.raises(RuntimeError, match=r"torch.chunk's layout gives this rank .*unevenly sharded"):
        ShardTensor(torch.zeros(4, 2, device=distributed_mesh.device_type), unknown)


@pytest.mark.world(4)
def test_chunk_sharding_shapes_is_what_chunk_mode_records(distributed_mesh_2d, rank) -> None:
    placements = [Shard(0), Shard(1)]
    shapes = chunk_sharding_shapes(distributed_mesh_2d, placements, (9, 3, 2))
    local = ShardTensor(
        torch.zeros(((5, 4)[rank // 2], (2, 1)[rank % 2], 2), device=distributed_mesh_2d.device_type),
        ShardTensorSpec(distributed_mesh_2d, placements, _meta((9, 3, 2))),
    )
    assert shapes == local.spec.sharding_shapes()
    assert chunk_sharding_shapes(distributed_mesh_2d, [Replicate(), Replicate()], (9, 3)) == {}


@pytest.mark.world(2)
def test_stable_hash_and_pickle(distributed_mesh) -> None:
    layout = Layout("1d-uneven", distributed_mesh, None)
    spec = layout.shard(torch.zeros(3, 2)).spec
    same = dataclasses.replace(spec)
    assert same._stable_hash() == spec._stable_hash()
    other = Layout("1d-even", distributed_mesh, None).shard(torch.zeros(4, 2)).spec
    assert other._stable_hash() != spec._stable_hash()
    hash(spec)
    loaded = pickle.loads(pickle.dumps(spec))
    assert loaded == spec and hash(loaded) == hash(spec) and loaded.local_shape == spec.local_shape
