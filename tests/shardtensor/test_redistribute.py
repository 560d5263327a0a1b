"""redistribute: every hop, its collectives, the specs it produces, and bitwise round trips."""

from __future__ import annotations

import pytest
import torch
from torch.distributed.tensor import Partial, Replicate, Shard

import meshsim
from shardtensor import ShardTensor
from shardtensor._redistribute import _negotiate_shapes

from .shardtensor_cases import DTYPE_IDS, DTYPES, KINDS, global_tensor, ramp, shard


def chunked(full, mesh, placements) -> ShardTensor:
    """This rank's torch.chunk shard of ``full`` as a ShardTensor (no collective)."""
    return ShardTensor.from_local(shard(full, mesh, placements), mesh, placements, "chunk", full.shape)


def check_layout(st: ShardTensor, full: torch.Tensor, placements) -> None:
    """``st`` holds torch.chunk's shard of ``full`` and the spec "chunk" would give it."""
    expected = chunked(full, st.device_mesh, placements)
    assert st.spec == expected.spec
    assert torch.equal(st.to_local(), expected.to_local())


@pytest.mark.world(1, 2, 3, 4, 8)
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("kind", list(KINDS))
def test_shard_to_shard_round_trip_is_bitwise(distributed_mesh, world_size, kind, dtype) -> None:
    mesh, size = distributed_mesh, KINDS[kind](world_size)
    full = global_tensor((size, size + 1, 2), dtype, mesh.device_type)
    st = chunked(full, mesh, [Shard(0)])
    with meshsim.record() as there:
        moved = st.redistribute(placements=[Shard(1)])
    with meshsim.record() as back_again:
        back = moved.redistribute(placements=[Shard(0)])
    assert there.counts() == back_again.counts() == {"all_to_all": 1}
    check_layout(moved, full, [Shard(1)])
    assert back.spec == st.spec
    assert torch.equal(back.to_local(), st.to_local())


@pytest.mark.world(1, 2, 3, 4, 8)
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("kind", list(KINDS))
def test_shard_to_replicate_round_trip_is_bitwise(distributed_mesh, world_size, kind, dtype) -> None:
    mesh = distributed_mesh
    full = global_tensor((3, KINDS[kind](world_size)), dtype, mesh.device_type)
    st = chunked(full, mesh, [Shard(1)])
    with meshsim.record() as gathered:
        replicated = st.redistribute(placements=[Replicate()])
    with meshsim.record() as sliced:
        back = replicated.redistribute(placements=[Shard(1)])
    assert gathered.counts() == {"all_gather": 1}
    assert sliced.counts() == {}
    assert torch.equal(replicated.to_local(), full)
    assert replicated.spec.sharding_shapes() == {}
    assert back.spec == st.spec
    assert torch.equal(back.to_local(), st.to_local())


@pytest.mark.world(2, 3, 4)
def test_uneven_inferred_layouts_move_and_gather_exactly(distributed_mesh, world_size, rank) -> None:
    sizes = ramp(world_size)  # 1, 2, 3, ...: not a torch.chunk layout
    mesh = distributed_mesh
    full = global_tensor((sum(sizes), 5), torch.float32, mesh.device_type)
    st = ShardTensor.from_local(shard(full, mesh, [Shard(0)], {0: sizes}), mesh, [Shard(0)])
    with meshsim.record() as led:
        moved = st.redistribute(placements=[Shard(1)])
        full_again = moved.full_tensor()
        replicated = st.redistribute(placements=[Replicate()])
    assert led.counts() == {"all_to_all": 1, "all_gather": 2}
    check_layout(moved, full, [Shard(1)])
    assert torch.equal(full_again, full)
    assert torch.equal(replicated.to_local(), full)


@pytest.mark.world(4)
def test_target_dim_smaller_than_the_mesh(distributed_mesh, ledger) -> None:
    # Upstream's skipped test_redistribute_target_dim_smaller_than_mesh: 3 columns over 4 ranks.
    full = global_tensor((8, 3), torch.float32, distributed_mesh.device_type)
    st = chunked(full, distributed_mesh, [Shard(0)])
    moved = st.redistribute(placements=[Shard(1)])
    check_layout(moved, full, [Shard(1)])
    assert moved.spec.shard_sizes == ((1, 1, 1, 0),)
    assert torch.equal(moved.redistribute(placements=[Shard(0)]).to_local(), st.to_local())
    assert ledger.counts() == {"all_to_all": 2}


