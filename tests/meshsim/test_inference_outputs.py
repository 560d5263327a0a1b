"""Collective outputs that are inference tensors are written as gloo writes them (issue 24, item 1).

Tensors made under ``torch.inference_mode()`` have no autograd version counter, and
torch refuses an in-place update of one outside the mode; gloo writes outputs in C++
and never asks. Each program runs on simulated ranks and on gloo thread ranks, and
the two must give the same values.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Shard, distribute_tensor

import meshsim

pytestmark = pytest.mark.filterwarnings("ignore::FutureWarning", "ignore::UserWarning")


def _broadcast() -> tuple[list[float], bool]:
    with torch.inference_mode():
        t = torch.full((4,), float(dist.get_rank()))
        dist.broadcast(t, src=0)
    return t.tolist(), t.is_inference()


def _all_gather_into_an_empty() -> list[float]:
    with torch.inference_mode():
        out = torch.empty(4)
        dist.all_gather_into_tensor(out, torch.full((2,), float(dist.get_rank())))
    return out.tolist()


def _distribute_tensor() -> list[float]:
    mesh = init_device_mesh("cpu", (2,))
    with torch.inference_mode():
        d = distribute_tensor(torch.arange(8.0), mesh, [Shard(0)])
    return d.to_local().tolist()


def _every_kind() -> dict[str, Any]:
    rank = dist.get_rank()
    got: dict[str, Any] = {}
    with torch.inference_mode():
        t = torch.full((4,), float(rank + 1))
        dist.all_reduce(t)
        got["all_reduce"] = t.tolist()
        out = torch.empty(2)
        dist.reduce_scatter_tensor(out, torch.arange(4.0) + rank)
        got["reduce_scatter"] = out.tolist()
        out = torch.empty(4)
        dist.all_to_all_single(out, torch.arange(4.0) + 10 * rank)
        got["all_to_all"] = out.tolist()
        outs = [torch.empty(2) for _ in range(2)]
        dist.all_gather(outs, torch.full((2,), float(rank)))
        got["all_gather"] = [o.tolist() for o in outs]
        got["functional"] = funcol.all_gather_tensor(torch.full((2,), float(rank)), 0, [0, 1]).tolist()
        if rank == 0:
            dist.send(torch.arange(3.0), 1)
        else:
            received = torch.empty(3)
            dist.recv(received, 0)
            got["recv"] = received.tolist()
    return got


def _one_rank_in_inference_mode() -> tuple[list[float], bool]:
    # the rank that carries out the call on sim is not the one whose output it writes
    if dist.get_rank() == 0:
        with torch.inference_mode():
            t = torch.full((2,), 1.0)
    else:
        t = torch.full((2,), 2.0)
    dist.all_reduce(t)
    dist.broadcast(t, src=1)
    return t.tolist(), t.is_inference()


PROGRAMS: dict[str, tuple[Callable[[], Any], list[Any]]] = {
    "broadcast": (_broadcast, [([0.0] * 4, True)] * 2),
    "all_gather_into_empty": (_all_gather_into_an_empty, [[0.0, 0.0, 1.0, 1.0]] * 2),
    "distribute_tensor": (_distribute_tensor, [[0.0, 1.0, 2.0, 3.0], [4.0, 5.0, 6.0, 7.0]]),
    "one_rank_in_inference_mode": (_one_rank_in_inference_mode, [([3.0, 3.0], True), ([3.0, 3.0], False)]),
}


@pytest.mark.parametrize("backend", ["sim", "gloo"])
@pytest.mark.parametrize("name", list(PROGRAMS))
def test_a_collective_writes_an_inference_output(name: str, backend: str) -> None:
    program, expected = PROGRAMS[name]
    assert meshsim.run(program, 2, backend=backend) == expected


def test_every_kind_of_output_is_written_as_on_gloo() -> None:
    sim = meshsim.run(_every_kind, 2)
    assert sim == meshsim.run(_every_kind, 2, backend="gloo")
    assert sim[1]["recv"] == [0.0, 1.0, 2.0]
    assert sim[0]["all_to_all"] == [0.0, 1.0, 10.0, 11.0]
