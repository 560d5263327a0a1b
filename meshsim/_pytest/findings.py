"""``--mesh-redundant``: the wasted collectives each test's simulated worlds find, reported or failed.

``summary`` (the default) ends the session with one line counting them, and shows a
failing test's own beside its failure; ``report`` lists them all at the end, one
entry per call site and rule; ``error`` fails the tests that issue them; ``off``
makes worlds not look at all. ``@pytest.mark.allow_redundant(*ops)`` allows known
ones. Calls that torch's parallelism modules make by design (DDP's and FSDP's
parameter sync and gradient reductions, ...) are counted apart: they are not the
test's own waste, and ``error`` does not fail them. While a test runs, a
:class:`meshsim._observe.watch.Watch` collects what its worlds find.
"""

from __future__ import annotations

import re
from collections import Counter
from collections.abc import Generator
from typing import Any

import pytest

from meshsim._pytest.state import state_of

__all__: list[str] = []

# a test's wasted calls: (api, site, reason, times, made_by: the torch module that made them or "")
Wasted = tuple[str, str, str, int, str]
_WASTED = pytest.StashKey[list[Wasted]]()


@pytest.hookimpl(tryfirst=True)
def pytest_configure(config: pytest.Config) -> None:
    """The marker; ``off``: the run's worlds do not look (a watch open until the run ends)."""
    config.addinivalue_line(
        "markers",
        "allow_redundant(*ops, reason=None): wasted collectives this test issues on purpose "
        "(all of them, or only these ops, e.g. 'all_gather'); not reported, and not failures "
        "under --mesh-redundant=error",
    )
    if config.getoption("mesh_redundant", "summary") == "off":
        from meshsim._observe.watch import Watch, watching

        state_of(config).watches.enter_context(watching(Watch(redundant=False)))


def pytest_unconfigure(config: pytest.Config) -> None:
    state_of(config).watches.close()


class _RedundantCollectives(AssertionError):
    """The test issued collectives that told no rank anything new (``--mesh-redundant=error``)."""


@pytest.hookimpl(wrapper=True)
def pytest_runtest_call(item: pytest.Item) -> Generator[None, None, None]:
    """Collect the wasted collectives the test's worlds find; under ``error``, fail on them."""
    mode = item.config.getoption("mesh_redundant", "summary")
    if mode == "off":
        return (yield)
    from meshsim._observe.findings import collecting

    with collecting() as found:
        try:
            result = yield
        finally:
            kept = _not_allowed(item, found)
            if kept:
                item.stash[_WASTED] = kept
    own = [w for w in kept if not w[4]]
    if own and mode == "error":
        raise _RedundantCollectives(_wasted_text(own, item.nodeid))
    return result


def _not_allowed(item: pytest.Item, found: list[Any]) -> list[Wasted]:
    """The findings the test's allow_redundant markers do not allow, per site, reason, maker."""
    allowed: set[str] = set()
    everything = False
    for marker in item.iter_markers("allow_redundant"):
        if not marker.args:
            everything = True
        allowed.update(str(op) for op in marker.args)
    if everything:
        return []
    counts: Counter[tuple[str, str, str, str]] = Counter(
        (f.api, f.site, f.reason, f.made_by or "")
        for f in found
        if f.op not in allowed and f.api not in allowed
    )
    return [(api, site, reason, times, by) for (api, site, reason, by), times in counts.items()]


def _wasted_text(wasted: list[Wasted], nodeid: str) -> str:
    lines = [f"{nodeid} issued {_calls(sum(w[3] for w in wasted))} that told no rank anything new:"]
    lines += _entries(wasted)
    lines.append(
        "Remove them, or mark the test @pytest.mark.allow_redundant(...) if they are meant; "
        "--mesh-redundant=report lists them without failing."
    )
    return "\n".join(lines)


def _entries(wasted: list[Wasted]) -> list[str]:
    lines = []
    for api, site, reason, times, by in wasted:
        again = f" ({times} times)" if times > 1 else ""
        made = f" (made by {by})" if by else ""
        lines.append(f"  {api} at {site}{made}{again}: {reason}")
    return lines


def _calls(n: int) -> str:
    return f"{n} collective" if n == 1 else f"{n} collectives"


