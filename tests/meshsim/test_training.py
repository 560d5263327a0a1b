"""FSDP2 and DDP on 4 simulated ranks give exactly the losses of a single-process reference."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.nn.parallel import DistributedDataParallel

import meshsim

WS, STEPS = 4, 3


def make_model() -> torch.nn.Module:
    torch.manual_seed(0)  # every rank builds the same weights, from its own RNG
    return torch.nn.Sequential(
        torch.nn.Linear(8, 16),
        torch.nn.ReLU(),
        torch.nn.Linear(16, 16),
        torch.nn.ReLU(),
        torch.nn.Linear(16, 4),
    )


def batch(rank: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 * step + rank)
    return torch.randn(5, 8, generator=g), torch.randn(5, 4, generator=g)


def reference() -> list[list[float]]:
    """losses[step][rank]: each rank's loss, gradients averaged over ranks, one SGD step."""
    model = make_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    losses = []
    for step in range(STEPS):
        grads, step_losses = [], []
        for rank in range(WS):
            x, y = batch(rank, step)
            model.zero_grad()
            loss = torch.nn.functional.mse_loss(model(x), y)
            loss.backward()
            step_losses.append(loss.item())
            grads.append([p.grad.clone() for p in model.parameters()])
        for i, p in enumerate(model.parameters()):
            p.grad = torch.stack([g[i] for g in grads]).mean(0)
        opt.step()
        losses.append(step_losses)
    return losses


def train(model: torch.nn.Module) -> list[float]:
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    losses = []
    for step in range(STEPS):
        x, y = batch(dist.get_rank(), step)
        opt.zero_grad()
        loss = torch.nn.functional.mse_loss(model(x), y)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses


def fsdp2() -> tuple[list[float], dict[str, int]]:
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    model = make_model()
    for layer in model:
        if isinstance(layer, torch.nn.Linear):
            fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    with meshsim.record() as ledger:
        losses = train(model)
    return losses, ledger.counts()


def ddp() -> tuple[list[float], dict[str, int]]:
    model = DistributedDataParallel(make_model())
    with meshsim.record() as ledger:
        losses = train(model)
    return losses, ledger.counts()


@pytest.mark.parametrize(
    ("program", "counts"),
    [
        (fsdp2, {"all_gather": 18, "reduce_scatter": 9}),
        # DDP's rank 0 broadcasts its rebuilt bucket order after the first step
        (ddp, {"all_reduce": 3, "broadcast": 2}),
    ],
    ids=["fsdp2", "ddp"],
)
def test_losses_equal_the_single_process_reference(program: object, counts: dict[str, int]) -> None:
    expected = reference()
    results = meshsim.run(program, WS)  # type: ignore[arg-type]
    for rank, (losses, seen) in enumerate(results):
        assert losses == [expected[step][rank] for step in range(STEPS)]
        assert seen == counts
