"""Collective latency and world setup cost: meshsim ``sim`` vs torch's threaded PG vs meshsim ``gloo``.

Run: ``python benchmarks/bench_meshsim.py`` (``--quick`` for fewer repetitions, ``--rounds N``
for more rounds where the machine's speed swings).

Every backend is measured in the same run, interleaved round by round. The table
reports medians over rounds; the threaded/sim ratio is the median of each round's
ratio, the two measured back to back in alternating order, with the range over
rounds beside it. On a shared, noisy machine the ratios are meaningful even when
the absolute numbers drift. Not a test: nothing here asserts a speed.

meshsim ``sim`` runs with its wasted-collective findings on and collected, as under
pytest; the on/off column is its cost, against the same backend with them off
(``meshsim.run(..., redundant=False)``).
"""

from __future__ import annotations

import argparse
import os
import statistics
import threading
import time
import warnings
from collections.abc import Callable

import torch
import torch.distributed as dist

import meshsim
from meshsim._observe.findings import collecting

warnings.filterwarnings("ignore", category=FutureWarning)

ELEMS = 256  # 1 KiB of float32


def _ops(iters: int) -> dict[str, Callable[[], float]]:
    """Per-rank loops; each returns seconds per call. Every rank sends its own values, as in a
    real job (a collective whose inputs are the same bytes everywhere is one the findings flag),
    except in the last, the findings' worst case: every call compared in full, and flagged."""

    def mine() -> torch.Tensor:
        return torch.full((ELEMS,), float(dist.get_rank() + 1))

    def all_gather() -> float:
        x = mine()
        out = torch.empty(ELEMS * dist.get_world_size())
        return _loop(lambda: dist.all_gather_into_tensor(out, x), iters)

    def all_reduce() -> float:
        # each call reduces a tensor of its own, fresh from the rank (as a step's gradients are):
        # a reduced tensor holds the same sum on every rank, and reducing it again is wasted
        fresh = iter([mine() for _ in range(iters + 1)])
        return _loop(lambda: dist.all_reduce(next(fresh)), iters)

    def all_to_all() -> float:
        ws = dist.get_world_size()
        x = mine().repeat(ws)
        out = torch.empty(ELEMS * ws)
        return _loop(lambda: dist.all_to_all_single(out, x), iters)

    def all_reduce_same() -> float:
        fresh = iter([torch.ones(ELEMS) for _ in range(iters + 1)])
        return _loop(lambda: dist.all_reduce(next(fresh)), iters)

    return {
        "all_gather_into_tensor": all_gather,
        "all_reduce": all_reduce,
        "all_to_all_single": all_to_all,
        "all_reduce, same bytes": all_reduce_same,
    }


def _loop(call: Callable[[], object], iters: int) -> float:
    call()  # warm-up
    start = time.perf_counter()
    for _ in range(iters):
        call()
    return (time.perf_counter() - start) / iters


# -- torch's threaded process group (torch.testing._internal.distributed.multi_threaded_pg) --


def _run_threaded(fn: Callable[[], float], world_size: int) -> list[float]:
    from torch.testing._internal.distributed import multi_threaded_pg as mtpg

    torch._C._distributed_c10d._set_thread_isolation_mode(True)
    mtpg._install_threaded_pg()
    store = dist.HashStore()
    results: list[float] = [0.0] * world_size

    def rank_main(rank: int) -> None:
        torch.set_num_threads(1)
        dist.init_process_group("threaded", rank=rank, world_size=world_size, store=store)
        results[rank] = fn()
        dist.destroy_process_group()

    threads = [threading.Thread(target=rank_main, args=(r,)) for r in range(world_size)]
    try:
        for t in threads:
            t.start()
        for t in threads:
            t.join(120)
    finally:
        mtpg.ProcessLocalGroup.reset()
        mtpg._uninstall_threaded_pg()
        torch._C._distributed_c10d._set_thread_isolation_mode(False)
    return results


