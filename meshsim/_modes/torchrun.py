"""Under torchrun: this process is one rank of the job, and its process group lives for the session.

Each test body runs here, then every rank agrees on the test's outcome (see
:mod:`meshsim._engine.outcomes`), so that a failure on any rank fails the test
everywhere.
"""

from __future__ import annotations

import datetime
import os
import pickle
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from meshsim._base.errors import RankError, format_user_traceback
from meshsim._engine.outcomes import (
    FAILED,
    PASSED,
    SKIPPED,
    XFAILED,
    combine,
    kind_of,
    outcome_exception,
    reason_of,
)
from meshsim._modes.fixtures import RankFixtures, resolve
from meshsim._modes.thread_ranks import TestFunction
from meshsim._record.ledger import Ledger
from meshsim._record.recorder import DispatchRecorder
from meshsim._record.standing import SILENT, WAITING, Standing, standing_of, verdict, verdict_error

__all__ = [
    "StaticSession",
    "TestFailedOnOtherRanks",
    "default_group_timeout",
    "set_group_timeout",
    "static_environment",
]


_STATIC_ENV = ("RANK", "WORLD_SIZE", "LOCAL_RANK")


def static_environment() -> dict[str, int] | None:
    """torchrun's rank variables as ints, or None when any is missing."""
    values = {key: os.environ.get(key) for key in _STATIC_ENV}
    if any(v is None for v in values.values()):
        return None
    return {key: int(v) for key, v in values.items() if v is not None}


class TestFailedOnOtherRanks(AssertionError):
    """The test passed here but failed on other ranks (``--multigpu-static``)."""

    __test__ = False  # not a test class, whatever pytest's name matching thinks


