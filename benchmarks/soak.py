"""Fault-injection soak for meshsim (issue 5): thousands of generated cases, one summary table.

Run: ``python benchmarks/soak.py --cases 10000 [--seed S] [--gloo-every N]`` (or ``tox -e soak``).

Each case is a generated SPMD program (tests/property/programs.py and runs.py), three in four with
a fault injected into one rank (tests/property/faults.py says what meshsim must then
report). Every case is judged as the property tests judge it: results and ledgers
equal the reference, or the right error naming the right rank and call site; and the
process state (threads, c10d world, excepthook, RNG) is as before. Each case also runs
under a watchdog, so a world that really hangs cannot hang the soak.

Case ``i`` of seed ``S`` is drawn from ``random.Random(S * 1_000_000 + i)``:
``--first i --cases 1`` replays it. Exits 1 if any "must be 0" count is not 0. Not a test.
"""

from __future__ import annotations

import argparse
import faulthandler
import os
import sys
import threading
import time
import warnings
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "property"))

from faults import FAULT_KINDS, Case, draw_case
from programs import RandomSource
from worlds import Outcome, judge, leftovers, next_world_problems, run_case, snapshot, timeout_for

import meshsim

warnings.filterwarnings("ignore", category=FutureWarning)

WATCHDOG_GRACE = 5.0  # seconds past a world's timeout before the soak stops waiting for it
LATE = 1.0  # a world that needs more than its timeout plus this has hung
PROMPT = 1.0  # every fault but the deliberate timeout must be reported within this
STACKS_AFTER = 3.0  # a case still running after this prints every thread's stack (once)
SLEEP_LIMIT = 20.0  # a "sleep" fault's rank sleeps this long if meshsim cannot stop it


@dataclass
class Tally:
    """Everything the summary table reports."""

    cases: int = 0
    injected: Counter[str] = field(default_factory=Counter)
    detected: Counter[str] = field(default_factory=Counter)
    misreported: Counter[str] = field(default_factory=Counter)
    wrong_results: int = 0
    slow: int = 0
    hangs: int = 0
    left_behind: int = 0
    slowest_detection: tuple[float, str] = (0.0, "-")
    gloo_slow: int = 0
    slowest_gloo: tuple[float, str] = (0.0, "-")
    slowest_timeout: tuple[float, float, str] = (0.0, 0.0, "-")
    failures: list[str] = field(default_factory=list)

    def fail(self, label: str, case: Case, problems: list[str]) -> None:
        if len(self.failures) < 20:
            self.failures.append(f"--- {label}\n{case}\n" + "\n".join(problems))


def _kind(case: Case, backend: str) -> str:
    kind = case.fault.kind if case.fault is not None else "none"
    return kind if backend == "sim" else f"{kind} (gloo)"


def _run_watched(case: Case, backend: str) -> Outcome | None:
    """``run_case`` in a worker thread; None if it outlives its timeout by WATCHDOG_GRACE."""
    box: list[Outcome] = []
    worker = threading.Thread(
        target=lambda: box.append(run_case(case, backend=backend, sleep_limit=SLEEP_LIMIT)),
        name="soak-case",
        daemon=True,
    )
    worker.start()
    worker.join(STACKS_AFTER)
    if worker.is_alive() and backend == "sim" and case.fault is not None and case.fault.kind != "sleep":
        print(f"=== a case still running after {STACKS_AFTER:g} s:\n{case}", file=sys.stderr, flush=True)
        faulthandler.dump_traceback(file=sys.stderr, all_threads=True)
    worker.join(2 * timeout_for(case, backend) + WATCHDOG_GRACE - STACKS_AFTER)
    return box[0] if box else None


