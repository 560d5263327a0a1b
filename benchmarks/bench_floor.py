"""DTensor programs on N simulated ranks against the floor of the design: N x one rank alone.

Run: ``python benchmarks/bench_floor.py`` (``--quick`` for fewer steps and rounds, ``--rounds N``
for more rounds where the machine's speed swings, ``--sizes 4 8``, ``--only NAME``).

meshsim runs an SPMD program once per rank, so a world cannot cost less than N times one rank
whose collectives move nothing. torch's ``FakeProcessGroup`` gives that rank: world size N,
rank 0, one thread, every collective a no-op. Every cost above N x that rank is meshsim's own
(hand-overs, per-rank state swaps, the ledger, call sites, findings, data movement).

Columns, per program and world size (milliseconds per step of the program, for the whole world):

- ``meshsim``: ``meshsim.run(body, N, gpu_paths=False)`` (torch's CPU collectives, the same path
  as every other column), from the first rank's start of the timed steps to the last rank's end
  (all ranks warmed up and past a barrier before the first starts);
- ``N x fake``: N times one rank on ``FakeProcessGroup`` (world size N, rank 0), the same program;
- ``local``: the program once under torch's ``LocalTensorMode`` (every rank's shard in one
  tensor, one thread), ``-`` where it does not run there (the reason printed below the table);
- ``threaded``: torch's threaded process group (one thread per rank, run at once under the GIL,
  torch's ``MultiThreadedTestCase`` machinery);
- ``ms/fake``, ``ms/local``, ``ms/thr``: meshsim over that column, the median of each round's
  ratio (the sides measured back to back, their order alternating by round), the range beside.

Programs: 64x64 float32 DTensors on a 1-D mesh of N ranks; ``R->P->R`` goes to Partial as
torch's own test does (``Redistribute.apply``: ``redistribute`` refuses it); the matmul contracts
a dimension sharded on both sides and takes the ``full_tensor`` of the Partial result; the FSDP2
step is forward, backward and SGD of a 3-layer MLP under ``fully_shard``; ``redistribute_cost``
is a slice of torch's ``test_graph_based_redistribute_cost`` (``_distribute_tensor`` with shard
orders, ``redistribute_cost`` with the graph-based planner) on a (2, 2, 2) mesh at 8 ranks,
(2, 2) at 4. A cell that does not run says why below the table.

``--split`` prints a second table instead: each rank's CPU time per step (``time.thread_time``,
so hand-overs do not blur it), split into the time inside the collectives (DTensor's
functional ones, ``torch.distributed._functional_collectives``, the call and its wait; the
``torch.distributed`` calls FSDP2 makes; the scatter and broadcast ``distribute_tensor`` makes;
meshsim's hand-overs included) and everything else,
meshsim against the fake rank. It says which part of the gap in ``ms/fake`` is the
collective path and which is the program's own code running slower.

Every rank and the fake/local runs use one intra-op thread (``torch.set_num_threads(1)``, as
meshsim's ranks do by default). Not a test: nothing here asserts a speed.
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import random
import statistics
import threading
import time
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_tensor

import meshsim

warnings.filterwarnings("ignore", category=FutureWarning)
warnings.filterwarnings("ignore", category=UserWarning)
# DTensor logs a warning per rank for CPU all_to_all fallbacks and multi-step plans
logging.getLogger("torch.distributed").setLevel(logging.ERROR)

Step = Callable[[], object]


@dataclass(frozen=True)
class Program:
    """One DTensor program: ``setup(world_size)`` runs on a rank (its group up) and returns one step."""

    name: str
    setup: Callable[[int], Step]
    steps: int  # timed steps per run (--quick halves it)


def _mesh(world_size: int) -> DeviceMesh:
    with _no_local_mode():
        return init_device_mesh("cpu", (world_size,))


@contextlib.contextmanager
def _no_local_mode() -> Iterator[None]:
    from torch.distributed._local_tensor import maybe_disable_local_tensor_mode

    with maybe_disable_local_tensor_mode():
        yield


def _sharded(world_size: int, placements: list[Any], rows: int = 64, cols: int = 64) -> DTensor:
    mesh = _mesh(world_size)
    torch.manual_seed(0)
    return distribute_tensor(torch.randn(rows, cols), mesh, placements)


def _s0_to_r(ws: int) -> Step:
    x = _sharded(ws, [Shard(0)])
    return lambda: x.redistribute(x.device_mesh, [Replicate()])


def _s0_to_s1(ws: int) -> Step:
    x = _sharded(ws, [Shard(0)])
    return lambda: x.redistribute(x.device_mesh, [Shard(1)])


def _r_p_r(ws: int) -> Step:
    x = _sharded(ws, [Replicate()])
    mesh = x.device_mesh
    from torch.distributed.tensor._redistribute import Redistribute  # R->P is internal (as torch's test)

    f32 = torch.float32
    config = {"op_dtype": f32, "out_dtype": f32, "backward_options": {"op_dtype": f32, "out_dtype": f32}}
    return lambda: Redistribute.apply(x, mesh, (Partial(),), False, config).redistribute(mesh, [Replicate()])


def _mul(ws: int) -> Step:
    x = _sharded(ws, [Shard(0)])
    y = _sharded(ws, [Shard(0)])
    return lambda: x * y


def _sum_full(ws: int) -> Step:
    x = _sharded(ws, [Shard(0)])
    return lambda: x.sum(0).full_tensor()


def _matmul(ws: int) -> Step:
    a = _sharded(ws, [Shard(1)])
    b = _sharded(ws, [Shard(0)])
    return lambda: (a @ b).full_tensor()


def _fsdp(ws: int) -> Step:
    from torch.distributed.fsdp import fully_shard

    mesh = _mesh(ws)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 16))
    for layer in (model[0], model[2]):
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    x = torch.randn(8, 32)

    def step() -> None:
        model(x).sum().backward()
        opt.step()
        opt.zero_grad()

    return step


def _redistribute_cost(ws: int) -> Step:
    """A slice of torch's ``test_graph_based_redistribute_cost``: mesh (2,2,2) at 8 ranks, (2,2) at 4."""
    from torch.distributed.tensor._collective_utils import redistribute_cost
    from torch.distributed.tensor._redistribute import use_min_cost_redistribution_plan
    from torch.testing._internal.distributed._tensor.common_dtensor import (
        generate_shard_orders,
        patched_distribute_tensor,
    )

    shape = (2, 2, 2) if ws == 8 else (2,) * (ws.bit_length() - 1)
    with _no_local_mode():
        mesh = init_device_mesh("cpu", shape)
    torch.manual_seed(21)
    data = torch.randn(16, 8)
    with _no_local_mode():
        orders = list(generate_shard_orders(mesh, data.ndim))
    random.Random(42).shuffle(orders)
    src_order, dst_order, *others = orders[:4]

    def step() -> None:
        with use_min_cost_redistribution_plan(enabled=True):
            src = patched_distribute_tensor(data.clone(), mesh, None, src_order)
            dst = patched_distribute_tensor(data.clone(), mesh, None, dst_order)
            redistribute_cost(src._spec, dst._spec)
            for order in others:
                mid = patched_distribute_tensor(data.clone(), mesh, None, order)
                redistribute_cost(src._spec, mid._spec)
                redistribute_cost(mid._spec, dst._spec)

    return step


