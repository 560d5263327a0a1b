"""``./dev gpu-check``: what a GPU machine must show before GPU CI relies on meshsim, in one table.

Four steps, each with its result and wall time:

1. the suite's ``--multigpu-static`` run under torchrun, one rank per GPU (NCCL);
2. simulated ranks on one GPU (``--mesh-cuda=cuda:0``);
3. the failure report on NCCL: a test whose rank 1 skips an all_reduce must fail with
   the per-rank table naming rank 1;
4. ShardTensor ``from_local`` "infer" vs "chunk" on NCCL ranks (``./dev demo`` shows it
   on simulated ranks).

On a machine without GPUs each step runs its CPU equivalent where one exists (gloo
ranks, ``--mesh-cuda=cpu``) and says so; what needs a GPU is listed as skipped, with
why. Exits 1 when a step failed. Uses the Python it runs under: on a GPU machine, the
machine's own torch with meshsim installed (``pip install --no-deps -e .``).
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
BUDGET = 480.0  # seconds: the whole check runs in under 8 minutes

SKIPS_A_COLLECTIVE = """
import pytest, torch, torch.distributed as dist

@pytest.mark.world(2)
def test_rank1_skips_all_reduce(rank, distributed_mesh):
    t = torch.ones(4, device=distributed_mesh.device_type)
    if rank != 1:
        dist.all_reduce(t, group=distributed_mesh.get_group())
"""

FROM_LOCAL = """
import statistics, time
import pytest, torch, torch.distributed as dist
from torch.distributed.tensor import Shard

import meshsim
from shardtensor import ShardTensor

@pytest.mark.multigpu_static
def test_from_local_infer_vs_chunk(distributed_mesh, rank, world_size):
    mesh = distributed_mesh
    device = mesh.device_type
    rows = 1000
    sizes = [len(c) for c in torch.arange(rows).chunk(world_size)] + [0] * world_size
    local = torch.randn(1, sizes[rank], 64, 32, device=device)
    shape = (1, rows, 64, 32)
    modes = {
        "infer": lambda: ShardTensor.from_local(local, mesh, [Shard(1)]),
        "chunk": lambda: ShardTensor.from_local(
            local, mesh, [Shard(1)], sharding_shapes="chunk", global_shape=shape
        ),
    }
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    line = []
    specs = []
    for mode, make in modes.items():
        with meshsim.record() as ledger:
            specs.append(make()._spec)
        per_call = []
        for _ in range(20):
            sync()
            start = time.perf_counter()
            make()
            sync()
            per_call.append(time.perf_counter() - start)
        calls = sum(ledger.counts().values())
        line.append(f"{mode} {statistics.median(per_call) * 1e3:.3f} ms, {calls} collective(s)")
    assert specs[0] == specs[1]
    if rank == 0:
        print(f"GPU-CHECK from_local on {world_size} {device} rank(s): " + "; ".join(line) + "; same spec")
"""


@dataclass
class Step:
    name: str
    result: str
    seconds: float | None  # None: not run


def _run(args: list[str], timeout: float, cwd: Path = ROOT) -> tuple[int, str, float]:
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    start = time.monotonic()
    try:
        done = subprocess.run(
            args,
            cwd=cwd,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            timeout=timeout,
        )
        code, out = done.returncode, done.stdout
    except subprocess.TimeoutExpired as timed_out:
        out = timed_out.stdout or ""
        code, out = -1, out if isinstance(out, str) else out.decode(errors="replace")
    return code, out, time.monotonic() - start


def _torchrun(nproc: int, *args: str) -> list[str]:
    return [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        f"--nproc_per_node={nproc}",
        "-m",
        "pytest",
        "-p",
        "no:cacheprovider",
        "--multigpu-static",
        *args,
    ]


def _summary(out: str) -> str:
    """pytest's last line (``3 passed, 1 skipped in 12.3s``), without the time."""
    lines = [line for line in out.splitlines() if re.search(r"\b(passed|failed|skipped|error)\b.* in ", line)]
    return re.sub(r" in [\d.]+s.*", "", lines[-1].strip("= ")) if lines else "no pytest summary"


def _tail(out: str, n: int = 15) -> str:
    return "\n".join("    " + line for line in out.splitlines()[-n:])


def static_suite(gpus: int, scratch: Path) -> Step:
    if gpus:
        name = f"torchrun --multigpu-static tests/shardtensor, {gpus} NCCL rank(s)"
        code, out, took = _run(_torchrun(gpus, "tests/shardtensor", "-q", "--mesh-allow-unrun"), 330)
    else:
        name = "torchrun --multigpu-static, 2 gloo CPU ranks (test_readme.py; CI step 3 runs the suite)"
        code, out, took = _run(_torchrun(2, "tests/shardtensor/test_readme.py", "-q"), 240)
    return Step(name, _verdict(code == 0, _summary(out), out), took)