def _one(tally: Tally, index: int, seed: int, gloo_every: int) -> None:
    backend = "gloo" if gloo_every and index % gloo_every == gloo_every - 1 else "sim"
    src = RandomSource(seed * 1_000_000 + index)
    faulty = src.integer(0, 3) > 0
    kinds = (("raise",) if backend == "gloo" else FAULT_KINDS) if faulty else ()
    case = draw_case(src, kinds=kinds, gloo=backend == "gloo")
    kind, label = _kind(case, backend), f"case {index} (seed {seed}, {backend})"
    tally.cases += 1
    tally.injected[kind] += 1
    before = snapshot(backend)
    outcome = _run_watched(case, backend)
    if outcome is None:
        tally.hangs += 1
        tally.fail(label, case, ["hung: the watchdog gave up on it"])
        return
    _judge(tally, case, outcome, kind, label, backend)
    left = leftovers(before, snapshot(backend))
    if left:
        tally.left_behind += 1
        tally.fail(label, case, ["left behind: " + "; ".join(left)])


def _judge(tally: Tally, case: Case, outcome: Outcome, kind: str, label: str, backend: str) -> None:
    wrong = judge(case, outcome)
    if case.fault is None:
        tally.wrong_results += bool(wrong)
    elif wrong:
        tally.misreported[kind] += 1
    else:
        tally.detected[kind] += 1
        _note_time(tally, case, outcome, f"{label}: {kind}", backend)
    late = _lateness(tally, case, outcome, backend)
    if wrong or late:
        tally.fail(label, case, late + wrong)


def _lateness(tally: Tally, case: Case, outcome: Outcome, backend: str) -> list[str]:
    """A hang (needed the timeout, or ran past it), or a fault reported after PROMPT.

    On gloo a peer blocked in C++ on the failed rank is released when gloo sees the
    rank's connections close, or at the latest by its group's timeout (the world's),
    which counts from the collective's start: there a hang is a world that outlived
    twice its timeout, and a world that ends after PROMPT is counted, not failed.
    """
    deliberate = case.fault is not None and case.fault.kind == "sleep"
    timed_out = isinstance(outcome.error, meshsim.DeadlockError) and outcome.error.timed_out
    limit = outcome.timeout + LATE if backend == "sim" else 2 * outcome.timeout + LATE
    notes = getattr(outcome.error, "__notes__", []) if outcome.error is not None else []
    stuck = any("could not stop" in note for note in notes)
    if (timed_out and not deliberate) or outcome.seconds > limit or stuck:
        tally.hangs += 1
        return [f"hung: {outcome.seconds:.2f} s, timeout {outcome.timeout:g} s"]
    if case.fault is not None and not deliberate and _detection(outcome) > PROMPT:
        if backend == "gloo":
            tally.gloo_slow += 1
            return []
        tally.slow += 1
        return [f"slow: reported {_detection(outcome):.2f} s after the fault ({outcome.seconds:.2f} s all)"]
    return []


def _detection(outcome: Outcome) -> float:
    """Seconds from the faulty rank reaching its fault to ``meshsim.run`` returning."""
    return outcome.detection if outcome.detection is not None else outcome.seconds


def _note_time(tally: Tally, case: Case, outcome: Outcome, label: str, backend: str) -> None:
    if case.fault is not None and case.fault.kind == "sleep":
        if outcome.seconds > tally.slowest_timeout[0]:
            tally.slowest_timeout = (outcome.seconds, outcome.timeout, label)
    elif backend == "gloo":
        if _detection(outcome) > tally.slowest_gloo[0]:
            tally.slowest_gloo = (_detection(outcome), label)
    elif _detection(outcome) > tally.slowest_detection[0]:
        tally.slowest_detection = (_detection(outcome), label)


