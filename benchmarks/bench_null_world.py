"""The floor of the design itself: ranks as threads behind a Python process group that does nothing else.

Run: ``python benchmarks/bench_null_world.py`` (``--quick``, ``--rounds N``, ``--sizes 4 8``,
``--only NAME``).

``bench_floor.py`` compares meshsim with N x one rank on torch's ``FakeProcessGroup``. That rank
runs in its own process, with a C++ process group whose collectives are no-ops. A world of
thread ranks cannot reach it: each collective crosses from torch's C++ into a Python process
group and back, every rank hands the interpreter to the next, and someone moves the data. This
script measures what that alone costs, with a "null" world built here for the purpose:

- one thread per rank, every rank on the CPU the caller is on (as meshsim pins its worlds);
- a ``torch.distributed.ProcessGroup`` subclass in Python whose collectives store the rank's
  tensors and pass the turn to the next rank over eventfds (the doorbells meshsim uses); the last
  rank to arrive moves the data for all;
- nothing more: no argument checks, no comparison of the ranks' calls, no ledger, no findings,
  no deadlock or timeout detection, no per-rank RNG, environment or default dtype.

It is not a usable simulator: a program whose ranks call different collectives, or any
collective it does not implement, fails or gives wrong results. It bounds from below what any
simulator of this shape can cost. Columns, milliseconds per step for the whole world:

- ``null``: the null world (its own set-up untimed; the timed steps run one rank at a time);
- ``meshsim``: ``bench_floor``'s meshsim column; ``N x fake``: its fake-rank column;
- ``null/fake``, ``ms/fake``, ``ms/null``: medians of each round's ratios (the sides back to
  back, their order alternating by round).

The programs are ``bench_floor``'s, where the null world implements their collectives: the
one-collective programs and the FSDP2 step. Not a test: nothing here asserts a speed.

torch names used here that are private (as in ``bench_floor``'s threaded column), checked in
torch 2.11, 2.13 and 2.14: ``torch.testing._internal.distributed.multi_threaded_pg``'s
``_install_threaded_pg``, ``_uninstall_threaded_pg`` and ``ProcessLocalGroup.reset`` (a c10d
world per thread), and ``torch._C._distributed_c10d._set_thread_isolation_mode``.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import threading
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import bench_floor  # the sibling script, found through the path above

from meshsim._engine import affinity
from meshsim._sim.work import completed  # meshsim's own completed Work: the same cost on both sides

BACKEND = "benchnull"
JOIN_TIMEOUT = 300.0  # seconds a null world may take before it is failed
PROGRAMS = [
    "S(0)->R",
    "S(0)->S(1)",
    "R->P->R",
    "x.sum(0).full_tensor()",
    "matmul, sharded k",
    "FSDP2 step, MLP",
]

Tensor = torch.Tensor
Move = Callable[[list[Any]], None]


class _Failed(Exception):
    """The null world was failed from outside (a rank raised, or it ran past its time)."""


class _Slot:
    """One group's collective in progress: what each rank passed, and how many arrived."""

    def __init__(self, size: int) -> None:
        self.size = size
        self.args: list[Any] = [None] * size
        self.arrived = 0
        self.generation = 0
        self.cond = threading.Condition()  # set-up only, when ranks run at once

    def arrive(self, move: Move) -> int:
        """Count the caller in; the last to arrive moves the data. Returns the generation it joined."""
        generation = self.generation
        self.arrived += 1
        if self.arrived == self.size:
            move(self.args)
            self.arrived = 0
            self.generation += 1
        return generation


class _World:
    """The null world's shared state: each rank's doorbell, each group's slot, the mode."""

    def __init__(self, size: int) -> None:
        self.size = size
        self.bells = [os.eventfd(0) for _ in range(size)]
        self.slots: dict[str, _Slot] = {}
        self.serial = False  # one rank at a time (the timed steps); at once during set-up
        self.failed = False

    def hand_over(self, rank: int) -> None:
        """Ring the next rank and sleep until rung."""
        os.eventfd_write(self.bells[(rank + 1) % self.size], 1)
        os.eventfd_read(self.bells[rank])
        if self.failed:
            raise _Failed()

    def fail(self) -> None:
        self.failed = True
        for bell in self.bells:
            os.eventfd_write(bell, 1)
        for slot in list(self.slots.values()):
            with slot.cond:
                slot.cond.notify_all()

    def close(self) -> None:
        for bell in self.bells:
            os.close(bell)


_WORLD: list[_World] = []  # the running null world (one at a time)


