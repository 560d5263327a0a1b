"""--mesh-redundant={off,summary,report,error} and the allow_redundant marker, from outside (pytester)."""

from __future__ import annotations

import pytest

pytestmark = pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")

PROGRAM = """
import pytest, torch, torch.distributed as dist

def shape_exchange():
    out = torch.empty(2 * dist.get_world_size(), dtype=torch.int64)
    dist.all_gather_into_tensor(out, torch.tensor([8, 3]))  # the same 16 bytes on every rank

@pytest.mark.world(2)
def test_wasteful(rank):
    shape_exchange()
    shape_exchange()  # a call is given one reason: this one is also a repeat of the first

@pytest.mark.world(2)
@pytest.mark.allow_redundant("all_gather")
def test_allowed(rank):
    shape_exchange()

@pytest.mark.world(2)
@pytest.mark.allow_redundant("all_reduce")
def test_allowed_something_else(rank):
    shape_exchange()

@pytest.mark.world(2)
def test_useful(rank):
    out = torch.empty(2 * dist.get_world_size(), dtype=torch.int64)
    dist.all_gather_into_tensor(out, torch.tensor([8, rank]))
"""

SAME = "every rank contributed the same 16 bytes: each rank could build the result from its own input"


def test_the_default_is_one_summary_line(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(test_program=PROGRAM)
    result = pytester.runpytest_subprocess("-p", "no:randomly")
    result.assert_outcomes(passed=4)
    out = result.stdout.str()
    mine = [line for line in out.splitlines() if "collective" in line]
    assert mine == [
        "meshsim: 3 collectives in 2 tests told no rank anything new (--mesh-redundant=report lists them)"
    ]
    assert "shape_exchange" not in out


def test_report_lists_each_call_site_with_its_tests(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(test_program=PROGRAM)
    result = pytester.runpytest_subprocess("-p", "no:randomly", "--mesh-redundant=report")
    result.assert_outcomes(passed=4)
    result.stdout.fnmatch_lines(
        [
            "*= meshsim: redundant collectives =*",
            f"all_gather_into_tensor at test_program.py:5 in shape_exchange: {SAME}",
            "  3 collectives in 2 tests:",
            "    test_program.py::test_allowed_something_else",
            "    test_program.py::test_wasteful (2 times)",
            "3 collectives in 2 tests told no rank anything new (--mesh-redundant=error fails them; "
            "@pytest.mark.allow_redundant allows known ones)",
        ]
    )
    section = result.stdout.str().split("meshsim: redundant collectives")[1]
    assert "test_useful" not in section
    assert "test_allowed\n" not in section


def test_error_fails_the_test_with_each_wasted_call_and_the_marker_allows_known_ones(
    pytester: pytest.Pytester,
) -> None:
    pytester.makepyfile(test_program=PROGRAM)
    result = pytester.runpytest_subprocess("--mesh-redundant=error")
    result.assert_outcomes(passed=2, failed=2)
    result.stdout.fnmatch_lines(
        [
            "test_program.py::test_wasteful issued 2 collectives that told no rank anything new:",
            f"  all_gather_into_tensor at test_program.py:5 in shape_exchange (2 times): {SAME}",
            "Remove them, or mark the test @pytest.mark.allow_redundant(...) if they are meant; "
            "--mesh-redundant=report lists them without failing.",
        ],
        consecutive=False,
    )
    result.stdout.fnmatch_lines(["FAILED test_program.py::test_allowed_something_else*"], consecutive=False)


def test_off_does_not_look(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(
        test_program=PROGRAM
        + """
def test_the_ledger_has_no_reasons():
    import meshsim
    def body():
        with meshsim.record() as ledger:
            dist.all_reduce(torch.ones(2))
        return [c.redundant for c in ledger]
    assert meshsim.run(body, 2) == [[None], [None]]
"""
    )
    result = pytester.runpytest_subprocess("--mesh-redundant=off")
    result.assert_outcomes(passed=5)
    assert "redundant collectives" not in result.stdout.str()


def test_a_bad_mode_is_a_usage_error(pytester: pytest.Pytester) -> None:
    pytester.makepyfile("def test_x():\n    pass\n")
    result = pytester.runpytest_subprocess("--mesh-redundant=loud")
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines(
        ["*--mesh-redundant: invalid choice: 'loud' (choose from *off*summary*report*error*"]
    )


DDP_PROGRAM = """
import pytest, torch, torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

@pytest.mark.world(2)
def test_ddp(rank):
    torch.manual_seed(0)  # the same parameters everywhere: DDP's broadcasts move nothing new
    model = DDP(torch.nn.Linear(4, 4))
    model(torch.ones(2, 4)).sum().backward()  # the same gradients: its all_reduce is wasted too

@pytest.mark.world(2)
def test_fails_after_waste(rank):
    dist.all_reduce(torch.ones(3))
    assert rank == 5
"""


def test_torchs_own_calls_are_apart_and_never_fail_a_test(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(test_program=DDP_PROGRAM)
    result = pytester.runpytest_subprocess("-p", "no:randomly", "--mesh-redundant=error", "-k", "ddp")
    result.assert_outcomes(passed=1)
    result.stdout.fnmatch_lines(
        [
            "meshsim: 4 more made by torch's parallelism modules (DDP, FSDP, ...), not counted "
            "(--mesh-redundant=report lists them)"
        ]
    )
    result = pytester.runpytest_subprocess("-p", "no:randomly", "--mesh-redundant=report", "-k", "ddp")
    result.assert_outcomes(passed=1)
    result.stdout.fnmatch_lines(
        [
            "*= meshsim: redundant collectives made by torch =*",
            "broadcast at test_program.py:7 in test_ddp (made by torch.nn.parallel.distributed): *",
            "*all_reduce at test_program.py:8 in test_ddp (made by torch.nn.parallel.distributed "
            "(its C++ gradient reducer)): *",
            "4 collectives in 1 test made by torch's parallelism modules told no rank anything new: *",
        ],
        consecutive=False,
    )
    assert "= meshsim: redundant collectives =" not in result.stdout.str()  # none of the test's own


def test_a_failing_test_shows_its_own_wasted_calls(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(test_program=DDP_PROGRAM)
    result = pytester.runpytest_subprocess("-p", "no:randomly", "-k", "fails")
    result.assert_outcomes(failed=1)
    result.stdout.fnmatch_lines(
        [
            "*- meshsim: redundant collectives -*",
            "1 collective told no rank anything new:",
            "  all_reduce at test_program.py:12 in test_fails_after_waste: every rank's input is the same*",
        ],
        consecutive=False,
    )
