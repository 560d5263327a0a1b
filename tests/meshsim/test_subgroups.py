"""Sub-groups a program makes for another backend (gloo, nccl) are served by meshsim's in a simulated world.

A real ``ProcessGroupGloo`` made inside a serialized world cannot finish its rendezvous
(ranks run one at a time) and would wait out its timeout: meshsim's backend serves the
group instead, records its calls, and ``dist.get_backend`` answers the name asked for.
"""

from __future__ import annotations

import inspect

import pytest
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh

import meshsim


def _sum_on(backend: str) -> tuple[list[float], str, dict[str, int]]:
    group = dist.new_group([0, 1], backend=backend)
    with meshsim.record() as ledger:
        t = torch.full((2,), float(dist.get_rank() + 1))
        dist.all_reduce(t, group=group)
    return t.tolist(), str(dist.get_backend(group)), ledger.counts()


@pytest.mark.parametrize(
    ("backend", "cuda"),
    [("gloo", None), ("gloo", "cpu"), ("nccl", "cpu"), ("cpu:gloo,cuda:nccl", "cpu")],
    ids=["gloo", "gloo-cuda-emulated", "nccl-cuda-emulated", "per-device"],
)
def test_a_subgroup_of_another_backend_is_served_and_keeps_its_name(backend: str, cuda: str | None) -> None:
    results = meshsim.run(_sum_on, 2, args=(backend,), cuda=cuda, timeout=10)
    assert results == [([3.0, 3.0], backend, {"all_reduce": 1})] * 2


def test_nccl_without_cuda_fails_as_a_real_process_would() -> None:
    with pytest.raises(meshsim.RankError, match=r"new_group\(backend='nccl'\) in rank 0: NCCL needs CUDA"):
        meshsim.run(_sum_on, 2, args=("nccl",), timeout=10)


def test_gloo_thread_ranks_keep_torchs_groups() -> None:
    assert (
        meshsim.run(_sum_on, 2, args=("gloo",), backend="gloo", timeout=10)
        == [([3.0, 3.0], "gloo", {"all_reduce": 1})] * 2
    )


def test_new_subgroups_and_a_mesh_with_a_backend_override() -> None:
    def body() -> tuple[str, str, list[float]]:
        sub, _ = dist.new_subgroups(group_size=2, backend="gloo")
        kwargs = {}
        if "backend_override" in inspect.signature(init_device_mesh).parameters:  # torch 2.8 and later
            kwargs["backend_override"] = {"tp": "gloo"}
        mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"), **kwargs)
        t = torch.ones(1)
        dist.all_reduce(t, group=mesh.get_group("tp"))
        dist.all_reduce(t, group=sub)
        return str(dist.get_backend(sub)), str(dist.get_backend(mesh.get_group("tp"))), t.tolist()

    results = meshsim.run(body, 4, timeout=10)
    assert [r[0] for r in results] == ["gloo"] * 4
    overridden = "backend_override" in inspect.signature(init_device_mesh).parameters
    assert [r[1] for r in results] == ["gloo" if overridden else "meshsim"] * 4
    assert [r[2] for r in results] == [[4.0]] * 4


def _own_subgroup() -> None:
    rank = dist.get_rank()
    dist.new_group([r for r in range(dist.get_world_size()) if r % 2 == rank % 2])


def _shifted_subgroup() -> None:
    dist.new_group([0, 1] if dist.get_rank() == 0 else [0, 1, 2, 3])


def test_each_rank_passing_its_own_subgroup_is_named_as_the_cause() -> None:
    # Megatron-core 0.19's test_expert_all_gather_group: new_group(ranks=<this rank's own expert-dp ranks>)
    with pytest.raises(meshsim.RankError) as info:
        meshsim.run(_own_subgroup, 4, timeout=10)
    message = str(info.value)
    assert "every rank must call new_group() (and build device meshes) with the same ranks" in message
    assert "the code may pass each rank its own subgroup's ranks" in message
    assert "dist.new_subgroups_by_enumeration" in message
    assert "Otherwise: Where every rank runs the same code" in message


def test_overlapping_lists_keep_the_shared_state_hint_only() -> None:
    with pytest.raises(meshsim.RankError) as info:
        meshsim.run(_shifted_subgroup, 4, timeout=10)
    message = str(info.value)
    assert "declare its module per rank with meshsim.per_rank_module" in message
    assert "its own subgroup's ranks" not in message
