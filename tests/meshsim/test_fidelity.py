"""Simulated ranks behave as real process groups do where tools and tests can tell (issue 15, D1-D6).

Each test runs one program on simulated ranks and asserts what gloo thread ranks
(or, for process-wide registrations, a process that never ran a world) give.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest
import torch
import torch.distributed as dist

import meshsim


def _on_both(fn: object, world_size: int) -> tuple[list[object], list[object]]:
    return meshsim.run(fn, world_size), meshsim.run(fn, world_size, backend="gloo")  # type: ignore[arg-type]


# -- D2: in-place collectives leave version counters alone, as gloo's C++ writes do ------


def _broadcast_into_a_viewed_leaf() -> tuple[int, list[float]]:
    x = torch.arange(12.0).reshape(12, 1).repeat(1, 3).requires_grad_()
    mine = torch.chunk(x, 4)[dist.get_rank()]
    dist.broadcast(x.detach(), src=0)
    y = (mine + 0).sum()  # autograd's in-place check on the view of x
    y.backward()
    assert x.grad is not None
    return x._version, [float(y.detach())]


def _every_write_leaves_versions() -> list[int]:
    ws, rank = dist.get_world_size(), dist.get_rank()
    t = torch.ones(4)
    out = torch.zeros(4 * ws)
    outs = [torch.zeros(4) for _ in range(ws)]
    dist.all_reduce(t)
    dist.all_gather_into_tensor(out, t)
    dist.all_gather(outs, t)
    # Not reduce_scatter_tensor: gloo finishes it with an ATen copy_ into the output,
    # which bumps its counter; NCCL writes it in C++ as every other output, and so
    # does meshsim (ledgers and semantics follow the GPU path).
    dist.all_to_all_single(out, out.clone())
    if rank == 0:
        dist.send(t, 1)
    elif rank == 1:
        dist.recv(t, 0)
    return [t._version, out._version, *(o._version for o in outs)]


def test_in_place_collectives_do_not_bump_version_counters() -> None:
    sim, gloo = _on_both(_broadcast_into_a_viewed_leaf, 4)
    assert sim == gloo
    sim, gloo = _on_both(_every_write_leaves_versions, 2)
    assert sim == gloo == [[0] * 4] * 2


# -- D6: a world's end removes only what meshsim registered -----------------------------


_REGISTERED_INSIDE = """
import torch, torch.distributed as dist
{world}
import torch.testing._internal.distributed.fake_pg
from torch.testing._internal.distributed.fake_pg import FakeStore
dist.init_process_group("fake", rank=0, world_size=4, store=FakeStore())
print(dist.get_backend(), dist.get_world_size(), sorted(dist.Backend.backend_list))
"""

_A_WORLD = """
import meshsim
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import distribute_tensor, Shard

def body():
    distribute_tensor(torch.ones(8), init_device_mesh("cpu", (4,)), [Shard(0)])

meshsim.run(body, 4)
"""


def _python(code: str) -> str:
    done = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr
    return done.stdout.strip()


def test_backends_registered_during_a_world_survive_it() -> None:
    # DTensor's first use imports torch's fake process group, which registers "fake";
    # the module stays imported and never registers it again.
    after_a_world = _python(_REGISTERED_INSIDE.format(world=_A_WORLD))
    never_a_world = _python(_REGISTERED_INSIDE.format(world=""))
    assert after_a_world == never_a_world
    assert after_a_world.startswith("fake 4")


@pytest.mark.parametrize("backend", ["sim", "gloo"])
def test_the_meshsim_backend_is_gone_after_a_world(backend: str) -> None:
    meshsim.run(lambda: None, 2, backend=backend)
    assert "meshsim" not in dist.Backend.backend_list
    assert "meshsim" not in dist.Backend.default_device_backend_map.values()
