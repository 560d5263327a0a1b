"""The pytest plugin, driven from outside with pytester."""

from __future__ import annotations

import socket

import pytest

pytestmark = pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")

MESH_TEST = """
import pytest, torch, torch.distributed as dist

@pytest.mark.world(1, 2, 4)
def test_sizes(rank, world_size, ledger):
    t = torch.ones(2)
    dist.all_reduce(t)
    assert t[0] == world_size and rank == dist.get_rank()
    assert ledger.counts() == {"all_reduce": 1}

@pytest.mark.world(4)
def test_meshes(distributed_mesh, distributed_mesh_2d, make_mesh, rank):
    assert distributed_mesh.mesh_dim_names == ("domain",) and distributed_mesh.size() == 4
    assert distributed_mesh_2d.shape == (2, 2)
    assert distributed_mesh_2d.mesh_dim_names == ("axis1", "axis2")
    mesh = make_mesh((2, 2), ("dp", "tp"))
    assert mesh is make_mesh((2, 2), ("dp", "tp"))
    assert tuple(mesh.get_coordinate()) == (rank // 2, rank % 2)

@pytest.mark.multigpu_static
def test_static_marker(world_size):
    assert world_size == 3

def test_plain():
    assert True
"""


def test_markers_are_documented(pytester: pytest.Pytester) -> None:
    result = pytester.runpytest("--markers")
    result.stdout.fnmatch_lines(
        [
            "@pytest.mark.world(*sizes, backend=None): run the test body on each of these numbers of ranks*",
            "@pytest.mark.multigpu_static: a distributed test (PhysicsNeMo's marker)*",
        ]
    )


def test_fixtures_are_documented(pytester: pytest.Pytester) -> None:
    result = pytester.runpytest("--fixtures")
    result.stdout.fnmatch_lines(
        [
            "distributed_mesh*",
            '*A 1-D DeviceMesh over every rank, dim name ``"domain"``*',
            "ledger*",
            "*This rank's :class:`meshsim.Ledger`*",
        ]
    )


FAILURES = """
import pytest, torch, torch.distributed as dist

@pytest.mark.world(4)
def test_rank_zero_fails(rank):
    if rank == 0:
        assert False, "only rank zero"
    dist.barrier()  # the others wait here for rank 0, which never comes

@pytest.mark.world(2)
def test_mismatch(rank):
    dist.all_reduce(torch.ones(3 if rank else 4))

@pytest.mark.world(2)
def test_deadlock(rank):
    if rank == 0:
        dist.barrier()

def test_no_marker(rank):
    pass

@pytest.mark.world(2, backend="gloo")
def test_gloo_marker(ledger):
    assert dist.get_backend() == "gloo"
    dist.all_reduce(torch.ones(1))
    assert ledger.counts() == {"all_reduce": 1}
"""


