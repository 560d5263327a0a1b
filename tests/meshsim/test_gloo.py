"""backend="gloo": real ProcessGroupGloo ranks in threads, with the same ledger as the simulator."""

from __future__ import annotations

import gc
import os
import sys

import pytest
import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Shard

import meshsim


def program() -> list[tuple[object, ...]]:
    """A mix of plain, functional, object, p2p, sub-group and DTensor collectives."""
    rank, ws = dist.get_rank(), dist.get_world_size()
    with meshsim.record() as ledger:
        t = torch.ones(4) * rank
        dist.all_reduce(t)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        dist.all_gather_into_tensor(torch.zeros(4 * ws), t)
        dist.all_gather([torch.zeros(4) for _ in range(ws)], t)
        dist.broadcast(t, src=1)
        dist.reduce(t, dst=0)
        dist.reduce_scatter_tensor(torch.zeros(4), torch.ones(4 * ws))
        dist.all_to_all_single(torch.zeros(4 * ws), torch.ones(4 * ws))
        dist.barrier()
        pair = dist.new_group([0, 1])
        if rank in (0, 1):
            dist.all_reduce(t, group=pair)
        if rank == 0:
            dist.send(t, 1)
        if rank == 1:
            dist.recv(t, 0)
        funcol.all_gather_tensor(t, 0, dist.group.WORLD).wait()
        funcol.all_reduce(t, "sum", dist.group.WORLD).wait()
        dist.all_gather_object([None] * ws, rank)
        mesh = init_device_mesh("cpu", (ws,))
        dt = DTensor.from_local(torch.ones(2, 8), mesh, [Shard(0)])
        dt.redistribute(mesh, [Shard(1)]).full_tensor()
    return [
        (c.op, c.api, c.group, c.dtype, c.bytes_in, c.bytes_out, c.reduce_op, c.seq, c.peer, c.site)
        for c in ledger.calls
    ]


def test_sim_and_gloo_ledgers_are_identical() -> None:
    sim = meshsim.run(program, 4)
    gloo = meshsim.run(program, 4, backend="gloo")
    assert len(sim[0]) == 17 and len(sim[2]) == 15
    assert sim == gloo


def test_gloo_results_match_the_simulator() -> None:
    def body() -> list[float]:
        x = torch.arange(4.0) + dist.get_rank()
        dist.all_reduce(x)
        out = torch.zeros(12)
        dist.all_gather_into_tensor(out, x[:4].clone()[:4].reshape(4))
        return x.tolist() + out.tolist()

    assert meshsim.run(body, 3, backend="gloo") == meshsim.run(body, 3)


def test_gloo_rank_error() -> None:
    def body() -> None:
        if dist.get_rank() == 1:
            raise ValueError("gloo rank fails")
        dist.all_reduce(torch.ones(2))

    try:
        meshsim.run(body, 3, backend="gloo", timeout=20)
    except meshsim.RankError as error:
        assert error.rank == 1
        assert str(error.__cause__) == "gloo rank fails"
    else:
        raise AssertionError("expected a RankError")


def test_dtensor_arithmetic_under_the_dispatch_recorder() -> None:
    """Regression: the recorder refused every op on a tensor subclass, FakeTensor included,
    so DTensor's sharding propagation failed on gloo and under --multigpu-static."""
    from torch.distributed.tensor import distribute_tensor

    def body() -> tuple[float, dict[str, int]]:
        mesh = init_device_mesh("cpu", (dist.get_world_size(),))
        dt = distribute_tensor(torch.ones(4, 2), mesh, [Shard(0)])
        with meshsim.record() as ledger:
            total = (dt * 3).full_tensor().sum().item()
        return total, ledger.counts()

    assert meshsim.run(body, 2, backend="gloo") == [(24.0, {"all_gather": 1})] * 2


def _raises_with_async_work_in_flight() -> None:
    # the shape of the generated program that found it: sub-groups, async work, a raise
    group = dist.new_group([0, 1, 4, 5, 3])
    mesh = init_device_mesh("cpu", (2, 3))
    works = []
    if dist.get_rank() != 2:
        works.append(dist.all_reduce(torch.ones(1, dtype=torch.float64), group=group, async_op=True))
    works.append(dist.all_reduce(torch.ones(2), group=mesh.get_group(1), async_op=True))
    if dist.get_rank() == 5:
        raise ValueError("five fails")
    dist.broadcast_object_list([None], group=mesh.get_group(1), group_src=0)
    for work in works:
        work.wait()


