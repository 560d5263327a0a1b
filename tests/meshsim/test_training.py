"""FSDP2 and DDP on 4 simulated ranks give exactly the losses of a single-process reference."""

from __future__ import annotations

from collections.abc import Callable

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


def fsdp2_counts() -> dict[str, int]:
    """FSDP2's collectives for STEPS steps of the model above, from its structure.

    Each Linear is its own FSDP group; the root group (``fully_shard(model)``) holds
    no parameters of its own, so it issues nothing. A group gathers its parameters in
    one all_gather before its forward and, since non-root groups free them after
    forward (``reshard_after_forward=True``, the default), again before its backward;
    it reduce-scatters its gradients once per backward.
    """
    groups = sum(isinstance(layer, torch.nn.Linear) for layer in make_model())
    return {"all_gather": 2 * groups * STEPS, "reduce_scatter": groups * STEPS}


def ddp_counts() -> dict[str, int]:
    """DDP's collectives for STEPS steps of the model above.

    The whole model fits one gradient bucket (DDP's first bucket holds up to 1 MiB,
    the model's gradients are well under), so each backward is one all_reduce. After
    the first step DDP rebuilds its buckets in the order gradients became ready, and
    rank 0 broadcasts that order: the parameters' indices, then the buckets' sizes.
    """
    gradient_bytes = sum(p.numel() * p.element_size() for p in make_model().parameters())
    assert gradient_bytes < 1 << 20  # one bucket
    return {"all_reduce": STEPS, "broadcast": 2}


@pytest.mark.parametrize(
    ("program", "counts"), [(fsdp2, fsdp2_counts), (ddp, ddp_counts)], ids=["fsdp2", "ddp"]
)
def test_losses_equal_the_single_process_reference(
    program: object, counts: Callable[[], dict[str, int]]
) -> None:
    expected = reference()
    results = meshsim.run(program, WS)  # type: ignore[arg-type]
    for rank, (losses, seen) in enumerate(results):
        assert losses == [expected[step][rank] for step in range(STEPS)]
        assert seen == counts()
