"""The user's fixtures that a torchrun process would run for itself run on every rank."""

from __future__ import annotations

import pytest

pytestmark = pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")

CONFTEST = """
import os, pytest, torch, torch.distributed as dist

@pytest.fixture(scope="session")
def pair_group(tmp_path_factory):
    log = tmp_path_factory.getbasetemp().parent / "log.txt"
    with open(log, "a") as f:
        f.write(f"built on rank {dist.get_rank()}\\n")
    yield dist.new_group([0, 1])
    with open(log, "a") as f:
        f.write(f"torn down on rank {dist.get_rank()}\\n")

@pytest.fixture(scope="module")
def rank_data():
    return torch.full((2,), float(dist.get_rank()))

@pytest.fixture
def tenfold(rank):
    return rank * 10

@pytest.fixture
def plain():
    return "built in the pytest process"
"""

TESTS = """
import pytest, torch, torch.distributed as dist

@pytest.mark.{marker}
def test_fixtures_are_per_rank(pair_group, rank_data, tenfold, plain, rank):
    t = torch.ones(1)
    dist.all_reduce(t, group=pair_group)
    assert t.item() == 2
    assert rank_data.tolist() == [rank, rank]
    assert tenfold == rank * 10
    assert plain == "built in the pytest process"

@pytest.mark.{marker}
def test_again(pair_group, rank):
    assert dist.get_process_group_ranks(pair_group) == [0, 1]

def test_a_test_outside_ranks_cannot_take_them(rank_data):
    pass
"""


@pytest.mark.parametrize(
    ("marker", "args", "builds"),
    [
        ("world(2)", (), 2),  # a world per test: the session fixture is built in each
        ("multigpu_static", ("--multigpu-static", "--world-size", "2"), 1),
    ],
    ids=["world-per-test", "static-job"],
)
def test_user_fixtures_run_on_every_rank(
    pytester: pytest.Pytester, marker: str, args: tuple[str, ...], builds: int
) -> None:
    pytester.makeconftest(CONFTEST)
    pytester.makepyfile(test_fixtures=TESTS.replace("{marker}", marker))
    result = pytester.runpytest_subprocess(*args, "-v")
    if marker == "multigpu_static":  # --multigpu-static runs only distributed tests
        result.assert_outcomes(passed=2, skipped=1)
    else:
        result.assert_outcomes(passed=2, failed=1)
        result.stdout.fnmatch_lines(
            [
                "*fixture 'rank_data' run on the ranks of distributed tests (set up by an earlier one, in a "
                "wider scope); this test runs once, outside any rank*"
            ]
        )
    log = (pytester.path / "log.txt").read_text().splitlines()
    built = [line for line in log if line.startswith("built")]
    torn = [line for line in log if line.startswith("torn")]
    assert sorted(built) == sorted([f"built on rank {r}" for r in (0, 1)] * builds)
    assert sorted(line.replace("torn down", "built") for line in torn) == sorted(built)


# a world per test, and the session's simulated static job
EITHER_WAY = pytest.mark.parametrize(
    ("marker", "args"),
    [("world(2)", ()), ("multigpu_static", ("--multigpu-static", "--world-size", "2"))],
    ids=["world-per-test", "static-job"],
)

AUTOUSE_CONFTEST = """
import pytest, torch.distributed as dist

@pytest.fixture(params=["cpu"])
def device(request):
    return request.param

@pytest.fixture(autouse=True)
def skip_on_cpu(device):
    if device == "cpu":
        pytest.skip("Skip tests on cpu")

@pytest.fixture
def noted(tmp_path_factory):
    log = tmp_path_factory.getbasetemp().parent / "log.txt"
    def note(text):
        with open(log, "a") as f:
            f.write(text + "\\n")
    return note
"""

