"""Simulated ranks behave as real process groups do where tools and tests can tell (issue 15, D1-D6).

Each test runs one program on simulated ranks and asserts what gloo thread ranks
(or, for process-wide registrations, a process that never ran a world) give.
"""

from __future__ import annotations

import functools
import subprocess
import sys
import textwrap
import warnings
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Shard, distribute_tensor
from torch.distributed.tensor.debug import CommDebugMode
from torch.utils._python_dispatch import TorchDispatchMode

import meshsim

pytestmark = pytest.mark.filterwarnings("ignore::FutureWarning")


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


# -- D1: dist.* collectives reach c10d's dispatcher ops, as dispatch modes see on gloo ---


class _OpNames(TorchDispatchMode):
    """Lists the collective ops it sees, in order (as any user dispatch mode would)."""

    def __init__(self) -> None:
        super().__init__()
        self.seen: list[str] = []

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        if func.namespace in ("c10d", "_c10d_functional"):
            self.seen.append(str(func))
        return func(*args, **(kwargs or {}))


@functools.cache
def _gloo_has_list_all_to_all() -> bool:
    """Whether this torch's ProcessGroupGloo takes the list-form all_to_all (torch 2.11's does not)."""

    def all_to_all() -> None:
        dist.all_to_all([torch.zeros(1) for _ in range(2)], [torch.ones(1) for _ in range(2)])

    try:
        meshsim.run(all_to_all, 2, backend="gloo")
    except meshsim.RankError as error:
        if "does not support alltoall" in str(error.__cause__):
            return False
        raise
    return True


def _every_collective_under_modes(
    list_all_to_all: bool,
) -> tuple[list[tuple[str, int]], list[str], list[tuple[object, ...]]]:
    ws, rank = dist.get_world_size(), dist.get_rank()
    with meshsim.record() as ledger, _OpNames() as names, CommDebugMode() as comm:
        t = torch.ones(4)
        dist.all_reduce(t)
        dist.broadcast(t, 0)
        dist.reduce(t, 0)
        dist.all_gather([torch.zeros(4) for _ in range(ws)], t)
        dist.all_gather_into_tensor(torch.zeros(4 * ws), t)
        dist.reduce_scatter(torch.zeros(4), [torch.ones(4) for _ in range(ws)])
        dist.reduce_scatter_tensor(torch.zeros(4), torch.ones(4 * ws))
        dist.all_to_all_single(torch.zeros(4 * ws), torch.ones(4 * ws))
        if list_all_to_all:
            dist.all_to_all([torch.zeros(1) for _ in range(ws)], [torch.ones(1) for _ in range(ws)])
        dist.gather(t, [torch.zeros(4) for _ in range(ws)] if rank == 0 else None, dst=0)
        dist.scatter(t, [torch.ones(4) for _ in range(ws)] if rank == 0 else None, src=0)
        dist.barrier()
        if rank == 0:
            dist.send(t, 1)
        elif rank == 1:
            dist.recv(t, 0)  # a pending receive, waited on through the mode
        dist.all_reduce(t, async_op=True).wait()
        dist.all_gather_object([None] * ws, {"rank": rank})
    counts = sorted((str(op), n) for op, n in comm.get_comm_counts().items())
    return counts, names.seen, ledger.project("op", "api", "group", "bytes_in", "bytes_out", "seq")


def test_dispatch_modes_see_plain_collectives_as_on_gloo() -> None:
    program = functools.partial(_every_collective_under_modes, _gloo_has_list_all_to_all())
    sim, gloo = _on_both(program, 2)
    assert sim == gloo
    counts = dict(sim[0][0])  # CommDebugMode counts collectives, not barrier or p2p
    assert counts["c10d.allreduce_"] == 2 and counts["c10d.scatter_"] == 1
    assert "c10d.barrier.default" in sim[0][1] and "c10d.send.default" in sim[0][1]
    assert "c10d.recv_.default" in sim[1][1]


