"""The plugin's state for one pytest run: one object in ``config.stash``, which every feature asks."""

from __future__ import annotations

import bisect
import contextlib
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import pytest

if TYPE_CHECKING:
    from meshsim._modes.torchrun import StaticSession
    from meshsim._observe.topology import Topology
    from meshsim._process.cuda import Spec
    from meshsim._pytest.simjob import SimulatedJob

__all__ = ["LedgerCheck", "PluginState", "state_of"]

#: A feature's check of a passed distributed test's ledgers: given the test and whether this process
#: writes files (under torchrun only rank 0 does), what takes every rank's ledger, or None (not wanted).
LedgerCheck = Callable[["pytest.Function", bool], "Callable[[list[Any]], None] | None"]


@dataclass
class PluginState:
    """What the plugin's features share for one pytest run.

    Attributes:
        backend, world_size, timeout: ``--mesh-backend``, ``--world-size``, ``--mesh-timeout``.
        num_threads: the intra-op threads of each simulated rank (``MESHSIM_NUM_THREADS``).
        cuda: ``--mesh-cuda`` resolved (a :class:`meshsim._process.cuda.Spec`; None: off),
            handed to every world the plugin starts (:mod:`meshsim._pytest.cuda`).
        suite: ``"static"`` or ``"dynamic"``: the suite ``--multigpu-*`` selects (None: all tests).
        unmarked: ``--mesh-unmarked``: ``"ranks"`` runs unmarked tests on the static suite's ranks.
        owns_suite_options: meshsim defined ``--multigpu-static`` / ``-dynamic`` (no conftest did).
        static: under torchrun, this process's rank of the job.
        job: ``--multigpu-static`` without torchrun: the session's simulated job.
        item: the distributed test being set up or run.
        topology: ``--mesh-cost``: the GPU topology tests, snapshots and traces are priced on.
        watches: the watches the plugin keeps open for the whole run (closed at its end).
        ledger_checks: the features that take a passed test's ledgers (snapshots, cost), in the
            order they run; each adds itself with :meth:`check_ledgers_with`.
    """

    backend: str
    world_size: int
    timeout: float
    num_threads: int | str = 1
    cuda: Spec | None = None
    suite: str | None = None
    unmarked: str = "skip"
    owns_suite_options: bool = False
    static: StaticSession | None = None
    job: SimulatedJob | None = None
    item: pytest.Item | None = None
    topology: Topology | None = None
    watches: contextlib.ExitStack = field(default_factory=contextlib.ExitStack)
    ledger_checks: list[tuple[int, LedgerCheck]] = field(default_factory=list)

    def check_ledgers_with(self, order: int, check: LedgerCheck) -> None:
        """Give ``check`` every passed distributed test's ledgers, after the checks of lower ``order``."""
        bisect.insort(self.ledger_checks, (order, check), key=lambda entry: entry[0])


_STATE = pytest.StashKey[PluginState]()


def state_of(config: pytest.Config) -> PluginState:
    """The run's state, made from the options when first asked."""
    state = config.stash.get(_STATE, None)
    if state is None:
        from meshsim._engine.world import num_threads_from_environment

        try:
            num_threads = num_threads_from_environment()
        except ValueError as error:
            raise pytest.UsageError(str(error)) from None
        state = config.stash[_STATE] = PluginState(
            config.getoption("mesh_backend"),
            config.getoption("world_size"),
            config.getoption("mesh_timeout"),
            num_threads,
        )
    return state
