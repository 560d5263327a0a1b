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
