"""``--mesh-backend=spawn``'s rank processes: kept for the session (``pool``) or new per test (``fresh``).

With ``pool`` the session's rank processes (:class:`meshsim._modes.spawn_pool.RankPools`)
live in ``config.stash``, one set per pytest process (per xdist worker under ``-n``),
and end with the session. ``--mesh-spawn=fresh`` (or the ``mesh_spawn`` ini option)
starts a new process per rank per test, as before.
"""

from __future__ import annotations

from collections import Counter
from typing import TYPE_CHECKING, Any

import pytest

if TYPE_CHECKING:
    from meshsim._modes.spawn import TestTarget
    from meshsim._modes.spawn_pool import RankPools

__all__ = ["SPAWN_MODES", "run_spawned"]

SPAWN_MODES = ("pool", "fresh")
_MODE = pytest.StashKey[str]()
_POOLS: pytest.StashKey[RankPools] = pytest.StashKey()


def pytest_addoption(parser: pytest.Parser) -> None:
    help_text = (
        "how --mesh-backend=spawn starts its rank processes: pool keeps them for the session, each "
        "running one rank of many tests, and replaces one a test left unusable (the default); fresh "
        "starts new processes for every test"
    )
    parser.getgroup("meshsim").addoption(
        "--mesh-spawn",
        choices=SPAWN_MODES,
        default=None,
        help=f"{help_text} (overrides the mesh_spawn ini option)",
    )
    parser.addini("mesh_spawn", default="pool", help=help_text)


@pytest.hookimpl(tryfirst=True)
def pytest_configure(config: pytest.Config) -> None:
    mode = config.getoption("mesh_spawn", None) or str(config.getini("mesh_spawn")).strip()
    if mode not in SPAWN_MODES:
        raise pytest.UsageError(f"mesh_spawn (ini) must be one of {SPAWN_MODES}, got {mode!r}")
    config.stash[_MODE] = mode


def run_spawned(
    config: pytest.Config,
    target: TestTarget,
    funcargs: dict[str, Any],
    world_size: int,
    *,
    timeout: float,
    record: bool,
    cuda: Any = None,
) -> list[Any]:
    """Run a test on ``world_size`` spawned ranks, in kept processes or fresh ones as ``--mesh-spawn`` says.

    Returns:
        each rank's ledger of the body (or None), rank 0's first.

    Raises:
        RankError: a rank failed, died or outlived ``timeout``.
    """
    if config.stash.get(_MODE, "pool") == "fresh":
        from meshsim._modes.spawn import run_in_processes

        return run_in_processes(target, funcargs, world_size, timeout=timeout, record=record, cuda=cuda)
    pools = config.stash.get(_POOLS, None)
    if pools is None:
        from meshsim._modes.spawn_pool import RankPools

        pools = config.stash[_POOLS] = RankPools()
    return pools.run(target, funcargs, world_size, timeout=timeout, record=record, cuda=cuda)


def pytest_unconfigure(config: pytest.Config) -> None:
    """End the session's rank processes."""
    pools = config.stash.get(_POOLS, None)
    if pools is not None:
        del config.stash[_POOLS]
        pools.close()


def pytest_terminal_summary(terminalreporter: Any) -> None:
    """One line on the kept rank processes (how many ran how many tests), and why any was replaced."""
    pools = terminalreporter.config.stash.get(_POOLS, None)
    if pools is None:
        return
    statistics = pools.statistics()
    terminalreporter.write_line(f"meshsim: spawned ranks: {statistics}")
    reasons = Counter(why for _, why in statistics.replaced)
    for why, times in reasons.most_common(_REASONS):
        first = why.splitlines()[0] if why else why
        terminalreporter.write_line(f"  {times} x {first}")
    if len(reasons) > _REASONS:
        terminalreporter.write_line(f"  and {len(reasons) - _REASONS} other reason(s)")


_REASONS = 5
