"""What each of meshsim's speed tricks buys, in a paired measurement: the trick against the plain way.

Run: ``python benchmarks/bench_tricks.py`` (``--rounds N`` for more pairs).

The complexity budget: a trick that relies on CPython or libc internals, or adds
a module for speed, stays only if it buys at least 5% on what
``bench_meshsim.py`` measures (a 4-rank all_reduce of 1 KiB, or a 4-rank world's
set-up and teardown). Each row here switches one trick off by patching meshsim's
modules from outside, and measures the shipped and the plain variant back to
back, alternating, ``--rounds`` times; the ratio is the median of the pairs'
ratios (plain / shipped: above 1.05 means the trick buys 5%). Not a test.
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import time
import warnings
from collections.abc import Callable, Iterator

import torch
import torch.distributed as dist

import meshsim
from meshsim._baton import doorbell as _doorbell
from meshsim._engine import affinity as _affinity
from meshsim._process import handover as _perrank
from meshsim._process import state as _state
from meshsim._sim import backend as _backend

warnings.filterwarnings("ignore", category=FutureWarning)

Toggle = Callable[[], contextlib.AbstractContextManager[None]]


def _all_reduce_us(calls: int) -> float:
    """Microseconds per 4-rank all_reduce of 1 KiB, timed on rank 0 inside one world."""

    def body() -> float:
        x = torch.ones(256)
        for _ in range(20):
            dist.all_reduce(x)
        start = time.perf_counter()
        for _ in range(calls):
            dist.all_reduce(x)
        return (time.perf_counter() - start) / calls * 1e6

    return float(meshsim.run(body, 4)[0])


def _world_us(worlds: int) -> float:
    """Microseconds per 4-rank world (set-up and teardown of an empty body)."""
    meshsim.run(lambda: None, 4)
    start = time.perf_counter()
    for _ in range(worlds):
        meshsim.run(lambda: None, 4)
    return (time.perf_counter() - start) / worlds * 1e6


@contextlib.contextmanager
def _patched(owner: object, name: str, value: object) -> Iterator[None]:
    saved = getattr(owner, name)
    setattr(owner, name, value)
    try:
        yield
    finally:
        setattr(owner, name, saved)


@contextlib.contextmanager
def _fresh_threads(inner: contextlib.AbstractContextManager[None]) -> Iterator[None]:
    """Run with new rank threads (made under ``inner``), and end them after."""
    meshsim.end_idle_threads()
    with inner:
        try:
            yield
        finally:
            meshsim.end_idle_threads()


def _lock_doorbells() -> contextlib.AbstractContextManager[None]:
    return _fresh_threads(_patched(_doorbell, "_fd_limit", lambda: 0))


def _eventfd_doorbells() -> contextlib.AbstractContextManager[None]:
    return _fresh_threads(contextlib.nullcontext())


def _no_pinning() -> contextlib.AbstractContextManager[None]:
    return _fresh_threads(_patched(_affinity, "affinity", lambda: None))


def _pinning() -> contextlib.AbstractContextManager[None]:
    return _fresh_threads(contextlib.nullcontext())


@contextlib.contextmanager
def _env_flag(value: str) -> Iterator[None]:
    import os

    saved = os.environ.get("MESHSIM_REUSE_THREADS")
    os.environ["MESHSIM_REUSE_THREADS"] = value
    try:
        yield
    finally:
        if saved is None:
            del os.environ["MESHSIM_REUSE_THREADS"]
        else:
            os.environ["MESHSIM_REUSE_THREADS"] = saved


def _no_hash_lookup() -> contextlib.AbstractContextManager[None]:
    return _patched(_backend, "reduce_op_names_by_hash", lambda: {})


@contextlib.contextmanager
def _plain_environ_snapshot() -> Iterator[None]:
    """A world's environment snapshots taken through os.environ (decoded) instead of its backing dict."""
    with _patched(_state, "_ENVIRON_DATA", None):
        yield


def _no_shared_runs() -> contextlib.AbstractContextManager[None]:
    """Every run of per-rank module globals swapped at every hand-over: each rank its own copies."""
    find_shared = _perrank.WorldSlots._find_shared

    def unshared(self: _perrank.WorldSlots) -> None:
        find_shared(self)
        for i, run in enumerate(self._shared):
            if run is not None:
                self._unshare(i, None, ())

    return _patched(_perrank.WorldSlots, "_find_shared", unshared)


ROWS: list[tuple[str, Toggle, Toggle, Callable[[int], float], int]] = [
    # name, shipped, plain, measure, repetitions per measurement
    ("eventfd doorbells (vs locks): all_reduce", _eventfd_doorbells, _lock_doorbells, _all_reduce_us, 400),
    ("eventfd doorbells (vs locks): world", _eventfd_doorbells, _lock_doorbells, _world_us, 60),
    ("CPU pinning (vs none): all_reduce", _pinning, _no_pinning, _all_reduce_us, 400),
    ("CPU pinning (vs none): world", _pinning, _no_pinning, _world_us, 60),
    ("reused rank threads (vs new): world", lambda: _env_flag("1"), lambda: _env_flag("0"), _world_us, 60),
    ("ReduceOp names by hash: all_reduce", contextlib.nullcontext, _no_hash_lookup, _all_reduce_us, 400),
    (
        "shared per-rank runs (vs swapped): all_reduce",
        contextlib.nullcontext,
        _no_shared_runs,
        _all_reduce_us,
        400,
    ),
    (
        "os.environ's backing dict (vs os.environ): world",
        contextlib.nullcontext,
        _plain_environ_snapshot,
        _world_us,
        60,
    ),
]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=9)
    args = parser.parse_args()
    if args.rounds < 1:
        parser.error(f"--rounds must be at least 1, got {args.rounds}")
    print(f"{'trick':48} {'shipped us':>11} {'plain us':>9} {'plain/shipped':>14}  (range)")
    for name, shipped, plain, measure, reps in ROWS:
        pairs = []
        for round_ in range(args.rounds):
            order = [(shipped, 0), (plain, 1)] if round_ % 2 == 0 else [(plain, 1), (shipped, 0)]
            times = [0.0, 0.0]
            for toggle, slot in order:
                with toggle():
                    times[slot] = measure(reps)
            pairs.append(times)
        ratios = [p / s for s, p in pairs]
        print(
            f"{name:48} {statistics.median(s for s, _ in pairs):11.1f} "
            f"{statistics.median(p for _, p in pairs):9.1f} {statistics.median(ratios):14.3f}"
            f"  ({min(ratios):.3f}-{max(ratios):.3f})"
        )


if __name__ == "__main__":
    main()