class _NullGroup(dist.ProcessGroup):
    """A rank's handle on a null group: collectives that only move the data."""

    def __init__(self, world: _World, group_rank: int, ranks: Sequence[int], name: str) -> None:
        super().__init__(group_rank, len(ranks))  # type: ignore[call-arg]
        self._world = world
        self._rank = group_rank
        self._me = ranks[group_rank]  # the global rank
        self._name = name
        self._slot = world.slots.setdefault(name, _Slot(len(ranks)))

    @property
    def group_name(self) -> str:  # type: ignore[override]
        return self._name

    def getBackendName(self) -> str:
        return BACKEND

    def _get_backend_name(self) -> str:
        return BACKEND

    def name(self) -> str:
        return BACKEND

    def _meet(self, args: Any, move: Move) -> None:
        slot, world = self._slot, self._world
        slot.args[self._rank] = args
        if world.serial:
            generation = slot.arrive(move)
            while slot.generation == generation:  # woken before its group completed: pass the turn on
                world.hand_over(self._me)
            return
        with slot.cond:
            generation = slot.arrive(move)
            if slot.generation != generation:
                slot.cond.notify_all()
            while slot.generation == generation:
                if world.failed or not slot.cond.wait(JOIN_TIMEOUT):
                    raise _Failed()

    def barrier(self, opts: Any = None) -> dist.Work:  # type: ignore[override]
        self._meet(None, lambda args: None)
        return completed([])

    def broadcast(self, tensors: list[Tensor], opts: Any = None) -> dist.Work:  # type: ignore[override]
        root = opts.rootRank if opts is not None else 0

        def move(args: list[list[Tensor]]) -> None:
            for i, source in enumerate(args[root]):
                for mine in args:
                    if mine is not args[root]:
                        mine[i].copy_(source)

        self._meet(list(tensors), move)
        return completed(list(tensors))

    def scatter(self, outputs: list[Tensor], input_lists: list[list[Tensor]], opts: Any = None) -> dist.Work:  # type: ignore[override]
        root = opts.rootRank if opts is not None else 0

        def move(args: list[tuple[list[Tensor], list[list[Tensor]]]]) -> None:
            pieces = args[root][1][0]
            for rank, (outs, _) in enumerate(args):
                outs[0].copy_(pieces[rank])

        self._meet((outputs, input_lists), move)
        return completed(list(outputs))

    def allreduce(self, tensors: list[Tensor], opts: Any = None) -> dist.Work:  # type: ignore[override]
        def move(args: list[list[Tensor]]) -> None:  # SUM: the only op these programs reduce with
            for i in range(len(args[0])):
                total = torch.stack([mine[i] for mine in args]).sum(0)
                for mine in args:
                    mine[i].copy_(total)

        self._meet(list(tensors), move)
        return completed(list(tensors))

    def allgather_into_tensor_coalesced(
        self, outputs: list[Tensor], inputs: list[Tensor], opts: Any = None
    ) -> dist.Work:  # type: ignore[override]
        def move(args: list[tuple[list[Tensor], list[Tensor]]]) -> None:
            for i in range(len(args[0][0])):
                full = torch.cat([ins[i] for _, ins in args])
                for outs, _ in args:
                    outs[i].copy_(full.view_as(outs[i]))

        self._meet((list(outputs), list(inputs)), move)
        return completed(list(outputs))

    def _allgather_base(self, output: Tensor, input: Tensor, opts: Any = None) -> dist.Work:  # type: ignore[override]
        return self.allgather_into_tensor_coalesced([output], [input], opts)

    # torch 2.13's names for the same calls (c10d's Python calls them on the group)
    all_gather_single = _allgather_base
    all_gather_single_coalesced = allgather_into_tensor_coalesced  # type: ignore[assignment]

    def reduce_scatter_tensor_coalesced(
        self, outputs: list[Tensor], inputs: list[Tensor], opts: Any = None
    ) -> dist.Work:  # type: ignore[override]
        size = self._slot.size

        def move(args: list[tuple[list[Tensor], list[Tensor]]]) -> None:  # SUM, and AVG for FSDP2
            average = opts is not None and opts.reduceOp == dist.ReduceOp.AVG
            for i in range(len(args[0][0])):
                total = torch.stack([ins[i] for _, ins in args]).sum(0)
                if average:
                    total = total / size
                pieces = total.reshape(size, -1)
                for rank, (outs, _) in enumerate(args):
                    outs[i].copy_(pieces[rank].view_as(outs[i]))

        self._meet((list(outputs), list(inputs)), move)
        return completed(list(outputs))

    def _reduce_scatter_base(self, output: Tensor, input: Tensor, opts: Any = None) -> dist.Work:  # type: ignore[override]
        return self.reduce_scatter_tensor_coalesced([output], [input], opts)

    reduce_scatter_single = _reduce_scatter_base  # type: ignore[assignment]
    reduce_scatter_single_coalesced = reduce_scatter_tensor_coalesced  # type: ignore[assignment]


def _create(opts: Any, backend_options: Any) -> _NullGroup:
    ranks = tuple(opts.global_ranks_in_group) or tuple(range(opts.group_size))
    return _NullGroup(_WORLD[0], opts.group_rank, ranks, str(opts.group_id))


