"""pytest --mesh-trace=DIR: one Chrome trace file per test that starts simulated worlds."""

from __future__ import annotations

import json

import pytest

pytestmark = pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")

PROGRAM = """
import pytest, torch, torch.distributed as dist
import meshsim

@pytest.mark.world(2, 3)
def test_marked(rank):
    dist.all_reduce(torch.full((2,), float(rank)))

def test_two_worlds():
    meshsim.run(lambda: dist.barrier(), 2)
    meshsim.run(lambda: dist.barrier(), 4)

@pytest.mark.world(2)
def test_fails(rank):
    assert rank == 0, "rank 1 fails"

def test_no_world():
    pass
"""


def test_each_test_writes_its_worlds_to_files_named_after_it(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(test_program=PROGRAM)
    result = pytester.runpytest_subprocess("--mesh-trace=traces")
    result.assert_outcomes(passed=4, failed=1)
    folder = pytester.path / "traces"
    result.stdout.fnmatch_lines([f"meshsim: traces: 5 written to {folder}"])
    names = sorted(p.name for p in folder.iterdir())
    assert names == [
        "test_program.py.test_fails.json",
        "test_program.py.test_marked_world2.json",
        "test_program.py.test_marked_world3.json",
        "test_program.py.test_two_worlds-2.json",
        "test_program.py.test_two_worlds.json",
    ]

    def ranks(name: str) -> int:
        events = json.loads((folder / name).read_text())["traceEvents"]
        return sum(1 for e in events if e["ph"] == "M" and e["name"] == "thread_name")

    assert [ranks(n) for n in names[1:]] == [2, 3, 4, 2]
    failed = json.loads((folder / "test_program.py.test_fails.json").read_text())["traceEvents"]
    (error,) = [e for e in failed if e.get("cat") == "error"]
    assert error["tid"] == 1 and "rank 1 fails" in error["args"]["error"]


def test_other_backends_are_a_usage_error(pytester: pytest.Pytester) -> None:
    pytester.makepyfile("def test_x():\n    pass\n")
    result = pytester.runpytest_subprocess("--mesh-trace=traces", "--mesh-backend=gloo")
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines(
        ["*--mesh-trace draws simulated worlds*with --mesh-backend=gloo there is nothing to draw*"]
    )
    assert not (pytester.path / "traces").exists()


def test_the_simulated_static_suite_writes_one_file_per_test(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(
        test_static="""
import pytest, torch, torch.distributed as dist

@pytest.mark.multigpu_static
def test_a():
    dist.all_reduce(torch.full((2,), float(dist.get_rank())))

@pytest.mark.multigpu_static
def test_b():
    assert dist.get_rank() != 1, "rank 1 fails"
"""
    )
    result = pytester.runpytest_subprocess("--multigpu-static", "--world-size=2", "--mesh-trace=traces")
    result.assert_outcomes(passed=1, failed=1)
    folder = pytester.path / "traces"
    assert sorted(p.name for p in folder.iterdir()) == [
        "test_static.py.test_a.json",
        "test_static.py.test_b.json",
    ]
    a = json.loads((folder / "test_static.py.test_a.json").read_text())["traceEvents"]
    assert sorted((e["name"], e["tid"]) for e in a if e["ph"] == "X") == [
        ("all_reduce", 0),
        ("all_reduce", 1),
        ("test_a", 0),
        ("test_a", 1),
    ]
    b = json.loads((folder / "test_static.py.test_b.json").read_text())["traceEvents"]
    (error,) = [e for e in b if e.get("cat") == "error"]
    assert error["tid"] == 1 and "rank 1 fails" in error["args"]["error"]
