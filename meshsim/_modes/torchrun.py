"""Under torchrun: this process is one rank of the job, and its process group lives for the session.

Each test body runs here, then every rank agrees on the test's outcome (see
:mod:`meshsim._engine.outcomes`), so that a failure on any rank fails the test
everywhere.
"""

from __future__ import annotations

import datetime
import os
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from meshsim._engine.outcomes import (
    CODES,
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

__all__ = ["StaticSession", "TestFailedOnOtherRanks", "static_environment"]


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
        # Outcomes travel on their own CPU group, apart from the tests' own traffic.
        self.agreement = dist.new_group(backend="gloo", timeout=timeout)

    def stop(self) -> None:
        """Leave the job once every rank is done with its session (rank 0's report printed)."""
        self._leave_together()
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
        """Run the body here, then agree with every rank on the outcome (one small all_gather).

        Every rank ends with the test's outcome (see :mod:`meshsim._engine.outcomes`): a
        failure on any rank fails it everywhere; else a skip or xfail on any rank
        skips or xfails it everywhere, with that rank's reason.

        Keyword args:
            check: called on every rank, when the body passed on every rank, with every
                rank's ledger of the body (gathered on the outcomes' group); what it
                raises is this rank's failure.
        """
        fixtures = RankFixtures(cache=self.fixtures_cache)
        failure: BaseException | None = None
        try:
            if check is not None:
                fixtures.open_ledger()
            kwargs = resolve(funcargs, fixtures)
            # A fresh recorder per test numbers each group's calls from 0, as a new
            # simulated world does, so ledgers compare equal across modes.
            with DispatchRecorder(), fixtures.recording():
                test(**kwargs)
        except BaseException as exc:  # reported after every rank has had its say
            failure = exc
        if check is not None:
            mismatch = self._check(check, fixtures.ledger if failure is None else None)
            failure = failure or mismatch
        here = kind_of(failure)
        kinds = self._outcomes(here)
        outcome, decider = combine(kinds)
        reasons: list[Any] = [None] * self.world_size
        if outcome in (SKIPPED, XFAILED):  # every rank takes part, whatever it raises after
            mine = reason_of(failure) if failure is not None else ""
            dist.all_gather_object(reasons, mine, group=self.agreement)
        if outcome == PASSED:
            return
        if failure is not None and (here == outcome or here == FAILED):
            raise failure
        if outcome == FAILED:
            failed = [r for r, kind in enumerate(kinds) if kind == FAILED]
            raise TestFailedOnOtherRanks(
                f"{here} on rank {self.rank} but failed on rank{'s' if len(failed) > 1 else ''} "
                f"{', '.join(map(str, failed))} (rank 0's report, or --mesh-report=all, shows why)"
            )
        assert decider is not None  # a skip or xfail came from somewhere
        raise outcome_exception(outcome, str(reasons[decider]), decider)

    def _check(self, check: Callable[[list[Ledger]], object], mine: Ledger | None) -> BaseException | None:
        """Gather every rank's ledger (None from a rank whose body failed) and check them if all came."""
        ledgers: list[Ledger | None] = [None] * self.world_size
        dist.all_gather_object(ledgers, mine, group=self.agreement)  # every rank takes part
        complete = [ledger for ledger in ledgers if ledger is not None]
        if len(complete) < self.world_size:
            return None
        try:
            check(complete)
        except BaseException as exc:
            return exc
        return None

    def _outcomes(self, here: str) -> list[str]:
        codes = torch.zeros(self.world_size, dtype=torch.int32)
        mine = torch.tensor([CODES.index(here)], dtype=torch.int32)
        dist.all_gather_into_tensor(codes, mine, group=self.agreement)
        return [CODES[code] for code in codes.tolist()]