@dataclass
class StaticSession:
    """This process is one rank of a torchrun job; the process group lives for the session."""

    rank: int
    world_size: int
    local_rank: int
    timeout: float
    fixtures_cache: dict[Any, Any] = field(default_factory=dict)
    agreement: Any = None
    owns_group: bool = False  # meshsim made the default group (no conftest had)
    out_of_step: bool = False  # a test left the ranks' collectives out of step: stop the session
    printer_silent: bool = False  # rank 0 sent no report of the last test: it cannot print it
    _tests: int = 0  # tests run, numbering their reports in the store
    _undo: list[Callable[[], None]] = field(default_factory=list)

    def start(self) -> None:
        """Join the torchrun job, unless the user's set-up (a conftest's manager) already has.

        Its default group is NCCL on ``cuda:LOCAL_RANK`` when CUDA is there, else gloo.
        Called once the conftests' ``pytest_configure`` have run, so that a
        distributed manager initialized there keeps the group it made.
        """
        timeout = datetime.timedelta(seconds=self.timeout)
        if not dist.is_initialized():
            self.owns_group = True
            if torch.cuda.is_available():
                torch.cuda.set_device(self.local_rank)
                dist.init_process_group("nccl", rank=self.rank, world_size=self.world_size, timeout=timeout)
            else:
                dist.init_process_group("gloo", rank=self.rank, world_size=self.world_size, timeout=timeout)
        else:
            set_group_timeout(timeout)  # a conftest's group: the tests' collectives end by --mesh-timeout too
        self._undo.append(default_group_timeout(timeout))
        # The end of the session travels on its own CPU group, apart from the tests' own traffic.
        self.agreement = dist.new_group(backend="gloo", timeout=timeout)

    def stop(self) -> None:
        """Leave the job once every rank is done with its session (rank 0's report printed)."""
        self._leave_together()
        while self._undo:
            self._undo.pop()()
        if self.owns_group and dist.is_initialized():
            dist.destroy_process_group()

    def _leave_together(self) -> None:
        """Wait for every rank to reach the end of its session.

        torchrun stops every worker as soon as one exits with an error; a rank that
        failed a test and reports nothing ends first, and cut rank 0's report of the
        failure short (seen with ledger snapshot diffs).
        """
        if self.agreement is None or not dist.is_initialized():
            return  # not started, or the user's own clean-up ended the process group
        try:
            dist.barrier(group=self.agreement)  # bounded by the group's timeout (--mesh-timeout)
        except RuntimeError:
            pass  # a rank is gone: torchrun reports it

    def run(
        self,
        test: TestFunction,
        funcargs: dict[str, Any],
        *,
        check: Callable[[list[Ledger]], object] | None = None,
    ) -> None:
        """Run the body here, then learn every rank's outcome and standing through the store.

        Every rank ends with the test's outcome (see :mod:`meshsim._engine.outcomes`): a
        failure on any rank fails it everywhere; else a skip or xfail on any rank
        skips or xfails it everywhere, with that rank's reason. A failure where ranks
        disagree (one finished, raised or went elsewhere while others wait in a
        collective) is reported with the rank the others wait for and every rank's state,
        as on simulated ranks; the session then stops (:attr:`out_of_step`): the job's
        process group holds a collective that will never complete.

        Keyword args:
            check: called on every rank, when the body passed on every rank, with every
                rank's ledger of the body (exchanged with the outcomes); what it raises is
                this rank's failure.
        """
        fixtures = RankFixtures(cache=self.fixtures_cache)
        failure: BaseException | None = None
        recorder = DispatchRecorder()
        try:
            if check is not None:
                fixtures.open_ledger()
            kwargs = resolve(funcargs, fixtures)
            # A fresh recorder per test numbers each group's calls from 0, as a new
            # simulated world does, so ledgers compare equal across modes.
            with recorder, fixtures.recording():
                test(**kwargs)
        except BaseException as exc:  # reported after every rank has had its say
            failure = exc
        here = kind_of(failure)
        mine = _Report(
            here,
            reason_of(failure) if here in (SKIPPED, XFAILED) and failure is not None else "",
            format_user_traceback(failure) if here == FAILED and failure is not None else "",
            standing_of(self.rank, recorder, ended=True, error=failure),
            fixtures.ledger if failure is None and check is not None else None,
        )
        reports = self._exchange(mine)
        kinds = _kinds(reports)
        outcome, decider = combine(kinds)
        if outcome == PASSED:
            if check is not None:
                check(
                    [report.ledger for report in reports if report is not None and report.ledger is not None]
                )
            return
        if outcome == FAILED:
            raise self._failure(failure, reports)
        if any(report is not None and report.standing.state == WAITING for report in reports):
            self.out_of_step = True  # a skip left the others in a collective: it will never complete
        assert decider is not None  # a skip or xfail came from somewhere
        report = reports[decider]
        if failure is not None and here == outcome:
            raise failure
        raise outcome_exception(outcome, report.reason if report is not None else "", decider)

    def _failure(self, failure: BaseException | None, reports: list[_Report | None]) -> BaseException:
        """What a failed test raises here: the disagreement's table, or the culprit's error with it."""
        standings = [
            report.standing if report is not None else _silent(rank, self._wait_limit())
            for rank, report in enumerate(reports)
        ]
        found = verdict(standings, self.world_size)
        self.printer_silent = reports[0] is None
        if found is not None and found.kind != "failed":
            self.out_of_step = True
            return verdict_error(found, "torchrun")
        if any(report is None for report in reports) or any(s.state == WAITING for s in standings):
            self.out_of_step = True  # a collective some rank is in will never complete
        failed = [r for r, report in enumerate(reports) if report is None or report.kind == FAILED]
        culprit = found.culprits[0] if found is not None else failed[0]
        error: BaseException
        if culprit == self.rank and failure is not None:
            error = failure
        elif reports[culprit] is not None and reports[culprit].traceback:  # type: ignore[union-attr]
            error = RankError(culprit, self.world_size, reports[culprit].traceback)  # type: ignore[union-attr]
        else:
            here = kind_of(failure)
            error = TestFailedOnOtherRanks(
                f"{here} on rank {self.rank} but failed on rank{'s' if len(failed) > 1 else ''} "
                f"{', '.join(map(str, failed))}"
            )
        if found is not None:
            error.add_note(found.message)
        return error

    def _wait_limit(self) -> float:
        """How long a rank waits for the others' reports: a collective stuck on them ends by the timeout."""
        return self.timeout + _REPORT_GRACE

    def _exchange(self, mine: _Report) -> list[_Report | None]:
        """Every rank's report, through the job's store: no collective, so a stuck one cannot block it.

        A rank that has not posted its report within :meth:`_wait_limit` is None.
        """
        self._tests += 1
        store = self._reports_store(self._tests)
        store.set(str(self.rank), pickle.dumps(mine))
        keys = [str(rank) for rank in range(self.world_size)]
        try:
            store.wait(keys, datetime.timedelta(seconds=self._wait_limit()))
        except (RuntimeError, dist.DistError):  # DistStoreError: some rank never posted
            pass
        return [pickle.loads(store.get(key)) if store.check([key]) else None for key in keys]

    def _reports_store(self, test: int) -> Any:
        """The job's store, its keys under one prefix per test.

        ``_get_default_store`` is private: the default group's store (torchrun's, or
        the one ``init_process_group`` made); checked on torch 2.13 and 2.14.
        """
        from torch._C._distributed_c10d import PrefixStore
        from torch.distributed.distributed_c10d import _get_default_store

        return PrefixStore(f"meshsim/reports/{test}/", _get_default_store())


