"""pytest --mesh-cost=TOPOLOGY: distributed tests priced on a GPU topology, budgets, snapshots, traces.

The expected figures come from :func:`meshsim._observe.cost.critical_path` over the
ledgers each program's tests must record, written out by hand here.
"""

from __future__ import annotations

import json
from collections.abc import Sequence

import pytest
import torch

import meshsim
from meshsim._observe.cost import critical_path, format_seconds

from .launch import torchrun_pytest

pytestmark = pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")

PROGRAM = """
import pytest, torch, torch.distributed as dist

@pytest.mark.world(2)
@pytest.mark.mesh_cost_budget(5e-6)
def test_reduce(rank):
    dist.all_reduce(torch.ones(256 * 1024))

@pytest.mark.world(3)
@pytest.mark.mesh_cost_budget("1ms")
def test_chain(rank):
    # three pairs, each its own group: the last pair's call waits for the two before it
    groups = [dist.new_group(pair) for pair in ([0, 1], [1, 2], [0, 2])]
    for group in groups:
        if rank in dist.get_process_group_ranks(group):
            dist.all_reduce(torch.ones(1024 * 1024), group=group)

@pytest.mark.world(4)
def test_gather(rank):
    dist.all_gather_into_tensor(torch.empty(4 * 4096), torch.ones(4096))

@pytest.mark.world(2)
def test_fails(rank):
    dist.barrier()
    assert rank == 0, "rank 1 fails"

def test_not_distributed():
    pass
"""


def _all_reduce(group: Sequence[int], nbytes: int, seq: int = 0) -> meshsim.Collective:
    return meshsim.Collective(
        "all_reduce", "all_reduce", tuple(group), torch.float32, nbytes, nbytes, "SUM", seq, "test_program.py"
    )


MIB = 1024 * 1024
_AB, _BC, _AC = _all_reduce((0, 1), 4 * MIB), _all_reduce((1, 2), 4 * MIB), _all_reduce((0, 2), 4 * MIB)
LEDGERS = {  # what each test's ranks record
    "test_reduce": [[_all_reduce((0, 1), MIB)]] * 2,
    "test_chain": [[_AB, _AC], [_AB, _BC], [_BC, _AC]],
    "test_gather": [
        [
            meshsim.Collective(
                "all_gather",
                "all_gather_into_tensor",
                (0, 1, 2, 3),
                torch.float32,
                16384,
                65536,
                None,
                0,
                "test_program.py",
            )
        ]
    ]
    * 4,
}


def _estimate(test: str, topology: str = "dgx-h100") -> str:
    return format_seconds(critical_path(LEDGERS[test], topology).total)


def _row(test: str, ranks: int, calls: int, extra: str = "") -> str:
    s = "" if calls == 1 else "s"
    return (
        f"*{_estimate(test)}  test_program.py::{test}  ({ranks} ranks, {calls} call{s} on the busiest){extra}"
    )


def test_the_summary_lists_each_test_s_critical_path_slowest_first(pytester: pytest.Pytester) -> None:
    # the chain's last call waits for both before it: more than any one rank's own calls
    assert critical_path(LEDGERS["test_chain"], "dgx-h100").total > 2 * _AB.estimated_time("dgx-h100")
    pytester.makepyfile(test_program=PROGRAM)
    result = pytester.runpytest_subprocess("--mesh-cost=dgx-h100", "--mesh-redundant=off")
    result.assert_outcomes(passed=3, failed=2)  # test_fails, and test_reduce over its 5 us budget
    result.stdout.fnmatch_lines(
        [
            "*= meshsim: estimated communication time on dgx-h100 =*",
            _row("test_chain", 3, 2),
            _row("test_reduce", 2, 1, "  over its budget of 5.0 us"),
            _row("test_gather", 4, 1),
            "3 tests priced: the critical path across each test's ranks, compute not counted*",
        ],
        consecutive=True,
    )
    result.stdout.no_fnmatch_line("*test_fails  (*")
    result.stdout.no_fnmatch_line("*test_not_distributed  (*")