# a sub-folder's `device` depends on a per-rank fixture: so do the autouse fixtures above it
AUTOUSE_SUB_CONFTEST = """
import pytest, torch.distributed as dist

@pytest.fixture
def device(rank, request):
    return request.node.get_closest_marker("device_is").args[0]

@pytest.fixture(autouse=True)
def note_rank(rank, noted):
    noted(f"autouse on rank {rank} of {dist.get_world_size()}")

@pytest.fixture
def used(rank, noted):
    noted(f"usefixtures on rank {rank}")
"""

AUTOUSE_TESTS = """
import pytest, torch.distributed as dist

@pytest.mark.{marker}
@pytest.mark.device_is("cpu")
def test_skipped_by_the_autouse_fixture(device):
    raise AssertionError("skip_on_cpu did not run on this rank")

@pytest.mark.{marker}
@pytest.mark.device_is("cuda")
@pytest.mark.usefixtures("used")
def test_runs_after_the_autouse_fixtures(device):
    assert device == "cuda"
"""


@EITHER_WAY
def test_autouse_and_usefixtures_fixtures_that_depend_on_ranks_run_on_every_rank(
    pytester: pytest.Pytester, marker: str, args: tuple[str, ...]
) -> None:
    # PhysicsNeMo's domain_parallel/mesh conftest: `device` overridden by a per-rank fixture
    # below an autouse `skip_on_cpu(device)`; on torchrun every process runs the autouse one
    pytester.makeconftest(AUTOUSE_CONFTEST)
    pytester.makeini("[pytest]\nmarkers =\n    device_is(name): the device the sub-folder's fixture gives\n")
    sub = pytester.mkpydir("sub")
    (sub / "conftest.py").write_text(AUTOUSE_SUB_CONFTEST)
    (sub / "test_autouse.py").write_text(AUTOUSE_TESTS.replace("{marker}", marker))
    result = pytester.runpytest_subprocess(*args, "-v", "-rs")
    result.assert_outcomes(passed=1, skipped=1)
    # a fixture's skip is reported at the test's line, as pytest reports it
    result.stdout.fnmatch_lines(
        [
            "*test_skipped_by_the_autouse_fixture SKIPPED*",
            "SKIPPED [[]1[]] sub/test_autouse.py:4: Skip tests on cpu",
        ]
    )
    log = (pytester.path / "log.txt").read_text().splitlines()
    # the skipped test stops at skip_on_cpu, before the sub-folder's autouse fixture
    assert sorted(log) == sorted(
        [f"autouse on rank {r} of 2" for r in (0, 1)] + [f"usefixtures on rank {r}" for r in (0, 1)]
    )


MONKEYPATCH_TESTS = """
import pytest, torch, torch.distributed as dist
import helpers

@pytest.fixture(autouse=True)
def rank_factory(rank, monkeypatch):
    # PhysicsNeMo's mesh suite: a closure over this rank's objects replaces a module's factory
    monkeypatch.setattr(helpers, "factory", lambda: rank)

@pytest.mark.{marker}
def test_each_rank_sees_what_it_patched(rank, monkeypatch):
    monkeypatch.setattr("helpers.value", f"rank {rank}")
    monkeypatch.delattr(helpers, "doomed")
    dist.barrier()  # every rank has patched before any checks
    assert helpers.factory() == rank
    assert helpers.value == f"rank {rank}"
    assert not hasattr(helpers, "doomed")
    t = torch.ones(1)
    dist.all_reduce(t)
    assert helpers.factory() == rank and helpers.value == f"rank {rank}"
"""

AFTER_TESTS = """
import pytest, helpers

@pytest.mark.{marker}
def test_the_next_test_s_ranks_see_the_module_as_it_was(rank):
    assert (helpers.factory(), helpers.value, helpers.doomed) == ("original", "original", "still here")

def test_the_module_is_as_it_was_after_the_ranks():
    assert helpers.factory() == "original"
    assert helpers.value == "original"
    assert helpers.doomed == "still here"
"""


