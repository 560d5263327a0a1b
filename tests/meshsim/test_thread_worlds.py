"""Pins meshsim's per-thread c10d worlds against the real torch calls they replace.

If a torch release changes what ``init_process_group`` records, these tests fail
first, pointing at meshsim/_thread_worlds.py.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d

import meshsim
from meshsim._sim.backend import BACKEND_NAME


def _c10d_state() -> dict[str, Any]:
    world = c10d._world
    pg = world.default_pg
    return {
        "default is WORLD": pg is dist.group.WORLD,
        "rank/size": (dist.get_rank(), dist.get_world_size()),
        "backend": dist.get_backend(),
        "backend config": world.pg_backend_config[pg],
        "name": world.pg_names[pg],
        "group_name": pg.group_name,
        "group ranks": world.pg_group_ranks[pg],
        "tags": {tag: [p is pg for p in pgs] for tag, pgs in world.tags_to_pg.items()},
        "tag": world.pg_to_tag[pg],
        "group count": world.group_count,
        "registry": torch._C._distributed_c10d._resolve_process_group(world.pg_names[pg]) is pg,
        "store type": type(world.pg_map[pg][1]).__name__,
        "process group ranks": dist.get_process_group_ranks(pg),
    }


def test_fast_default_group_matches_init_process_group() -> None:
    def body() -> tuple[dict[str, Any], dict[str, Any]]:
        fast = _c10d_state()
        pg = dist.group.WORLD
        dist.destroy_process_group()
        # the real call, through the backend meshsim registered for the world
        dist.init_process_group(BACKEND_NAME, rank=pg.rank(), world_size=pg.size(), store=dist.HashStore())
        return fast, _c10d_state()

    for fast, real in meshsim.run(body, 3):
        assert fast == real


def test_new_group_after_the_fast_default_group() -> None:
    def body() -> tuple[str, list[int]]:
        group = dist.new_group([0, 2])
        if dist.get_rank() in (0, 2):
            return group.group_name, dist.get_process_group_ranks(group)
        return "", []

    assert meshsim.run(body, 3) == [("1", [0, 2]), ("", []), ("1", [0, 2])]