def run_null(program: bench_floor.Program, ws: int, steps: int) -> float:
    """The null world's seconds for ``steps`` steps of ``program`` on ``ws`` ranks."""
    from torch.testing._internal.distributed import multi_threaded_pg as mtpg

    world = _World(ws)
    _WORLD[:] = [world]
    cpu = affinity.current_cpu(affinity.affinity())
    spans: list[tuple[float, float]] = [(0.0, 0.0)] * ws
    errors: list[BaseException] = []
    set_up = threading.Barrier(ws)

    def rank_main(rank: int) -> None:
        try:
            if cpu is not None:
                os.sched_setaffinity(0, {cpu})  # this thread only
            torch.set_num_threads(1)
            dist.init_process_group(BACKEND, rank=rank, world_size=ws, store=store)
            step = program.setup(ws)
            step()  # warm-up
            dist.barrier()
            if set_up.wait(JOIN_TIMEOUT) == 0:
                world.serial = True
            set_up.wait(JOIN_TIMEOUT)
            if rank != 0:
                os.eventfd_read(world.bells[rank])  # rank 0 runs first
                if world.failed:
                    raise _Failed()
            spans[rank] = bench_floor._loop(step, steps)
            os.eventfd_write(world.bells[(rank + 1) % ws], 1)  # done: the next rank runs
        except _Failed:
            pass
        except BaseException as exc:  # reported by the caller
            errors.append(exc)
            set_up.abort()
            world.fail()

    torch._C._distributed_c10d._set_thread_isolation_mode(True)  # type: ignore[attr-defined]
    mtpg._install_threaded_pg()  # type: ignore[no-untyped-call]
    store = dist.HashStore()  # type: ignore[attr-defined]
    threads = [threading.Thread(target=rank_main, args=(r,), daemon=True) for r in range(ws)]
    try:
        for t in threads:
            t.start()
        for t in threads:
            t.join(JOIN_TIMEOUT)
            if t.is_alive():
                world.fail()
                errors.append(TimeoutError(f"a null world of {ws} ranks ran past {JOIN_TIMEOUT} s"))
                break
    finally:
        mtpg.ProcessLocalGroup.reset()  # type: ignore[no-untyped-call]
        mtpg._uninstall_threaded_pg()  # type: ignore[no-untyped-call]
        torch._C._distributed_c10d._set_thread_isolation_mode(False)  # type: ignore[attr-defined]
        if not any(t.is_alive() for t in threads):  # a stuck rank may still read its doorbell
            world.close()
        _WORLD.clear()
    if errors:
        raise errors[0]
    return max(end for _, end in spans) - min(start for start, _ in spans)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--quick", action="store_true", help="half the steps, 3 rounds")
    parser.add_argument("--rounds", type=int, default=None, help="rounds per cell (default 5, --quick 3)")
    parser.add_argument("--sizes", type=int, nargs="+", default=[4, 8], help="world sizes")
    parser.add_argument("--only", nargs="+", default=None, help="programs whose name starts so")
    args = parser.parse_args()
    rounds = args.rounds or (3 if args.quick else 5)
    if rounds < 1 or any(ws < 2 for ws in args.sizes):
        parser.error(f"--rounds must be at least 1 (got {rounds}) and --sizes at least 2 (got {args.sizes})")
    names = [n for n in PROGRAMS if args.only is None or any(n.startswith(o) for o in args.only)]
    if not names:
        parser.error(f"--only {args.only} matches none of {PROGRAMS}")
    programs = [p for p in bench_floor.PROGRAMS if p.name in names]
    dist.Backend.register_backend(BACKEND, _create, extended_api=True, devices=["cpu"])  # type: ignore[call-arg]
    sides: list[tuple[str, Callable[[bench_floor.Program, int, int], float]]] = [
        ("null", run_null),
        ("meshsim", bench_floor.run_meshsim),
        ("fake", bench_floor.run_fake),
    ]
    print(f"ms per step for the whole world; medians over {rounds} rounds")
    header = (
        f"{'program':24} {'ws':>3} {'null':>8} {'meshsim':>8} {'N x fake':>8} "
        f"{'null/fake':>9} {'ms/fake':>8} {'ms/null':>8}"
    )
    print(header)
    print("-" * len(header))
    not_run: list[str] = []
    for program in programs:
        steps = bench_floor._steps(program, args.quick)
        for ws in args.sizes:
            got: dict[str, list[float]] = {name: [] for name, _ in sides}
            try:
                for r in range(rounds):
                    for name, run in sides if r % 2 == 0 else sides[::-1]:
                        got[name].append(run(program, ws, steps) / steps * 1e3)
            except Exception as exc:  # a row that cannot run is reported below the table
                not_run.append(f"{program.name} at {ws}, {name}: {bench_floor._why(exc)}")
                continue
            med = {name: statistics.median(values) for name, values in got.items()}
            over = [
                _ratio(got[a], got[b])
                for a, b in (("null", "fake"), ("meshsim", "fake"), ("meshsim", "null"))
            ]
            print(
                f"{program.name:24} {ws:>3} {med['null']:8.3f} {med['meshsim']:8.3f} {med['fake']:8.3f} "
                f"{over[0]:8.2f}x {over[1]:7.2f}x {over[2]:7.2f}x",
                flush=True,
            )
    for line in not_run:
        print(f"not run: {line}")


def _ratio(tops: list[float], bottoms: list[float]) -> float:
    """The median of the rounds' ratios."""
    return statistics.median(top / bottom for top, bottom in zip(tops, bottoms, strict=True))


if __name__ == "__main__":
    main()