# (source, target, collectives there, collectives back)
PAIRS_2D = [
    ("S0,S1", "S1,S0", {"all_gather": 1, "all_to_all": 1}, {"all_gather": 1, "all_to_all": 1}),
    ("S0,S1", "R,R", {"all_gather": 2}, {}),
    ("S0,R", "R,S0", {"all_gather": 1}, {"all_gather": 1}),
    ("R,S1", "S0,S1", {}, {"all_gather": 1}),
    ("S0,S1", "S0,S2", {"all_to_all": 1}, {"all_to_all": 1}),
    ("S0,S1", "S2,S1", {"all_to_all": 1}, {"all_to_all": 1}),
    ("S1,R", "S0,S1", {"all_to_all": 1}, {"all_gather": 1, "all_to_all": 1}),
    ("R,R", "S2,S0", {}, {"all_gather": 2}),
]


def placements_of(text: str) -> list:
    return [Replicate() if p == "R" else Shard(int(p[1:])) for p in text.split(",")]


@pytest.mark.world(4, 8)
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("kind", ["even", "uneven", "empty"])
@pytest.mark.parametrize(
    ("source", "target", "there", "back"), PAIRS_2D, ids=[f"{a}-{b}" for a, b, *_ in PAIRS_2D]
)
def test_2d_round_trip_is_bitwise(distributed_mesh_2d, source, target, there, back, kind, dtype) -> None:
    mesh = distributed_mesh_2d
    size = KINDS[kind](max(mesh.shape))
    full = global_tensor((size, size, size), dtype, mesh.device_type)
    st = chunked(full, mesh, placements_of(source))
    with meshsim.record() as forth_led:
        moved = st.redistribute(placements=placements_of(target))
    with meshsim.record() as back_led:
        returned = moved.redistribute(placements=placements_of(source))
    assert forth_led.counts() == there
    assert back_led.counts() == back
    check_layout(moved, full, placements_of(target))
    assert returned.spec == st.spec
    assert torch.equal(returned.to_local(), st.to_local())


@pytest.mark.world(4)
def test_2d_uneven_sizes_of_a_dim_that_stays_sharded_are_kept(distributed_mesh_2d, rank) -> None:
    mesh, placements = distributed_mesh_2d, [Shard(0), Shard(1)]
    rows = (3, 1)  # inferred, not torch.chunk's (2, 2)
    full = global_tensor((4, 6, 2), torch.float32, mesh.device_type)
    st = ShardTensor.from_local(shard(full, mesh, placements, {0: rows, 1: (3, 3)}), mesh, placements)
    with meshsim.record() as led:
        moved = st.redistribute(placements=[Shard(0), Shard(2)])
    assert led.counts() == {"all_to_all": 1}
    assert moved.spec.shard_sizes == (rows, (1, 1))
    expected = shard(full, mesh, [Shard(0), Shard(2)], {0: rows, 1: (1, 1)})
    assert torch.equal(moved.to_local(), expected)
    assert moved.spec == ShardTensor.from_local(expected, mesh, [Shard(0), Shard(2)]).spec


@pytest.mark.world(2, 4)
@pytest.mark.parametrize("kind", ["uneven", "empty"])
def test_negotiated_shapes_give_the_same_bits_at_twice_the_all_to_alls(
    distributed_mesh, world_size, kind
) -> None:
    mesh, size = distributed_mesh, KINDS[kind](world_size)
    full = global_tensor((size, size), torch.float32, mesh.device_type)
    st = chunked(full, mesh, [Shard(0)])
    with meshsim.record() as fast:
        quick = st.redistribute(placements=[Shard(1)])
    with _negotiate_shapes(), meshsim.record() as slow:
        negotiated = st.redistribute(placements=[Shard(1)])
    assert fast.counts() == {"all_to_all": 1}
    assert slow.counts() == {"all_to_all": 2}
    assert slow.calls[0].dtype == torch.int64  # the shapes travel first
    assert negotiated.spec == quick.spec
    assert torch.equal(negotiated.to_local(), quick.to_local())