def _status(name: str) -> int:
    """A ``VmRSS``/``VmHWM`` value from /proc/self/status, in bytes (0 where there is none)."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(name + ":"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def _mib(n: int) -> str:
    return f"{n / 2**20:.0f} MiB" if n else "n/a"


def _table(tally: Tally) -> list[str]:
    kinds = sorted(tally.injected, key=lambda k: (k.endswith("(gloo)"), k != "none", k))
    rows = [("kind", "injected", "detected", "missed/misreported")]
    for kind in kinds:
        if kind.startswith("none"):
            rows.append((f"{kind}: no fault", str(tally.injected[kind]), "-", "-"))
        else:
            rows.append(
                (kind, str(tally.injected[kind]), str(tally.detected[kind]), str(tally.misreported[kind]))
            )
    faults = sum(n for k, n in tally.injected.items() if not k.startswith("none"))
    rows.append(
        ("all faults", str(faults), str(sum(tally.detected.values())), str(sum(tally.misreported.values())))
    )
    widths = [max(len(r[i]) for r in rows) for i in range(4)]
    return [
        "  ".join(v.rjust(w) if i else v.ljust(w) for i, (v, w) in enumerate(zip(r, widths))) for r in rows
    ]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cases", type=int, default=10_000, help="number of cases (default 10000)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the whole run (default 0)")
    parser.add_argument("--first", type=int, default=0, help="index of the first case (to replay one)")
    parser.add_argument(
        "--gloo-every", type=int, default=50, help="every Nth case on gloo; 0: none (default 50)"
    )
    args = parser.parse_args()

    warm_up = time.monotonic()
    for index in range(3):  # imports and first-use costs (device meshes, gloo) are not detection time
        run_case(draw_case(RandomSource(-1 - index), kinds=FAULT_KINDS if index else ()))
        run_case(draw_case(RandomSource(-1 - index), gloo=True), backend="gloo")
    warm_up = time.monotonic() - warm_up
    meshsim.end_idle_threads()  # rank threads kept for reuse are not a leak; counted without them
    threads_start, rss_start = threading.active_count(), _status("VmRSS")
    tally, start = Tally(), time.monotonic()
    for index in range(args.first, args.first + args.cases):
        _one(tally, index, args.seed, args.gloo_every)
        if (index - args.first + 1) % 500 == 0:
            print(
                f"  {index - args.first + 1} cases, {time.monotonic() - start:.0f} s",
                file=sys.stderr,
                flush=True,
            )
    seconds = time.monotonic() - start
    final = next_world_problems()  # the world after the last case runs correctly too
    tally.wrong_results += bool(final)

    for failure in tally.failures:
        print(failure, file=sys.stderr)
    misreported = sum(tally.misreported.values())
    must_be_0 = {
        "wrong results": tally.wrong_results,
        "faults missed or misreported": misreported,
        f"faults reported after more than {PROMPT:g} s (all but the deliberate timeout)": tally.slow,
        "hangs (needed the timeout, ran past it by 1 s (gloo: twice it), or left a thread)": tally.hangs,
        "cases that left state behind (threads, c10d world, excepthook, RNG, descriptors)": tally.left_behind,
    }
    print(
        f"meshsim soak: {tally.cases} cases run (seed {args.seed}, first {args.first}, gloo every "
        f"{args.gloo_every or 'never'}) in {seconds:.0f} s, {tally.cases / seconds:.1f} cases/s, "
        f"{os.cpu_count()} CPUs, after a {warm_up:.1f} s warm-up"
    )
    print("\n".join(_table(tally)))
    print("must be 0:")
    print("\n".join(f"  {name}: {count}" for name, count in must_be_0.items()))
    detection, label = tally.slowest_detection
    print(
        f"slowest detection (all but the deliberate timeout; from the fault to run() returning): "
        f"{detection:.3f} s ({label})"
    )
    gloo_end, label = tally.slowest_gloo
    print(
        f"gloo (not must be 0: peers blocked in C++ wait for gloo to see the failed rank's "
        f"connections close, or for the world's timeout): {tally.gloo_slow} worlds ended more than "
        f"{PROMPT:g} s after the fault; slowest {gloo_end:.3f} s ({label})"
    )
    taken, timeout, label = tally.slowest_timeout
    print(f"slowest deliberate timeout: {taken:.3f} s with timeout {timeout:g} s ({label})")
    peak, end = _mib(_status("VmHWM")), _mib(_status("VmRSS"))
    print(f"peak RSS (VmHWM): {peak}; RSS at start {_mib(rss_start)}, at end {end}")
    meshsim.end_idle_threads()
    print(f"threads (idle rank threads ended): {threads_start} at start, {threading.active_count()} at end")
    return 1 if any(must_be_0.values()) else 0


if __name__ == "__main__":
    sys.exit(main())
