"""Suites written for ``torchrun -m pytest`` on simulated ranks: --mesh-unmarked=ranks, per-rank imports."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from .launch import torchrun_pytest

TREE = Path(__file__).parents[2] / "examples" / "torchrun_style"

# A helper of the test tree that reads the rank at import, and a test module that does too.
HELPER = """
import os
rank = int(os.environ["LOCAL_RANK"])
"""

UNMARKED = """
import os
import torch.distributed as dist
from mysuite.helper import rank as helper_rank

rank = int(os.environ["LOCAL_RANK"])

def test_runs_on_every_rank_with_its_own_imports():
    assert rank == helper_rank == dist.get_rank()
    with open(os.environ["RANKS_FILE"], "a") as ranks:
        ranks.write(f"{rank}\\n")
"""

# A library module (outside the rootdir) that keeps the process's group in a module global.
LIBRARY = """
import torch.distributed as dist

_GROUP = None

def initialize():
    global _GROUP
    _GROUP = dist.new_group(list(range(dist.get_world_size())))

def get_group():
    return _GROUP
"""

USES_LIBRARY = """
import torch, torch.distributed as dist
import libstate_torchrun_style as libstate

def test_initialize():
    libstate.initialize()

def test_all_reduce_on_the_library_group():
    t = torch.ones(1)
    dist.all_reduce(t, group=libstate.get_group())
    assert t.item() == dist.get_world_size()
"""


@pytest.fixture
def suite(pytester: pytest.Pytester, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> pytest.Pytester:
    """A torchrun-style suite: a package with a helper and an unmarked test module; ranks append to a file."""
    pytester.makeini("[pytest]\n")
    package = pytester.mkpydir("mysuite")
    (package / "helper.py").write_text(HELPER)
    (package / "test_unmarked.py").write_text(UNMARKED)
    monkeypatch.setenv("RANKS_FILE", str(tmp_path / "ranks.txt"))
    return pytester


def _ranks(tmp_path: Path) -> list[str]:
    path = tmp_path / "ranks.txt"
    return path.read_text().split() if path.exists() else []


def test_unmarked_tests_are_skipped_by_default_with_the_option_named(
    suite: pytest.Pytester, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("LOCAL_RANK", "0")  # without the option, the pytest process has only its own
    result = suite.runpytest_subprocess("--multigpu-static", "-rs", "-p", "no:cacheprovider")
    result.assert_outcomes(skipped=1)
    result.stdout.fnmatch_lines(
        ["*--mesh-unmarked=ranks runs unmarked tests on every rank, as torchrun -m pytest does*"]
    )
    assert _ranks(tmp_path) == []


def test_with_the_option_each_rank_runs_them_importing_the_tree_itself(
    suite: pytest.Pytester, tmp_path: Path
) -> None:
    result = suite.runpytest_subprocess(
        "--multigpu-static", "--mesh-unmarked=ranks", "-p", "no:cacheprovider"
    )
    result.assert_outcomes(passed=1)
    assert _ranks(tmp_path) == ["0", "1", "2", "3"]


@pytest.mark.slow  # a pytest process of its own
def test_the_ini_option_asks_for_it_too(suite: pytest.Pytester, tmp_path: Path) -> None:
    suite.makeini("[pytest]\nmesh_unmarked = ranks\n")
    result = suite.runpytest_subprocess("--multigpu-static", "--world-size=2", "-p", "no:cacheprovider")
    result.assert_outcomes(passed=1)
    assert _ranks(tmp_path) == ["0", "1"]


@pytest.mark.slow  # a pytest process of its own
def test_a_bad_ini_value_is_a_usage_error(suite: pytest.Pytester) -> None:
    suite.makeini("[pytest]\nmesh_unmarked = every\n")
    result = suite.runpytest_subprocess("--multigpu-static", "-p", "no:cacheprovider")
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines(["*mesh_unmarked must be one of skip, ranks, got 'every'*"])


@pytest.mark.slow  # a pytest process of its own
def test_gloo_thread_ranks_refuse_per_rank_imports(suite: pytest.Pytester) -> None:
    result = suite.runpytest_subprocess("--multigpu-static", "--mesh-unmarked=ranks", "--mesh-backend=gloo")
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines(
        [
            "*--mesh-unmarked=ranks gives each simulated rank its own imports*"
            "--mesh-backend=gloo thread ranks run at once and would share them*"
        ]
    )


@pytest.fixture
def library(
    pytester: pytest.Pytester, tmp_path_factory: pytest.TempPathFactory, monkeypatch: pytest.MonkeyPatch
) -> pytest.Pytester:
    """A parallel-state-like library outside the rootdir, and unmarked tests that use its group."""
    outside = tmp_path_factory.mktemp("site")
    (outside / "libstate_torchrun_style.py").write_text(LIBRARY)
    monkeypatch.setenv("PYTHONPATH", str(outside))
    pytester.makeini("[pytest]\n")
    pytester.makepyfile(test_library=USES_LIBRARY)
    return pytester


@pytest.mark.slow  # a pytest process of its own
def test_a_declared_library_modules_globals_are_per_rank(library: pytest.Pytester) -> None:
    result = library.runpytest_subprocess(
        "--multigpu-static",
        "--mesh-unmarked=ranks",
        "--mesh-per-rank-modules=libstate_torchrun_style",
        "-p",
        "no:cacheprovider",
    )
    result.assert_outcomes(passed=2)


def test_an_undeclared_library_group_shared_by_ranks_is_named_as_the_cause(library: pytest.Pytester) -> None:
    result = library.runpytest_subprocess(
        "--multigpu-static", "--mesh-unmarked=ranks", "-p", "no:cacheprovider"
    )
    result.assert_outcomes(passed=1, failed=1)
    result.stdout.fnmatch_lines(
        [
            "*ForeignGroupError: rank 0 called all_reduce on a process group that rank 3 created*"
            "It is libstate_torchrun_style._GROUP: a module global every rank thread shares, last set by "
            "rank 3.*meshsim.per_rank_module('libstate_torchrun_style') (pytest: "
            "--mesh-per-rank-modules=libstate_torchrun_style)*",
        ]
    )


@pytest.mark.slow  # a pytest process of its own
def test_a_bad_module_name_is_a_usage_error(library: pytest.Pytester) -> None:
    result = library.runpytest_subprocess("--multigpu-static", "--mesh-per-rank-modules=libstate,not-a-name")
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines(["*'not-a-name' is not a module name*"])


@pytest.mark.slow  # a pytest process of its own
def test_a_p_plugins_session_fixture_runs_on_every_rank(
    pytester: pytest.Pytester, tmp_path_factory: pytest.TempPathFactory, monkeypatch: pytest.MonkeyPatch
) -> None:
    outside = tmp_path_factory.mktemp("plugins")
    (outside / "rank_plugin_torchrun_style.py").write_text(
        "import pytest, torch.distributed as dist\n\n"
        "@pytest.fixture(scope='session')\n"
        "def process_rank():\n"
        "    return dist.get_rank()\n"
    )
    monkeypatch.setenv("PYTHONPATH", str(outside))
    pytester.makeini("[pytest]\n")
    pytester.makepyfile(
        test_plugin_fixture="""
        import torch.distributed as dist

        def test_the_session_fixture_is_this_ranks(process_rank):
            assert process_rank == dist.get_rank()
        """
    )
    result = pytester.runpytest_subprocess(
        "-p",
        "rank_plugin_torchrun_style",
        "--multigpu-static",
        "--mesh-unmarked=ranks",
        "-p",
        "no:cacheprovider",
    )
    result.assert_outcomes(passed=1)


@pytest.fixture
def tree(pytester: pytest.Pytester) -> pytest.Pytester:
    """The torchrun-style tree (examples/torchrun_style) in pytester's directory."""
    shutil.copytree(TREE, pytester.path, dirs_exist_ok=True, ignore=shutil.ignore_patterns("__pycache__"))
    return pytester