@EITHER_WAY
def test_what_a_rank_monkeypatches_is_its_own(
    pytester: pytest.Pytester, marker: str, args: tuple[str, ...]
) -> None:
    pytester.makepyfile(helpers="factory = lambda: 'original'\nvalue = 'original'\ndoomed = 'still here'\n")
    pytester.makepyfile(
        test_patch=MONKEYPATCH_TESTS.replace("{marker}", marker),
        test_zz_after=AFTER_TESTS.replace("{marker}", marker),
    )
    pytester.syspathinsert()
    result = pytester.runpytest_subprocess(*args, "-v", "-p", "no:randomly")
    if marker == "multigpu_static":  # --multigpu-static runs only distributed tests
        result.assert_outcomes(passed=2, skipped=1)
    else:
        result.assert_outcomes(passed=3)


def test_an_autouse_skip_whose_dependency_a_sub_conftest_overrides_per_rank_skips_every_rank(
    pytester: pytest.Pytester,
) -> None:
    """PhysicsNeMo's shape: an autouse fixture asks for ``device``, which a deeper conftest
    overrides with a fixture built from a per-rank one; its skip applies on every rank, as
    under torchrun, whether the test asks for ``device`` itself or not."""
    pytester.makeconftest(
        """
        import pytest

        @pytest.fixture
        def device():
            return "cuda"
        """
    )
    pytester.makepyfile(
        **{
            "parallel/conftest.py": """
                import pytest, torch.distributed as dist
                from torch.distributed.device_mesh import init_device_mesh

                @pytest.fixture(autouse=True)
                def skip_on_cpu(device):
                    if device == "cpu":
                        pytest.skip("Skip tests on cpu")

                @pytest.fixture(scope="session")
                def user_mesh():
                    return init_device_mesh("cpu", (dist.get_world_size(),))
            """,
            "parallel/mesh/conftest.py": """
                import pytest

                @pytest.fixture
                def device(user_mesh, rank):
                    return user_mesh.device_type
            """,
            "parallel/mesh/test_on_ranks.py": """
                import pytest

                @pytest.mark.multigpu_static
                def test_asks_for_device(device):
                    assert False, "not skipped"

                @pytest.mark.multigpu_static
                def test_does_not(rank):
                    assert False, "not skipped"

                @pytest.mark.world(2)
                def test_world_marked(device):
                    assert False, "not skipped"
            """,
        }
    )
    result = pytester.runpytest_subprocess("--multigpu-static", "-rs")
    result.assert_outcomes(skipped=3)
    result.stdout.fnmatch_lines(
        [f"SKIPPED [[]1[]] parallel/mesh/test_on_ranks.py:{line}: Skip tests on cpu" for line in (3, 7, 11)]
    )
    result = pytester.runpytest_subprocess("-rs", "-k", "world_marked")  # not the static suite
    result.assert_outcomes(skipped=1)
    result.stdout.fnmatch_lines(["SKIPPED [[]1[]] parallel/mesh/test_on_ranks.py:11: Skip tests on cpu"])