def _tests(n: int) -> str:
    return f"{n} test" if n == 1 else f"{n} tests"


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(
    item: pytest.Item, call: pytest.CallInfo[None]
) -> Generator[None, pytest.TestReport, pytest.TestReport]:
    """The test's wasted calls travel on its report (to xdist's controller too); a failed test
    shows its own beside the failure; ``error``: its text."""
    report = yield
    if call.when != "call":
        return report
    wasted = item.stash.get(_WASTED, None)
    if wasted is not None:
        report.meshsim_redundant = [list(w) for w in wasted]  # type: ignore[attr-defined]
        if report.failed and not isinstance(getattr(call.excinfo, "value", None), _RedundantCollectives):
            text = f"{_calls(sum(w[3] for w in wasted))} told no rank anything new:"
            report.sections.append(("meshsim: redundant collectives", "\n".join([text, *_entries(wasted)])))
    if call.excinfo is not None and isinstance(call.excinfo.value, _RedundantCollectives):
        report.longrepr = str(call.excinfo.value)
    return report


def _groups(
    terminalreporter: Any, torch_made: bool
) -> dict[tuple[str, str, str, str], tuple[Counter[str], Counter[str]]]:
    """Every report's wasted calls, grouped per (api, site, rule, maker): the reasons and the tests."""
    groups: dict[tuple[str, str, str, str], tuple[Counter[str], Counter[str]]] = {}
    for reports in terminalreporter.stats.values():
        for report in reports:
            for api, site, reason, times, *by in getattr(report, "meshsim_redundant", None) or ():
                made_by = by[0] if by else ""
                if bool(made_by) != torch_made:
                    continue
                rule = re.sub(r"\d+", "N", reason)
                reasons, tests = groups.setdefault((api, site, rule, made_by), (Counter(), Counter()))
                reasons[reason] += times
                tests[report.nodeid] += times
    return groups


def _counts(groups: dict[tuple[str, str, str, str], tuple[Counter[str], Counter[str]]]) -> tuple[int, int]:
    """How many calls, in how many tests."""
    total = sum(sum(tests.values()) for _, tests in groups.values())
    return total, len({nodeid for _, tests in groups.values() for nodeid in tests})


@pytest.hookimpl(tryfirst=True)
def pytest_terminal_summary(terminalreporter: Any, exitstatus: int, config: pytest.Config) -> None:
    """``summary``: one line. ``report``: a section listing the wasted collectives, one entry per
    call site and rule (sizes and call numbers aside), with the tests that issued them (``-v``
    names every test, not the first few); torch's own calls in a section apart."""
    mode = config.getoption("mesh_redundant", "summary")
    own, torchs = _groups(terminalreporter, False), _groups(terminalreporter, True)
    if not own and not torchs:
        return
    (calls, tests), (made, made_in) = _counts(own), _counts(torchs)
    if mode != "report":
        parts = []
        if calls:
            parts.append(f"{_calls(calls)} in {_tests(tests)} told no rank anything new")
        if made:
            parts.append(f"{made} more made by torch's parallelism modules (DDP, FSDP, ...), not counted")
        terminalreporter.write_line(f"meshsim: {'; '.join(parts)} (--mesh-redundant=report lists them)")
        return
    if own:
        terminalreporter.section("meshsim: redundant collectives", sep="=")
        _write_groups(terminalreporter, own)
        terminalreporter.write_line(
            f"{_calls(calls)} in {_tests(tests)} told no rank anything new "
            "(--mesh-redundant=error fails them; @pytest.mark.allow_redundant allows known ones)"
        )
    if torchs:
        terminalreporter.section("meshsim: redundant collectives made by torch", sep="=")
        _write_groups(terminalreporter, torchs)
        terminalreporter.write_line(
            f"{_calls(made)} in {_tests(made_in)} made by torch's parallelism modules told no rank "
            "anything new: they are made by design (parameter sync, gradient reductions), not "
            "counted as the tests' own and never failed by --mesh-redundant=error"
        )


def _write_groups(
    terminalreporter: Any, groups: dict[tuple[str, str, str, str], tuple[Counter[str], Counter[str]]]
) -> None:
    shown = None if terminalreporter.config.getoption("verbose", 0) > 0 else 3
    for (api, site, _, by), (reasons, tests) in sorted(
        groups.items(), key=lambda kv: -sum(kv[1][1].values())
    ):
        reason, _count = reasons.most_common(1)[0]
        variants = f" (and {len(reasons) - 1} more like it)" if len(reasons) > 1 else ""
        made = f" (made by {by})" if by else ""
        terminalreporter.write_line(f"{api} at {site}{made}: {reason}{variants}")
        terminalreporter.write_line(f"  {_calls(sum(tests.values()))} in {_tests(len(tests))}:")
        names = sorted(tests)
        for nodeid in names[:shown]:
            again = f" ({tests[nodeid]} times)" if tests[nodeid] > 1 else ""
            terminalreporter.write_line(f"    {nodeid}{again}")
        if shown is not None and len(names) > shown:
            terminalreporter.write_line(f"    ... and {len(names) - shown} more (-v lists them)")