@pytest.mark.skipif(not os.path.isdir("/proc/self/fd"), reason="counts descriptors through /proc")
def test_a_failed_gloo_world_closes_its_sockets_when_it_ends() -> None:
    """Found by the property tests' descriptor count: the stop loop's map of every thread's
    frame (sys._current_frames) formed a cycle with its own frame, keeping every rank's
    frames, and so their gloo groups and sockets, alive until a later gc; peers blocked on
    those sockets waited for that too."""
    meshsim.run(dist.barrier, 2, backend="gloo", timeout=10)  # gloo's process-wide device
    meshsim.end_idle_threads()  # idle rank threads keep their doorbells
    gc.collect()  # earlier tests' garbage must not close sockets in the middle of this one
    before = len(os.listdir("/proc/self/fd"))
    with pytest.raises(meshsim.RankError, match="five fails"):
        meshsim.run(_raises_with_async_work_in_flight, 6, backend="gloo", timeout=10)
    assert len(os.listdir("/proc/self/fd")) == before


def _dtensor_and_shardtensor_ops() -> None:
    """Ops that fill torch's and shardtensor's process-wide caches with this world's meshes."""
    from torch.distributed.tensor import Replicate, distribute_tensor

    from shardtensor import ShardTensor

    mesh = init_device_mesh("cpu", (2, dist.get_world_size() // 2))  # its own sub-groups
    full = torch.arange(16.0).reshape(4, 4)
    dt = distribute_tensor(full, mesh, [Shard(0), Replicate()])
    ((dt + dt) @ dt).redistribute(mesh, [Replicate(), Shard(1)]).full_tensor()  # cost model, planner
    local = full.chunk(2)[mesh.get_coordinate()[0]]
    st = ShardTensor.from_local(local, mesh, [Shard(0), Replicate()], "chunk", full.shape)
    leaf = st.detach().requires_grad_()
    (leaf.exp() * 2 + leaf).sum().full_tensor().backward()  # shardtensor's plans, autograd


def _os_threads() -> int:
    return len(os.listdir("/proc/self/task"))


def _op_schemas_leak_their_strategies() -> bool:
    """torch 2.11's ``OpSchema.__post_init__`` (C++) keeps a reference to each OpStrategy argument.

    Every sharding propagation wraps its specs in OpStrategies, so their meshes, and
    the meshes' groups, live as long as the process; nothing meshsim can drop.
    """
    from torch.distributed.tensor._op_schema import OpSchema, OpStrategy

    strategy = OpStrategy([])
    before = sys.getrefcount(strategy)
    OpSchema(torch.ops.aten.mm.default, (strategy,), {})
    return sys.getrefcount(strategy) > before


@pytest.mark.skipif(not os.path.isdir("/proc/self/task"), reason="counts threads through /proc")
def test_gloo_worlds_that_used_dtensor_and_shardtensor_leave_no_threads_behind() -> None:
    """Each gloo group owns worker threads until its last reference goes, and a mesh holds
    its groups: process-wide caches keyed by meshes (DTensor's cost model, its sharding
    propagation, per rank thread too, its redistribute planners, shardtensor's plans) kept
    every ended world's groups, ~10,000 threads over a gloo run of tests/shardtensor."""
    if _op_schemas_leak_their_strategies():
        pytest.skip("this torch's OpSchema leaks its OpStrategy arguments, and with them their meshes")
    meshsim.run(_dtensor_and_shardtensor_ops, 4, backend="gloo")  # warm-up: imports, gloo's device
    gc.collect()
    before = _os_threads()  # the warm-up's rank threads wait, idle, for the next worlds
    gc.disable()  # groups must go when their world ends, not at a later collection
    try:
        for _ in range(3):
            meshsim.run(_dtensor_and_shardtensor_ops, 4, backend="gloo")
        after = _os_threads()
    finally:
        gc.enable()
    assert after <= before + 2, f"{after - before} more threads after 3 gloo worlds"