def test_collected_ids(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(test_mesh=MESH_TEST)
    collected = pytester.runpytest("--collect-only", "-q")
    collected.stdout.fnmatch_lines(
        [
            "test_mesh.py::test_sizes[[]world1[]]",
            "test_mesh.py::test_sizes[[]world2[]]",
            "test_mesh.py::test_sizes[[]world4[]]",
            "test_mesh.py::test_meshes",
        ]
    )


def test_fixtures_failures_and_reports(pytester: pytest.Pytester) -> None:
    """One subprocess run (torch cannot be imported twice in one process, as pytester's
    in-process mode would): per-rank fixtures, a failing rank, mismatch and deadlock tables."""
    pytester.makepyfile(test_mesh=MESH_TEST, test_failures=FAILURES)
    result = pytester.runpytest_subprocess("--world-size", "3", "--mesh-timeout", "60", "-v")
    result.assert_outcomes(passed=7, failed=3, errors=1)
    result.stdout.fnmatch_lines(
        [
            "*test_failures.py::test_rank_zero_fails FAILED*",
            "*test_failures.py::test_mismatch FAILED*",
            "*test_failures.py::test_deadlock FAILED*",
            "*test_failures.py::test_no_marker ERROR*",
            "*test_failures.py::test_gloo_marker PASSED*",
            "*test_mesh.py::test_static_marker PASSED*",
        ],
        consecutive=False,
    )
    result.stdout.fnmatch_lines(
        [
            "rank 0 of 4 raised; its traceback:",
            '*assert False, "only rank zero"',
            "AssertionError: only rank zero",
        ]
    )
    result.stdout.fnmatch_lines(
        [
            "CollectiveMismatchError: ranks entered different collectives in call #0 of group [[]0, 1[]]:",
            "  rank 0: all_reduce(float32[[]4[]], SUM)*",
            "  rank 1: all_reduce(float32[[]3[]], SUM)*",
        ]
    )
    result.stdout.fnmatch_lines(
        [
            "DeadlockError: deadlock: no rank of the 2-rank world can make progress.",
            "*rank 1: finished: its function returned",
        ]
    )
    result.stdout.fnmatch_lines(["*fixture 'rank' is per rank; mark the test with @pytest.mark.world(n)*"])
    result.stdout.no_fnmatch_line("*timeout: *")


def test_gloo_backend_option(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(
        """
        import pytest, torch, torch.distributed as dist

        @pytest.mark.world(2)
        def test_option(ledger):
            assert dist.get_backend() == "gloo"
            dist.all_reduce(torch.ones(1))
            assert ledger.counts() == {"all_reduce": 1}

        @pytest.mark.world(2, backend="sim")
        def test_override():
            assert dist.get_backend() == "meshsim"
        """
    )
    pytester.runpytest_subprocess("--mesh-backend", "gloo").assert_outcomes(passed=2)


@pytest.mark.parametrize(
    ("marker", "message"),
    [
        ("world()", "@pytest.mark.world needs one or more positive int world sizes, got ()"),
        ("world(0)", "@pytest.mark.world needs one or more positive int world sizes, got (0,)"),
        (
            "world(2, backend='mpi')",
            "@pytest.mark.world(backend=...) must be one of ('sim', 'gloo', 'spawn'), got 'mpi'",
        ),
        ("world(2, size=3)", "@pytest.mark.world takes sizes and backend=..., got ['size']"),
    ],
)
def test_bad_world_markers(pytester: pytest.Pytester, marker: str, message: str) -> None:
    pytester.makepyfile(f"import pytest\n@pytest.mark.{marker}\ndef test_x():\n    pass\n")
    result = pytester.runpytest()
    result.assert_outcomes(errors=1)
    result.stdout.fnmatch_lines(["*ERROR collecting*", message])
    result.stdout.no_fnmatch_line("*Traceback*")


def test_bad_options(pytester: pytest.Pytester) -> None:
    result = pytester.runpytest("--world-size", "0")
    result.stderr.fnmatch_lines(["*--world-size must be a positive integer, got '0'*"])


def test_static_mode_with_xdist_is_a_usage_error(
    pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch
) -> None:
    _torchrun_env(monkeypatch, world_size=1)
    pytester.makepyfile("def test_x():\n    pass\n")
    result = pytester.runpytest_subprocess("--multigpu-static", "-n", "2")
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines(["*--multigpu-static is incompatible with -n (pytest-xdist)*"])


def _torchrun_env(monkeypatch: pytest.MonkeyPatch, *, world_size: int) -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    for key, value in {
        "RANK": "0",
        "LOCAL_RANK": "0",
        "WORLD_SIZE": str(world_size),
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(port),
    }.items():
        monkeypatch.setenv(key, value)


def test_static_mode_skips_other_world_sizes_and_writes_per_rank_junit(
    pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A 1-process torchrun job: rank 0 of 1, on gloo."""
    _torchrun_env(monkeypatch, world_size=1)
    pytester.makepyfile(
        """
        import pytest, torch, torch.distributed as dist

        @pytest.mark.world(1, 2)
        def test_sizes(rank, world_size, ledger, distributed_mesh):
            dist.all_reduce(torch.ones(1))
            assert (rank, world_size) == (0, 1)
            assert ledger.counts() == {"all_reduce": 1}

        def test_plain():
            pass
        """
    )
    result = pytester.runpytest_subprocess("--multigpu-static", "-rs", "--junitxml=junit-{rank}.xml")
    result.assert_outcomes(passed=1, skipped=2)
    result.stdout.fnmatch_lines(
        [
            "*needs a world of 2 ranks; torchrun started 1 (WORLD_SIZE)*",
            "*--multigpu-static runs only distributed tests (marked world or multigpu_static)*",
        ]
    )
    assert (pytester.path / "junit-0.xml").exists()
