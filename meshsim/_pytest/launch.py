"""Real ranks for the static suite: this process as one rank under torchrun, or a torchrun-like launch.

- ``torchrun ... pytest --multigpu-static``: this process is one rank of the job
  (:class:`meshsim._modes.torchrun.StaticSession`); it joins the job once the
  conftests have configured (a distributed manager there keeps the group it made),
  and only rank 0 reports unless ``--mesh-report=all``.
- ``pytest --multigpu-static --mesh-backend=spawn`` without torchrun: one pytest
  process per rank, started as torchrun would start them (:mod:`meshsim._modes.launch`).
"""

from __future__ import annotations

from collections import Counter

import pytest

from meshsim._pytest.options import size_of, spec_of, static_environment_or_none
from meshsim._pytest.state import state_of

__all__ = ["unrun_line"]

_UNRUN = pytest.StashKey["tuple[Counter[int], int]"]()  # sizes the skipped tests need; distributed tests


def _xdist_workers(config: pytest.Config) -> bool:
    workers = getattr(config.option, "numprocesses", None)
    return bool(workers) and workers != 0


@pytest.hookimpl(tryfirst=True)
def pytest_cmdline_main(config: pytest.Config) -> int | None:
    """--multigpu-static --mesh-backend=spawn, no torchrun: start a pytest per rank, as torchrun would."""
    from meshsim._modes.torchrun import static_environment

    if (
        not config.getoption("multigpu_static", default=False)
        or config.getoption("mesh_backend") != "spawn"
        or static_environment() is not None
        or config.option.help
        or config.option.version
    ):
        return None
    if _xdist_workers(config):
        raise pytest.UsageError(
            "--multigpu-static --mesh-backend=spawn starts one pytest process per rank; "
            "it is incompatible with -n (pytest-xdist): drop -n"
        )
    from meshsim._modes.launch import launch

    size = config.getoption("world_size")
    print(
        f"meshsim: --multigpu-static --mesh-backend=spawn: {size} pytest processes, one per rank, "
        "started as torchrun would start them",
        flush=True,
    )
    args = config.invocation_params.args
    return launch(args, size, timeout=config.getoption("mesh_timeout"), cwd=str(config.invocation_params.dir))


@pytest.hookimpl(tryfirst=True)
def pytest_configure(config: pytest.Config) -> None:
    """Under torchrun, make this process's rank (it joins the job at the session's start)."""
    env = static_environment_or_none(config)
    if env is None:
        return
    if _xdist_workers(config):
        raise pytest.UsageError(
            "--multigpu-static is incompatible with -n (pytest-xdist): torchrun already starts "
            "one pytest per rank; drop -n"
        )
    from meshsim._modes.torchrun import StaticSession

    xml = getattr(config.option, "xmlpath", None)
    if xml and "{rank}" in xml:
        config.option.xmlpath = xml.replace("{rank}", str(env["RANK"]))
    # joined in pytest_sessionstart, after the conftests' pytest_configure (a manager's own init)
    state = state_of(config)
    state.static = StaticSession(env["RANK"], env["WORLD_SIZE"], env["LOCAL_RANK"], state.timeout)


@pytest.hookimpl(trylast=True)
def pytest_sessionstart(session: pytest.Session) -> None:
    """Under torchrun, join the job; only rank 0 reports: other ranks drop the terminal reporter."""
    config = session.config
    static = state_of(config).static
    if static is None:
        return
    static.start()
    if static.rank == 0:
        return
    if config.getoption("mesh_report") == "rank0":
        reporter = config.pluginmanager.get_plugin("terminalreporter")
        if reporter is not None:
            config.pluginmanager.unregister(reporter)


def pytest_report_header(config: pytest.Config) -> list[str]:
    """Under torchrun: which rank of the job this process is."""
    static = state_of(config).static
    if static is None:
        return []
    return [f"meshsim: --multigpu-static, rank {static.rank} of {static.world_size}"]


@pytest.hookimpl(trylast=True)
def pytest_unconfigure(config: pytest.Config) -> None:
    """Leave the torchrun job once every rank is done."""
    state = state_of(config)
    if state.static is not None:
        state.static.stop()
        state.static = None


def pytest_collection_finish(session: pytest.Session) -> None:
    """Under torchrun: count the selected distributed tests, and those this job's size cannot run."""
    static = state_of(session.config).static
    if static is None:
        return
    needs: Counter[int] = Counter()
    distributed = 0
    for item in session.items:
        spec = spec_of(item)
        if spec is None:
            continue
        distributed += 1
        if item.get_closest_marker("world") is not None and size_of(item, spec) != static.world_size:
            needs[size_of(item, spec)] += 1
    session.config.stash[_UNRUN] = (needs, distributed)


def unrun_line(needs: Counter[int], world_size: int) -> str:
    """``3 tests need world 4; this job has 2 ranks: torchrun --nproc-per-node=4``."""
    parts = [
        f"{n} test{'s' if n > 1 else ''} need{'' if n > 1 else 's'} world {size}"
        for size, n in sorted(needs.items())
    ]
    commands = " or ".join(f"torchrun --nproc-per-node={size}" for size in sorted(needs))
    return f"{', '.join(parts)}; this job has {world_size} rank{'s' if world_size > 1 else ''}: {commands}"


def _all_unrun(config: pytest.Config) -> bool:
    needs, distributed = config.stash.get(_UNRUN, (Counter(), 0))
    return distributed > 0 and sum(needs.values()) == distributed


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter, config: pytest.Config) -> None:
    """Under torchrun: one line naming the world sizes tests needed that this job does not have."""
    static = state_of(config).static
    needs, _ = config.stash.get(_UNRUN, (Counter(), 0))
    if static is None or not needs:
        return
    line = f"meshsim: {unrun_line(needs, static.world_size)}"
    if _all_unrun(config):
        keep = " (--mesh-allow-unrun: exit status 0)" if config.getoption("mesh_allow_unrun") else ""
        terminalreporter.write_line(f"{line}; no distributed test ran{keep}", red=not keep, yellow=bool(keep))
    else:
        terminalreporter.write_line(line, yellow=True)


@pytest.hookimpl(trylast=True)
def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    """Under torchrun, a job that ran no distributed test because of its size fails (unless allowed)."""
    config = session.config
    if state_of(config).static is None or config.getoption("mesh_allow_unrun") or not _all_unrun(config):
        return
    if exitstatus in (pytest.ExitCode.OK, pytest.ExitCode.NO_TESTS_COLLECTED):
        session.exitstatus = pytest.ExitCode.TESTS_FAILED