def set_group_timeout(timeout: datetime.timedelta, group: Any = None) -> None:
    """The timeout of ``group``'s (default: the default group's) later collectives.

    ``dist.set_timeout`` is public from torch 2.14; before, ``_set_pg_timeout`` (private;
    present on 2.13, deprecated in its favour on 2.14) does the same.
    """
    public = getattr(dist, "set_timeout", None)
    if public is not None:
        public(timeout, group)
        return
    from torch.distributed.distributed_c10d import _set_pg_timeout

    _set_pg_timeout(timeout, group)


def default_group_timeout(timeout: datetime.timedelta) -> Callable[[], None]:
    """Groups made without a timeout (``new_group``, a DeviceMesh's) get ``timeout``, not c10d's default.

    c10d looks its default up through the module function ``_get_default_timeout``
    (private; torch 2.11-2.15); returns the undo step. This process is one rank of
    the job, so the change is its own; it is undone when the session ends.
    """
    from torch.distributed import distributed_c10d as c10d

    original = c10d._get_default_timeout
    c10d._get_default_timeout = lambda backend: timeout  # type: ignore[assignment]

    def undo() -> None:
        c10d._get_default_timeout = original  # type: ignore[assignment]

    return undo


_REPORT_GRACE = 10.0  # seconds a rank waits for the others' reports beyond the collectives' timeout


@dataclass(frozen=True)
class _Report:
    """What one rank tells the others at a test's end (pickled into the job's store)."""

    kind: str  # how its body ended (see meshsim._engine.outcomes)
    reason: str  # a skip's or xfail's reason
    traceback: str  # a failure's traceback, from the user's code on
    standing: Standing
    ledger: Ledger | None  # the body's, when passed and asked for


def _kinds(reports: list[_Report | None]) -> list[str]:
    """Each rank's outcome; a rank whose collective failed because another skipped or xfailed has no say.

    As on simulated ranks (see :mod:`meshsim._engine.outcomes`), the skip decides;
    the ranks it left in a collective fail only by its group's timeout.
    """
    kinds = [report.kind if report is not None else FAILED for report in reports]
    if not any(kind in (SKIPPED, XFAILED) for kind in kinds):
        return kinds
    victims = [
        r
        for r, report in enumerate(reports)
        if report is not None and report.kind == FAILED and report.standing.state == WAITING
    ]
    if len(victims) == kinds.count(FAILED):
        for r in victims:
            kinds[r] = PASSED
    return kinds


def _silent(rank: int, waited: float) -> Standing:
    return Standing(rank, SILENT, f"no report within {waited:g} s (stuck in its own code, or gone)")