PROGRAMS = [
    Program("S(0)->R", _s0_to_r, 200),
    Program("S(0)->S(1)", _s0_to_s1, 200),
    Program("R->P->R", _r_p_r, 100),
    Program("x*y (S(0))", _mul, 400),
    Program("x.sum(0).full_tensor()", _sum_full, 200),
    Program("matmul, sharded k", _matmul, 100),
    Program("FSDP2 step, MLP", _fsdp, 20),
    Program("redistribute_cost", _redistribute_cost, 5),
]


def _steps(program: Program, quick: bool) -> int:
    """The timed steps per run (``--quick`` halves them)."""
    return max(1, program.steps // 2) if quick else program.steps


def _timed(step: Step, steps: int) -> tuple[float, float]:
    step()  # warm-up: caches, first-use imports
    return _loop(step, steps)


def _loop(step: Step, steps: int) -> tuple[float, float]:
    start = time.perf_counter()
    for _ in range(steps):
        step()
    return start, time.perf_counter()


# -- the runners: each returns the world's seconds for ``steps`` steps --


def run_meshsim(program: Program, ws: int, steps: int) -> float:
    def body() -> tuple[float, float]:
        step = program.setup(ws)
        step()
        dist.barrier()
        return _loop(step, steps)

    spans = meshsim.run(body, ws, gpu_paths=False, timeout=300)
    return max(end for _, end in spans) - min(start for start, _ in spans)


@contextlib.contextmanager
def _fake_group(ws: int) -> Iterator[None]:
    from torch.testing._internal.distributed.fake_pg import FakeStore

    saved = torch.get_num_threads()
    torch.set_num_threads(1)
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=ws)
    try:
        yield
    finally:
        dist.destroy_process_group()
        torch.set_num_threads(saved)


