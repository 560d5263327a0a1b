"""The README's and the docs' example tests, verbatim, so the guide cannot drift from what runs.

Every example test in README.md and docs/*.md is one of this file's, character for
character: the last test here checks it.
"""

import re
from pathlib import Path

import pytest
import torch
from torch.distributed.tensor import Replicate, Shard

import meshsim
from shardtensor import ShardTensor


@pytest.mark.world(1, 2, 4)  # three tests: ids world1, world2, world4
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


@pytest.mark.world(4)
def test_reshard(distributed_mesh, rank):
    torch.manual_seed(rank)  # each rank its own values, as real shards have
    local = torch.randn(2, 8)  # an even layout: every rank's shard is 2 x 8
    st = ShardTensor.from_local(local, distributed_mesh, [Shard(0)])  # sharding_shapes="infer"
    st.redistribute(placements=[Shard(1)])


def test_the_guide_shows_these_tests_verbatim() -> None:
    """Every example test in README.md and docs/*.md is one of this file's, character for character."""
    root = Path(__file__).resolve().parents[2]
    guide = [root / "README.md", *sorted((root / "docs").glob("*.md"))]
    if not guide[0].is_file():
        pytest.skip(f"no README.md in {root} (meshsim installed without its repository)")
    source = Path(__file__).read_text(encoding="utf-8")
    shown = 0
    for page in guide:
        for block in re.findall(r"```python\n(.*?)```", page.read_text(encoding="utf-8"), re.S):
            start = re.search(r"^(@pytest\.mark|def test_)", block, re.M)
            if start is None:
                continue  # not a test: a snippet of API use
            shown += 1
            test = block[start.start() :]
            assert test in source, (
                f"{page.relative_to(root)} shows a test that is not in {Path(__file__).name}:\n{test}"
            )
    assert shown, "README.md and docs/ show no example test"
