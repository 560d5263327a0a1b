"""meshsim.testing.spawn_threads_and_init_comms and torch's decorators re-exported (issue 24, item 5).

Each program runs under meshsim's decorator and under torch's own
(``torch.testing._internal.common_distributed``), and both must end the same way:
what the function sees on every rank, and what the caller gets when ranks fail
(``RuntimeError``) or skip (``unittest.SkipTest``).
"""

from __future__ import annotations

import threading
import unittest
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch.testing._internal import common_distributed
from torch.testing._internal.distributed._tensor import common_dtensor

import meshsim
import meshsim.testing

pytestmark = pytest.mark.filterwarnings("ignore::FutureWarning")

Decorator = Callable[..., Any]
DECORATORS: dict[str, Decorator] = {
    "meshsim": meshsim.testing.spawn_threads_and_init_comms,
    "torch": common_distributed.spawn_threads_and_init_comms,
}


class _Holder:
    """What torch's decorator passes every rank as ``self``: one object for all."""

    def __init__(self) -> None:
        self.lock = threading.Lock()  # torch's ranks run at once
        self.seen: list[tuple[int, int, list[float]]] = []


def _gathers(self: _Holder) -> None:
    rank, ws = dist.get_rank(), dist.get_world_size()
    out = [torch.zeros(1) for _ in range(ws)]
    dist.all_gather(out, torch.full((1,), float(rank)))
    with self.lock:
        self.seen.append((rank, ws, [float(t) for t in out]))


@pytest.mark.parametrize("which", list(DECORATORS))
def test_every_rank_runs_the_function_with_the_same_self(which: str) -> None:
    holder = _Holder()
    DECORATORS[which](world_size=3)(_gathers)(holder)
    assert sorted(holder.seen) == [(r, 3, [0.0, 1.0, 2.0]) for r in range(3)]


def test_bare_use_runs_on_torchs_default_world_size() -> None:
    holder = _Holder()
    meshsim.testing.spawn_threads_and_init_comms(_gathers)(holder)
    assert len(holder.seen) == common_distributed.DEFAULT_WORLD_SIZE


def _fails_on(ranks: set[int]) -> Callable[[object], None]:
    def body(self: object) -> None:
        t = torch.ones(3)
        dist.all_reduce(t)
        if dist.get_rank() in ranks:
            raise AssertionError("Mimic real test failure.")
        dist.all_reduce(t)

    return body


@pytest.mark.parametrize("which", list(DECORATORS))
@pytest.mark.parametrize("ranks", [{0}, {1}, {1, 2, 3}], ids=["rank 0", "rank 1", "every rank but 0"])
def test_a_failing_rank_reaches_the_caller_as_a_runtime_error(which: str, ranks: set[int]) -> None:
    with pytest.raises(RuntimeError, match=r"Thread \d exited with exception:") as caught:
        DECORATORS[which](world_size=4)(_fails_on(ranks))(_Holder())
    assert "AssertionError: Mimic real test failure." in str(caught.value)


def test_the_runtime_error_names_the_rank_and_chains_its_exception() -> None:
    with pytest.raises(RuntimeError, match=r"^Thread 1 exited with exception:") as caught:
        meshsim.testing.spawn_threads_and_init_comms(world_size=4)(_fails_on({1}))(_Holder())
    assert isinstance(caught.value.__cause__, AssertionError)


@pytest.mark.parametrize("which", list(DECORATORS))
def test_a_skip_on_every_rank_skips(which: str) -> None:
    @DECORATORS[which](world_size=4)
    @unittest.skip("check if skip exception can be captured correctly.")
    def skipped(self: object) -> None:
        pass

    with pytest.raises(unittest.SkipTest):
        skipped(_Holder())


def test_the_skip_keeps_the_ranks_reason() -> None:
    @meshsim.testing.spawn_threads_and_init_comms(world_size=2)
    def skipped(self: object) -> None:
        raise unittest.SkipTest("no accelerator")

    with pytest.raises(unittest.SkipTest, match=r"no accelerator \(rank 0\)"):
        skipped(_Holder())


