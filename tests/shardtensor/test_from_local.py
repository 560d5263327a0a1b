"""ShardTensor.from_local: the infer, chunk and dict modes, their collectives, and bad inputs."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch.distributed.tensor import Partial, Replicate, Shard

import meshsim
from shardtensor import ShardTensor

from .shardtensor_cases import DTYPE_IDS, DTYPES, KINDS, global_tensor, ramp, shard


@pytest.mark.world(1, 2, 3, 4, 8)
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("kind", list(KINDS))
def test_chunk_spec_equals_infer_1d(distributed_mesh, world_size, kind, dtype) -> None:
    mesh = distributed_mesh
    full = global_tensor((KINDS[kind](world_size), 3), dtype, mesh.device_type)
    local = shard(full, mesh, [Shard(0)])
    with meshsim.record() as inferred:
        by_infer = ShardTensor.from_local(local, mesh, [Shard(0)], "infer")
    with meshsim.record() as chunked:
        by_chunk = ShardTensor.from_local(local, mesh, [Shard(0)], "chunk", global_shape=full.shape)
    assert by_chunk.spec == by_infer.spec
    assert by_chunk.shape == full.shape and by_chunk.dtype == dtype
    assert inferred.counts() == {"all_gather": 1}
    assert chunked.counts() == {}


PLACEMENTS_2D = {
    "S0,S1": [Shard(0), Shard(1)],
    "S1,S0": [Shard(1), Shard(0)],
    "S0,R": [Shard(0), Replicate()],
    "R,S1": [Replicate(), Shard(1)],
    "S1,P": [Shard(1), Partial()],
}


@pytest.mark.world(4, 8)
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("kind", ["even", "uneven", "empty"])
@pytest.mark.parametrize("name", list(PLACEMENTS_2D))
def test_chunk_spec_equals_infer_2d(distributed_mesh_2d, world_size, name, kind, dtype) -> None:
    mesh, placements = distributed_mesh_2d, PLACEMENTS_2D[name]
    shape = [3, 3, 2]
    for m, p in enumerate(placements):
        if isinstance(p, Shard):
            shape[p.dim] = KINDS[kind](mesh.size(m))
    full = global_tensor(shape, dtype, mesh.device_type)
    local = shard(full, mesh, placements)
    with meshsim.record() as inferred:
        by_infer = ShardTensor.from_local(local, mesh, placements)
    with meshsim.record() as chunked:
        by_chunk = ShardTensor.from_local(local, mesh, placements, "chunk", global_shape=shape)
    assert by_chunk.spec == by_infer.spec
    assert list(by_infer.shape) == shape
    shard_dims = sum(isinstance(p, Shard) for p in placements)
    assert inferred.counts() == {"all_gather": shard_dims}
    assert chunked.counts() == {}


@pytest.mark.world(4)
def test_default_call_is_infer(distributed_mesh, rank, ledger) -> None:
    local = torch.full((rank + 1, 2), float(rank), device=distributed_mesh.device_type)
    st = ShardTensor.from_local(local, distributed_mesh, [Shard(0)])
    explicit = ShardTensor.from_local(local, distributed_mesh, [Shard(0)], sharding_shapes="infer")
    assert st.spec == explicit.spec
    assert st.shape == (10, 2)
    assert ledger.counts() == {"all_gather": 2}
    assert ledger.project("op", "dtype") == [("all_gather", torch.int64)] * 2


@pytest.mark.world(1, 2, 3, 4)
@pytest.mark.parametrize("layout", ["ramp", "empty-middle"])
def test_infer_accepts_any_concatenable_layout(distributed_mesh, rank, world_size, layout, ledger) -> None:
    sizes = (
        ramp(world_size)
        if layout == "ramp"
        else tuple(0 if r == world_size // 2 else 2 for r in range(world_size))
    )
    mesh = distributed_mesh
    full = global_tensor((sum(sizes), 4), torch.float32, mesh.device_type)
    local = shard(full, mesh, [Shard(0)], {0: sizes})
    st = ShardTensor.from_local(local, mesh, [Shard(0)], global_shape=full.shape)
    assert ledger.counts() == {"all_gather": 1}
    assert st.shape == full.shape
    assert st.spec.sharding_shapes() == {0: tuple((s, 4) for s in sizes)}
    assert st.offsets() == (sum(sizes[:rank]),)
    assert st.offsets(0) == sum(sizes[:rank])
    assert torch.equal(st.to_local(), local)


@pytest.mark.world(1, 2, 3, 4)
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_dict_mode_needs_no_collective(distributed_mesh, rank, world_size, dtype, ledger) -> None:
    sizes = ramp(world_size)
    mesh = distributed_mesh
    local = shard(global_tensor((sum(sizes), 3), dtype, mesh.device_type), mesh, [Shard(0)], {0: sizes})
    shapes = {0: [(s, 3) for s in sizes]}
    st = ShardTensor.from_local(local, mesh, [Shard(0)], sharding_shapes=shapes)
    assert ledger.counts() == {}
    assert st.spec == ShardTensor.from_local(local, mesh, [Shard(0)]).spec


@pytest.mark.world(4)
def test_dict_mode_2d(distributed_mesh_2d, rank, ledger) -> None:
    mesh, placements = distributed_mesh_2d, [Shard(0), Shard(1)]
    rows, cols = (3, 1), (0, 2)
    row, col = divmod(rank, 2)
    local = shard(
        global_tensor((4, 2), torch.float32, mesh.device_type), mesh, placements, {0: rows, 1: cols}
    )
    shapes = {0: [(r, cols[col]) for r in rows], 1: [(rows[row], c) for c in cols]}
    st = ShardTensor.from_local(local, mesh, placements, shapes, global_shape=(4, 2))
    assert ledger.counts() == {}
    assert st.spec.sharding_shapes() == {0: tuple(shapes[0]), 1: tuple(shapes[1])}
    assert st.spec == ShardTensor.from_local(local, mesh, placements).spec


@pytest.mark.world(1, 4)
def test_chunk_without_shard_placements_checks_the_global_shape(distributed_mesh, rank, ledger) -> None:
    local = torch.zeros(4, 3, device=distributed_mesh.device_type)
    st = ShardTensor.from_local(local, distributed_mesh, [Partial()], "chunk", global_shape=(4, 3))
    assert st.shape == (4, 3) and st.spec.sharding_shapes() == {}
    with pytest.raises(
        ValueError,
        match=rf"Rank {rank} expected local shape \(99, 3\) does not match tensor's local shape \(4, 3\)",
    ):
        ShardTensor.from_local(local, distributed_mesh, [Replicate()], "chunk", global_shape=(99, 3))
    assert ledger.counts() == {}


@pytest.mark.world(4)
def test_chunk_mismatch_names_the_rank_and_both_shapes(distributed_mesh, rank, ledger) -> None:
    # 10 rows over 4 ranks chunk as 3,3,3,1; rank 3 pretends to hold 2.
    local = torch.zeros((3, 3, 3, 2)[rank], 5, device=distributed_mesh.device_type)
    if rank == 3:
        with pytest.raises(
            ValueError,
            match=r"^Rank 3 expected local shape \(1, 5\) does not match tensor's local shape \(2, 5\)",
        ):
            ShardTensor.from_local(local, distributed_mesh, [Shard(0)], "chunk", global_shape=(10, 5))
    else:
        ShardTensor.from_local(local, distributed_mesh, [Shard(0)], "chunk", global_shape=(10, 5))
    assert ledger.counts() == {}


@pytest.mark.world(2)
def test_infer_with_a_disagreeing_global_shape_raises(distributed_mesh, ledger) -> None:
    local = torch.zeros(3, 2, device=distributed_mesh.device_type)
    with pytest.raises(
        ValueError, match=r"global_shape \(7, 2\) does not match the global shape \(6, 2\) inferred"
    ):
        ShardTensor.from_local(local, distributed_mesh, [Shard(0)], global_shape=(7, 2))
    assert ledger.counts() == {"all_gather": 1}


@pytest.mark.world(2)
def test_infer_rejects_shapes_that_do_not_concatenate(distributed_mesh, rank) -> None:
    local = torch.zeros(3, 2 + rank, device=distributed_mesh.device_type)
    with pytest.raises(ValueError, match=r"differs from the local shape .* outside the sharded tensor dim 0"):
        ShardTensor.from_local(local, distributed_mesh, [Shard(0)])


@pytest.mark.world(4)
def test_infer_checks_after_every_gather_so_no_rank_is_left_waiting(
    distributed_mesh_2d, rank, ledger
) -> None:
    # Rank 0 holds 3 rows where its mesh-dim-1 neighbour (rank 1) holds 2: only the
    # second gather (over mesh dim 1) shows it, to ranks 0 and 1.
    local = torch.zeros(3 if rank == 0 else 2, 2, device=distributed_mesh_2d.device_type)
    if rank in (0, 1):
        with pytest.raises(
            ValueError, match=r"of coordinate \d along mesh dim 1 differs from the local shape"
        ):
            ShardTensor.from_local(local, distributed_mesh_2d, [Shard(0), Shard(1)])
    else:
        ShardTensor.from_local(local, distributed_mesh_2d, [Shard(0), Shard(1)])
    assert ledger.counts() == {"all_gather": 2}


@pytest.mark.world(2)
def test_from_local_shares_storage_with_the_input(distributed_mesh) -> None:
    local = torch.zeros(2, 3, device=distributed_mesh.device_type)
    st = ShardTensor.from_local(local, distributed_mesh, [Shard(0)], "chunk", global_shape=(4, 3))
    local.add_(1)
    assert torch.equal(st.to_local(), local)


@pytest.mark.world(2)
def test_the_mesh_defaults_to_the_active_one(distributed_mesh) -> None:
    local = torch.zeros(2, 3, device=distributed_mesh.device_type)
    with distributed_mesh:
        st = ShardTensor.from_local(
            local, placements=[Shard(0)], sharding_shapes="chunk", global_shape=(4, 3)
        )
    assert st.device_mesh == distributed_mesh
    with pytest.raises(ValueError, match=r"device_mesh is None and no DeviceMesh is active"):
        ShardTensor.from_local(local, placements=[Shard(0)])


# -- bad inputs: (id, call arguments after the local tensor, error, message) -----------------------------

BAD_INPUTS = [
    (
        "mode-unknown",
        {"sharding_shapes": "even"},
        ValueError,
        r"^If sharding_shapes is a string, it must be one of: 'chunk', 'infer'$",
    ),
    (
        "chunk-without-global-shape",
        {"sharding_shapes": "chunk"},
        ValueError,
        r"^If sharding_shapes is 'chunk', global_shape must be provided$",
    ),
    (
        "mode-wrong-type",
        {"sharding_shapes": 3},
        TypeError,
        r"sharding_shapes must be 'infer', 'chunk' or a dict .* got 3 of type int",
    ),
    (
        "too-many-placements",
        {"placements": [Shard(0), Replicate()]},
        ValueError,
        r"^Mesh dimension must match placements length",
    ),
    ("no-placements", {"placements": []}, ValueError, r"^Mesh dimension must match placements length"),
    (
        "placement-not-placement",
        {"placements": ["S0"]},
        TypeError,
        r"placements\[0\] is 'S0' of type str; expected a Placement",
    ),
    (
        "placements-not-a-list",
        {"placements": Shard(0)},
        TypeError,
        r"placements must be a list or tuple of Placement objects .* got Shard\(dim=0\)",
    ),
    (
        "shard-dim-out-of-range",
        {"placements": [Shard(2)]},
        ValueError,
        r"placements\[0\] is Shard\(2\), out of range for a tensor with 2 dims \(valid dims: -2 to 1\)",
    ),
    (
        "shard-dim-negative-out-of-range",
        {"placements": [Shard(-3)]},
        ValueError,
        r"placements\[0\] is Shard\(-3\), out of range",
    ),
    (
        "partial-max",
        {"placements": [Partial("max")]},
        ValueError,
        r"placements\[0\] is Partial\(.*max.*\): only Partial\('sum'\) is supported",
    ),
    (
        "global-shape-wrong-rank",
        {"sharding_shapes": "chunk", "global_shape": (4,)},
        ValueError,
        r"global_shape \(4,\) has 1 dims, but the local tensor has 2",
    ),
    (
        "global-shape-negative",
        {"sharding_shapes": "chunk", "global_shape": (-4, 3)},
        ValueError,
        r"global_shape \(-4, 3\) has a negative size",
    ),
    (
        "global-shape-not-ints",
        {"sharding_shapes": "chunk", "global_shape": (4.0, 3)},
        TypeError,
        r"global_shape must be a tuple of ints \(or torch.Size\), got \(4.0, 3\)",
    ),
    (
        "global-shape-a-string",
        {"sharding_shapes": "chunk", "global_shape": "43"},
        TypeError,
        r"global_shape must be a tuple of ints .* got '43'",
    ),
    ("dict-empty", {"sharding_shapes": {}}, ValueError, r"^sharding_shapes as a dict cannot be empty$"),
    (
        "dict-missing-key",
        {"placements": [Shard(0)], "sharding_shapes": {1: [(2, 3), (2, 3)]}},
        ValueError,
        r"sharding_shapes has keys \[1\] but the Shard placements are on mesh dims \[0\] "
        r"\(missing: \[0\], extra: \[1\]\)",
    ),
    (
        "dict-wrong-length",
        {"sharding_shapes": {0: [(2, 3)]}},
        ValueError,
        r"sharding_shapes\[0\] has 1 shapes, but mesh dim 0 has 2 coordinates",
    ),
    (
        "dict-not-shapes",
        {"sharding_shapes": {0: [2, 2]}},
        TypeError,
        r"sharding_shapes\[0\] must be a sequence of shapes .* got \[2, 2\]",
    ),
    (
        "dict-negative",
        {"sharding_shapes": {0: [(2, 3), (-2, 3)]}},
        ValueError,
        r"sharding_shapes\[0\] has a negative size",
    ),
    (
        "dict-wrong-local",
        {"sharding_shapes": {0: [(1, 3), (1, 3)]}},
        ValueError,
        r"Rank \d: sharding_shapes\[0\]\[\d\] is \(1, 3\), but this rank's local tensor has shape \(2, 3\)",
    ),
    (
        "dict-not-a-cross-section",
        {"sharding_shapes": {0: [(2, 3), (2, 4)]}},
        ValueError,
        r"given shape \(2, 4\) of coordinate \d along mesh dim 0 differs from the local shape \(2, 3\)",
    ),
    (
        "dict-disagrees-with-global-shape",
        {"sharding_shapes": {0: [(2, 3), (2, 3)]}, "global_shape": (5, 3)},
        ValueError,
        r"global_shape \(5, 3\) does not match the global shape \(4, 3\) implied by sharding_shapes",
    ),
    (
        "mesh-not-a-mesh",
        {"device_mesh": "cpu"},
        TypeError,
        r"device_mesh must be a DeviceMesh, got 'cpu' of type str",
    ),
]


@pytest.mark.world(2)
@pytest.mark.parametrize(
    ("call", "error", "message"), [c[1:] for c in BAD_INPUTS], ids=[c[0] for c in BAD_INPUTS]
)
def test_bad_input_raises_before_any_collective(distributed_mesh, call, error, message, ledger) -> None:
    local = torch.zeros(2, 3, device=distributed_mesh.device_type)
    kwargs = {"device_mesh": distributed_mesh, "placements": [Shard(0)], **call}
    if kwargs.get("sharding_shapes") == {0: [(2, 3), (2, 4)]} and dist.get_rank() == 1:
        kwargs["sharding_shapes"] = {0: [(2, 4), (2, 3)]}  # each rank's own entry is right
    with pytest.raises(error, match=message):
        ShardTensor.from_local(local, **kwargs)
    assert ledger.counts() == {}


UPSTREAM_MESSAGES = [
    ({"sharding_shapes": "even"}, "If sharding_shapes is a string, it must be one of: 'chunk', 'infer'"),
    ({"sharding_shapes": "chunk"}, "If sharding_shapes is 'chunk', global_shape must be provided"),
    ({"placements": [Shard(0), Shard(1)]}, "Mesh dimension must match placements length"),
]


@pytest.mark.world(2)
@pytest.mark.parametrize(("call", "message"), UPSTREAM_MESSAGES, ids=["mode", "chunk", "placements"])
def test_physicsnemo_messages_are_kept_exactly(distributed_mesh, call, message) -> None:
    local = torch.zeros(2, 3, device=distributed_mesh.device_type)
    kwargs = {"device_mesh": distributed_mesh, "placements": [Shard(0)], **call}
    with pytest.raises(ValueError) as caught:
        ShardTensor.from_local(local, **kwargs)
    assert str(caught.value) == message


@pytest.mark.world(2)
@pytest.mark.parametrize("local", [None, [1.0, 2.0]], ids=["none", "list"])
def test_a_non_tensor_is_refused(distributed_mesh, local) -> None:
    with pytest.raises(
        TypeError, match=rf"local_tensor must be a plain torch.Tensor .* got {type(local).__name__}"
    ):
        ShardTensor.from_local(local, distributed_mesh, [Shard(0)])


@pytest.mark.world(2)
def test_a_shard_tensor_is_refused(distributed_mesh) -> None:
    st = ShardTensor.from_local(
        torch.zeros(2, device=distributed_mesh.device_type), distributed_mesh, [Shard(0)], "chunk", (4,)
    )
    with pytest.raises(TypeError, match=r"local_tensor must be a plain torch.Tensor .* got ShardTensor"):
        ShardTensor.from_local(st, distributed_mesh, [Shard(0)])


@pytest.mark.world(4)
def test_one_tensor_dim_over_two_mesh_dims_is_refused(distributed_mesh_2d) -> None:
    local = torch.zeros(2, 3, device=distributed_mesh_2d.device_type)
    with pytest.raises(ValueError, match=r"tensor dim 0 is sharded by mesh dims 0 and 1 .* not supported"):
        ShardTensor.from_local(local, distributed_mesh_2d, [Shard(0), Shard(-2)])