def _runners() -> dict[str, Callable[[Callable[[], float], int], list[float]]]:
    return {
        # findings on, and looked at, as under pytest (whose plugin collects them per test)
        "meshsim sim": _sim_collecting,
        "torch threaded": _run_threaded,
        # the wasted-collective findings off: what comparing every rank's payload costs the sim
        # backend (the ops above send the same bytes from every rank: the findings' worst case)
        "sim findings off": lambda fn, ws: meshsim.run(fn, ws, redundant=False),
        "meshsim gloo": lambda fn, ws: meshsim.run(fn, ws, backend="gloo"),
    }


def _sim_collecting(fn: Callable[[], float], world_size: int) -> list[float]:
    with collecting():
        return meshsim.run(fn, world_size)


def _fresh_threads(fn: Callable[[], float], world_size: int) -> list[float]:
    """meshsim ``sim`` with rank-thread reuse turned off: every world starts its own threads."""
    saved = os.environ.get("MESHSIM_REUSE_THREADS")
    os.environ["MESHSIM_REUSE_THREADS"] = "0"
    try:
        meshsim.end_idle_threads()
        return meshsim.run(fn, world_size)
    finally:
        if saved is None:
            del os.environ["MESHSIM_REUSE_THREADS"]
        else:
            os.environ["MESHSIM_REUSE_THREADS"] = saved


def _noop() -> float:
    return 0.0


