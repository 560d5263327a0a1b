"""``--mesh-cost=TOPOLOGY``: what each distributed test's collectives would cost on GPUs, and budgets.

With ``--mesh-cost=dgx-h100`` (any preset of :func:`meshsim.topology`, optionally
``NAME:FIELD=VALUE,...`` to change its figures, e.g. ``dgx-h100:gpus_per_node=4``),
every world-marked or ``multigpu_static`` test that passes on its ranks is priced:
its ranks' ledgers laid out on one estimated GPU clock
(:func:`meshsim._observe.cost.critical_path`: a collective ends for everyone when
its last rank could start it, plus the slowest rank's estimate; compute takes no
time). The session ends with the slowest tests. ``--mesh-cost-budget=DURATION``, or
``@pytest.mark.mesh_cost_budget(DURATION)`` on a test (the marker wins), fails a
test whose estimate is over it.

The ledgers reach this module from :mod:`meshsim._pytest.ranks`, which hands every
rank's ledger of a passed body to the checks features add to the run's state
(:func:`check_for`'s here) on every backend; the
estimate travels on the test's report (to xdist's controller too). Snapshots and
traces read the topology from the run's state (:mod:`meshsim._pytest.state`).

Non-goals: worlds a test starts itself (``meshsim.run`` in a plain test) are not
priced here; price their ledgers with ``critical_path`` directly.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Generator
from typing import TYPE_CHECKING, Any

import pytest

from meshsim._pytest.state import state_of

if TYPE_CHECKING:
    from meshsim._observe.topology import Topology

__all__ = ["check_for"]

_MARKER = "mesh_cost_budget"
_BUDGET = pytest.StashKey[tuple[float, str]]()  # a test's budget in seconds, and who set it
_PRICED = pytest.StashKey[dict[str, Any]]()  # what the test's estimate came to (see _priced)
_SHOWN = 10  # tests the summary lists without -v


def _topology(text: str) -> Topology:
    """``--mesh-cost=NAME[:FIELD=VALUE,...]`` as a topology named after the option's text."""
    from meshsim._observe.topology import PRESETS, topology

    name, _, rest = text.strip().partition(":")
    if name not in PRESETS:
        raise pytest.UsageError(
            f"--mesh-cost={text}: unknown topology {name!r}; expected one of {', '.join(sorted(PRESETS))}, "
            "optionally followed by :FIELD=VALUE,... (e.g. dgx-h100:gpus_per_node=4)"
        )
    overrides: dict[str, Any] = dict(_field(text, part) for part in rest.split(",")) if rest else {}
    try:
        return topology(name, name=text.strip(), **overrides)
    except (TypeError, ValueError) as error:
        raise pytest.UsageError(f"--mesh-cost={text}: {error}") from None


def _topology_text(text: str) -> str:
    """The option's converter: checks the text now (a usage error), keeps it a string (xdist sends
    the options to its workers, which rebuild the topology)."""
    _topology(text)
    return text.strip()


_NUMBER_FIELDS = ("intra_bandwidth", "intra_latency", "inter_bandwidth", "inter_latency", "base_latency")


def _field(text: str, part: str) -> tuple[str, int | float]:
    """One ``FIELD=VALUE`` of the option: ``gpus_per_node`` an int, the links' figures numbers (SI)."""
    key, eq, value = (s.strip() for s in part.partition("="))
    fields = ("gpus_per_node", *_NUMBER_FIELDS)
    if not eq or key not in fields:
        raise pytest.UsageError(
            f"--mesh-cost={text}: {part.strip()!r} is not FIELD=VALUE with FIELD one of {', '.join(fields)} "
            "(e.g. dgx-h100:gpus_per_node=4,inter_bandwidth=25e9)"
        )
    try:
        return key, int(value) if key == "gpus_per_node" else float(value)
    except ValueError:
        wanted = "a whole number" if key == "gpus_per_node" else "a number (bytes per second or seconds)"
        raise pytest.UsageError(f"--mesh-cost={text}: {key}={value!r} is not {wanted}") from None


