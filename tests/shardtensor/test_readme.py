"""The README's and the docs' example tests, verbatim, so the guide cannot drift from what runs.

The docs include the ``# --8<--`` sections below (pymdownx.snippets); the README's one
test is copied, and checked here to be one of this file's.
"""

import re
from pathlib import Path

import pytest
import torch
from torch.distributed.tensor import Replicate, Shard

import meshsim
from shardtensor import ShardTensor


# --8<-- [start:gather]
@pytest.mark.world(1, 2, 4)  # three tests: ids world=1, world=2, world=4
def test_gather_is_one_all_gather(distributed_mesh, rank, world_size, ledger):
    local = torch.full((rank + 1, 8), float(rank))  # uneven shards
    st = ShardTensor.from_local(local, distributed_mesh, [Shard(0)])
    full = st.redistribute(placements=[Replicate()]).to_local()

    assert full.shape == (sum(range(1, world_size + 1)), 8)
    assert ledger.counts() == {"all_gather": 2}  # shape inference + the gather
    # --8<-- [end:gather]


# --8<-- [start:snapshot]
@pytest.mark.world(2, 4)
def test_reshard_collectives_are_pinned(distributed_mesh, rank, ledger_snapshot):
    local = torch.full((rank + 1, 8), float(rank))  # uneven shards
    st = ShardTensor.from_local(local, distributed_mesh, [Shard(0)])
    st.redistribute(placements=[Shard(1)])
    # --8<-- [end:snapshot]


@pytest.mark.world(4)
def test_the_operators_example(distributed_mesh, rank) -> None:
    # The README's ShardTensor section, with the values it names checked.
    mesh = distributed_mesh
    local = torch.full((rank + 1, 3), float(rank))  # rows 1, 2, 3, 4 on 4 ranks
    w, bias = torch.ones(3, 2), torch.ones(2)
    x = ShardTensor.from_local(local, mesh, [Shard(0)])
    with meshsim.record() as ledger:
        y = torch.relu(x @ w) * 2 + bias
        loss = y.mean()
    assert ledger.counts() == {}
    with meshsim.record() as ledger:
        value = loss.full_tensor()
    assert ledger.counts() == {"all_reduce": 1}
    rows = torch.cat([torch.full((r + 1, 3), float(r)) for r in range(4)])
    torch.testing.assert_close(value, (torch.relu(rows @ w) * 2 + bias).mean())


# --8<-- [start:round_trip]
GLOBAL = (1, 16, 512, 256)  # 4 ranks, each a (1, 4, 512, 256) bfloat16 shard


@pytest.mark.world(4)
@pytest.mark.parametrize("mode", ["infer", "chunk"])
@pytest.mark.mesh_cost_budget("30us")
def test_round_trip(distributed_mesh, mode):
    shape = GLOBAL if mode == "chunk" else None  # "infer" all_gathers every rank's shape
    x = torch.randn(1, 4, 512, 256, dtype=torch.bfloat16)
    st = ShardTensor.from_local(x, distributed_mesh, [Shard(1)], mode, shape)
    y = st.redistribute(placements=[Shard(2)]).to_local()
    z = ShardTensor.from_local(y, distributed_mesh, [Shard(2)], mode, shape)
    z.redistribute(placements=[Shard(1)])
    # --8<-- [end:round_trip]


def test_the_readme_shows_one_of_these_tests() -> None:
    """The README's example test is one of this file's, character for character."""
    readme = Path(__file__).resolve().parents[2] / "README.md"
    if not readme.is_file():
        pytest.skip(f"no README.md at {readme} (meshsim installed without its repository)")
    blocks = re.findall(r"```python\n(.*?)```", readme.read_text(encoding="utf-8"), re.S)
    tests = [block[block.index("@pytest.mark") :] for block in blocks if "def test_" in block]
    assert tests, "README.md shows no example test"
    source = Path(__file__).read_text(encoding="utf-8")
    for test in tests:
        assert test in source, f"README.md's example test is not in {Path(__file__).name}:\n{test}"
