"""meshsim's wasted-collective findings on shardtensor's own code paths (sim backend).

The cases PhysicsNeMo found by profiling on GPUs (PRs #1791 and #1779): ``from_local``'s
"infer" pays an all_gather of shapes every rank could derive itself when the layout is even,
and the shape-negotiation all_to_all that upstream had before #1779 sends every rank the
same shapes. "chunk" with ``global_shape`` issues nothing at all.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Shard

import meshsim
from shardtensor import ShardTensor
from shardtensor._redistribute import _negotiate_shapes

# these tests issue wasted collectives on purpose
pytestmark = pytest.mark.allow_redundant()

WS = 4
LOCAL = (1, 4, 8, 6)  # a 4-d shard, as in bench_shardtensor.py: shapes are 4 int64 = 32 bytes


def _calls(body, *args):
    """Every rank's ledger entries as (api, dtype, redundant) while ``body`` runs."""

    def rank(*a):
        mesh = init_device_mesh("cpu", (WS,))
        with meshsim.record() as ledger:
            body(mesh, *a)
        return [(c.api, c.dtype, c.redundant) for c in ledger]

    per_rank = meshsim.run(rank, WS, args=args, backend="sim")
    assert all(calls == per_rank[0] for calls in per_rank), per_rank
    return per_rank[0]


def _local(rows: int = LOCAL[1]) -> torch.Tensor:
    shape = (LOCAL[0], rows, *LOCAL[2:])
    return torch.full(shape, float(dist.get_rank()))  # different data on every rank


def test_infer_on_an_even_layout_is_flagged_with_the_bytes_every_rank_could_derive() -> None:
    def body(mesh):
        ShardTensor.from_local(_local(), mesh, [Shard(1)])

    assert _calls(body) == [
        (
            "all_gather_into_tensor",
            torch.int64,
            "every rank contributed the same 32 bytes: each rank could build the result from its own input",
        )
    ]


def test_infer_on_an_uneven_layout_is_not_flagged() -> None:
    def body(mesh):
        ShardTensor.from_local(_local(rows=dist.get_rank() + 1), mesh, [Shard(1)])

    assert _calls(body) == [("all_gather_into_tensor", torch.int64, None)]


def test_chunk_with_a_global_shape_issues_nothing() -> None:
    def body(mesh):
        shape = (LOCAL[0], LOCAL[1] * WS, *LOCAL[2:])
        ShardTensor.from_local(_local(), mesh, [Shard(1)], "chunk", global_shape=shape)

    assert _calls(body) == []


def test_the_negotiated_shape_all_to_all_is_flagged_and_the_data_all_to_all_is_not() -> None:
    def body(mesh):
        shape = (LOCAL[0], LOCAL[1] * WS, *LOCAL[2:])
        st = ShardTensor.from_local(_local(), mesh, [Shard(1)], "chunk", global_shape=shape)
        with _negotiate_shapes():
            st.redistribute(placements=[Shard(2)])

    assert _calls(body) == [
        (
            "all_to_all_single",
            torch.int64,
            "every rank contributed the same 128 bytes: each rank could build the result from its own input",
        ),
        ("all_to_all_single", torch.float32, None),
    ]