def run_fake(program: Program, ws: int, steps: int) -> float:
    with _fake_group(ws):
        start, end = _timed(program.setup(ws), steps)
    return ws * (end - start)


def run_local(program: Program, ws: int, steps: int) -> float:
    from torch.distributed._local_tensor import LocalTensorMode

    with _fake_group(ws), LocalTensorMode(frozenset(range(ws))):
        start, end = _timed(program.setup(ws), steps)
    return end - start


def run_threaded(program: Program, ws: int, steps: int) -> float:
    from torch.testing._internal.distributed import multi_threaded_pg as mtpg

    torch._C._distributed_c10d._set_thread_isolation_mode(True)
    mtpg._install_threaded_pg()
    store = dist.HashStore()
    spans: list[tuple[float, float]] = [(0.0, 0.0)] * ws
    errors: list[BaseException] = []

    def rank_main(rank: int) -> None:
        try:
            torch.set_num_threads(1)
            dist.init_process_group("threaded", rank=rank, world_size=ws, store=store)
            step = program.setup(ws)
            step()
            dist.barrier()
            spans[rank] = _loop(step, steps)
            dist.barrier()
            dist.destroy_process_group()
        except BaseException as exc:  # reported by the caller
            errors.append(exc)

    threads = [threading.Thread(target=rank_main, args=(r,)) for r in range(ws)]
    try:
        for t in threads:
            t.start()
        for t in threads:
            t.join(300)
    finally:
        mtpg.ProcessLocalGroup.reset()
        mtpg._uninstall_threaded_pg()
        torch._C._distributed_c10d._set_thread_isolation_mode(False)
    if errors:
        raise errors[0]
    return max(end for _, end in spans) - min(start for start, _ in spans)


# -- --split: each rank's CPU inside the collectives DTensor and FSDP2 call, and outside them --

# What DTensor calls for its collectives (module attributes looked up at each call), and the
# tensor subclass whose wait ends an asynchronous one. torch.distributed._functional_collectives
# is private: these names were looked up on torch 2.11, 2.13 and 2.14 (2.11 has no *_single
# ones); a name that is missing is skipped.
_FUNCOL_CALLS = (
    "all_gather_single",
    "all_gather_tensor",
    "all_reduce",
    "reduce_scatter_single",
    "reduce_scatter_tensor",
    "all_to_all_single",
    "wait_tensor",
)
# and what FSDP2 calls (torch.distributed's functions: the *_single names are newer torch's)
_DIST_CALLS = (
    "all_gather_single",
    "all_gather_into_tensor",
    "reduce_scatter_single",
    "reduce_scatter_tensor",
    "all_reduce",
)

# and what distribute_tensor calls to send rank 0's data (src_data_rank=0): mesh_scatter and
# mesh_broadcast look these names up in the private torch.distributed.tensor._collective_utils
# (imported there from distributed_c10d in torch 2.11, 2.13 and 2.14)
_MESH_CALLS = ("scatter", "broadcast")


