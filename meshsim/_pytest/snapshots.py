"""Ledger snapshots: the check a ``ledger_snapshot`` test's ranks' ledgers get, and the session's count.

The check itself is :func:`meshsim._observe.snapshot.check_snapshot`; the file is
``__snapshots__/<module>.ledger.json`` beside the test module, keyed by the test id
without its file. ``--mesh-snapshot-update`` rewrites entries instead of comparing.
Under ``--mesh-cost`` an entry also carries (and is checked against) the test's
estimated communication time on that topology.
"""

from __future__ import annotations

import re
from collections import Counter
from collections.abc import Callable, Generator
from pathlib import Path
from typing import Any

import pytest

from meshsim._pytest.state import state_of

__all__ = ["check_for"]

_SNAPSHOT = pytest.StashKey[str]()  # what a test's check did: created, matched, updated


def pytest_configure(config: pytest.Config) -> None:
    """Snapshots take every passed distributed test's ledgers first (before they are priced)."""
    state_of(config).check_ledgers_with(0, check_for)


def check_for(item: pytest.Function, write: bool) -> Callable[[list[Any]], None] | None:
    """For a test that uses ``ledger_snapshot``: what checks every rank's ledger against its file."""
    if "ledger_snapshot" not in item.fixturenames:
        return None
    from meshsim._observe.snapshot import SnapshotMismatchError, check_snapshot

    path = _snapshot_file(item.path)
    key = _key_in(path, item.nodeid.split("::", 1)[-1])  # the test id without its file: moving it keeps it
    update = bool(item.config.getoption("mesh_snapshot_update"))
    topology = state_of(item.config).topology  # --mesh-cost: the entry carries the estimate

    def check(ledgers: list[Any]) -> None:
        try:
            item.stash[_SNAPSHOT] = check_snapshot(
                path, key, ledgers, update=update, write=write, topology=topology
            )
        except SnapshotMismatchError as error:
            error.add_note(
                "If the change is intended, rerun with --mesh-snapshot-update to rewrite the snapshot, "
                "and review the file's diff."
            )
            raise

    return check


def _key_in(path: Path, key: str) -> str:
    """``key``, or its spelling before world ids lost their ``=`` (``world=2``, meshsim 0.1) where
    only that one is in the file: snapshots written then keep matching, under their old name."""
    legacy = re.sub(r"\bworld(\d+)\b", r"world=\1", key)
    if legacy == key:
        return key
    from meshsim._observe.snapshot_file import entry_of, load

    try:
        document = load(path)
    except ValueError:
        return key  # not a snapshot file: check_snapshot says so
    return legacy if not entry_of(document, key) and entry_of(document, legacy) else key


def _snapshot_file(module: Path) -> Path:
    """Where ``module``'s ledger snapshots live: ``__snapshots__/<stem>.ledger.json`` beside it."""
    return module.parent / "__snapshots__" / f"{module.stem}.ledger.json"


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(
    item: pytest.Item, call: pytest.CallInfo[None]
) -> Generator[None, pytest.TestReport, pytest.TestReport]:
    """The check's outcome travels on the report (to xdist's controller too)."""
    report = yield
    snapshot = item.stash.get(_SNAPSHOT, None)
    if snapshot is not None and call.when == "call":
        report.meshsim_snapshot = snapshot  # type: ignore[attr-defined]
    return report


@pytest.hookimpl(trylast=True)
def pytest_terminal_summary(terminalreporter: Any, exitstatus: int, config: pytest.Config) -> None:
    """One line on what the session's snapshot checks did."""
    done = Counter(
        outcome
        for reports in terminalreporter.stats.values()
        for report in reports
        if (outcome := getattr(report, "meshsim_snapshot", None)) is not None
    )
    if done:
        words = {"created": "written", "updated": "rewritten", "matched": "unchanged"}
        parts = [f"{done[kind]} {word}" for kind, word in words.items() if done[kind]]
        terminalreporter.write_line(f"meshsim: ledger snapshots: {', '.join(parts)}")