def test_without_the_option_nothing_is_priced_and_budgets_are_not_checked(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(test_program=PROGRAM)
    result = pytester.runpytest_subprocess("--mesh-redundant=off")
    result.assert_outcomes(passed=4, failed=1)
    result.stdout.no_fnmatch_line("*estimated communication time*")


def test_a_test_over_its_budget_fails_with_the_estimate_budget_and_topology(
    pytester: pytest.Pytester,
) -> None:
    budget = 8e-6  # test_gather's estimate is over it, the marker's 1 ms keeps test_chain's
    assert critical_path(LEDGERS["test_gather"], "dgx-h100").total > budget
    pytester.makepyfile(test_program=PROGRAM)
    result = pytester.runpytest_subprocess(
        "--mesh-cost=dgx-h100", "--mesh-cost-budget=8us", "--mesh-redundant=off", "-k", "not fails"
    )
    result.assert_outcomes(passed=2, failed=2)
    result.stdout.fnmatch_lines(
        [
            f"test_program.py::test_reduce: estimated communication time {_estimate('test_reduce')} on "
            "dgx-h100 (the critical path across its 2 ranks) is over its budget of 5.0 us "
            "(@pytest.mark.mesh_cost_budget). Cut its collectives, or raise the budget if the cost is meant.",
            f"test_program.py::test_gather: estimated communication time {_estimate('test_gather')} on "
            "dgx-h100 (the critical path across its 4 ranks) is over its budget of 8.0 us "
            "(--mesh-cost-budget)*",
        ],
        consecutive=False,
    )
    assert "FAILED test_program.py::test_chain" not in result.stdout.str()


def test_gpus_per_node_moves_a_group_across_nodes(pytester: pytest.Pytester) -> None:
    """Two GPUs a node: the chain's (0, 2) pair crosses to another node, and is priced so."""
    spread = meshsim.topology("dgx-h100", gpus_per_node=2)
    expected = format_seconds(critical_path(LEDGERS["test_chain"], spread).total)
    assert expected != _estimate("test_chain")
    pytester.makepyfile(test_program=PROGRAM)
    result = pytester.runpytest_subprocess("--mesh-cost=dgx-h100:gpus_per_node=2", "-k", "chain")
    result.assert_outcomes(passed=1)
    result.stdout.fnmatch_lines(
        [
            "*= meshsim: estimated communication time on dgx-h100:gpus_per_node=2 =*",
            f"{expected}  test_program.py::test_chain  (3 ranks, 2 calls on the busiest)",
        ]
    )


@pytest.mark.slow  # gloo and spawned ranks; ./dev test prices simulated ones
@pytest.mark.parametrize("backend", ["gloo", "spawn"])
def test_other_backends_price_the_same_ledgers(pytester: pytest.Pytester, backend: str) -> None:
    pytester.makepyfile(test_program=PROGRAM)
    chosen = "chain or gather" if backend == "gloo" else "gather"  # spawn costs seconds per test
    result = pytester.runpytest_subprocess("--mesh-cost=dgx-h100", f"--mesh-backend={backend}", "-k", chosen)
    result.assert_outcomes(passed=2 if backend == "gloo" else 1)
    rows = [_row("test_chain", 3, 2), _row("test_gather", 4, 1)]
    result.stdout.fnmatch_lines(rows if backend == "gloo" else rows[1:], consecutive=True)


@pytest.mark.slow  # two inner sessions, one with two xdist workers
def test_the_simulated_static_suite_and_xdist_workers_price_their_tests(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(
        test_static="""
        import pytest, torch, torch.distributed as dist

        @pytest.mark.multigpu_static
        def test_static():
            dist.all_reduce(torch.ones(256 * 1024), group=dist.new_group([0, 1]))
        """
    )
    static = pytester.runpytest_subprocess("--mesh-cost=dgx-h100", "--multigpu-static", "--world-size=3")
    static.assert_outcomes(passed=1)
    # rank 2 takes no part: its ledger is empty, and the path is rank 0's and 1's call
    ledgers = [LEDGERS["test_reduce"][0], LEDGERS["test_reduce"][1], []]
    expected = format_seconds(critical_path(ledgers, "dgx-h100").total)
    static.stdout.fnmatch_lines(
        [f"{expected}  test_static.py::test_static  (3 ranks, 1 call on the busiest)"]
    )

    pytester.makepyfile(test_program=PROGRAM)
    spread = pytester.runpytest_subprocess(
        "--mesh-cost=dgx-h100", "-n", "2", "test_program.py", "-k", "gather"
    )
    spread.assert_outcomes(passed=1)
    spread.stdout.fnmatch_lines([_row("test_gather", 4, 1)])  # counted by xdist's controller


@pytest.mark.slow  # torchrun
def test_torchrun_ranks_price_the_gathered_ledgers(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(
        test_static="""
        import pytest, torch, torch.distributed as dist

        @pytest.mark.multigpu_static
        def test_static():
            dist.all_reduce(torch.ones(256 * 1024))

        @pytest.mark.multigpu_static
        @pytest.mark.mesh_cost_budget("1us")
        def test_over():
            dist.all_reduce(torch.ones(256 * 1024))
        """
    )
    result = torchrun_pytest(pytester, "--mesh-cost=dgx-h100", timeout=300)
    estimate = _estimate("test_reduce")  # the same call on the same two ranks
    result.stdout.fnmatch_lines(
        [
            "meshsim: --multigpu-static, rank 0 of 2",
            f"test_static.py::test_over: estimated communication time {estimate} on dgx-h100 (the critical "
            "path across its 2 ranks) is over its budget of 1.0 us (@pytest.mark.mesh_cost_budget)*",
            f"{estimate}  test_static.py::test_over  (2 ranks, 1 call on the busiest)  over its budget*",
            f"{estimate}  test_static.py::test_static  (2 ranks, 1 call on the busiest)",
            "*1 failed, 1 passed*",
        ],
        consecutive=False,
    )


# An inner pytest each: ./dev test keeps one case per check (topology name, field value,
# budget, budget without topology), the slow tier the rest.
@pytest.mark.parametrize(
    ("options", "message"),
    [
        (
            ["--mesh-cost=dgx-h200"],
            "*--mesh-cost=dgx-h200: unknown topology 'dgx-h200'; expected one of dgx-a100, dgx-h100, "
            "gb200-nvl72, pcie, optionally followed by :FIELD=VALUE,... (e.g. dgx-h100:gpus_per_node=4)*",
        ),
        pytest.param(
            ["--mesh-cost=dgx-h100:gpus=4"],
            "*--mesh-cost=dgx-h100:gpus=4: 'gpus=4' is not FIELD=VALUE with FIELD one of gpus_per_node, "
            "intra_bandwidth, *",
            marks=pytest.mark.slow,
        ),
        (
            ["--mesh-cost=pcie:gpus_per_node=four"],
            "*--mesh-cost=pcie:gpus_per_node=four: gpus_per_node='four' is not a whole number*",
        ),
        pytest.param(
            ["--mesh-cost=pcie:gpus_per_node=0"],
            "*--mesh-cost=pcie:gpus_per_node=0: gpus_per_node must be at least 1, got 0*",
            marks=pytest.mark.slow,
        ),
        pytest.param(
            ["--mesh-cost=pcie:inter_bandwidth=-5"],
            "*--mesh-cost=pcie:inter_bandwidth=-5: topology 'pcie:inter_bandwidth=-5': inter_bandwidth must "
            "be a finite number above 0 (bytes per second), got -5.0*",
            marks=pytest.mark.slow,
        ),
        (
            ["--mesh-cost=pcie", "--mesh-cost-budget=-1ms"],
            "*--mesh-cost-budget=-1ms: expected a positive duration: seconds (0.002) or with a unit "
            "(500us, 2ms, 1.5s)*",
        ),
        pytest.param(
            ["--mesh-cost=pcie", "--mesh-cost-budget=0"],
            "*--mesh-cost-budget=0: expected a positive duration*",
            marks=pytest.mark.slow,
        ),
        (["--mesh-cost-budget=1ms"], "*--mesh-cost-budget needs --mesh-cost=TOPOLOGY to price the tests on*"),
    ],
    ids=["unknown", "field", "not-int", "zero-gpus", "negative-bandwidth", "negative", "zero", "no-topology"],
)
def test_bad_options_are_usage_errors_naming_the_value(
    pytester: pytest.Pytester, options: list[str], message: str
) -> None:
    pytester.makepyfile("def test_x():\n    pass\n")
    result = pytester.runpytest_subprocess(*options)
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines([message])


@pytest.mark.parametrize(
    ("marker", "shown"),
    [
        ("'fast'", "'fast'"),
        # an inner pytest each: ./dev test keeps the first
        *(pytest.param(m, m, marks=pytest.mark.slow) for m in ("-1", "", "1, 2", "ms=2")),
    ],
    ids=["word", "negative", "empty", "two", "keyword"],
)
def test_a_malformed_budget_marker_errors_its_test(
    pytester: pytest.Pytester, marker: str, shown: str
) -> None:
    pytester.makepyfile(
        f"""
        import pytest

        @pytest.mark.world(2)
        @pytest.mark.mesh_cost_budget({marker})
        def test_x(rank):
            pass
        """
    )
    result = pytester.runpytest_subprocess("--mesh-cost=pcie")
    result.assert_outcomes(errors=1)
    result.stdout.fnmatch_lines(
        [
            f"*@pytest.mark.mesh_cost_budget({shown}): expected one positive duration: seconds as a number "
            "(0.002) or a string with a unit ('500us', '2ms')"
        ]
    )


SNAPSHOT_PROGRAM = """
import pytest, torch, torch.distributed as dist

N = 256 * 1024

@pytest.mark.world(2)
def test_reduce(rank, ledger_snapshot):
    dist.all_reduce(torch.ones(N))
"""
ESTIMATE = "estimate of 2 on dgx-h100"


def _snapshot(pytester: pytest.Pytester) -> dict[str, object]:
    document = json.loads((pytester.path / "__snapshots__" / "test_program.ledger.json").read_text())
    entry: dict[str, object] = document["tests"]["test_reduce"]
    return entry


def _set_estimate(pytester: pytest.Pytester, value: str | None) -> None:
    path = pytester.path / "__snapshots__" / "test_program.ledger.json"
    document = json.loads(path.read_text())
    entry = document["tests"]["test_reduce"]
    entry.pop(ESTIMATE, None)
    if value is not None:
        entry[ESTIMATE] = value
    path.write_text(json.dumps(document))


@pytest.mark.slow  # five inner sessions
def test_a_snapshot_carries_the_estimate_and_fails_when_it_moves(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(test_program=SNAPSHOT_PROGRAM)
    cost = ["--mesh-cost=dgx-h100", "--mesh-redundant=off"]
    created = pytester.runpytest_subprocess(*cost)
    created.assert_outcomes(passed=1)
    created.stdout.fnmatch_lines(["meshsim: ledger snapshots: 1 written"])
    line = "all_reduce all_reduce [0,1] float32 in=1048576 out=1048576 SUM"
    stored = _estimate("test_reduce")
    assert _snapshot(pytester) == {"rank 0 of 2": [line], "rank 1 of 2": [line], ESTIMATE: stored}

    # the same calls, an estimate three times the stored one (a model or topology change)
    tripled = format_seconds(3 * critical_path(LEDGERS["test_reduce"], "dgx-h100").total)
    _set_estimate(pytester, tripled)
    moved = pytester.runpytest_subprocess(*cost)
    moved.assert_outcomes(failed=1)
    moved.stdout.fnmatch_lines(
        [
            "the estimated communication time of test_reduce on 2 ranks differs from its ledger snapshot in "
            "__snapshots__/test_program.ledger.json (the collectives are the same):",
            f"estimate of 2 on dgx-h100: stored {tripled}, this run {stored} (0.33*x; the tolerance is "
            "10% either way)",
            "If the change is intended, rerun with --mesh-snapshot-update*",
        ]
    )
    # within 10%: a match, and the file is left as it is
    near = format_seconds(1.05 * critical_path(LEDGERS["test_reduce"], "dgx-h100").total)
    _set_estimate(pytester, near)
    pytester.runpytest_subprocess(*cost).stdout.fnmatch_lines(["meshsim: ledger snapshots: 1 unchanged"])
    assert _snapshot(pytester)[ESTIMATE] == near

    # 64 times the bytes: the lines' diff, and the estimate's move beside it
    pytester.makepyfile(test_program=SNAPSHOT_PROGRAM.replace("N = 256 * 1024", "N = 64 * 256 * 1024"))
    big = format_seconds(critical_path([[_all_reduce((0, 1), 64 * MIB)]] * 2, "dgx-h100").total)
    grown = pytester.runpytest_subprocess(*cost, "--mesh-cost-budget=100us")  # over it, too: both said
    grown.assert_outcomes(failed=1)
    grown.stdout.fnmatch_lines(
        [
            "*-all_reduce all_reduce [[]0,1[]] float32 in=1048576 out=1048576 SUM",
            "*+all_reduce all_reduce [[]0,1[]] float32 in=67108864 out=67108864 SUM",
            f"estimate of 2 on dgx-h100: stored {near}, this run {big} (*x; the tolerance is 10% either way)",
            f"test_program.py::test_reduce: estimated communication time {big} on dgx-h100 (the critical "
            "path across its 2 ranks) is over its budget of 100.0 us (--mesh-cost-budget)*",
        ],
        consecutive=False,
    )
    pytester.runpytest_subprocess(*cost, "--mesh-snapshot-update").stdout.fnmatch_lines(
        ["meshsim: ledger snapshots: 1 rewritten"]
    )
    assert _snapshot(pytester)[ESTIMATE] == big


@pytest.mark.slow  # four inner sessions
def test_an_entry_without_an_estimate_is_not_checked_until_updated(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(test_program=SNAPSHOT_PROGRAM)
    pytester.runpytest_subprocess().assert_outcomes(passed=1)  # written without --mesh-cost
    assert ESTIMATE not in _snapshot(pytester)
    before = _snapshot(pytester)

    pytester.runpytest_subprocess("--mesh-cost=dgx-h100").stdout.fnmatch_lines(
        ["meshsim: ledger snapshots: 1 unchanged"]
    )
    assert _snapshot(pytester) == before
    updated = pytester.runpytest_subprocess("--mesh-cost=dgx-h100", "--mesh-snapshot-update")
    updated.stdout.fnmatch_lines(["meshsim: ledger snapshots: 1 rewritten"])
    assert _snapshot(pytester) == {**before, ESTIMATE: _estimate("test_reduce")}
    # another topology's run has nothing to check against: it passes, and the file stays
    pytester.runpytest_subprocess("--mesh-cost=pcie").assert_outcomes(passed=1)
    assert ESTIMATE in _snapshot(pytester) and "estimate of 2 on pcie" not in _snapshot(pytester)


def test_the_trace_has_the_ranks_on_the_estimated_gpu_clock(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(test_program=PROGRAM)
    result = pytester.runpytest_subprocess("--mesh-cost=dgx-h100", "--mesh-trace=traces", "-k", "chain")
    result.assert_outcomes(passed=1)
    events = json.loads((pytester.path / "traces" / "test_program.py.test_chain.json").read_text())
    gpu = [e for e in events["traceEvents"] if e["pid"] == 2]
    names = {(e["name"], e.get("tid")): e["args"] for e in gpu if e["ph"] == "M"}
    assert names[("process_name", None)] == {"name": "estimated GPU clock, dgx-h100"}
    assert [names[("thread_name", r)]["name"] for r in range(3)] == ["rank 0", "rank 1", "rank 2"]

    schedule = critical_path(LEDGERS["test_chain"], "dgx-h100")
    for rank in range(3):
        drawn = [e for e in gpu if e["ph"] == "X" and e["tid"] == rank]
        spans = schedule.of(rank)
        assert [e["args"]["group"] for e in drawn] == [list(s.call.group) for s in spans]
        assert [e["ts"] for e in drawn] == pytest.approx([s.start * 1e6 for s in spans])
        assert [e["dur"] for e in drawn] == pytest.approx([(s.end - s.start) * 1e6 for s in spans])
        assert [e["args"]["estimate"] for e in drawn] == [str(s.estimate) for s in spans]
    # rank 2's first call waits for the (0, 1) pair's: compute takes no time on this clock
    waited = [e["args"].get("waited for a slower rank") for e in gpu if e["ph"] == "X" and e["tid"] == 2]
    assert waited == [format_seconds(schedule.of(2)[0].start), None]


def test_the_options_and_the_marker_are_documented(pytester: pytest.Pytester) -> None:
    pytester.runpytest("--help").stdout.fnmatch_lines(
        ["  --mesh-cost=TOPOLOGY *price each distributed test's*", "  --mesh-cost-budget=DURATION"]
    )
    pytester.runpytest("--markers").stdout.fnmatch_lines(["@pytest.mark.mesh_cost_budget(duration): *"])