def _distribute_a_tensor() -> dict[str, int]:
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    with CommDebugMode() as comm:
        distribute_tensor(torch.arange(16.0).reshape(8, 2), mesh, [Shard(0)])
    return {str(op): n for op, n in comm.get_comm_counts().items()}


def test_distribute_tensor_is_one_scatter_as_torchs_own_test_expects() -> None:
    sim, gloo = _on_both(_distribute_a_tensor, 4)
    assert sim == gloo == [{"c10d.scatter_": 1}] * 4


# -- D3: nn.Module global hooks are per rank -------------------------------------------


class _Reduces(torch.nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dist.all_reduce(x)
        return x * 2


def _module_collectives_under_comm_debug_mode() -> dict[str, int]:
    model = torch.nn.Sequential(_Reduces(), _Reduces())
    with CommDebugMode() as comm:  # its module tracker registers global module hooks
        model(torch.ones(2))
    return {key: sum(ops["forward"].values()) for key, ops in comm.comm_module_counts.items()}


def test_global_module_hooks_are_per_rank() -> None:
    sim = meshsim.run(_module_collectives_under_comm_debug_mode, 4)
    assert sim == [{"Global": 2, "Sequential": 2, "Sequential.0": 1, "Sequential.1": 1}] * 4
    # each rank's tracker saw only its own modules: the hooks a rank registers do not
    # reach another rank's module calls, and none outlive the world
    hooks = torch.nn.modules.module
    assert not hooks._global_forward_hooks and not hooks._global_forward_pre_hooks


def _count_module_calls() -> int:
    calls: list[str] = []
    handle = torch.nn.modules.module.register_module_forward_hook(
        lambda m, i, o: calls.append(type(m).__name__)
    )
    dist.barrier()  # every rank has registered its hook before any module runs
    torch.nn.Linear(2, 2)(torch.ones(2))
    dist.barrier()
    handle.remove()
    return len(calls)


def test_a_ranks_global_hook_sees_only_its_own_modules() -> None:
    assert meshsim.run(_count_module_calls, 4) == [1, 1, 1, 1]


def _one_rank_hooks_its_modules() -> list[int]:
    calls: list[str] = []
    rank = dist.get_rank()
    handle = None
    if rank == 1:  # the other ranks register nothing: their tables stay empty
        handle = torch.nn.modules.module.register_module_forward_hook(lambda m, i, o: calls.append("hooked"))
    dist.barrier()
    torch.nn.Linear(2, 2)(torch.ones(2))
    seen = [len(calls)]
    dist.barrier()
    if handle is not None:
        handle.remove()  # through the handle: the table it refers to is this rank's
    dist.barrier()
    torch.nn.Linear(2, 2)(torch.ones(2))
    return [*seen, len(calls)]


def test_a_hook_one_rank_registers_and_removes_is_its_own() -> None:
    module = torch.nn.modules.module
    tables = module._global_forward_hooks
    assert meshsim.run(_one_rank_hooks_its_modules, 3) == [[0, 0], [1, 1], [0, 0]]
    assert module._global_forward_hooks is tables and not tables


def _count_forward_calls() -> int:
    dist.barrier()
    before = len(_CALLER_HOOK_CALLS)  # the list is the process's: no other rank runs until the barrier
    torch.nn.Linear(2, 2)(torch.ones(2))
    calls = len(_CALLER_HOOK_CALLS) - before
    dist.barrier()
    return calls


_CALLER_HOOK_CALLS: list[int] = []


def test_a_hook_the_caller_registered_runs_in_every_rank_and_stays_the_callers() -> None:
    # as after a fork: every rank starts with the caller's hooks
    handle = torch.nn.modules.module.register_module_forward_hook(
        lambda m, i, o: _CALLER_HOOK_CALLS.append(1)
    )
    try:
        assert meshsim.run(_count_forward_calls, 3) == [1, 1, 1]
    finally:
        handle.remove()
    assert not torch.nn.modules.module._global_forward_hooks


# -- D4: torch.distributed flags that ranks set are per rank; the caller's is back after --


def _min_cost_plan_in_a_rank() -> tuple[object, object]:
    import torch.distributed.tensor._redistribute as redistribute

    with redistribute.use_min_cost_redistribution_plan(True):
        inside = redistribute._FORCE_MIN_COST_REDISTRIBUTION_PLAN
        dist.barrier()  # every rank enters before any leaves: exits interleave
    return inside, redistribute._FORCE_MIN_COST_REDISTRIBUTION_PLAN


def test_redistribution_flags_are_per_rank_and_do_not_leak() -> None:
    import torch.distributed.tensor._redistribute as redistribute

    before = redistribute._FORCE_MIN_COST_REDISTRIBUTION_PLAN
    assert meshsim.run(_min_cost_plan_in_a_rank, 4) == [(True, before)] * 4
    assert redistribute._FORCE_MIN_COST_REDISTRIBUTION_PLAN == before


def _implicit_replication_in_a_rank() -> tuple[bool, bool]:
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor.experimental import implicit_replication

    with implicit_replication():
        dist.barrier()  # another rank leaving its block must not end this rank's
        inside = bool(DTensor._op_dispatcher._allow_implicit_replication)
    return inside, bool(DTensor._op_dispatcher._allow_implicit_replication)


def test_implicit_replication_is_per_rank() -> None:
    # torch keeps this flag per thread (2.11-2.15): rank threads get it per rank as they are
    from torch.distributed.tensor import DTensor

    assert meshsim.run(_implicit_replication_in_a_rank, 3) == [(True, False)] * 3
    assert DTensor._op_dispatcher._allow_implicit_replication is False


# -- D5: warnings are per rank ---------------------------------------------------------


def _warn_across_a_collective() -> list[str]:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        warnings.warn(f"from rank {dist.get_rank()}", UserWarning, stacklevel=1)
        dist.barrier()  # every rank is inside catch_warnings at once
    return [str(w.message) for w in caught]


def test_catch_warnings_records_each_ranks_own_warnings() -> None:
    filters = list(warnings.filters)
    assert meshsim.run(_warn_across_a_collective, 4) == [[f"from rank {r}"] for r in range(4)]
    assert warnings.filters == filters


def _a_filter_set_in_a_rank() -> int:
    if dist.get_rank() == 0:
        warnings.simplefilter("error")  # without catch_warnings: it must stay rank 0's
    dist.barrier()
    try:
        warnings.warn("a warning", UserWarning, stacklevel=1)
    except UserWarning:
        return 1
    return 0


def test_a_ranks_warning_filters_are_its_own() -> None:
    filters = list(warnings.filters)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        assert meshsim.run(_a_filter_set_in_a_rank, 3) == [1, 0, 0]
    assert warnings.filters == filters


def _catch_warnings_then_another_rank_filters() -> int:
    # rank 0 saves the filter list (to restore on exit) before rank 1 changes its own in place
    if dist.get_rank() == 0:
        with warnings.catch_warnings():
            dist.barrier()
    else:
        dist.barrier()
        if dist.get_rank() == 1:
            warnings.simplefilter("error")
    dist.barrier()
    return _raises_on_a_warning()


def _another_rank_filters_then_catch_warnings() -> int:
    # rank 0 changes its filter list in place before rank 1 saves it (to restore on exit)
    if dist.get_rank() == 0:
        warnings.simplefilter("error")
        dist.barrier()
    else:
        with warnings.catch_warnings():
            dist.barrier()
    dist.barrier()
    return _raises_on_a_warning()


def _raises_on_a_warning() -> int:
    try:
        warnings.warn("a warning", UserWarning, stacklevel=1)
    except UserWarning:
        return 1
    return 0


@pytest.mark.parametrize(
    ("body", "expected"),
    [
        (_catch_warnings_then_another_rank_filters, [0, 1, 0]),
        (_another_rank_filters_then_catch_warnings, [1, 0, 0]),
    ],
    ids=["saved-then-changed", "changed-then-saved"],
)
def test_a_filter_list_a_rank_saved_is_not_another_ranks(body: Any, expected: list[int]) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        filters = warnings.filters
        content = list(filters)
        assert meshsim.run(body, 3) == expected
        assert warnings.filters is filters and warnings.filters == content


def _rank_0_changes_shared_state_on_its_way_out() -> tuple[int, int]:
    if dist.get_rank() == 0:  # no collective after these: the next rank runs once this one returns
        warnings.simplefilter("error")
        torch.nn.modules.module.register_module_forward_hook(lambda m, i, o: None)
        return (-1, -1)
    return (_raises_on_a_warning(), len(torch.nn.modules.module._global_forward_hooks))


def test_what_a_finishing_rank_changed_stays_its_own() -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        assert meshsim.run(_rank_0_changes_shared_state_on_its_way_out, 3) == [(-1, -1), (0, 0), (0, 0)]
    assert not torch.nn.modules.module._global_forward_hooks


# -- D4: other torch.distributed globals a world leaves changed are reported ------------


def _turn_a_torch_flag_off() -> None:
    import torch.distributed._local_tensor as local_tensor

    local_tensor._PROCESS_MODE = not local_tensor._PROCESS_MODE


def test_a_world_that_leaves_a_torch_distributed_global_changed_is_reported() -> None:
    import torch.distributed._local_tensor as local_tensor

    before = local_tensor._PROCESS_MODE
    try:
        with pytest.warns(
            meshsim.StateLeakWarning, match=rf"_local_tensor\._PROCESS_MODE: {before} -> {not before}"
        ):
            meshsim.run(_turn_a_torch_flag_off, 1)
    finally:
        local_tensor._PROCESS_MODE = before


def _delete_and_rebind_torch_globals() -> None:
    import torch.distributed._local_tensor as local_tensor

    del local_tensor._PROCESS_MODE
    dist.distributed_c10d._MPI_AVAILABLE = torch.ones(3)


def test_a_deleted_global_and_one_rebound_to_a_tensor_are_reported() -> None:
    """A global a rank deletes reads as absent; one rebound to a value that does not compare
    (a tensor) is still told apart from its old value. Both in one report, nothing else."""
    import torch.distributed._local_tensor as local_tensor

    process_mode, mpi = local_tensor._PROCESS_MODE, dist.distributed_c10d._MPI_AVAILABLE
    try:
        with pytest.warns(meshsim.StateLeakWarning) as caught:
            meshsim.run(_delete_and_rebind_torch_globals, 1)
    finally:
        local_tensor._PROCESS_MODE = process_mode
        dist.distributed_c10d._MPI_AVAILABLE = mpi
    changed = {line.strip() for line in str(caught[0].message).splitlines() if line.startswith("  ")}
    assert changed == {
        f"torch.distributed.distributed_c10d._MPI_AVAILABLE: {mpi} -> tensor([1., 1., 1.])",
        f"torch.distributed._local_tensor._PROCESS_MODE: {process_mode} -> (absent)",
    }


def _ask_whether_spmd_types_is_installed() -> None:
    dist._is_spmd_types_available()  # type: ignore[attr-defined]


@pytest.mark.skipif(not hasattr(dist, "_spmd_types_available"), reason="torch 2.14+ memoizes it")
def test_a_memo_torch_fills_on_first_use_is_not_a_leak(monkeypatch: pytest.MonkeyPatch) -> None:
    """torch 2.14+ memoizes whether spmd_types is installed in torch.distributed on first
    use (FSDP, and so Dynamo, ask at import): the world that asked first was reported."""
    monkeypatch.setattr(dist, "_spmd_types_available", None)
    with warnings.catch_warnings():
        warnings.simplefilter("error", meshsim.StateLeakWarning)
        meshsim.run(_ask_whether_spmd_types_is_installed, 2)


def test_an_ordinary_dtensor_world_leaves_nothing_changed() -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("error", meshsim.StateLeakWarning)
        meshsim.run(_distribute_a_tensor, 4)
        meshsim.run(_min_cost_plan_in_a_rank, 2)