@pytest.mark.slow  # a pytest process of its own (the tree's package is called tests, as ours is)
def test_the_example_tree_passes_on_8_simulated_ranks_with_cuda_emulated(tree: pytest.Pytester) -> None:
    result = tree.runpytest_subprocess(
        "--multigpu-static",
        "--mesh-unmarked=ranks",
        "--world-size=8",
        "--mesh-cuda=cpu",
        "-p",
        "no:cacheprovider",
    )
    result.assert_outcomes(passed=6)


@pytest.mark.slow  # torchrun
def test_the_example_tree_passes_under_torchrun(tree: pytest.Pytester) -> None:
    result = torchrun_pytest(tree, "--mesh-unmarked=ranks", timeout=300)
    assert result.ret == 0, result.stdout.str()
    result.stdout.fnmatch_lines(["*6 passed*"])


# Set-up written for torchrun: pytest's xunit functions, and a helper that sets the device only
# before it makes the group (as Megatron's Utils.initialize_distributed does).
XUNIT = """
import os
import pytest
import torch
import torch.distributed as dist

LOCAL_RANK = int(os.environ["LOCAL_RANK"])
SEEN = {}  # this rank's: the test module is each rank's own import

def setup_module():
    SEEN["module"] = dist.get_rank()

def setup_function():
    if not dist.is_initialized():  # under torchrun without meshsim's group
        torch.cuda.set_device(LOCAL_RANK)
        dist.init_process_group("nccl")
    t = torch.ones(1)
    dist.all_reduce(t)  # a collective: every rank must run the set-up
    SEEN["function"] = t.item()

def test_the_set_up_ran_on_this_rank():
    assert SEEN == {"module": dist.get_rank(), "function": dist.get_world_size()}

def test_each_rank_starts_on_its_local_gpu():
    assert torch.cuda.current_device() == LOCAL_RANK
    assert torch.ones(1, device="cuda").device == torch.device("cuda", LOCAL_RANK)

@pytest.mark.world(2)
def test_a_world_of_its_own_too(rank):
    assert torch.cuda.current_device() == rank
"""


def test_xunit_set_up_runs_on_every_rank_and_each_starts_on_its_local_gpu(pytester: pytest.Pytester) -> None:
    pytester.makeini("[pytest]\n")
    pytester.makepyfile(test_xunit=XUNIT)
    result = pytester.runpytest_subprocess(
        "--multigpu-static", "--mesh-unmarked=ranks", "--mesh-cuda=cpu", "-p", "no:cacheprovider", timeout=300
    )
    result.assert_outcomes(passed=3)