class _CollectiveClock:
    """Each thread's CPU time inside the wrapped collectives (the outermost call only)."""

    def __init__(self) -> None:
        self._local = threading.local()
        self.inside: dict[int, int] = {}

    def wrap(self, fn: Callable[..., Any]) -> Callable[..., Any]:
        local, inside = self._local, self.inside

        def timed(*args: Any, **kwargs: Any) -> Any:
            depth = getattr(local, "depth", 0)
            local.depth = depth + 1
            start = time.thread_time_ns()
            try:
                return fn(*args, **kwargs)
            finally:
                local.depth = depth
                if depth == 0:
                    me = threading.get_ident()
                    inside[me] = inside.get(me, 0) + time.thread_time_ns() - start

        return timed

    @contextlib.contextmanager
    def installed(self) -> Iterator[None]:
        import torch.distributed._functional_collectives as funcol
        import torch.distributed.tensor._collective_utils as utils

        saved: list[tuple[Any, str, Any]] = [
            (funcol, name, getattr(funcol, name)) for name in _FUNCOL_CALLS if hasattr(funcol, name)
        ]
        saved += [(dist, name, getattr(dist, name)) for name in _DIST_CALLS if hasattr(dist, name)]
        saved += [(utils, name, getattr(utils, name)) for name in _MESH_CALLS if hasattr(utils, name)]
        saved.append((funcol.AsyncCollectiveTensor, "wait", funcol.AsyncCollectiveTensor.wait))
        for owner, name, fn in saved:
            setattr(owner, name, self.wrap(fn))
        try:
            yield
        finally:
            for owner, name, fn in saved:
                setattr(owner, name, fn)

    def measure(self, step: Step, steps: int) -> tuple[float, float]:
        """This thread's CPU seconds per step: in all, and inside the collectives."""
        me = threading.get_ident()
        self.inside[me] = 0
        start = time.thread_time_ns()
        _loop(step, steps)
        total = time.thread_time_ns() - start
        return total / steps / 1e9, self.inside[me] / steps / 1e9


def split_meshsim(program: Program, ws: int, steps: int, clock: _CollectiveClock) -> tuple[float, float]:
    def body() -> tuple[float, float]:
        step = program.setup(ws)
        step()
        dist.barrier()
        return clock.measure(step, steps)

    per_rank = meshsim.run(body, ws, gpu_paths=False, timeout=300)
    return statistics.mean(t for t, _ in per_rank), statistics.mean(i for _, i in per_rank)


def split_fake(program: Program, ws: int, steps: int, clock: _CollectiveClock) -> tuple[float, float]:
    with _fake_group(ws):
        step = program.setup(ws)
        step()
        return clock.measure(step, steps)


def run_split(programs: list[Program], sizes: list[int], rounds: int, quick: bool) -> None:
    clock = _CollectiveClock()
    got: dict[tuple[str, int, str], list[tuple[float, float]]] = {}
    failed: set[tuple[str, int, str]] = set()
    with clock.installed():
        for round_ in range(rounds):
            for ws in sizes:
                for program in programs:
                    steps = _steps(program, quick)
                    sides = (("meshsim", split_meshsim), ("fake", split_fake))
                    for side, run in sides if round_ % 2 == 0 else sides[::-1]:
                        key = (program.name, ws, side)
                        if key in failed:
                            continue
                        try:
                            got.setdefault(key, []).append(run(program, ws, steps, clock))
                        except Exception as exc:  # said here, the row left out
                            failed.add(key)
                            got.pop(key, None)
                            print(f"not run: {program.name} at {ws}, {side}: {_why(exc)}")
    print(
        f"each rank's CPU (us per step, medians over {rounds} rounds): in the collectives (DTensor's\n"
        "functional ones, call and wait; FSDP2's torch.distributed calls; distribute_tensor's scatter\n"
        "and broadcast; meshsim's hand-overs included)\n"
        "and outside them"
    )
    header = (
        f"{'program':24} {'ws':>3} {'meshsim in':>10} {'fake in':>8} {'extra in':>8} "
        f"{'meshsim out':>11} {'fake out':>8} {'extra out':>9}"
    )
    print(header)
    print("-" * len(header))
    for program in programs:
        for ws in sizes:
            mine, fake = got.get((program.name, ws, "meshsim")), got.get((program.name, ws, "fake"))
            if not mine or not fake:
                continue
            m_in = statistics.median(i for _, i in mine) * 1e6
            m_out = statistics.median(t - i for t, i in mine) * 1e6
            f_in = statistics.median(i for _, i in fake) * 1e6
            f_out = statistics.median(t - i for t, i in fake) * 1e6
            print(
                f"{program.name:24} {ws:>3} {m_in:10.1f} {f_in:8.1f} {m_in - f_in:+8.1f} "
                f"{m_out:11.1f} {f_out:8.1f} {m_out - f_out:+9.1f}"
            )


