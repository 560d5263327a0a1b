"""``pytest --multigpu-static --mesh-backend=spawn`` without torchrun: start the job as torchrun would.

The pytest process becomes the launcher. It starts one pytest per rank, each with
the same arguments and torchrun's environment (``RANK``, ``WORLD_SIZE``,
``LOCAL_RANK``, ``MASTER_ADDR``, ``MASTER_PORT``, ...), so each runs the session
as a torchrun process would: its conftest's set-up, its fixtures and every static
test, once (see the ``--multigpu-static`` mode under torchrun in
:mod:`meshsim.pytest_plugin`). The launcher owns the rendezvous store, on
127.0.0.1 only (torchrun's agent store, which the ranks join as clients), and
keeps gloo on the loopback interface (:mod:`meshsim._process.loopback`).

Every rank writes to this terminal; by default only rank 0 reports (``--mesh-report``).
The exit status is rank 0's, or another rank's when rank 0 passed but it did not.
Once a rank has exited with an error, the others get the process groups' timeout
(``--mesh-timeout``) plus a grace period to finish before they are stopped.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Sequence

from meshsim._process.loopback import LOOPBACK_HOST, loopback_environment, loopback_store

__all__ = ["die_with_parent", "launch"]

_GRACE = 10.0  # seconds beyond the groups' timeout that ranks get once one has failed
_POLL = 0.1


def launch(args: Sequence[str], world_size: int, *, timeout: float, cwd: str) -> int:
    """Run ``pytest *args`` as ``world_size`` torchrun-style rank processes; returns the exit status.

    Args:
        args: pytest's command-line arguments, as given.
        world_size: the number of rank processes.

    Keyword args:
        timeout: the process groups' timeout (``--mesh-timeout``), which bounds how long
            ranks wait for one that has died.
        cwd: the directory pytest was started in.
    """
    store = loopback_store(world_size + 1, timeout=timeout)
    command = [sys.executable, "-m", "pytest", *args]
    processes = [
        subprocess.Popen(
            command,
            cwd=cwd,
            env=_rank_environment(rank, world_size, store.port),
            preexec_fn=die_with_parent,  # before exec; the launcher runs no other threads yet
        )
        for rank in range(world_size)
    ]
    try:
        codes = _wait(processes, timeout + _GRACE)
    finally:
        for process in processes:
            if process.poll() is None:
                process.kill()
            process.wait()
        del store
    return _status(codes)


def _rank_environment(rank: int, world_size: int, port: int) -> dict[str, str]:
    env = dict(os.environ)
    env.update(
        {
            "RANK": str(rank),
            "LOCAL_RANK": str(rank),
            "WORLD_SIZE": str(world_size),
            "LOCAL_WORLD_SIZE": str(world_size),
            "GROUP_RANK": "0",
            "MASTER_ADDR": LOOPBACK_HOST,
            "MASTER_PORT": str(port),
            # join the launcher's store as clients, as torchrun's workers join its agent's
            "TORCHELASTIC_USE_AGENT_STORE": "True",
            "TORCHELASTIC_RESTART_COUNT": "0",
            "OMP_NUM_THREADS": env.get("OMP_NUM_THREADS", "1"),
        }
    )
    env.update(loopback_environment(nccl=True))
    return env


def _wait(processes: list[subprocess.Popen[bytes]], grace: float) -> list[int]:
    """Every rank's exit status; once one has failed, the others get ``grace`` seconds."""
    deadline: float | None = None
    while True:
        codes = [process.poll() for process in processes]
        if all(code is not None for code in codes):
            return [int(code) for code in codes if code is not None]
        if deadline is None and any(code not in (None, 0) for code in codes):
            deadline = time.monotonic() + grace
        if deadline is not None and time.monotonic() > deadline:
            stuck = [rank for rank, code in enumerate(codes) if code is None]
            print(
                f"meshsim: rank(s) {stuck} still ran {grace:g} s after another rank failed: stopped",
                file=sys.stderr,
            )
            return [int(code) if code is not None else _STOPPED for code in codes]
        time.sleep(_POLL)


_STOPPED = 3  # pytest's INTERNAL_ERROR


def _status(codes: Sequence[int]) -> int:
    """Rank 0's exit status, or the first other rank's that is not 0 when rank 0's is."""
    if codes[0] != 0:
        return codes[0]
    return next((code for code in codes if code != 0), 0)


def die_with_parent() -> None:
    """Ask Linux to kill this process when its parent dies, so no rank outlives its launcher.

    Called in a launched child before exec, and first thing in a spawned rank.
    """
    if sys.platform.startswith("linux"):
        import ctypes

        try:
            ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
        except OSError:
            pass
