"""Unmarked tests, written for ``torchrun --nproc-per-node=N -m pytest``: every process runs each one."""

from __future__ import annotations

import os

import parallel_state as ps
import pytest
import torch
import torch.distributed as dist

from tests.helpers import Utils

rank = int(os.environ["LOCAL_RANK"])  # this process's rank, read once, at import


def test_each_process_imported_the_tree_itself(session_rank: int) -> None:
    assert rank == Utils.rank == dist.get_rank() == session_rank
    assert Utils.world_size == dist.get_world_size()


@pytest.mark.parametrize("tp", [1, 2])
def test_tensor_parallel_all_reduce(tp: int) -> None:
    Utils.initialize_model_parallel(tp)
    group = ps.get_tensor_model_parallel_group()
    t = torch.tensor([float(rank)])
    dist.all_reduce(t, group=group)
    first = rank - rank % tp
    assert t.item() == sum(range(first, first + tp))
    assert ps.get_tensor_model_parallel_rank() == rank % tp
    Utils.destroy_model_parallel()


def test_the_gloo_side_group_serves_cpu_tensors() -> None:
    Utils.initialize_model_parallel(2)
    gloo = ps.get_tensor_model_parallel_group(gloo=True)
    assert dist.get_backend(gloo) == "gloo"
    gathered = [torch.zeros(1) for _ in range(2)]
    dist.all_gather(gathered, torch.tensor([float(rank)]), group=gloo)
    first = rank - rank % 2
    assert [g.item() for g in gathered] == [float(first), float(first + 1)]
    Utils.destroy_model_parallel()


def test_data_parallel_groups_cross_the_tensor_parallel_ones() -> None:
    Utils.initialize_model_parallel(2)
    t = torch.ones(1)
    dist.all_reduce(t, group=ps.get_data_parallel_group())
    assert t.item() == Utils.world_size // 2
    Utils.destroy_model_parallel()


class TestWithSetUpMethods:
    """pytest's xunit set-up (``setup_method``, as Megatron's test classes write it) runs in every process."""

    def setup_method(self, method: object) -> None:
        Utils.initialize_model_parallel(2)
        if torch.cuda.is_available():  # each process's own GPU: its local rank
            torch.cuda.set_device(rank % torch.cuda.device_count())

    def teardown_method(self, method: object) -> None:
        Utils.destroy_model_parallel()

    def test_the_set_up_made_this_ranks_groups(self) -> None:
        t = torch.ones(1, device="cuda" if torch.cuda.is_available() else "cpu")
        dist.all_reduce(t, group=ps.get_tensor_model_parallel_group())
        assert t.item() == 2
        if torch.cuda.is_available():
            assert t.device == torch.device("cuda", rank % torch.cuda.device_count())
