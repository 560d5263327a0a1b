"""Process-global torch tables that a rank changes inside a world (issue 24, item 2).

DTensor's custom operator handlers are per rank on simulated ranks, as each process
has its own: ``loss_parallel()`` around a collective works, as on one process per
rank (gloo thread ranks share the table and fail). DTensor's sharding-propagation
registries stay one per process (a module imported in one rank registers its
strategies for all, as every process would); a world that leaves one changed is
reported, on sim and on gloo thread ranks alike.
"""

from __future__ import annotations

import sys
import warnings
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Shard, distribute_tensor
from torch.distributed.tensor.parallel import loss_parallel

import meshsim

pytestmark = pytest.mark.filterwarnings("ignore::FutureWarning")


@torch.library.custom_op("meshsim_test_tables::plus_one", mutates_args=())
def _plus_one(x: torch.Tensor) -> torch.Tensor:
    return x + 1


# an operator no torch version has a sharding strategy for
_OP = torch.ops.meshsim_test_tables.plus_one.default
_PROPAGATOR = DTensor._op_dispatcher.sharding_propagator


def _handlers() -> dict[object, object]:
    return DTensor._op_dispatcher._custom_op_handlers  # type: ignore[no-any-return]


# -- DTensor's custom operator handlers: per rank --------------------------------------


def _cross_entropy_under_loss_parallel(rank: int) -> None:
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    torch.manual_seed(0)  # every rank the same logits and targets
    logits = torch.randn(4, 8, requires_grad=True)
    target = torch.randint(8, (4,))
    expected = F.cross_entropy(logits, target)
    sharded = distribute_tensor(logits.detach(), mesh, [Shard(1)]).requires_grad_()
    with loss_parallel():
        loss = F.cross_entropy(sharded, target)
        loss.backward()
        dist.barrier()  # a hand-over while every rank is inside the context
    assert torch.allclose(loss.full_tensor(), expected)
    # rank 0 alone enters it again: only its own table has the handlers
    if rank == 0:
        with loss_parallel():
            dist.barrier()
            assert torch.ops.aten._log_softmax.default in _handlers()
    else:
        dist.barrier()
        assert torch.ops.aten._log_softmax.default not in _handlers()


@pytest.mark.world(2, backend="spawn")
def test_loss_parallel_around_collectives_on_one_process_per_rank(rank: int) -> None:
    _cross_entropy_under_loss_parallel(rank)


@pytest.mark.world(2)
def test_loss_parallel_around_collectives_on_simulated_ranks(rank: int) -> None:
    _cross_entropy_under_loss_parallel(rank)


def _barrier_in_loss_parallel() -> int:
    with loss_parallel():
        dist.barrier()
    return len(_handlers())


def test_the_callers_handlers_are_back_after_a_world() -> None:
    before = dict(_handlers())
    assert meshsim.run(_barrier_in_loss_parallel, 2) == [len(before)] * 2
    assert _handlers() == before


def test_gloo_thread_ranks_share_the_handlers() -> None:
    """The README's limit: nothing is swapped on gloo thread ranks, and the second exit fails."""
    with pytest.raises(meshsim.RankError) as caught:
        meshsim.run(_barrier_in_loss_parallel, 2, backend="gloo")
    assert isinstance(caught.value.__cause__, KeyError)


# -- DTensor's sharding-propagation tables: shared, a change left behind reported --------


def _register_a_strategy_on_rank_0() -> None:
    if dist.get_rank() == 0:
        _PROPAGATOR.register_op_strategy(_OP, lambda schema: None)
    dist.barrier()


@pytest.mark.parametrize("backend", ["sim", "gloo"])
def test_a_strategy_a_rank_registers_and_leaves_is_reported(backend: str) -> None:
    meshsim.run(dist.barrier, 2, backend=backend)  # a world that imports nothing comes next
    before = len(_PROPAGATOR.op_strategy_funcs)
    reported = rf"sharding_propagator\.op_strategy_funcs: {before} -> {before + 1} entries"
    try:
        with pytest.warns(meshsim.StateLeakWarning, match=reported):
            meshsim.run(_register_a_strategy_on_rank_0, 2, backend=backend)
    finally:
        _PROPAGATOR.op_strategy_funcs.pop(_OP, None)


def _register_and_undo_a_strategy() -> None:
    _PROPAGATOR.register_op_strategy(_OP, lambda schema: None)
    del _PROPAGATOR.op_strategy_funcs[_OP]
    dist.barrier()


def test_a_strategy_a_rank_registers_and_undoes_is_not_reported() -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("error", meshsim.StateLeakWarning)
        meshsim.run(_register_and_undo_a_strategy, 2)
    assert _OP not in _PROPAGATOR.op_strategy_funcs


_REGISTERING_MODULE = """
import torch
from torch.distributed.tensor import DTensor

DTensor._op_dispatcher.sharding_propagator.register_op_strategy(
    torch.ops.meshsim_test_tables.plus_one.default, lambda schema: None
)
"""


def _import_a_registering_module() -> None:
    if dist.get_rank() == 0:
        __import__("meshsim_test_registers_a_strategy")
    dist.barrier()


def test_a_strategy_a_module_registers_as_a_rank_imports_it_is_not_reported(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Every process would import the module and register it (torch does so for prims.fma)."""
    (tmp_path / "meshsim_test_registers_a_strategy.py").write_text(_REGISTERING_MODULE)
    monkeypatch.syspath_prepend(str(tmp_path))
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error", meshsim.StateLeakWarning)
            meshsim.run(_import_a_registering_module, 2)
        assert _OP in _PROPAGATOR.op_strategy_funcs
    finally:
        _PROPAGATOR.op_strategy_funcs.pop(_OP, None)
        sys.modules.pop("meshsim_test_registers_a_strategy", None)