def simulated_on_gpu(gpus: int, scratch: Path) -> Step:
    device = "cuda:0" if gpus else "cpu"
    args = [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-q", "-x", f"--mesh-cuda={device}"]
    if gpus:
        name = "simulated ranks on one GPU: tests/shardtensor --mesh-cuda=cuda:0"
        code, out, took = _run([*args, "tests/shardtensor", "-m", "not slow"], 240)
    else:
        name = "simulated ranks, CUDA emulated: --mesh-cuda=cpu (test_readme.py, test_cuda_option.py)"
        code, out, took = _run(
            [*args, "tests/shardtensor/test_readme.py", "tests/plugin/test_cuda_option.py", "-m", "not slow"],
            240,
        )
    return Step(name, _verdict(code == 0, _summary(out), out), took)


def failure_report(gpus: int, scratch: Path) -> Step:
    folder = scratch / "report"
    folder.mkdir()
    (folder / "test_user_sharding.py").write_text(SKIPS_A_COLLECTIVE)
    backend = "NCCL" if gpus >= 2 else "gloo CPU"
    name = f"failure report, 2 {backend} ranks: rank 1 skips an all_reduce"
    if gpus == 1:
        name += " (NCCL needs one GPU per rank)"
    # gloo's all_reduce blocks rank 0 until the timeout; NCCL's returns, and the bodies' ends disagree
    timeout = "--mesh-timeout=20" if gpus >= 2 else "--mesh-timeout=8"
    code, out, took = _run(_torchrun(2, "test_user_sharding.py", "-q", timeout), 150, cwd=folder)
    wanted = [
        "rank 0: waiting in all_reduce(float32[4], SUM), call #0 of group [0, 1]",
        "rank 1: finished",
        "Ranks wait for rank 1, which finished.",
    ]
    missing = [line for line in wanted if line not in out]
    ok = code not in (0, -1) and not missing
    text = "failed as expected, rank 1 named, per-rank table" if ok else f"exit {code}; missing {missing}"
    return Step(name, _verdict(ok, text, out), took)


def from_local(gpus: int, scratch: Path) -> Step:
    folder = scratch / "from_local"
    folder.mkdir()
    (folder / "test_from_local.py").write_text(FROM_LOCAL)
    ranks = gpus if gpus >= 2 else 2
    backend = "NCCL" if gpus >= 2 else "gloo CPU"
    name = f'from_local "infer" vs "chunk", {ranks} {backend} ranks'
    code, out, took = _run(_torchrun(ranks, "test_from_local.py", "-q", "-s"), 150, cwd=folder)
    found = re.search(r"GPU-CHECK from_local on .*?: (.*)", out)
    ok = code == 0 and found is not None
    return Step(name, _verdict(ok, found.group(1) if found else f"exit {code}", out), took)


def _verdict(ok: bool, text: str, out: str) -> str:
    if ok:
        return f"ok: {text}"
    print(f"--- output of a failed step (last lines):\n{_tail(out)}", flush=True)
    return f"FAILED: {text}"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="./dev gpu-check", description=__doc__.splitlines()[0])
    parser.parse_args(argv)
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    print(f"gpu-check: torch {torch.__version__}, {gpus} GPU(s), {sys.executable}", flush=True)
    steps: list[Step] = []
    skipped: list[str] = []
    started = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="meshsim-gpu-check-") as tmp:
        for check in (static_suite, simulated_on_gpu, failure_report, from_local):
            if time.monotonic() - started > BUDGET:
                steps.append(Step(check.__name__, f"not run: the {BUDGET:g} s budget is spent", None))
                continue
            print(f"gpu-check: {check.__name__} ...", flush=True)
            steps.append(check(gpus, Path(tmp)))
    if not gpus:
        skipped = [
            "NCCL (steps 1, 3, 4 ran on gloo CPU ranks instead): no GPU on this machine",
            "--mesh-cuda=cuda:0 (step 2 emulated CUDA on the CPU instead): no GPU on this machine",
        ]
    elif gpus == 1:
        skipped = [
            "failure report on NCCL (step 3 ran on gloo CPU ranks): "
            "NCCL needs one GPU per rank, this machine has 1"
        ]
    _table(steps)
    for line in skipped:
        print(f"skipped: {line}")
    print(f"total {time.monotonic() - started:.0f} s")
    return 1 if any(step.result.startswith("FAILED") for step in steps) else 0


def _table(steps: list[Step]) -> None:
    width = max(len(step.name) for step in steps)
    print(f"\n{'step':{width}}  {'time':>6}  result")
    for step in steps:
        took = f"{step.seconds:5.0f}s" if step.seconds is not None else "     -"
        print(f"{step.name:{width}}  {took:>6}  {step.result}")


if __name__ == "__main__":
    sys.exit(main())
