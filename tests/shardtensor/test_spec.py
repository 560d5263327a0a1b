"""The one chunking rule and ShardTensorSpec as a value type."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from torch.distributed.tensor import Partial, Replicate, Shard

from shardtensor import ShardTensor, ShardTensorSpec, chunk_sizes
from shardtensor._spec import contiguous_stride, make_spec

# The table of upstream's notes: torch.chunk's layouts, including those with empty shards.
CHUNK_TABLE = [
    (8, 4, (2, 2, 2, 2)),
    (10, 4, (3, 3, 3, 1)),
    (7, 4, (2, 2, 2, 1)),
    (9, 4, (3, 3, 3, 0)),
    (6, 4, (2, 2, 2, 0)),
    (5, 4, (2, 2, 1, 0)),
    (3, 4, (1, 1, 1, 0)),
    (0, 4, (0, 0, 0, 0)),
    (5, 1, (5,)),
]


@pytest.mark.parametrize(
    ("size", "parts", "expected"), CHUNK_TABLE, ids=[f"{s}/{p}" for s, p, _ in CHUNK_TABLE]
)
def test_chunk_sizes_table(size: int, parts: int, expected: tuple[int, ...]) -> None:
    assert chunk_sizes(size, parts) == expected


@given(size=st.integers(0, 300), parts=st.integers(1, 40))
def test_chunk_sizes_is_torch_chunk_padded_with_empty_shards(size: int, parts: int) -> None:
    sizes = chunk_sizes(size, parts)
    from_torch = [c.shape[0] for c in torch.empty(size).chunk(parts)] if size else []
    assert list(sizes) == from_torch + [0] * (parts - len(from_torch))
    assert sum(sizes) == size
    assert list(sizes) == sorted(sizes, reverse=True)


@pytest.mark.parametrize(("size", "parts"), [(-1, 4), (4, 0)], ids=["negative-size", "no-parts"])
def test_chunk_sizes_rejects_bad_arguments(size: int, parts: int) -> None:
    with pytest.raises(ValueError, match=rf"size={size}, parts={parts}"):
        chunk_sizes(size, parts)


@given(shape=st.lists(st.integers(0, 5), max_size=5))
def test_contiguous_stride_is_torchs(shape: list[int]) -> None:
    assert contiguous_stride(tuple(shape)) == torch.empty(shape).stride()


@pytest.mark.world(4)
def test_spec_is_a_value_type(distributed_mesh_2d, rank) -> None:
    mesh = distributed_mesh_2d

    def spec(placements=None, shape=(7, 5), dtype=torch.float32, sizes=None) -> ShardTensorSpec:
        placements = placements or (Shard(0), Shard(1))
        return make_spec(mesh, placements, shape, dtype, sizes or {0: (4, 3), 1: (3, 2)})

    a, b = spec(), spec()
    assert a == b and hash(a) == hash(b) and a is not b
    assert a != spec(dtype=torch.bfloat16)
    assert a != spec(shape=(7, 6), sizes={0: (4, 3), 1: (3, 3)})
    assert a != spec(sizes={0: (3, 4), 1: (3, 2)})
    assert a != spec(placements=(Shard(0), Replicate()), sizes={0: (4, 3)})
    assert len({a, b}) == 1
    assert repr(a).startswith("ShardTensorSpec(mesh=DeviceMesh(")
    assert "shard_sizes=((4, 3), (3, 2))" in repr(a)
    sizes = "(sizes mesh dim 0: 4, 3; mesh dim 1: 3, 2)"
    assert str(a) == f"[S(0), S(1)] (7, 5) float32 on a 2x2 {mesh.device_type} mesh {sizes}"


@pytest.mark.world(4)
def test_sharding_shapes_are_cross_sections_through_this_rank(distributed_mesh_2d, rank) -> None:
    spec = make_spec(distributed_mesh_2d, (Shard(0), Shard(1)), (7, 5), torch.float32, {0: (4, 3), 1: (3, 2)})
    row, col = divmod(rank, 2)
    mine = ((4, 3)[row], (3, 2)[col])
    assert spec.local_shape == mine
    assert spec.sharding_shapes() == {
        0: ((4, mine[1]), (3, mine[1])),
        1: ((mine[0], 3), (mine[0], 2)),
    }
    assert spec.sharding_shapes(1) == ((mine[0], 3), (mine[0], 2))
    assert spec.offsets() == ((0, 4)[row], (0, 3)[col])
    assert spec.offsets(1) == (0, 3)[col]


@pytest.mark.world(2)
def test_sharding_shapes_has_keys_only_for_shard_mesh_dims(distributed_mesh_2d) -> None:
    spec = make_spec(distributed_mesh_2d, (Replicate(), Partial()), (3, 4), torch.float32, {})
    assert spec.sharding_shapes() == {}
    assert spec.local_shape == (3, 4)
    assert spec.offsets() == (0, 0)
    with pytest.raises(ValueError, match=r"mesh dim 0 is not sharded .*Shard mesh dims: \[\]"):
        spec.sharding_shapes(0)


@pytest.mark.world(2)
def test_spec_rejects_sizes_that_do_not_add_up(distributed_mesh) -> None:
    with pytest.raises(ValueError, match=r"tensor dim 0 of size 5, but its shard sizes are \(2, 2\)"):
        make_spec(distributed_mesh, (Shard(0),), (5, 3), torch.float32, {0: (2, 2)})


@pytest.mark.world(2)
def test_wrapping_a_local_tensor_of_the_wrong_shape_is_refused(distributed_mesh, rank) -> None:
    spec = make_spec(distributed_mesh, (Shard(0),), (5, 3), torch.float32, {0: (3, 2)})
    with pytest.raises(ValueError, match=r"local_tensor has shape \(4, 3\) and dtype torch.float32, but"):
        ShardTensor(torch.zeros(4, 3, device=distributed_mesh.device_type), spec)
