"""``--mesh-redundant``: the wasted collectives each test's simulated worlds find, reported or failed.

``report`` (the default) lists them at the end of the session, one entry per call
site and rule; ``error`` fails the tests that issue them; ``off`` makes worlds not
look at all. ``@pytest.mark.allow_redundant(*ops)`` allows known ones. While a test
runs, a :class:`meshsim._observe.watch.Watch` collects what its worlds find.
"""

from __future__ import annotations

import re
from collections import Counter
from collections.abc import Generator
from typing import Any

import pytest

from meshsim._pytest.state import state_of

__all__: list[str] = []

_WASTED = pytest.StashKey[
    list[tuple[str, str, str, int]]
]()  # a test's wasted calls: (api, site, reason, times)


@pytest.hookimpl(tryfirst=True)
def pytest_configure(config: pytest.Config) -> None:
    """The marker; ``off``: the run's worlds do not look (a watch open until the run ends)."""
    config.addinivalue_line(
        "markers",
        "allow_redundant(*ops, reason=None): wasted collectives this test issues on purpose "
        "(all of them, or only these ops, e.g. 'all_gather'); not reported, and not failures "
        "under --mesh-redundant=error",
    )
    if config.getoption("mesh_redundant", "report") == "off":
        from meshsim._observe.watch import Watch, watching

        state_of(config).watches.enter_context(watching(Watch(redundant=False)))


def pytest_unconfigure(config: pytest.Config) -> None:
    state_of(config).watches.close()


class _RedundantCollectives(AssertionError):
    """The test issued collectives that told no rank anything new (``--mesh-redundant=error``)."""


@pytest.hookimpl(wrapper=True)
def pytest_runtest_call(item: pytest.Item) -> Generator[None, None, None]:
    """Collect the wasted collectives the test's worlds find; under ``error``, fail on them."""
    mode = item.config.getoption("mesh_redundant", "report")
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
    if kept and mode == "error":
        raise _RedundantCollectives(_wasted_text(kept, item.nodeid))
    return result


def _not_allowed(item: pytest.Item, found: list[Any]) -> list[tuple[str, str, str, int]]:
    """The findings the test's allow_redundant markers do not allow, counted per (api, site, reason)."""
    allowed: set[str] = set()
    everything = False
    for marker in item.iter_markers("allow_redundant"):
        if not marker.args:
            everything = True
        allowed.update(str(op) for op in marker.args)
    if everything:
        return []
    counts: Counter[tuple[str, str, str]] = Counter(
        (f.api, f.site, f.reason) for f in found if f.op not in allowed and f.api not in allowed
    )
    return [(api, site, reason, times) for (api, site, reason), times in counts.items()]


def _wasted_text(wasted: list[tuple[str, str, str, int]], nodeid: str) -> str:
    lines = [f"{nodeid} issued {_calls(sum(t for *_, t in wasted))} that told no rank anything new:"]
    for api, site, reason, times in wasted:
        again = f" ({times} times)" if times > 1 else ""
        lines.append(f"  {api} at {site}{again}: {reason}")
    lines.append(
        "Remove them, or mark the test @pytest.mark.allow_redundant(...) if they are meant; "
        "--mesh-redundant=report lists them without failing."
    )
    return "\n".join(lines)


def _calls(n: int) -> str:
    return f"{n} collective" if n == 1 else f"{n} collectives"


def _tests(n: int) -> str:
    return f"{n} test" if n == 1 else f"{n} tests"


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(
    item: pytest.Item, call: pytest.CallInfo[None]
) -> Generator[None, pytest.TestReport, pytest.TestReport]:
    """The test's wasted calls travel on its report (to xdist's controller too); ``error``: its text."""
    report = yield
    if call.when != "call":
        return report
    wasted = item.stash.get(_WASTED, None)
    if wasted is not None:
        report.meshsim_redundant = [list(w) for w in wasted]  # type: ignore[attr-defined]
    if call.excinfo is not None and isinstance(call.excinfo.value, _RedundantCollectives):
        report.longrepr = str(call.excinfo.value)
    return report


@pytest.hookimpl(tryfirst=True)
def pytest_terminal_summary(terminalreporter: Any, exitstatus: int, config: pytest.Config) -> None:
    """A section listing the wasted collectives, one entry per call site and rule (sizes and call
    numbers aside), with the tests that issued them. ``-v`` names every test, not the first few."""
    groups: dict[tuple[str, str, str], tuple[Counter[str], Counter[str]]] = {}
    for reports in terminalreporter.stats.values():
        for report in reports:
            for api, site, reason, times in getattr(report, "meshsim_redundant", None) or ():
                rule = re.sub(r"\d+", "N", reason)
                reasons, tests = groups.setdefault((api, site, rule), (Counter(), Counter()))
                reasons[reason] += times
                tests[report.nodeid] += times
    if not groups:
        return
    shown = None if terminalreporter.config.getoption("verbose", 0) > 0 else 3
    total = sum(sum(tests.values()) for _, tests in groups.values())
    everywhere = {nodeid for _, tests in groups.values() for nodeid in tests}
    terminalreporter.section("meshsim: redundant collectives", sep="=")
    for (api, site, _), (reasons, tests) in sorted(groups.items(), key=lambda kv: -sum(kv[1][1].values())):
        reason, _count = reasons.most_common(1)[0]
        variants = f" (and {len(reasons) - 1} more like it)" if len(reasons) > 1 else ""
        terminalreporter.write_line(f"{api} at {site}: {reason}{variants}")
        terminalreporter.write_line(f"  {_calls(sum(tests.values()))} in {_tests(len(tests))}:")
        names = sorted(tests)
        for nodeid in names[:shown]:
            again = f" ({tests[nodeid]} times)" if tests[nodeid] > 1 else ""
            terminalreporter.write_line(f"    {nodeid}{again}")
        if shown is not None and len(names) > shown:
            terminalreporter.write_line(f"    ... and {len(names) - shown} more (-v lists them)")
    terminalreporter.write_line(
        f"{_calls(total)} in {_tests(len(everywhere))} told no rank anything new "
        "(--mesh-redundant=error fails them; @pytest.mark.allow_redundant allows known ones)"
    )