def _duration(text: str) -> float:
    """``--mesh-cost-budget``: a positive duration, seconds or with a unit."""
    from meshsim._observe.cost import parse_seconds

    try:
        seconds = parse_seconds(text)
    except ValueError:
        seconds = 0.0
    if not seconds > 0:
        raise pytest.UsageError(
            f"--mesh-cost-budget={text}: expected a positive duration: seconds (0.002) or with a unit "
            "(500us, 2ms, 1.5s)"
        )
    return seconds


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("meshsim")
    group.addoption(
        "--mesh-cost",
        metavar="TOPOLOGY",
        type=_topology_text,
        default=None,
        help="price each distributed test's collectives on a GPU topology (dgx-h100, gb200-nvl72, "
        "dgx-a100, pcie; NAME:gpus_per_node=4 and other FIELD=VALUE change its figures): the "
        "critical path across its ranks, the slowest tests listed at the end, ledger snapshots "
        "and --mesh-trace files carry it",
    )
    group.addoption(
        "--mesh-cost-budget",
        metavar="DURATION",
        type=_duration,
        default=None,
        help="with --mesh-cost: fail a test whose estimate is over DURATION (seconds, or 500us, 2ms); "
        "@pytest.mark.mesh_cost_budget(DURATION) sets one test's",
    )


def pytest_configure(config: pytest.Config) -> None:
    """The marker, and the topology every feature prices on."""
    config.addinivalue_line(
        "markers",
        f"{_MARKER}(duration): with --mesh-cost, fail the test when its estimated communication "
        "time (the critical path across its ranks) is over duration: seconds as a number, or a "
        "string with a unit ('500us', '2ms'); overrides --mesh-cost-budget",
    )
    text = config.getoption("mesh_cost", None)
    if config.getoption("mesh_cost_budget", None) is not None and text is None:
        raise pytest.UsageError("--mesh-cost-budget needs --mesh-cost=TOPOLOGY to price the tests on")
    state = state_of(config)
    state.topology = _topology(text) if text is not None else None
    state.check_ledgers_with(1, check_for)  # after the snapshot check: a changed snapshot is still priced


def pytest_runtest_setup(item: pytest.Item) -> None:
    """The test's budget: its marker's, else the option's; a malformed marker fails the test here."""
    marker = item.get_closest_marker(_MARKER)
    if marker is not None:
        item.stash[_BUDGET] = (_marker_budget(marker), f"@pytest.mark.{_MARKER}")
    elif (budget := item.config.getoption("mesh_cost_budget", None)) is not None:
        item.stash[_BUDGET] = (budget, "--mesh-cost-budget")


def _marker_budget(marker: pytest.Mark) -> float:
    from meshsim._observe.cost import parse_seconds

    (value, *extra), kwargs = marker.args or (None,), marker.kwargs
    seconds = 0.0
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        seconds = float(value)
    elif isinstance(value, str):
        try:
            seconds = parse_seconds(value)
        except ValueError:
            pass
    if extra or kwargs or not seconds > 0 or seconds == float("inf"):
        given = ", ".join([*map(repr, marker.args), *(f"{k}={v!r}" for k, v in kwargs.items())])
        pytest.fail(
            f"@pytest.mark.{_MARKER}({given}): expected one positive duration: seconds as a number "
            "(0.002) or a string with a unit ('500us', '2ms')",
            pytrace=False,
        )
    return seconds


class _OverBudget(AssertionError):
    """The test's estimated communication time is over its budget."""


def check_for(item: pytest.Function, write: bool) -> Callable[[list[Any]], None] | None:
    """Under ``--mesh-cost``: what prices every rank's ledger of the test's body (and checks its budget).

    ``write`` does not matter: pricing writes nothing.
    """
    topology = state_of(item.config).topology
    if topology is None:
        return None

    def check(ledgers: list[Any]) -> None:
        from meshsim._observe.cost import critical_path

        try:
            seconds = critical_path(ledgers, topology).total
        except ValueError as error:  # ledgers that do not line up: say so, the test stands
            item.stash[_PRICED] = {"error": str(error).splitlines()[0]}
            return
        priced = _priced(item, seconds, ledgers)
        item.stash[_PRICED] = priced
        if priced["budget"] is not None and seconds > priced["budget"]:
            raise _OverBudget(_over_text(item, topology, priced))

    return check


