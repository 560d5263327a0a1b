"""A world's timeout counts progress: a rank that computes is no hang; one that spins or blocks is reported.

The world's ``timeout`` bounds how long it may go without a wait completing while
ranks wait. A rank running its own code and using the CPU holds that clock off (a
slow compile on a loaded machine is work, not a hang), up to ``RUN_LIMIT`` timeouts of
CPU time; a rank that uses no CPU (blocked on a lock outside meshsim) is reported after one
timeout and a probe of its CPU clock (as long as the timeout, a second at most).
"""

from __future__ import annotations

import re
import threading
import time

import pytest
import torch
import torch.distributed as dist

import meshsim

TIMEOUT = 0.3


def _compute(cpu_seconds: float) -> int:
    """Burn ``cpu_seconds`` of this thread's CPU time (not wall time: a loaded machine runs it slower)."""
    start, n = time.thread_time(), 0
    while time.thread_time() - start < cpu_seconds:
        n += 1
    return n


def _slow_rank_program(cpu_seconds: float) -> list[float]:
    if dist.get_rank() == 0:
        _compute(cpu_seconds)
    t = torch.full((2,), float(dist.get_rank() + 1))
    dist.all_reduce(t)
    return t.tolist()


def test_a_rank_computing_longer_than_the_timeout_while_others_wait_finishes() -> None:
    # rank 0 computes for 3 timeouts of CPU time while rank 1 waits for it in the all_reduce
    got = meshsim.run(_slow_rank_program, 2, args=(3 * TIMEOUT,), timeout=TIMEOUT)
    # what gloo thread ranks give for the same program (their groups' timeout is long enough)
    assert got == meshsim.run(_slow_rank_program, 2, args=(0.0,), backend="gloo", timeout=60.0)
    assert got == [[3.0, 3.0], [3.0, 3.0]]


def test_a_rank_spinning_forever_is_reported_after_the_run_limit() -> None:
    def body() -> None:
        if dist.get_rank() == 1:
            while True:
                pass
        dist.barrier()

    spun = r"kept using the CPU, [\d.]+ CPU seconds \(10 x the timeout\)"
    with pytest.raises(meshsim.DeadlockError, match=spun) as info:
        meshsim.run(body, 2, timeout=TIMEOUT)
    error = info.value
    assert error.timed_out and error.ranks == (1,)
    assert error.states[1] == "running its own code"
    assert "waiting in barrier()" in error.states[0]
    assert f"(timeout={TIMEOUT:g} s)" in str(error)


def test_a_rank_blocked_on_a_lock_is_reported_after_the_timeout() -> None:
    held = threading.Lock()
    held.acquire()
    blocked: list[threading.Thread] = []

    def body() -> None:
        if dist.get_rank() == 0:
            blocked.append(threading.current_thread())
            held.acquire()  # blocks: nobody releases it while the world runs
            held.release()
        dist.barrier()

    try:
        with pytest.raises(meshsim.DeadlockError, match="They used no CPU: blocked outside meshsim") as info:
            meshsim.run(body, 2, timeout=TIMEOUT)
    finally:
        held.release()  # the rank's thread goes on, and leaves at its next collective
        for thread in blocked:  # gone before the next test counts threads or descriptors
            thread.join(30)
    assert not any(thread.is_alive() for thread in blocked)
    error = info.value
    assert error.timed_out and error.ranks == (0,)
    assert error.states[0] == "running its own code"
    assert error.states[1] == "ready, waiting for its turn to run"  # serialized: rank 0 holds the baton


def test_a_rank_napping_in_short_sleeps_is_probed_longer_then_reported() -> None:
    """A rank sleeping 5 ms at a time uses a little CPU (about 0.5%): too little to be
    computing (2%), too much to be surely blocked (0.1%). The world reads its CPU clock
    again over two and then four times the probe before it reports the rank. (The
    property tests' sleep fault naps longer, to be reported after a single probe.)"""

    def body() -> None:
        if dist.get_rank() == 1:
            end = time.monotonic() + 30
            while time.monotonic() < end:
                time.sleep(0.005)
        dist.barrier()

    with pytest.raises(meshsim.DeadlockError, match="They used no CPU") as info:
        meshsim.run(body, 2, timeout=TIMEOUT)
    error = info.value
    assert error.timed_out and error.ranks == (1,)
    assert error.states[1] == "running its own code"
    assert "waiting in barrier()" in error.states[0]
    idle = re.search(r"made no progress for ([\d.]+) s", str(error))
    assert idle is not None
    # the timeout, then probes of 1, 2 and 4 timeouts (the message rounds to tenths)
    assert float(idle.group(1)) >= (1 + 1 + 2 + 4) * TIMEOUT - 0.1
