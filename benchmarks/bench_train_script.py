"""One training script three ways, paired: one process, torchrun's processes, ``meshsim run``'s ranks.

Runs ``examples/train_llama.py`` (or ``--script``) as ``python SCRIPT``, ``torchrun --standalone
--nproc-per-node=N SCRIPT`` (gloo on CPU) and ``meshsim run --nproc-per-node=N SCRIPT``, in a fresh
random order each round, and prints per launcher: the median wall time, the ratio to torchrun's,
the peak memory of the whole process tree, and whether rank 0's losses equal the one-process run's
(within ``--rtol``, relative).

Memory: every 50 ms, each process's VmHWM (the kernel's own peak RSS of that process) is read;
"sum of peaks" adds them over the tree (torchrun's agent and its workers; their shared pages
counted once per process, as RSS does), "PSS" is the largest sum of proportional set sizes seen
at a poll (shared pages split between the processes that map them).

    python benchmarks/bench_train_script.py --rounds 3
    python benchmarks/bench_train_script.py --nproc 8 -- --pp 2 --tp 2
"""

from __future__ import annotations

import argparse
import os
import random
import re
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def _children() -> dict[int, list[int]]:
    kids: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as stat:
                    parent = int(stat.read().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            kids.setdefault(parent, []).append(int(entry))
    return kids


def _tree(root: int) -> list[int]:
    kids, found, todo = _children(), [], [root]
    while todo:
        pid = todo.pop()
        found.append(pid)
        todo += kids.get(pid, [])
    return found


def _field(path: str, name: str) -> int:
    try:
        with open(path) as source:
            for line in source:
                if line.startswith(name):
                    return int(line.split()[1])
    except OSError:
        pass
    return 0


def measure(command: list[str]) -> tuple[float, float, float, str]:
    """Wall seconds, MiB summed over per-process peaks, MiB of the largest PSS sum, stdout."""
    start = time.perf_counter()
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
    peaks: dict[int, int] = {}
    largest_pss = 0
    import threading

    chunks: list[str] = []
    reader = threading.Thread(target=lambda: chunks.append(proc.stdout.read()))  # type: ignore[union-attr]
    reader.start()
    while proc.poll() is None:
        pss = 0
        for pid in _tree(proc.pid):
            peaks[pid] = max(peaks.get(pid, 0), _field(f"/proc/{pid}/status", "VmHWM:"))
            pss += _field(f"/proc/{pid}/smaps_rollup", "Pss:")
        largest_pss = max(largest_pss, pss)
        time.sleep(0.05)
    reader.join()
    wall = time.perf_counter() - start
    out = "".join(chunks)
    if proc.returncode != 0:
        raise SystemExit(f"{' '.join(command)} failed ({proc.returncode}):\n{out[-3000:]}")
    return wall, sum(peaks.values()) / 1024, largest_pss / 1024, out


def losses(out: str) -> list[float]:
    return [float(m) for m in re.findall(r"step \d+ loss_full (\S+)", out)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--script", default=str(ROOT / "examples" / "train_llama.py"))
    parser.add_argument("--nproc", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--rtol", type=float, default=1e-5)
    parser.add_argument("args", nargs="*", help="the script's arguments (after --)")
    options = parser.parse_args()
    bin_dir = Path(sys.executable).parent
    script = [options.script, "--print-full", *options.args]
    launchers = {
        "python (1 process)": [sys.executable, *script],
        f"torchrun ({options.nproc} processes, gloo)": [
            str(bin_dir / "torchrun"),
            "--standalone",
            f"--nproc-per-node={options.nproc}",
            *script,
        ],
        f"meshsim run ({options.nproc} ranks)": [
            sys.executable,
            "-m",
            "meshsim",
            "run",
            f"--nproc-per-node={options.nproc}",
            *script,
        ],
    }
    results: dict[str, list[tuple[float, float, float, list[float]]]] = {name: [] for name in launchers}
    for _ in range(options.rounds):
        order = list(launchers)
        random.shuffle(order)
        for name in order:
            wall, peaks, pss, out = measure(launchers[name])
            results[name].append((wall, peaks, pss, losses(out)))
    reference = results["python (1 process)"][0][3]
    torchrun = next(name for name in launchers if name.startswith("torchrun"))
    torch_wall = statistics.median(r[0] for r in results[torchrun])
    print(
        f"{options.script} {' '.join(options.args)}: {options.rounds} rounds, medians; losses vs one process"
    )
    print(f"{'launcher':30} {'wall s':>7} {'/torchrun':>9} {'sum of peaks MiB':>17} {'PSS MiB':>8}  losses")
    for name, rows in results.items():
        wall = statistics.median(r[0] for r in rows)
        peaks = statistics.median(r[1] for r in rows)
        pss = statistics.median(r[2] for r in rows)
        got = rows[0][3]
        worst = max((abs(a - b) / abs(b) for a, b in zip(got, reference)), default=float("nan"))
        same = len(got) == len(reference) and worst <= options.rtol
        verdict = f"{'equal' if same else 'DIFFER'} (max rel. {worst:.1e}, {len(got)} steps)"
        print(f"{name:30} {wall:7.2f} {wall / torch_wall:9.2f} {peaks:17.0f} {pss:8.0f}  {verdict}")
    print("losses per step (one process):", " ".join(f"{x:.7f}" for x in reference))


if __name__ == "__main__":
    main()
