"""Static tests as PhysicsNeMo writes them: fixtures and the manager, no meshsim imports."""

from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist
from manager import Manager


@pytest.mark.multigpu_static
def test_the_manager_answers_for_this_rank(distributed_mesh):
    manager = Manager()
    assert manager.rank == dist.get_rank() == int(os.environ["RANK"])
    assert manager.world_size == dist.get_world_size()
    assert distributed_mesh.mesh_dim_names == ("domain",)
    assert distributed_mesh.get_local_rank() == manager.rank


@pytest.mark.multigpu_static
def test_the_plugins_configure_ran_once_on_this_rank():
    assert Manager().configured == 1


@pytest.mark.multigpu_static
def test_session_meshes_are_built_once_per_rank(distributed_mesh, distributed_mesh_2d):
    assert distributed_mesh_2d.shape == (2, dist.get_world_size() // 2)
    assert Manager().meshes_built == 2
    t = torch.ones(1)
    dist.all_reduce(t, group=distributed_mesh.get_group())
    assert t.item() == dist.get_world_size()


@pytest.mark.multigpu_static
def test_a_rank_may_skip():
    if Manager().rank == 1:
        pytest.skip("rank 1 has no data")


def test_runs_only_without_the_static_flag():
    assert not dist.is_initialized()
