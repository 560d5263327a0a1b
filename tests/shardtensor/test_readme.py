"""The README's example tests, verbatim, so the guide cannot drift from what runs."""

import pytest
import torch
from torch.distributed.tensor import Replicate, Shard

from shardtensor import ShardTensor


@pytest.mark.world(1, 2, 4)  # three tests: ids world=1, world=2, world=4
def test_gather_is_one_all_gather(distributed_mesh, rank, world_size, ledger):
    local = torch.full((rank + 1, 8), float(rank))  # uneven shards
    st = ShardTensor.from_local(local, distributed_mesh, [Shard(0)])
    full = st.redistribute(placements=[Replicate()]).to_local()

    assert full.shape == (sum(range(1, world_size + 1)), 8)
    assert ledger.counts() == {"all_gather": 2}  # shape inference + the gather


@pytest.mark.world(2, 4)
def test_reshard_collectives_are_pinned(distributed_mesh, rank, ledger_snapshot):
    local = torch.full((rank + 1, 8), float(rank))  # uneven shards
    st = ShardTensor.from_local(local, distributed_mesh, [Shard(0)])
    st.redistribute(placements=[Shard(1)])
