"""DTensor on simulated meshes: redistribute forward and backward, 1-D and 2-D, even and uneven."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_tensor

import meshsim


def _global(rows: int, cols: int) -> torch.Tensor:
    return torch.arange(rows * cols, dtype=torch.float32).reshape(rows, cols) / 7


def _local_shard(full: torch.Tensor, dim: int) -> torch.Tensor:
    pieces = full.chunk(dist.get_world_size(), dim=dim)
    rank = dist.get_rank()
    if rank < len(pieces):
        return pieces[rank].clone()
    shape = list(full.shape)
    shape[dim] = 0
    return full.new_zeros(shape)


@pytest.mark.parametrize("rows", [8, 10, 3], ids=["even", "uneven", "empty-shards"])
def test_shard0_to_shard1_is_one_all_to_all_and_differentiates(rows: int) -> None:
    def body() -> tuple[dict[str, int], bool, bool]:
        mesh = init_device_mesh("cpu", (4,))
        full = _global(rows, 8)
        local = _local_shard(full, 0).requires_grad_()
        dt = DTensor.from_local(local, mesh, [Shard(0)], shape=full.shape, stride=full.stride())
        with meshsim.record() as ledger:
            moved = dt.redistribute(mesh, [Shard(1)])
        values_ok = torch.equal(moved.full_tensor(), full)
        (moved.to_local() * 3).sum().backward()
        return ledger.counts(), values_ok, torch.equal(local.grad, torch.full_like(local, 3.0))

    for counts, values_ok, grad_ok in meshsim.run(body, 4):
        assert counts == {"all_to_all": 1}
        assert values_ok and grad_ok


def test_cpu_path_can_be_kept_with_gpu_paths_false() -> None:
    def body() -> dict[str, int]:
        mesh = init_device_mesh("cpu", (2,))
        dt = DTensor.from_local(torch.ones(2, 4), mesh, [Shard(0)])
        with meshsim.record() as ledger:
            dt.redistribute(mesh, [Shard(1)])
        return ledger.counts()

    assert meshsim.run(body, 2, gpu_paths=False) == [{"all_gather": 1}] * 2


def test_1d_placements_forward_and_backward() -> None:
    def body() -> list[object]:
        mesh = init_device_mesh("cpu", (dist.get_world_size(),))
        full = _global(6, 4)
        results: list[object] = []
        local = _local_shard(full, 0).requires_grad_()
        dt = DTensor.from_local(local, mesh, [Shard(0)], shape=full.shape, stride=full.stride())
        with meshsim.record() as ledger:
            rep = dt.redistribute(mesh, [Replicate()])
        results.append(ledger.counts())
        results.append(torch.equal(rep.to_local(), full))
        (rep.to_local() ** 2).sum().backward()
        results.append(torch.allclose(local.grad, 2 * local.detach()))
        partial = DTensor.from_local(torch.ones(4, 4) * (dist.get_rank() + 1), mesh, [Partial()])
        with meshsim.record() as ledger:
            reduced = partial.redistribute(mesh, [Replicate()])
            scattered = partial.redistribute(mesh, [Shard(0)])
        results.append(ledger.counts())
        total = sum(range(1, dist.get_world_size() + 1))
        results.append(torch.equal(reduced.to_local(), torch.full((4, 4), float(total))))
        results.append(scattered.to_local().shape == (2, 4) and bool((scattered.to_local() == total).all()))
        with meshsim.record() as ledger:
            back = rep.redistribute(mesh, [Shard(1)])
        results.append(ledger.counts())
        results.append(torch.equal(back.full_tensor(), full))
        return results

    for result in meshsim.run(body, 2):
        assert result == [
            {"all_gather": 1},
            True,
            True,
            {"all_reduce": 1, "reduce_scatter": 1},
            True,
            True,
            {},
            True,
        ]


@pytest.mark.parametrize(
    ("src", "dst"),
    [
        ((Shard(0), Shard(1)), (Replicate(), Replicate())),
        ((Shard(0), Shard(1)), (Shard(1), Shard(0))),
        ((Replicate(), Shard(0)), (Shard(0), Replicate())),
    ],
    ids=["S0S1-RR", "S0S1-S1S0", "RS0-S0R"],
)
def test_2d_mesh_redistribute_round_trip_and_gradient(
    src: tuple[object, ...], dst: tuple[object, ...]
) -> None:
    def body() -> tuple[bool, bool]:
        mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("a", "b"))
        full = _global(8, 6)
        shard = distribute_tensor(full, mesh, list(src))  # type: ignore[arg-type]
        leaf = shard.to_local().clone().requires_grad_()
        dt = DTensor.from_local(leaf, mesh, list(src), shape=full.shape, stride=full.stride())  # type: ignore[arg-type]
        moved = dt.redistribute(mesh, list(dst))  # type: ignore[arg-type]
        back = moved.redistribute(mesh, list(src))  # type: ignore[arg-type]
        same = torch.equal(back.full_tensor(), full)
        # d/d(local) of sum(full * W) is W's matching local piece
        (moved.full_tensor() * full).sum().backward()
        return same, torch.allclose(leaf.grad, shard.to_local())

    assert meshsim.run(body, 4) == [(True, True)] * 4
