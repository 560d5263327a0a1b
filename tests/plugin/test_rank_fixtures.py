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