def test_ranks_in_different_collectives_raise_a_runtime_error_with_meshsims_report() -> None:
    @meshsim.testing.spawn_threads_and_init_comms(world_size=2)
    def mismatched(self: object) -> None:
        if dist.get_rank() == 0:
            dist.all_reduce(torch.ones(2))
        else:
            dist.broadcast(torch.ones(2), src=0)

    with pytest.raises(RuntimeError, match="meshsim world was stopped") as caught:
        mismatched(_Holder())
    assert isinstance(caught.value.__cause__, meshsim.CollectiveMismatchError)


@pytest.mark.parametrize(
    ("options", "error", "message"),
    [
        ({"world_size": 0}, ValueError, "world_size must be at least 1, got 0"),
        ({"world_size": "4"}, TypeError, "world_size must be an int, got '4'"),
        ({"timeout": -1}, ValueError, "timeout must be positive, got -1"),
        ({"timeout": "60"}, TypeError, r"timeout must be seconds \(a number\), got '60'"),
    ],
    ids=["zero ranks", "ranks as text", "negative timeout", "timeout as text"],
)
def test_bad_options_are_refused(options: dict[str, Any], error: type[Exception], message: str) -> None:
    with pytest.raises(error, match=message):
        meshsim.testing.spawn_threads_and_init_comms(**options)


# -- torch's decorators, re-exported: they work unchanged on meshsim's bases ------------


def test_torchs_decorators_are_re_exported_as_they_are() -> None:
    assert meshsim.testing.skip_if_lt_x_gpu is common_distributed.skip_if_lt_x_gpu
    assert meshsim.testing.skip_if_no_gpu is common_distributed.skip_if_no_gpu
    assert meshsim.testing.requires_gloo is common_distributed.requires_gloo
    assert meshsim.testing.skip_unless_torch_gpu is common_dtensor.skip_unless_torch_gpu


class _Decorated(meshsim.testing.DTensorTestBase):
    __test__ = False  # run by the test below, through unittest's API

    @property
    def world_size(self) -> int:
        return 2

    @meshsim.testing.with_comms
    @meshsim.testing.skip_if_lt_x_gpu(2)
    def test_needs_two_gpus(self) -> None:
        dist.barrier()

    @meshsim.testing.with_comms
    @meshsim.testing.skip_if_lt_x_gpu(2, allow_cpu=True)
    def test_runs_on_cpu(self) -> None:
        dist.barrier()

    @meshsim.testing.with_comms
    @meshsim.testing.skip_unless_torch_gpu
    def test_needs_a_gpu(self) -> None:
        dist.barrier()

    @meshsim.testing.with_comms
    @meshsim.testing.skip_if_no_gpu
    def test_needs_a_gpu_per_rank(self) -> None:
        dist.barrier()

    @meshsim.testing.requires_gloo()
    @meshsim.testing.with_comms
    def test_needs_gloo(self) -> None:
        dist.barrier()


_HAS_GPUS = torch.cuda.is_available() and torch.cuda.device_count() >= 2
CPU_OUTCOMES = {
    "test_needs_two_gpus": "skipped",
    "test_runs_on_cpu": "passed",
    "test_needs_a_gpu": "skipped",
    "test_needs_a_gpu_per_rank": "skipped",
    "test_needs_gloo": "passed",
}


@pytest.mark.skipif(_HAS_GPUS, reason="the outcomes of a machine without GPUs")
@pytest.mark.parametrize("name", list(CPU_OUTCOMES))
def test_torchs_decorators_skip_or_run_on_meshsims_bases(name: str) -> None:
    result = unittest.TestResult()
    _Decorated(name).run(result)
    assert not result.errors and not result.failures, result.errors + result.failures
    assert ("skipped" if result.skipped else "passed") == CPU_OUTCOMES[name]


# -- split sizes: a tensor is refused, as gloo's process group refuses it -----------------


def _split_sizes_as_a_tensor() -> None:
    ws = dist.get_world_size()
    sizes = torch.ones(ws, dtype=torch.int64)
    dist.all_to_all_single(torch.zeros(ws, 2), torch.ones(ws, 2), sizes, sizes)


@pytest.mark.parametrize("backend", ["sim", "gloo"])
def test_split_sizes_given_as_a_tensor_are_refused_as_on_gloo(backend: str) -> None:
    with pytest.raises(meshsim.RankError) as caught:
        meshsim.run(_split_sizes_as_a_tensor, 2, backend=backend)
    assert isinstance(caught.value.__cause__, TypeError)
