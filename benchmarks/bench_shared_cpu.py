"""Two processes whose simulated worlds chose the same CPU: with the starvation check, and without.

Run: ``python benchmarks/bench_shared_cpu.py`` (``--seconds S`` per run, ``--rounds N``).

A serialized world pins its rank threads to the CPU its caller is on. Two processes (two
pytest-xdist workers, two test runs) can choose the same one; each then gets half a CPU for as
long as its world lasts while another CPU idles. The world's supervisor measures its process's
CPU time against wall time each second and gives the pinning up when the share is well under one
CPU (``meshsim/_engine/affinity.py``). Here both processes' worlds are made to choose the first
allowed CPU, and each runs 8-rank worlds of ``bench_floor``'s ``redistribute_cost`` steps for
the same wall time:

- ``check``: as shipped;
- ``no check``: the check off, so the pinning stays (meshsim before it).

Printed: steps per second of each process and its CPU share (medians over rounds, the two modes
alternating), and check / no check. Needs two CPUs. Not a test: nothing here asserts a speed.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time

CHILD = """
import os, sys, time
sys.path.insert(0, {here!r})
import torch, torch.distributed as dist
import meshsim, bench_floor
from meshsim._engine import affinity
mode, seconds, cpu = sys.argv[1], float(sys.argv[2]), int(sys.argv[3])
affinity.current_cpu = lambda allowed: cpu  # both processes' worlds on one CPU
if mode == "nocheck":
    affinity.Starvation.starved = lambda self: False
program = next(p for p in bench_floor.PROGRAMS if p.name.startswith("redistribute_cost"))

def body():
    step = program.setup(8)
    n, start = 0, time.perf_counter()
    while True:
        step()
        n += 1
        done = torch.tensor([float(time.perf_counter() - start > seconds)])
        dist.broadcast(done, 0)  # every rank stops after the same step
        if done.item():
            return n

torch.set_num_threads(1)
cpu0, wall0 = time.process_time(), time.perf_counter()
steps = meshsim.run(body, 8, gpu_paths=False, timeout=600)[0]
wall = time.perf_counter() - wall0
print(steps / wall, (time.process_time() - cpu0) / wall)
"""


def _pair(mode: str, seconds: float, cpu: int) -> list[tuple[float, float]]:
    here = os.path.dirname(os.path.abspath(__file__))
    code = CHILD.format(here=here)
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", code, mode, str(seconds), str(cpu)], stdout=subprocess.PIPE, text=True
        )
        for _ in range(2)
    ]
    out = []
    for proc in procs:
        text, _ = proc.communicate(timeout=seconds * 20 + 120)
        if proc.returncode != 0:
            raise SystemExit(f"a {mode} process failed (exit {proc.returncode})")
        steps, share = map(float, text.split())
        out.append((steps, share))
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=8.0, help="wall time each process runs (default 8)")
    parser.add_argument("--rounds", type=int, default=3, help="rounds, each running both modes (default 3)")
    args = parser.parse_args()
    allowed = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else []
    if len(allowed) < 2:
        raise SystemExit("needs two CPUs this process may run on")
    results: dict[str, list[tuple[float, float]]] = {"check": [], "nocheck": []}
    for r in range(args.rounds):
        for mode in ("check", "nocheck") if r % 2 == 0 else ("nocheck", "check"):
            results[mode] += _pair(mode, args.seconds, allowed[0])
            time.sleep(0.5)
    print(
        f"two processes at once, each running 8-rank worlds for {args.seconds:g} s, both made to choose "
        f"CPU {allowed[0]}; medians over {args.rounds} rounds (2 processes each)"
    )
    print(f"{'mode':10s} {'steps/s':>9s} {'CPU share':>10s}")
    med = {}
    for mode, label in (("check", "check"), ("nocheck", "no check")):
        steps = statistics.median(s for s, _ in results[mode])
        share = statistics.median(c for _, c in results[mode])
        med[mode] = steps
        print(f"{label:10s} {steps:9.2f} {share * 100:9.0f}%")
    print(f"check / no check: {med['check'] / med['nocheck']:.2f}x the steps per second")


if __name__ == "__main__":
    main()