RUNNERS: dict[str, Callable[[Program, int, int], float]] = {
    "meshsim": run_meshsim,
    "N x fake": run_fake,
    "local": run_local,
    "threaded": run_threaded,
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="half the steps, 3 rounds")
    parser.add_argument("--rounds", type=int, default=None, help="rounds to take medians over (default 5)")
    parser.add_argument("--sizes", type=int, nargs="+", default=[4, 8], help="world sizes (default 4 8)")
    parser.add_argument("--only", nargs="+", default=None, help="programs whose name starts so")
    parser.add_argument("--sides", nargs="+", default=list(RUNNERS), choices=list(RUNNERS))
    parser.add_argument(
        "--split", action="store_true", help="each rank's CPU in and out of the collectives, meshsim and fake"
    )
    args = parser.parse_args()
    rounds = args.rounds if args.rounds is not None else (3 if args.quick else 5)
    if rounds < 1:
        parser.error(f"--rounds must be at least 1, got {rounds}")
    programs = [p for p in PROGRAMS if args.only is None or any(p.name.startswith(o) for o in args.only)]
    if not programs:
        parser.error(f"--only {args.only} matches no program; the programs: {[p.name for p in PROGRAMS]}")
    if args.split:
        run_split(programs, args.sizes, rounds, args.quick)
        return
    sides = list(args.sides)
    table: dict[tuple[str, int, str], list[float]] = {}
    skipped: dict[tuple[str, int, str], str] = {}
    for round_ in range(rounds):
        order = sides if round_ % 2 == 0 else sides[::-1]
        for ws in args.sizes:
            for program in programs:
                steps = _steps(program, args.quick)
                for side in order:
                    key = (program.name, ws, side)
                    if key in skipped:
                        continue
                    try:
                        seconds = RUNNERS[side](program, ws, steps)
                    except Exception as exc:  # a cell that cannot run is reported below the table
                        skipped[key] = _why(exc)
                        continue
                    table.setdefault(key, []).append(seconds / steps)
    _print(table, skipped, programs, args.sizes, sides, rounds)


def _why(exc: BaseException) -> str:
    """One line on why a cell did not run: the rank's own exception where meshsim wraps it."""
    cause = exc.__cause__ if isinstance(exc, meshsim.RankError) and exc.__cause__ is not None else exc
    text = str(cause).strip().splitlines()
    return f"{type(cause).__name__}: {text[0][:120] if text else ''}"


def _print(
    table: dict[tuple[str, int, str], list[float]],
    skipped: dict[tuple[str, int, str], str],
    programs: list[Program],
    sizes: list[int],
    sides: list[str],
    rounds: int,
) -> None:
    print(
        f"milliseconds per step for the whole world, medians over {rounds} rounds; ms/X: meshsim over X,\n"
        "the median of the rounds' ratios (range over rounds); - : did not run (reasons below)"
    )
    ratio_sides = [s for s in ("N x fake", "local", "threaded") if s in sides and "meshsim" in sides]
    short = {"N x fake": "ms/fake", "local": "ms/local", "threaded": "ms/thr"}
    header = f"{'program':24} {'ws':>3} " + " ".join(f"{s:>9}" for s in sides)
    header += "".join(f" {short[s]:>8} {'range':>11}" for s in ratio_sides)
    print(header)
    print("-" * len(header))
    for program in programs:
        for ws in sizes:
            cells = []
            for side in sides:
                values = table.get((program.name, ws, side))
                cells.append(f"{statistics.median(values) * 1e3:9.3f}" if values else f"{'-':>9}")
            line = f"{program.name:24} {ws:>3} " + " ".join(cells)
            mine = table.get((program.name, ws, "meshsim"))
            for side in ratio_sides:
                other = table.get((program.name, ws, side))
                if not mine or not other or len(mine) != len(other):
                    line += f" {'-':>8} {'':>11}"
                    continue
                ratios = [m / o for m, o in zip(mine, other)]
                line += f" {statistics.median(ratios):7.2f}x {min(ratios):5.2f}-{max(ratios):<5.2f}"
            print(line)
    if skipped:
        print("\nnot run:")
        for (name, ws, side), why in sorted(skipped.items()):
            print(f"  {name} at {ws}, {side}: {why}")


if __name__ == "__main__":
    main()
