"""``--mesh-trace=DIR``: each test's simulated worlds drawn as timelines, one file per world.

While a test runs, a :class:`meshsim._observe.watch.Watch` gives every call a
simulated world runs a tracer writing ``DIR/<test id>.json`` (then ``-2``, ``-3``...
for further worlds of the test). The session's end counts the files written.
With ``--mesh-cost`` each file also has the world on the estimated GPU clock of
that topology (a second process; see :mod:`meshsim._observe.trace`).
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Generator
from pathlib import Path
from typing import Any

import pytest

from meshsim._pytest.options import static_environment_or_none
from meshsim._pytest.state import state_of

__all__: list[str] = []

_TRACE_DIR = pytest.StashKey[Path]()
_TRACE_SINCE = pytest.StashKey[float]()


@pytest.hookimpl(tryfirst=True)
def pytest_configure(config: pytest.Config) -> None:
    """Check the backend and make the folder."""
    folder = config.getoption("mesh_trace", None)
    if folder is None:
        return
    backend = config.getoption("mesh_backend")
    torchrun = static_environment_or_none(config) is not None
    if backend != "sim" or torchrun:
        where = "under torchrun" if torchrun else f"with --mesh-backend={backend}"
        raise pytest.UsageError(
            f"--mesh-trace draws simulated worlds, whose ranks meshsim sees between calls; {where} "
            "there is nothing to draw (use --mesh-backend=sim)"
        )
    path = Path(folder)
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise pytest.UsageError(f"--mesh-trace={folder}: cannot make the folder: {exc}") from None
    config.stash[_TRACE_DIR] = path.resolve()
    config.stash[_TRACE_SINCE] = time.time()


@pytest.hookimpl(wrapper=True)
def pytest_runtest_call(item: pytest.Item) -> Generator[None, None, None]:
    """The test's worlds write its trace files."""
    folder = item.config.stash.get(_TRACE_DIR, None)
    if folder is None:
        return (yield)
    from meshsim._observe.trace import Tracer, file_name
    from meshsim._observe.watch import Watch, watching

    stem = file_name(item.nodeid)
    worlds = itertools.count(1)
    topology = state_of(item.config).topology  # --mesh-cost: a second process on the GPU clock

    def tracer(name: str, world_size: int) -> Tracer:
        n = next(worlds)
        path = folder / (f"{stem}.json" if n == 1 else f"{stem}-{n}.json")
        return Tracer(path, world_size, name, topology=topology)

    with watching(Watch(tracer=tracer)):
        return (yield)


def pytest_terminal_summary(terminalreporter: Any, exitstatus: int, config: pytest.Config) -> None:
    """How many trace files the session wrote (xdist workers write too: the files are counted)."""
    folder = config.stash.get(_TRACE_DIR, None)
    if folder is not None:
        since = config.stash[_TRACE_SINCE]
        written = [p for p in folder.glob("*.json") if p.stat().st_mtime >= since]
        terminalreporter.write_line(f"meshsim: traces: {len(written)} written to {folder}")
