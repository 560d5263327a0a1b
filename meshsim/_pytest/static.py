"""The simulated static suite: ``pytest --multigpu-static`` without torchrun, on one simulated job.

The job (:class:`meshsim._pytest.simjob.SimulatedJob`) keeps one world for the
session and runs the user's per-process hooks on its ranks, as torchrun's
processes would; ``multigpu_static`` tests run on it (:mod:`meshsim._pytest.ranks`).
"""

from __future__ import annotations

import pytest

from meshsim._pytest.options import static_environment_or_none
from meshsim._pytest.state import state_of

__all__: list[str] = []


@pytest.hookimpl(tryfirst=True)
def pytest_configure(config: pytest.Config) -> None:
    """Start the session's job before the conftests configure: their hooks then run on its ranks."""
    if not config.getoption("multigpu_static", default=False) or static_environment_or_none(config):
        return
    from meshsim._pytest.simjob import SimulatedJob

    state = state_of(config)
    job = SimulatedJob(
        config, state.world_size, state.backend, state.timeout, state.num_threads, cuda=state.cuda
    )
    job.start()
    state.job = job


def pytest_report_header(config: pytest.Config) -> list[str]:
    """The session's simulated job: its size and backend, and what gloo thread ranks share."""
    state = state_of(config)
    if state.job is None:
        return []
    lines = [
        f"meshsim: --multigpu-static on {state.world_size} simulated ranks (--mesh-backend="
        f"{state.backend}): one job for the session, set up as torchrun would"
    ]
    if state.backend == "gloo":
        lines.append(
            "meshsim: gloo thread ranks run at once and share what a process owns (RANK in the "
            "environment, RNGs, singletons declared per rank): use --mesh-backend=sim or spawn for "
            "code that reads its rank from them"
        )
    return lines


@pytest.hookimpl(trylast=True)
def pytest_unconfigure(config: pytest.Config) -> None:
    """End the job's world (the user's clean-up hooks run there) and stop routing their hooks."""
    state = state_of(config)
    if state.job is not None:
        job, state.job = state.job, None
        job.stop()