def _priced(item: pytest.Item, seconds: float, ledgers: list[Any]) -> dict[str, Any]:
    budget, by = item.stash.get(_BUDGET, (None, None))
    calls = max((len(ledger) for ledger in ledgers), default=0)
    return {"seconds": seconds, "ranks": len(ledgers), "calls": calls, "budget": budget, "by": by}


def _over_text(item: pytest.Item, topology: Topology, priced: dict[str, Any]) -> str:
    from meshsim._observe.cost import format_seconds

    return (
        f"{item.nodeid}: estimated communication time {format_seconds(priced['seconds'])} on "
        f"{topology.name} (the critical path across its {priced['ranks']} ranks) is over its budget "
        f"of {format_seconds(priced['budget'])} ({priced['by']}). Cut its collectives, or raise "
        "the budget if the cost is meant."
    )


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(
    item: pytest.Item, call: pytest.CallInfo[None]
) -> Generator[None, pytest.TestReport, pytest.TestReport]:
    """The estimate travels on the report (to xdist's controller too); over budget: the message alone."""
    report = yield
    if call.when != "call":
        return report
    priced = item.stash.get(_PRICED, None)
    if priced is not None:
        report.meshsim_cost = dict(priced)  # type: ignore[attr-defined]
    if call.excinfo is not None and isinstance(call.excinfo.value, _OverBudget):
        error = call.excinfo.value
        report.longrepr = "\n".join([str(error), *getattr(error, "__notes__", [])])
    return report


@dataclasses.dataclass(frozen=True)
class _Row:
    nodeid: str
    seconds: float
    ranks: int
    calls: int
    budget: float | None


def pytest_terminal_summary(terminalreporter: Any, exitstatus: int, config: pytest.Config) -> None:
    """The slowest tests by estimate (``-v``: every one), and those that could not be priced."""
    topology = state_of(config).topology
    if topology is None:
        return
    from meshsim._observe.cost import format_seconds

    rows, unpriced = _collected(terminalreporter)
    terminalreporter.section(f"meshsim: estimated communication time on {topology.name}", sep="=")
    if not rows and not unpriced:
        terminalreporter.write_line("no distributed test passed: nothing priced")
        return
    rows.sort(key=lambda row: (-row.seconds, row.nodeid))
    shown = rows if config.getoption("verbose", 0) > 0 else rows[:_SHOWN]
    times = [format_seconds(row.seconds) for row in shown]
    width = max((len(t) for t in times), default=0)
    for row, time in zip(shown, times):
        calls = f"{row.calls} call" + ("" if row.calls == 1 else "s")
        over = ""
        if row.budget is not None and row.seconds > row.budget:
            over = f"  over its budget of {format_seconds(row.budget)}"
        line = f"{time:>{width}}  {row.nodeid}  ({row.ranks} ranks, {calls} on the busiest){over}"
        terminalreporter.write_line(line)
    if len(rows) > len(shown):
        terminalreporter.write_line(f"... and {len(rows) - len(shown)} faster (-v lists them)")
    for nodeid, reason in unpriced:
        terminalreporter.write_line(f"not priced: {nodeid}: {reason}")
    terminalreporter.write_line(
        f"{len(rows)} test{'s' if len(rows) != 1 else ''} priced: the critical path across each test's "
        "ranks, compute not counted (--mesh-cost-budget or @pytest.mark.mesh_cost_budget fail tests over "
        "a budget)"
    )


def _collected(terminalreporter: Any) -> tuple[list[_Row], list[tuple[str, str]]]:
    rows, unpriced = [], []
    for reports in terminalreporter.stats.values():
        for report in reports:
            priced = getattr(report, "meshsim_cost", None)
            if priced is None:
                continue
            if "error" in priced:
                unpriced.append((report.nodeid, priced["error"]))
                continue
            row = _Row(report.nodeid, priced["seconds"], priced["ranks"], priced["calls"], priced["budget"])
            rows.append(row)
    return rows, sorted(unpriced)