# PhysicsNeMo's test tree, in its shape: the root conftest parametrizes `device` and, under
# --multigpu-static, registers a plugin module whose session `distributed_mesh` overrides
# meshsim's; a middle conftest's autouse `skip_on_cpu(device)` comes before another autouse
# fixture (pytest sets up a conftest's autouse fixtures in name order); the deepest conftest
# overrides `device` with one built from `distributed_mesh` (no `rank`); its tests are a base
# module's, re-exported into the static suite.
TREE = {
    "conftest.py": """
        import pytest

        @pytest.fixture(params=["cpu"])
        def device(request):
            return request.param

        def pytest_configure(config):
            if config.getoption("--multigpu-static"):
                config.pluginmanager.register(
                    __import__("plugins.dist_fixtures", fromlist=[""]), name="dist_fixtures"
                )
    """,
    "plugins/__init__.py": "",
    "plugins/dist_fixtures.py": """
        import pytest, torch, torch.distributed as dist
        from torch.distributed.device_mesh import init_device_mesh

        @pytest.fixture(scope="session")
        def distributed_mesh():
            kind = "cuda" if torch.cuda.is_available() else "cpu"
            yield init_device_mesh(kind, (dist.get_world_size(),), mesh_dim_names=("domain",))
    """,
    "parallel/conftest.py": """
        import pytest

        @pytest.fixture(autouse=True)
        def skip_on_cpu(device):
            if device == "cpu":
                pytest.skip("Skip tests on cpu")

        @pytest.fixture(autouse=True)
        def then_a_gpu_is_needed(tmp_path_factory):
            # set up after skip_on_cpu: under torchrun, on a machine without GPUs, never reached
            log = tmp_path_factory.getbasetemp().parent / "log.txt"
            with open(log, "a") as f:
                f.write("reached\\n")
            import torch
            torch.cuda.current_device()
    """,
    "parallel/mesh/conftest.py": """
        import pytest

        @pytest.fixture
        def device(distributed_mesh):
            return distributed_mesh.device_type
    """,
    "basesuite.py": """
        import torch

        def test_ones(device):
            assert torch.ones(2, device=device).sum().item() == 2

        class TestTwice:
            def test_twice(self, device):
                assert (2 * torch.ones(1, device=device)).device.type == device
    """,
    "parallel/mesh/test_imported.py": """
        import pytest, torch.distributed as dist
        from basesuite import TestTwice, test_ones

        pytestmark = pytest.mark.multigpu_static

        def test_on_the_mesh(distributed_mesh):
            assert distributed_mesh.size() == dist.get_world_size()
    """,
}


def test_physicsnemo_s_tree_an_autouse_skip_whose_device_a_deeper_conftest_makes_per_rank(
    pytester: pytest.Pytester,
) -> None:
    """Without CUDA every test skips at skip_on_cpu, on every rank, before the fixtures pytest
    sets up after it, reported at the test's line; with ``--mesh-cuda=cpu`` every test runs."""
    import textwrap

    for path, text in TREE.items():
        target = pytester.path / path
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_text(textwrap.dedent(text))
    pytester.syspathinsert()
    result = pytester.runpytest_subprocess("--multigpu-static", "--world-size", "2", "-rs")
    result.assert_outcomes(skipped=3)
    for where in ("basesuite.py:4", "basesuite.py:8", "parallel/mesh/test_imported.py:7"):  # each test's line
        result.stdout.fnmatch_lines([f"SKIPPED [[]1[]] {where}: Skip tests on cpu"])
    assert not (pytester.path / "log.txt").exists(), "a fixture after the skip was set up"
    result = pytester.runpytest_subprocess("--multigpu-static", "--world-size", "2", "--mesh-cuda=cpu")
    result.assert_outcomes(passed=3)
    # set up once per test, in the pytest process: it needs no per-rank value
    assert (pytester.path / "log.txt").read_text().splitlines() == ["reached"] * 3


def test_a_per_rank_fixture_that_fails_on_one_rank_errors_at_set_up_with_that_rank_s_traceback(
    pytester: pytest.Pytester,
) -> None:
    """On the static suite, as under torchrun: the test errors in its set-up, not in its body."""
    pytester.makepyfile(
        """
        import pytest

        @pytest.fixture
        def shard(rank):
            if rank == 1:
                raise ValueError(f"no shard for rank {rank}")
            return rank

        @pytest.mark.multigpu_static
        def test_takes_the_shard(shard):
            raise AssertionError("the body ran")

        @pytest.mark.multigpu_static
        def test_next(rank):
            pass
        """
    )
    result = pytester.runpytest_subprocess("--multigpu-static", "--world-size", "2")
    result.assert_outcomes(passed=1, errors=1)
    result.stdout.fnmatch_lines(
        [
            "*ERROR at setup of test_takes_the_shard*",
            "rank 1 of 2 raised; its traceback:",
            "*in shard",
            "ValueError: no shard for rank 1",
        ]
    )
    result.stdout.no_fnmatch_line("*the body ran*")