def partial_values(shape, rank: int, device: str) -> torch.Tensor:
    """Small integers, so that every sum is exact in any order."""
    return ((torch.arange(torch.Size(shape).numel()) + 3 * rank) % 7).reshape(shape).float().to(device)


@pytest.mark.world(1, 2, 3, 4)
@pytest.mark.parametrize("kind", ["even", "uneven", "empty", "sparse"])
def test_partial_to_replicate_and_to_shard(distributed_mesh, world_size, rank, kind) -> None:
    mesh, shape = distributed_mesh, (KINDS[kind](world_size), 3)
    local = partial_values(shape, rank, mesh.device_type)
    total = sum(partial_values(shape, r, mesh.device_type) for r in range(world_size))
    st = ShardTensor.from_local(local, mesh, [Partial()])
    with meshsim.record() as reduced:
        replicated = st.redistribute(placements=[Replicate()])
    with meshsim.record() as scattered:
        sharded = st.redistribute(placements=[Shard(0)])
    assert reduced.counts() == {"all_reduce": 1}
    assert scattered.counts() == {"reduce_scatter": 1}
    assert torch.equal(replicated.to_local(), total)
    check_layout(sharded, total, [Shard(0)])
    assert torch.equal(st.to_local(), local)  # the partial input is left alone


@pytest.mark.world(4)
def test_partial_on_a_2d_mesh_reduces_over_its_own_mesh_dim(distributed_mesh_2d, rank) -> None:
    mesh = distributed_mesh_2d
    row, col = divmod(rank, 2)
    full = global_tensor((3, 4), torch.float32, mesh.device_type)
    local = shard(full, mesh, [Shard(0), Replicate()], {0: (2, 1)}) * (col + 1)  # partial over mesh dim 1
    st = ShardTensor.from_local(local, mesh, [Shard(0), Partial()], {0: [(2, 4), (1, 4)]})
    with meshsim.record() as led:
        sharded = st.redistribute(placements=[Shard(0), Shard(1)])
    assert led.counts() == {"reduce_scatter": 1}
    assert [c.group for c in led.calls] == [tuple(mesh.mesh[row].tolist())]
    expected = shard(full * 3, mesh, [Shard(0), Shard(1)], {0: (2, 1), 1: (2, 2)})
    assert torch.equal(sharded.to_local(), expected)


@pytest.mark.world(2)
def test_redistribute_to_the_same_placements_costs_nothing(distributed_mesh, ledger) -> None:
    st = chunked(
        global_tensor((5, 2), torch.float32, distributed_mesh.device_type), distributed_mesh, [Shard(0)]
    )
    same = st.redistribute(distributed_mesh, [Shard(-2)])
    assert same.spec == st.spec
    assert same.to_local().data_ptr() == st.to_local().data_ptr()
    assert ledger.counts() == {}


@pytest.mark.world(2)
def test_redistribute_rejects_bad_targets(distributed_mesh, make_mesh, ledger) -> None:
    st = chunked(
        global_tensor((4, 2), torch.float32, distributed_mesh.device_type), distributed_mesh, [Shard(0)]
    )
    with pytest.raises(
        ValueError,
        match=r"^Can not redistribute to Partial, redistributing to Partial is for internal use only!",
    ):
        st.redistribute(placements=[Partial()])
    with pytest.raises(ValueError, match=r"^placements is needed for redistribute!$"):
        st.redistribute()
    with pytest.raises(ValueError, match=r"^Mesh dimension must match placements length"):
        st.redistribute(placements=[Shard(0), Shard(1)])
    with pytest.raises(
        ValueError, match=r"placements\[0\] is Shard\(5\), out of range for a tensor with 2 dims"
    ):
        st.redistribute(placements=[Shard(5)])
    with pytest.raises(NotImplementedError, match=r"redistribute across meshes is not supported"):
        st.redistribute(make_mesh((2,), ("other",)), [Replicate()])
    assert ledger.counts() == {}
