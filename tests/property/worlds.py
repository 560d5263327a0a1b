"""Running one generated case in a meshsim world, and judging it against properties 1-3 of issue 5.

Shared by the property tests and ``benchmarks/soak.py``: :func:`run_case` runs a
:class:`~faults.Case` and times it, :func:`judge` lists how the outcome falls short of
the properties (empty: it is right), :func:`snapshot` and :func:`leftovers` compare the
process state a world must hand back untouched.
"""

from __future__ import annotations

import functools
import os
import sys
import threading
import time
import traceback
import warnings
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d
from calls import expected_ledger
from faults import Case, check_error
from programs import Program, Step
from reference import compare_outputs, reference
from runs import fault_reached, run_rank

import meshsim

FAULT_TIMEOUT = 30.0  # generous: a detection that waited for it would show as a timeout error
SLEEP_TIMEOUT = 0.5  # the deliberate-timeout fault: the world must give up after this (a short
# timeout also catches a rank that is merely slow: on a loaded machine 0.3 s proved too short)


@dataclass(frozen=True)
class Outcome:
    """What ``meshsim.run`` did with a case: returned ``runs`` or raised ``error``, in ``seconds``."""

    runs: list[Any] | None
    error: BaseException | None
    seconds: float
    timeout: float
    detection: float | None = None  # seconds from the faulty rank reaching its fault to the end


GLOO_TIMEOUT = 10.0  # gloo: ranks blocked in C++ on a failed rank that gloo does not release
# at once (its connections still open) are released by the groups' timeout, the world's


def timeout_for(case: Case, backend: str = "sim") -> float:
    if case.fault is not None and case.fault.kind == "sleep":
        return SLEEP_TIMEOUT
    return GLOO_TIMEOUT if backend == "gloo" else FAULT_TIMEOUT


def run_case(case: Case, *, backend: str = "sim", sleep_limit: float = 20.0) -> Outcome:
    """Run ``case`` in a world; only a :class:`meshsim.MeshError` is caught."""
    timeout = timeout_for(case, backend)
    fault_reached.clear()
    start = time.monotonic()
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", FutureWarning)  # torch 2.13's renamed collectives
            runs = meshsim.run(
                run_rank,
                case.program.world_size,
                args=(case.program, case.fault),
                kwargs={"sleep_limit": sleep_limit},
                timeout=timeout,
                backend=backend,
                serialize=case.serialize,
            )
    except meshsim.MeshError as error:
        return _outcome(None, error, start, timeout)
    return _outcome(runs, None, start, timeout)


def _outcome(runs: list[Any] | None, error: BaseException | None, start: float, timeout: float) -> Outcome:
    end = time.monotonic()
    detection = end - fault_reached[0] if fault_reached else None
    return Outcome(runs, error, end - start, timeout, detection)


def judge(case: Case, outcome: Outcome) -> list[str]:
    """How ``outcome`` falls short of property 1 (no fault) or 2 (a fault); empty if it is right."""
    if case.fault is None:
        if outcome.error is not None:
            return [f"a correct program raised {type(outcome.error).__name__}: {outcome.error}"]
        assert outcome.runs is not None
        return wrong_results(case.program, outcome.runs)
    assert case.expected is not None
    if outcome.error is None:
        return [f"the fault ({case.fault}) went unreported; expected {case.expected}"]
    return check_error(outcome.error, case.expected)


def wrong_results(program: Program, runs: list[Any]) -> list[str]:
    """Where any rank's outputs or ledger differ from the single-process reference."""
    expected = reference(program)
    problems = []
    for rank, run in enumerate(runs):
        problems += [f"rank {rank}: {p}" for p in compare_outputs(run.outputs, expected[rank])]
        ledger = expected_ledger(program, rank)
        if run.ledger != ledger:
            diff = [f"    got {a}\n    exp {b}" for a, b in zip(run.ledger, ledger) if a != b]
            problems.append(f"rank {rank}: ledger of {len(run.ledger)} calls, expected {len(ledger)}:")
            problems += diff
    return problems