def _bare_threads(fn: Callable[[], float], world_size: int) -> list[float]:
    """Start and join ``world_size`` plain threads: the floor under any thread-per-rank world."""
    threads = [threading.Thread(target=fn) for _ in range(world_size)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    return []


def _setup_cost(runner: Callable[[Callable[[], float], int], list[float]], ws: int, n: int) -> float:
    start = time.perf_counter()
    for _ in range(n):
        runner(_noop, ws)
    return (time.perf_counter() - start) / n


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer iterations and rounds")
    parser.add_argument(
        "--rounds", type=int, default=None, help="rounds to take medians over (default 9, 3 with --quick)"
    )
    args = parser.parse_args()
    iters, rounds = (100, 3) if args.quick else (200, 9)
    if args.rounds is not None:
        if args.rounds < 1:
            parser.error(f"--rounds must be at least 1, got {args.rounds}")
        rounds = args.rounds
    runners = _runners()
    sizes = (2, 4, 8)
    table: dict[tuple[str, str, int], list[float]] = {}
    probes: list[float] = []
    for round_ in range(rounds):
        probes.append(_host_probe())
        # sim (findings on and off) each back to back with threaded, in alternating order, so
        # that each round's ratios compare them under the same machine conditions; gloo after them
        if round_ % 2 == 0:
            order = ["meshsim sim", "torch threaded", "sim findings off"]
        else:
            order = ["sim findings off", "torch threaded", "meshsim sim"]
        order.append("meshsim gloo")
        for ws in sizes:
            for op in _ops(iters):
                for name in order:
                    n = iters if name != "meshsim gloo" else max(10, iters // 10)
                    per_call = max(runners[name](_ops(n)[op], ws))
                    table.setdefault((op, name, ws), []).append(per_call)
            for name in order:
                reps = 50 if name != "meshsim gloo" else 3
                cost = _setup_cost(runners[name], ws, reps)
                table.setdefault(("setup+teardown", name, ws), []).append(cost)
            table.setdefault(("fresh threads", "", ws), []).append(_setup_cost(_fresh_threads, ws, 50))
            table.setdefault(("bare threads", "", ws), []).append(_setup_cost(_bare_threads, ws, 50))
    _print(table, runners, sizes, rounds)
    _print_rounds(table, probes, sizes)
    _big_world()


def _host_probe() -> float:
    """Microseconds per ``torch.stack(4 x 1 KiB).sum(0)`` in this thread: how fast the host runs torch now.

    On a shared VM this swings by ~2x from minute to minute while plain Python
    does not; the sim backend, whose every call runs torch ops on one CPU, swings
    with it, torch's threaded PG much less.
    """
    saved = torch.get_num_threads()
    torch.set_num_threads(1)
    xs = [torch.ones(ELEMS) for _ in range(4)]
    try:
        for _ in range(200):
            torch.stack(xs).sum(0)
        start = time.perf_counter()
        for _ in range(2000):
            torch.stack(xs).sum(0)
        return (time.perf_counter() - start) / 2000 * 1e6
    finally:
        torch.set_num_threads(saved)


def _print_rounds(
    table: dict[tuple[str, str, int], list[float]], probes: list[float], sizes: tuple[int, ...]
) -> None:
    print("\nper round: host probe (us per torch.stack(4 x 1 KiB).sum(0), before the round), threaded/sim")
    print(f"{'round':>5} {'probe us':>9} " + " ".join(f"{'all_reduce ' + str(ws):>14}" for ws in sizes))
    for i, probe in enumerate(probes):
        ratios = []
        for ws in sizes:
            threaded = table[("all_reduce", "torch threaded", ws)][i]
            sim = table[("all_reduce", "meshsim sim", ws)][i]
            ratios.append(f"{threaded / sim:13.2f}x")
        print(f"{i + 1:>5} {probe:9.2f} " + " ".join(ratios))


def _print(
    table: dict[tuple[str, str, int], list[float]],
    runners: dict[str, object],
    sizes: tuple[int, ...],
    rounds: int,
) -> None:
    names = list(runners)
    header = (
        f"{'operation':24} {'ws':>3} "
        + " ".join(f"{n:>16}" for n in names)
        + f" {'threaded/sim':>13} {'(rounds: min-max)':>18} {'on/off':>7} {'threaded/off':>13}"
    )
    print(
        f"median microseconds per call (per world for setup+teardown), 1 KiB float32, {rounds} rounds;\n"
        "threaded/sim is the median of each round's ratio (the two measured back to back);\n"
        "on/off: meshsim sim with the wasted-collective findings on (the default) over off, median ratio;\n"
        "threaded/off: torch threaded over meshsim sim with the findings off (meshsim.run where nobody\n"
        "looks at them: no ledger, no pytest), median of the rounds' ratios"
    )
    print(header)
    print("-" * len(header))
    ops = [*_ops(1), "setup+teardown"]
    for op in ops:
        for ws in sizes:
            med = {n: statistics.median(table[(op, n, ws)]) * 1e6 for n in names}
            pairs = zip(table[(op, "torch threaded", ws)], table[(op, "meshsim sim", ws)])
            ratios = [threaded / sim for threaded, sim in pairs]
            cells = " ".join(f"{med[n]:16.1f}" for n in names)
            spread = f"{min(ratios):.2f}-{max(ratios):.2f}"
            pairs = zip(table[(op, "meshsim sim", ws)], table[(op, "sim findings off", ws)])
            cost = statistics.median(on / off for on, off in pairs)
            pairs = zip(table[(op, "torch threaded", ws)], table[(op, "sim findings off", ws)])
            off = statistics.median(threaded / sim for threaded, sim in pairs)
            head = f"{op:24} {ws:>3} {cells} {statistics.median(ratios):12.2f}x {spread:>18}"
            print(f"{head} {cost:6.2f}x {off:12.2f}x")
    for key, text in (
        ("fresh threads", "meshsim sim setup+teardown with MESHSIM_REUSE_THREADS=0 (new rank threads)"),
        ("bare threads", "starting and joining bare Python threads, one per rank (what reuse saves)"),
    ):
        med = {ws: statistics.median(table[(key, "", ws)]) * 1e6 for ws in sizes}
        print(f"\n{text}: " + ", ".join(f"{us:.0f} us at {ws}" for ws, us in med.items()))


def _big_world() -> None:
    def body() -> float:
        x = torch.ones(4)
        dist.all_reduce(x)
        return float(x[0])

    start = time.perf_counter()
    values = meshsim.run(body, 256, timeout=300)
    elapsed = time.perf_counter() - start
    ok = all(v == 256.0 for v in values)
    print(f"\n256-rank world, one all_reduce: {'correct' if ok else 'WRONG'} in {elapsed:.2f} s")


if __name__ == "__main__":
    main()
