"""pytest --mesh-cuda=cpu: a test tree written for GPUs runs on simulated ranks, unchanged."""

from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="pins the emulation where CUDA is absent")

PROGRAM = """
import pytest, torch, torch.distributed as dist

# decided at collection, in the pytest process: GPU-only tests are skipped without a GPU
needs_gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")

@pytest.fixture
def device():
    return torch.device("cuda")  # a fixture of the pytest process

@needs_gpu
@pytest.mark.world(2)
def test_all_reduce_on_cuda(rank, device, ledger):
    dist.init_process_group("nccl")
    torch.cuda.set_device(rank)
    x = torch.full((4,), float(rank), device=device)
    dist.all_reduce(x)
    assert x.device == torch.device("cuda", rank)
    assert x.tolist() == [1.0] * 4
    assert ledger.counts() == {"all_reduce": 1}

@needs_gpu
def test_collection_saw_cuda():
    assert torch.cuda.device_count() >= 2
"""


def test_gpu_tests_run_with_the_emulation_and_skip_without(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(test_program=PROGRAM)
    pytester.runpytest_subprocess("-p", "no:cacheprovider").assert_outcomes(skipped=2)
    pytester.runpytest_subprocess("-p", "no:cacheprovider", "--mesh-cuda=cpu").assert_outcomes(passed=2)


def test_the_environment_variable_turns_it_on(
    pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch
) -> None:
    pytester.makepyfile(test_program=PROGRAM)
    monkeypatch.setenv("MESHSIM_CUDA", "cpu")
    pytester.runpytest_subprocess("-p", "no:cacheprovider").assert_outcomes(passed=2)


def test_a_bad_value_is_a_usage_error(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(test_program=PROGRAM)
    result = pytester.runpytest_subprocess("--mesh-cuda=gpu")
    result.stderr.fnmatch_lines(["*--mesh-cuda: cuda must be 'cpu'*'cuda:N'*got 'gpu'*"])
    assert result.ret == pytest.ExitCode.USAGE_ERROR


WORLDS = """
import os, pytest, torch
import meshsim

@pytest.mark.world(2)
def test_two(rank):
    torch.cuda.set_device(rank)
    assert torch.cuda.device_count() == 8

@pytest.mark.world(16)
def test_sixteen(rank):
    torch.cuda.set_device(rank)
    x = torch.ones(1, device="cuda")
    assert x.device == torch.device("cuda", rank)
    assert torch.cuda.device_count() == 16

def test_the_pytest_process_emulates_for_the_default_world_size():
    assert torch.cuda.device_count() == 8

def test_the_setting_travels_as_a_value_not_through_the_environment():
    assert "MESHSIM_CUDA" not in os.environ

def test_a_world_started_here_emulates_as_this_process_does():
    def body():
        return str(torch.ones(1, device="cuda").device), torch.cuda.device_count()

    assert meshsim.run(body, 12) == [("cuda:0", 12)] * 12
"""


def test_each_world_sees_as_many_gpus_as_its_ranks_per_node(
    pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Issue 38: a world larger than the first one of the session (rank 8 of @world(16)) gets its GPU."""
    monkeypatch.delenv("MESHSIM_CUDA", raising=False)
    monkeypatch.delenv("MESHSIM_CUDA_DEVICES", raising=False)
    pytester.makepyfile(test_worlds=WORLDS)
    result = pytester.runpytest_subprocess("-p", "no:cacheprovider", "--mesh-cuda=cpu")
    result.assert_outcomes(passed=5)


SPAWNED = """
import pytest, torch, torch.distributed as dist

@pytest.mark.world(2, backend="spawn")
def test_spawned_ranks_emulate(rank):
    torch.cuda.set_device(rank)
    x = torch.full((2,), float(rank), device="cuda")
    dist.all_reduce(x)
    assert x.device == torch.device("cuda", rank) and x.tolist() == [1.0, 1.0]
"""


@pytest.mark.slow  # two spawned rank processes, each importing torch
def test_spawned_ranks_are_handed_the_emulation(
    pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("MESHSIM_CUDA", raising=False)
    pytester.makepyfile(test_spawned=SPAWNED)
    result = pytester.runpytest_subprocess("-p", "no:cacheprovider", "--mesh-cuda=cpu", "--mesh-timeout=120")
    result.assert_outcomes(passed=1)


SPAWNED_COMPILE = """
import pytest, torch, torch.distributed as dist

def shifted(x):
    return x + torch.cuda.current_device() + torch.arange(x.shape[0], device=x.device)

@pytest.mark.world(2, backend="spawn")
def test_spawned_ranks_compile(rank):
    torch.cuda.set_device(rank)
    out = torch.compile(shifted, backend="aot_eager")(torch.zeros(2, device="cuda"))
    dist.all_reduce(out)
    assert out.device == torch.device("cuda", rank) and out.tolist() == [1.0, 3.0]
"""


@pytest.mark.slow  # two spawned rank processes, each importing torch and compiling
def test_spawned_ranks_compile_under_the_emulation(
    pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch
) -> None:
    """On PyPI's CUDA build with no GPU, Dynamo reached the CUDA runtime through torch.accelerator
    as it started each frame, in spawned ranks (``CUDA driver version is insufficient``)."""
    monkeypatch.delenv("MESHSIM_CUDA", raising=False)
    pytester.makepyfile(test_spawned=SPAWNED_COMPILE)
    result = pytester.runpytest_subprocess("-p", "no:cacheprovider", "--mesh-cuda=cpu", "--mesh-timeout=120")
    result.assert_outcomes(passed=1)