@functools.cache
def open_gloo_device() -> None:
    """Run one small gloo world, once per process.

    gloo opens a process-wide TCP device (four descriptors) on first use and keeps it
    for the life of the process: a snapshot that counts descriptors must come after it.
    """
    meshsim.run(_barrier, 2, backend="gloo", timeout=GLOO_TIMEOUT)


def _barrier() -> None:
    dist.barrier()  # a collective: gloo opens its device when ranks first connect


def snapshot(backend: str = "sim") -> dict[str, Any]:
    """The process state a world must leave as it found it (property 3).

    Descriptors: a sim world opens eventfds (its doorbells), a gloo world sockets too.
    Sockets are counted for gloo cases only, which start with a garbage collection:
    other tests' gloo sockets left in reference cycles may close at any collection.
    Idle rank threads, kept for later worlds with their doorbells, are ended first.
    """
    meshsim.end_idle_threads()
    return {
        "threads": threading.active_count(),
        "rank threads": sorted(t.name for t in threading.enumerate() if t.name.startswith("meshsim-rank-")),
        "c10d world": c10d._world,
        "initialized": dist.is_initialized(),
        "excepthook": sys.excepthook,
        "unraisablehook": sys.unraisablehook,
        "rng": torch.get_rng_state(),
        "descriptors": _world_descriptors(sockets=backend == "gloo"),
    }


def _world_descriptors(*, sockets: bool) -> int | None:
    """How many eventfds (and sockets) the process holds. None without /proc."""
    if not os.path.isdir("/proc/self/fd"):
        return None
    count = 0
    for fd in os.listdir("/proc/self/fd"):
        try:
            link = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            continue  # closed since the listing (the listing's own descriptor)
        count += link == "anon_inode:[eventfd]" or (sockets and link.startswith("socket:"))
    return count


def leftovers(before: dict[str, Any], after: dict[str, Any]) -> list[str]:
    """What differs between two snapshots (empty: nothing), with the stacks of live rank threads."""
    problems = []
    for key, old in before.items():
        new = after[key]
        same = torch.equal(old, new) if isinstance(old, torch.Tensor) else (old is new or old == new)
        if not same:
            problems.append(
                f"{key}: {old!r} before, {new!r} after" if key != "rng" else "the RNG state changed"
            )
    if after["rank threads"] != before["rank threads"]:
        problems.append(rank_stacks())
    return problems


def rank_stacks() -> str:
    """Where every live ``meshsim-rank-*`` thread is, innermost frame last."""
    frames = sys._current_frames()
    parts = []
    for thread in threading.enumerate():
        frame = frames.get(thread.ident or -1)
        if thread.name.startswith("meshsim-rank-") and frame is not None:
            stack = "".join(traceback.format_stack(frame)[-6:])
            parts.append(f"{thread.name}:\n{stack}")
    return "\n".join(parts)


# What "the next world runs correctly" runs: a little of everything, on 3 ranks.
NEXT_WORLD = Program(
    3,
    new_groups=((2, 0),),
    steps=(
        Step("all_reduce", op="SUM", shape=(3,)),
        Step("all_gather", dtype=torch.int64, sizes=(2, 2, 2)),  # gloo: even sizes only
        Step("p2p", pairs=((0, 1), (1, 2), (2, 0)), style="batch"),
        Step("broadcast", root=1, dtype=torch.bfloat16),
        Step("reduce_scatter_tensor", op="MAX", shape=(2,)),
        Step("barrier"),
    ),
)


def next_world_problems(backend: str = "sim") -> list[str]:
    """Run :data:`NEXT_WORLD` and say what is wrong with it (empty: nothing)."""
    outcome = run_case(Case(NEXT_WORLD), backend=backend)
    return judge(Case(NEXT_WORLD), outcome)
