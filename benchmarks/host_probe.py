"""How fast the host runs each kind of work right now, sampled over time beside a simulated all_reduce.

Run: ``python benchmarks/host_probe.py [--samples 20] [--pause 2]``.

A diagnostic, not a test. On a shared VM the speed of torch ops can swing by ~2x
from one minute to the next while plain Python and system calls do not; the sim
backend, which runs every rank's torch work on one CPU, swings with torch. Each
row samples, on one CPU: a plain Python loop, an eventfd write+read (two system
calls), a hand-over between two threads through eventfds (what a rank hand-over
costs at least), ``torch.stack(4 x 1 KiB).sum(0)``, ``torch.equal`` of two small tensors
back to back and right after 60 us of Python that calls no torch op (what the first torch
op after a rank hand-over meets), and then a 4-rank sim all_reduce of 1 KiB.
"""

from __future__ import annotations

import argparse
import os
import statistics
import threading
import time
from collections.abc import Callable

import torch
import torch.distributed as dist

import meshsim


def _per_call(fn: Callable[[], object], calls: int) -> float:
    """Microseconds per call of ``fn``."""
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    return (time.perf_counter() - start) / calls * 1e6


def _python_loop() -> int:
    total = 0
    for i in range(1000):
        total += i
    return total


def _probes() -> dict[str, Callable[[], float]]:
    own = os.eventfd(0)
    ping, pong = os.eventfd(0), os.eventfd(0)

    def partner() -> None:
        while True:
            os.eventfd_read(ping)
            os.eventfd_write(pong, 1)

    threading.Thread(target=partner, daemon=True).start()  # it inherits the pinning: same CPU

    def system_calls() -> None:
        os.eventfd_write(own, 1)
        os.eventfd_read(own)

    def hand_over() -> None:
        os.eventfd_write(ping, 1)
        os.eventfd_read(pong)

    xs = [torch.ones(256) for _ in range(4)]
    return {
        "python loop x1000": lambda: _per_call(_python_loop, 200),
        "eventfd write+read": lambda: _per_call(system_calls, 5000),
        "thread hand-over": lambda: _per_call(hand_over, 3000),
        "torch stack+sum": lambda: _per_call(lambda: torch.stack(xs).sum(0), 3000),
        "equal": lambda: _op_after_python(0),
        "equal after 60us py": lambda: _op_after_python(60),
    }


def _op_after_python(python_us: float, calls: int = 2000) -> float:
    """Median microseconds of one small ``torch.equal`` right after ``python_us`` of Python alone."""
    a, b = torch.ones(4), torch.ones(4)
    times = []
    for _ in range(calls):
        end = time.perf_counter() + python_us * 1e-6
        while time.perf_counter() < end:
            pass
        start = time.perf_counter()
        torch.equal(a, b)
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e6


def _all_reduce() -> float:
    x = torch.ones(256)
    return _per_call(lambda: dist.all_reduce(x), 1000)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--samples", type=int, default=20, help="rows to print")
    parser.add_argument("--pause", type=float, default=2.0, help="seconds between rows")
    args = parser.parse_args()
    allowed = os.sched_getaffinity(0)
    os.sched_setaffinity(0, {min(allowed)})
    torch.set_num_threads(1)
    probes = _probes()
    os.sched_setaffinity(0, allowed)
    print("us per call; each row one sample, the probes on one CPU")
    print(" ".join(f"{name:>20}" for name in [*probes, "sim all_reduce ws4"]))
    for _ in range(args.samples):
        os.sched_setaffinity(0, {min(allowed)})
        row = [probe() for probe in probes.values()]
        os.sched_setaffinity(0, allowed)
        row.append(max(meshsim.run(_all_reduce, 4)))
        print(" ".join(f"{value:20.2f}" for value in row), flush=True)
        time.sleep(args.pause)


if __name__ == "__main__":
    main()
