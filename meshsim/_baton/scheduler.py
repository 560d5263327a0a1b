"""Who may run: the baton of cooperative scheduling, blocking waits, deadlock and timeout detection.

A world's ranks are threads. With ``serialize=True`` (the default) exactly one
rank holds the baton and runs; it passes the baton, in rank order, only when it
blocks (in a collective, a recv, a store wait) or finishes. Runs are therefore
deterministic, and process-global state such as the RNG can be swapped per rank
at each hand-over. With ``serialize=False`` every rank runs whenever it is not
blocked.

Either way a rank blocks only through :meth:`Scheduler.wait`, so the scheduler
always knows what every rank is doing: the moment no rank can run while some
wait, that is a deadlock, reported at once. A world that makes no progress for
``timeout`` seconds while some rank waits is reported by :meth:`check_timeout`,
which the thread that started the world calls periodically.

This module knows nothing of tensors or groups: a :class:`Waitable` describes itself.
"""

from __future__ import annotations

import sys
import threading
import time
import traceback
from collections.abc import Callable, Sequence
from typing import Protocol

from meshsim._base import MESHSIM_DIR
from meshsim._base.errors import DeadlockError, WorldAborted
from meshsim._base.tables import deadlock_text, why_text
from meshsim._base.waits import Waitable
from meshsim._baton.doorbell import Doorbell

__all__ = ["SAFETY_POLL", "Scheduler", "Waitable"]

_RUNNING, _READY, _BLOCKED, _DONE = "running", "ready", "blocked", "done"
# Seconds between the supervisor's nudges (see nudge): waits are woken explicitly,
# this only bounds each wait.
SAFETY_POLL = 1.0
# A world whose running ranks compute but complete no wait fails after this many timeouts
# of their CPU time.
RUN_LIMIT = 10
# Seconds (at most; never more than the timeout) over which a running rank's CPU clock is
# read to tell computing from blocked.
PROBE = 1.0
# The share of a probe's wall time the running ranks must spend on the CPU to count as
# computing: a thread blocked on a lock uses none, one polling in short sleeps well under
# 1%; a computing one gets its share of the machine (2 CPUs and 30 busy processes: 6%).
_CPU_SHARE = 0.02
# Below this share a probe shows a blocked rank (a thread asleep on a lock uses microseconds);
# between it and _CPU_SHARE the probe is looked at again over twice the time, up to
# _LONGEST_PROBE probes' worth, so that a computing rank a loaded machine starved for one
# probe is not taken for a blocked one.
_BLOCKED_SHARE = 0.001
_LONGEST_PROBE = 4
_CPU_CLOCKS = getattr(time, "pthread_getcpuclockid", None)  # Linux, the BSDs; not macOS or Windows


def _cpu_time(ident: int | None) -> float | None:
    """The CPU seconds thread ``ident`` has used (None where this cannot be read, or it is gone)."""
    if ident is None or _CPU_CLOCKS is None:
        return None
    try:
        return time.clock_gettime(_CPU_CLOCKS(ident))
    except (OSError, OverflowError, ValueError):
        return None


class HandOver(Protocol):
    """What the scheduler swaps at a hand-over: each rank's share of the process."""

    def save(self, rank: int) -> None: ...

    def load(self, rank: int) -> None: ...


def _nothing(rank: int) -> None:
    """No per-rank state to swap."""


class Scheduler:
    """The run state of every rank of one world.

    Args:
        world_size: number of ranks.
        bells: each rank's doorbell, where its thread sleeps (before it starts, too:
            the first ring starts it). They belong to the rank threads.

    Keyword args:
        serialize: run one rank at a time (see the module docstring).
        handover: what each rank owns of the process (the hand-over registry as this world
            sees it, :class:`meshsim._process.handover.WorldSlots`): its ``save(rank)`` runs
            in the rank's thread, with the lock held, just before it hands the baton to
            another rank, and its ``load(rank)`` when the rank resumes after another ran
            (serialize mode; None: nothing is swapped).

    Attributes:
        finished: set when the world fails; its owner sets it too once every rank
            thread is through (:class:`meshsim._engine.threads.Countdown`).
    """

    def __init__(
        self,
        world_size: int,
        bells: Sequence[Doorbell],
        *,
        serialize: bool,
        handover: HandOver | None = None,
    ) -> None:
        self.lock = threading.Lock()
        self.world_size = world_size
        self.serialize = serialize
        self.error: BaseException | None = None
        self.finished = threading.Event()
        self._save = handover.save if handover is not None else _nothing
        self._load = handover.load if handover is not None else _nothing
        self._state = [_READY] * world_size
        self._waiting: list[Waitable | None] = [None] * world_size
        # Each rank sleeps at its own doorbell (see _doorbell). Wake-ups are collected while
        # the lock is held and delivered after it is released, so a woken rank never
        # wakes only to block again on the lock (that doubled the cost of a hand-over).
        if len(bells) != world_size:
            raise ValueError(f"a {world_size}-rank world needs {world_size} doorbells, got {len(bells)}")
        self._bells = list(bells)
        # A rank not yet started sleeps at its doorbell too: it is started by the
        # first ring (see _threads), like a rank parked in _await_turn.
        self._parked = [True] * world_size
        self._signals: list[int] = []
        self._idents: list[int | None] = [None] * world_size
        self._outcome: list[str] = [""] * world_size
        # The timeout's view of running ranks (check_timeout): until when a computing rank
        # holds the clock off, the progress stamp when that began, and a CPU probe.
        self._grace_until = 0.0
        self._busy_from = -1.0
        self._probe: tuple[float, dict[int, float | None]] | None = None
        self._busy_cpu = 0.0  # CPU seconds running ranks used since the last progress
        self._window: float | None = None  # a longer probe, after an inconclusive one
        # No rank runs before begin(), which rings the first one(s).
        self._holder: int | None = None
        self._begun = False
        self._last_ran: int | None = None
        self._done = 0
        self._progress_at = time.monotonic()
        # called (lock held) when every rank that has not finished waits on an idle
        # Waitable: a session's job is over
        self.on_idle: Callable[[], None] | None = None

    def __enter__(self) -> Scheduler:
        """``with scheduler:`` holds :attr:`lock`; the wake-ups made meanwhile go out as it is released.

        A plain ``with scheduler.lock:`` would leave them pending until the next
        release by anyone: without serialization, a woken rank stayed parked that long.
        """
        self.lock.acquire()
        return self

    def __exit__(self, *exc_info: object) -> None:
        self._unlock()

    # -- called by rank threads -------------------------------------------------

    def begin(self) -> None:
        """Start the world: rank 0 in serialize mode, every rank otherwise."""
        self.lock.acquire()
        try:
            self._begun = True
            if not self.serialize:
                for rank in range(self.world_size):
                    self._signal(rank)
            elif self._holder is None and self._state[0] == _READY:
                self._holder = 0
                self._signal(0)
            self._check_deadlock()
        finally:
            self._unlock()

    def start(self, rank: int) -> None:
        """Register the calling thread as ``rank``; returns when it may run."""
        self.lock.acquire()
        try:
            self._idents[rank] = threading.get_ident()
            self._await_turn(rank)
            self._state[rank] = _RUNNING
        finally:
            self._unlock()
        self._resumed(rank)

    def wait(self, rank: int, waitable: Waitable) -> None:
        """Block ``rank`` until ``waitable.done``; raise its error if it has one.

        Raises:
            WorldAborted: the world failed while waiting.
        """
        if not waitable.done:
            self.lock.acquire()
            self.wait_locked(rank, waitable)
        elif waitable.error is not None:
            raise waitable.error

    def wait_locked(self, rank: int, waitable: Waitable) -> None:
        """:meth:`wait`, for a caller that holds ``lock``; releases it, and rings what is pending.

        A rank that completed ``waitable`` itself (the last to arrive at a collective)
        passes through without blocking, and the wake-ups it caused go out at once.
        """
        blocked = False
        try:
            if not waitable.done:
                blocked = True
                self._block(rank, waitable)
        finally:
            self._unlock()
        if blocked:
            self._resumed(rank)
        if waitable.error is not None:
            raise waitable.error

    def finish(self, rank: int, outcome: str) -> None:
        """Mark ``rank`` as finished (``outcome`` says how, for diagnostics)."""
        self.lock.acquire()
        try:
            self._state[rank] = _DONE
            self._outcome[rank] = outcome
            self._done += 1
            self._progress_at = time.monotonic()
            if self._done == self.world_size:
                return  # the world sets `finished` once every rank thread is through
            if self.serialize and self._holder == rank:
                self._pass_baton(rank)
            self._check_deadlock()
        finally:
            self._unlock()

    def wake(self, waitable: Waitable) -> None:
        """Mark ``waitable`` done and its waiters runnable. Call with ``lock`` held."""
        waitable.done = True
        self._progress_at = time.monotonic()
        for rank in waitable.waiters:
            if self._state[rank] == _BLOCKED and self._waiting[rank] is waitable:
                self._state[rank] = _READY
                if not self.serialize:
                    self._signal(rank)

    def resume(self, waitable: Waitable, *, reload: bool = True) -> None:
        """Complete an idle ``waitable`` and let its waiters run (a world's next call).

        In serialize mode the lowest waiting rank gets the baton. ``reload``: the caller's
        state was in place meanwhile, so every rank loads its own when it next runs;
        False for a call posted before any rank ran (the ranks' states are in place).
        """
        self.lock.acquire()
        try:
            self.raise_if_aborted()
            self.wake(waitable)
            if self.serialize:
                if reload:
                    self._last_ran = None
                if self._holder is None and self._begun:
                    for rank, state in enumerate(self._state):
                        if state == _READY:
                            self._holder = rank
                            self._signal(rank)
                            break
        finally:
            self._unlock()

    def raise_if_aborted(self) -> None:
        """Raise :class:`WorldAborted` when the world has failed. Call with ``lock`` held."""
        if self.error is not None:
            raise WorldAborted()

    # -- called by anyone ----------------------------------------------------------

    def abort(self, error: BaseException) -> bool:
        """Fail the world with ``error`` (the first error wins) and release every rank.

        Returns:
            whether ``error`` became the world's error.
        """
        self.lock.acquire()
        try:
            return self._abort(error)
        finally:
            self._unlock()

    def nudge(self) -> None:
        """Ring every parked rank's doorbell once, so that no park outlasts the caller's period.

        Parks have no timeout of their own (:meth:`Doorbell.park`): the thread that
        started the world calls this every :data:`SAFETY_POLL` seconds. A nudged rank
        looks at its state and parks again. Every rank still in the world is rung, not
        only those marked parked: a wake-up that was sent but lost clears the mark.
        """
        self.lock.acquire()
        try:
            self._wake_everyone()
        finally:
            self._unlock()

    def running_idents(self) -> list[int]:
        """Thread idents of ranks that are running their own code (not blocked, not done)."""
        with self.lock:
            return [
                ident
                for ident, state in zip(self._idents, self._state)
                if ident is not None and state == _RUNNING
            ]

    def running_cpu(self) -> float | None:
        """The CPU seconds the ranks running their own code have used in all (None: cannot tell)."""
        if _CPU_CLOCKS is None:
            return None
        times = [_cpu_time(ident) for ident in self.running_idents()]
        return sum(t for t in times if t is not None)

    def check_timeout(self, timeout: float) -> bool:
        """Fail the world if it made no progress for ``timeout`` s while a rank waits.

        Progress is a collective (or any wait) completing, or a rank that runs its own
        code using the CPU: a rank busy computing (an Inductor compile on a loaded
        machine) restarts the clock, so it is not mistaken for a hang. Whether a running
        rank computes is read from its thread's CPU clock over a probe of
        ``min(timeout, PROBE)`` seconds (computing: at least 2% of the probe on the CPU,
        a share a loaded machine still gives; between 0.1% and 2%, the clock is read
        again over twice the time, up to four probes' worth): a rank blocked outside
        meshsim (a lock, a sleep, I/O) uses none and is reported after ``timeout`` and
        the probe. Running ranks that compute
        on and on without any wait completing are reported once they have used
        ``RUN_LIMIT`` x ``timeout`` CPU seconds: counted in CPU time, not wall time, so
        a loaded machine does not cut a long computation short.

        Returns:
            whether the world was failed by this call.
        """
        self.lock.acquire()
        try:
            if self.error is not None or self.finished.is_set():
                return False
            now = time.monotonic()
            idle = now - self._progress_at
            if idle < timeout or now < self._grace_until:
                return False
            waiting = [r for r in range(self.world_size) if self._state[r] == _READY or self._waits(r)]
            if not waiting:
                return False
            if self._busy_from != self._progress_at:  # progress since the last extension: a fresh count
                self._busy_from, self._probe, self._busy_cpu = self._progress_at, None, 0.0
                self._window = None
            shortest = min(timeout, PROBE)
            probe = self._window or shortest
            used = self._computing(now, probe)
            if used is None:
                return False  # probing
            self._busy_cpu += used
            self._window = None
            if self._busy_cpu >= RUN_LIMIT * timeout:
                return self._abort(self._timeout_error(idle, timeout))
            if used >= _CPU_SHARE * probe:
                self._grace_until = now + timeout  # a rank computes: wait another timeout
                return False
            if used >= _BLOCKED_SHARE * probe and probe < _LONGEST_PROBE * shortest:
                self._window = 2 * probe  # some CPU, too little to tell: look again, for longer
                return False
            return self._abort(self._timeout_error(idle, timeout))
        finally:
            self._unlock()

    def _computing(self, now: float, probe: float) -> float | None:
        """The CPU seconds the running ranks used during the probe; None while it runs. Lock held."""
        running = [r for r in range(self.world_size) if self._state[r] == _RUNNING]
        if self._probe is None:
            self._probe = (now, {r: _cpu_time(self._idents[r]) for r in running})
            return None
        began, before = self._probe
        if now - began < probe:
            return None
        self._probe = None
        used = 0.0
        for rank in running:
            start, end = before.get(rank), _cpu_time(self._idents[rank])
            if start is not None and end is not None:
                used += end - start
            elif _CPU_CLOCKS is None:
                used += now - began  # no thread CPU clocks here: a running rank counts as computing
        return used

    # -- internals (lock held) --------------------------------------------------

    def _block(self, rank: int, waitable: Waitable) -> None:
        if self.error is not None:
            raise WorldAborted()
        self._state[rank] = _BLOCKED
        self._waiting[rank] = waitable
        waitable.waiters.append(rank)
        self._progress_at = time.monotonic()
        if self.serialize:
            self._pass_baton(rank)
        if self._holder is None:  # with the baton passed to a ready rank, progress is certain
            self._check_deadlock()
        self._await_turn(rank)
        self._state[rank] = _RUNNING
        self._waiting[rank] = None

    def _await_turn(self, rank: int) -> None:
        bell = self._bells[rank]
        while True:
            if self.error is not None:
                raise WorldAborted()
            if self._state[rank] == _READY and (not self.serialize or self._holder == rank):
                return
            self._parked[rank] = True
            signals = self._take_signals()
            self.lock.release()
            try:
                _ring(self._bells, signals)
                bell.park()  # bounded by nudge()
            finally:
                self.lock.acquire()

    def _signal(self, rank: int) -> None:
        """Wake ``rank`` once the lock is released."""
        if self._parked[rank]:
            self._parked[rank] = False
            self._signals.append(rank)

    def _wake_everyone(self) -> None:
        """Ring every rank still in the world once the lock is released, parked or not."""
        self._signals.extend(rank for rank, state in enumerate(self._state) if state != _DONE)

    def _take_signals(self) -> Sequence[int]:
        """The pending wake-ups, taken (a shared empty tuple when there are none)."""
        signals = self._signals
        if not signals:
            return _NONE
        self._signals = []
        return signals

    def _unlock(self) -> None:
        signals = self._take_signals()
        self.lock.release()
        _ring(self._bells, signals)

    def _resumed(self, rank: int) -> None:
        if self.serialize and self._last_ran != rank:
            self._last_ran = rank
            self._load(rank)

    def _pass_baton(self, rank: int) -> None:
        if self._last_ran == rank:
            # a finished rank too: what it changed of the state ranks share (a filter, a hook
            # registered on its way out) must stay its own, not reach the next rank
            self._save(rank)
        n = self.world_size
        for step in range(1, n + 1):
            nxt = (rank + step) % n
            if self._state[nxt] == _READY:
                self._holder = nxt
                self._signal(nxt)
                return
        self._holder = None

    def _check_deadlock(self) -> None:
        if not self._begun:
            return
        states = self._state
        if _RUNNING in states or _READY in states or _BLOCKED not in states:
            return
        if not any(self._waits(rank) for rank in range(self.world_size)):
            if self.on_idle is not None:
                self.on_idle()
            return
        self._abort(self._stall_error())

    def _waits(self, rank: int) -> bool:
        """Whether ``rank`` is blocked on something other than an idle Waitable."""
        waitable = self._waiting[rank]
        return self._state[rank] == _BLOCKED and waitable is not None and not waitable.idle

    def _abort(self, error: BaseException) -> bool:
        if self.error is not None:
            return False
        self.error = error
        self._wake_everyone()
        self.finished.set()
        return True

    # -- diagnostics ------------------------------------------------------------

    def _describe(self, rank: int) -> str:
        state = self._state[rank]
        if state == _BLOCKED:
            waitable = self._waiting[rank]
            return waitable.describe(rank) if waitable is not None else "blocked"
        if state == _DONE:
            return self._outcome[rank] or "finished"
        if state == _READY:
            return "ready, waiting for its turn to run"
        return "running its own code"

    def _states(self) -> dict[int, str]:
        return {rank: self._describe(rank) for rank in range(self.world_size)}

    def _stall_error(self) -> BaseException:
        for waitable in self._waiting:
            if waitable is not None:
                better = waitable.stalled()
                if better is not None:
                    return better
        states = self._states()
        culprits = self._culprits()
        message = deadlock_text(self.world_size, states, self._why(culprits))
        return DeadlockError(message, states=states, ranks=culprits)

    def _culprits(self) -> tuple[int, ...]:
        """Ranks that blocked ranks wait for and that are not themselves in the same wait."""
        found: set[int] = set()
        for rank, waitable in enumerate(self._waiting):
            if waitable is not None and self._state[rank] == _BLOCKED:
                found.update(r for r in waitable.missing() if self._waiting[r] is not waitable)
        return tuple(sorted(found))

    def _why(self, culprits: tuple[int, ...]) -> str:
        done = [r for r in culprits if self._state[r] == _DONE]
        return why_text(done, [r for r in culprits if self._state[r] != _DONE])

    def _stacks(self) -> dict[int, str]:
        """The stack of every rank thread that has not finished, formatted."""
        frames = sys._current_frames()
        try:
            return {
                rank: _format_stack(frames[ident])
                for rank, ident in enumerate(self._idents)
                if ident in frames and self._state[rank] != _DONE
            }
        finally:
            frames.clear()  # it holds this frame, whose locals hold it: a cycle keeping every rank's frames

    def _timeout_error(self, idle: float, timeout: float) -> DeadlockError:
        states = self._states()
        busy = tuple(r for r in range(self.world_size) if self._state[r] == _RUNNING)
        spun = self._busy_cpu >= RUN_LIMIT * timeout
        stacks = self._stacks()
        lines = []
        for rank, text in states.items():
            lines.append(f"  rank {rank}: {text}")
            if stacks.get(rank):
                lines.append(stacks[rank])
        who = ", ".join(map(str, busy)) if busy else "none"
        if not busy:
            why = ""
        elif spun:
            why = (
                f" They kept using the CPU, {self._busy_cpu:.1f} CPU seconds ({RUN_LIMIT} x the timeout), "
                "without any wait completing (a loop that never ends?)."
            )
        else:
            why = " They used no CPU: blocked outside meshsim (a lock, a sleep, I/O)?"
        message = (
            f"timeout: the {self.world_size}-rank world made no progress for {idle:.1f} s "
            f"(timeout={timeout:g} s) while ranks waited; ranks still running their own "
            f"code: {who}.{why}\n" + "\n".join(lines)
        )
        return DeadlockError(message, states=states, timed_out=True, ranks=busy)


_NONE: tuple[int, ...] = ()


def _ring(bells: list[Doorbell], ranks: Sequence[int]) -> None:
    for rank in ranks:
        bells[rank].ring()


def _format_stack(frame: object) -> str:
    """A rank's stack without the threading and meshsim frames that surround user code."""
    summary = traceback.extract_stack(frame)  # type: ignore[arg-type]
    keep = [
        entry
        for entry in summary
        if not entry.filename.startswith(MESHSIM_DIR) and not entry.filename.endswith("threading.py")
    ]
    text = "".join(traceback.format_list(keep))
    return "\n".join("      " + line for line in text.rstrip().splitlines())
