"""A simulated world as a timeline: Chrome trace-event JSON, which Perfetto's UI and chrome://tracing open.

One track (thread) per rank. On it, a slice for the rank's function from start to
end and, inside it, one slice per collective from the rank's arrival to its
release, with the call's op, api, group, bytes, site and, when the call was wasted,
the reason (:mod:`meshsim._observe.findings`). For every collective, a flow arrow runs
from each rank that waited to the last rank to arrive: the one it waited for. A
rank that raised gets an instant event with the error at the moment it failed; a
world that failed otherwise (a timeout) gets one on the process.

Times are the simulation's wall clock, in microseconds from the world's start.
Simulated ranks take turns on one CPU, so a slice shows order and waiting, not what
the call would take on a GPU.

Given a topology, a second process, ``estimated GPU clock, TOPOLOGY``, has the same
ranks as threads and the world's completed collectives laid out as
:func:`meshsim._observe.cost.critical_path` schedules them: a call starts when its
last rank could start it and lasts the slowest rank's estimate. Compute is left
out (it takes no time on that clock), so a gap on a rank's track is that rank
waiting for a slower one; each slice's args hold the rank's own estimate and the
wait before it. Point-to-point calls are not drawn on either process.

A :class:`Tracer` is an instrument of the world (:class:`meshsim._sim.rendezvous.Instrument`)
for one of its calls. Who writes where: ``meshsim.run(..., trace="world.json")`` names
the file; the pytest plugin's ``--mesh-trace=DIR`` names one per test, through a
:class:`meshsim._observe.watch.Watch`.
"""

from __future__ import annotations

import itertools
import json
import os
import re
import time
import warnings
from pathlib import Path
from typing import TYPE_CHECKING, Any

from meshsim._base.errors import WorldAborted
from meshsim._record.ledger import Collective
from meshsim._sim.rendezvous import Instrument

if TYPE_CHECKING:
    from meshsim._observe.topology import Topology
    from meshsim._sim.rendezvous import Call, GroupState, Slot

__all__ = ["Tracer", "checked_path", "file_name"]

_PID = 1  # the world, on the simulation's clock
_GPU_PID = 2  # the same ranks on the estimated GPU clock


class Tracer(Instrument):
    """The events of one world's call, appended by its rank threads as they go; written at its end."""

    def __init__(self, path: Path, world_size: int, name: str, *, topology: Topology | None = None) -> None:
        self.path = path
        self.topology = topology
        self._priced: list[list[Collective]] = [[] for _ in range(world_size)]  # each rank's, in order
        self._start = time.perf_counter_ns()
        self._began = [0.0] * world_size  # when each rank started the call
        self._flows = itertools.count(1)
        self.has_error = False  # an error event was added
        self.events: list[dict[str, Any]] = [
            _meta("process_name", None, {"name": f"meshsim world: {name} on {world_size} ranks"}),
        ]
        for rank in range(world_size):
            self.events.append(_meta("thread_name", rank, {"name": f"rank {rank}"}))
            self.events.append(_meta("thread_sort_index", rank, {"sort_index": rank}))

    def now(self) -> float:
        """Microseconds since the world started."""
        return (time.perf_counter_ns() - self._start) / 1000

    def rank_started(self, rank: int, name: str) -> None:
        self._began[rank] = self.now()

    def rank_finished(self, rank: int, name: str, outcome: str) -> None:
        """The rank's function, from its start to now."""
        start = self._began[rank]
        self.events.append(
            {
                "name": name,
                "cat": "rank",
                "ph": "X",
                "ts": start,
                "dur": self.now() - start,
                "pid": _PID,
                "tid": rank,
                "args": {"outcome": outcome},
            }
        )

    def arrived(self, rank: int, group: GroupState, call: Call) -> None:
        call.arrived = self.now()

    def released(
        self,
        rank: int,
        group: GroupState,
        call: Call,
        slot: Slot | None,
        error: BaseException | None = None,
    ) -> None:
        """``call`` on ``rank``, from its arrival (``call.arrived``) to now; ``slot`` once complete."""
        released = self.now()
        payload = call.payload
        _, bytes_in, bytes_out = payload.traffic(call.group_rank)
        args: dict[str, Any] = {
            "op": payload.op,
            "api": payload.api,
            "call": call.text,
            "group": list(group.ranks),
            "bytes in": bytes_in,
            "bytes out": bytes_out,
            "site": call.site,
        }
        if payload.reduce_op is not None:
            args["reduce op"] = payload.reduce_op
        event: dict[str, Any] = {
            "name": payload.api,
            "cat": "collective",
            "ph": "X",
            "ts": call.arrived,
            "dur": released - call.arrived,
            "pid": _PID,
            "tid": rank,
            "args": args,
        }
        if isinstance(error, WorldAborted):
            args["error"] = "stopped: the world failed (see its error event)"
        elif error is not None:
            args["error"] = f"{type(error).__name__}: {error}".splitlines()[0]
        if slot is not None and self.topology is not None:
            self._priced[rank].append(_entry(group, call, slot.seq))
        if slot is not None:
            last = slot.last
            assert last is not None  # the slot completed
            last_rank = group.ranks[last.group_rank]
            args["last to arrive"] = last_rank
            if slot.wasted is not None:
                args["redundant"] = slot.wasted
                event["cname"] = "terrible"  # chrome://tracing's red; Perfetto colours by name
            if last is not call:
                args["waited for"] = f"rank {last_rank}, {last.arrived - call.arrived:.1f} us"
                self._flow(rank, call.arrived, last_rank, last.arrived, payload.api)
        self.events.append(event)

    def _flow(self, waiter: int, since: float, last: int, arrived: float, name: str) -> None:
        """An arrow from ``waiter``'s slice (at its arrival) to the last arriver's (at its arrival)."""
        flow = next(self._flows)
        common = {"name": f"{name}: waits for the last rank", "cat": "wait", "id": flow, "pid": _PID}
        self.events.append({**common, "ph": "s", "ts": since, "tid": waiter})
        self.events.append({**common, "ph": "f", "bp": "e", "ts": arrived, "tid": last})

    def failed(self, rank: int | None, exc: BaseException) -> None:
        """``exc`` at this moment, on ``rank``'s track (or the process's when None)."""
        if rank is None and self.has_error:
            return  # a rank raised it: its event says so
        self.has_error = True
        text = f"{type(exc).__name__}: {exc}"
        event: dict[str, Any] = {
            "name": f"error: {type(exc).__name__}",
            "cat": "error",
            "ph": "i",
            "ts": self.now(),
            "pid": _PID,
            "s": "t" if rank is not None else "p",
            "args": {"error": text},
        }
        if rank is not None:
            event["tid"] = rank
        self.events.append(event)

    def ended(self) -> None:
        """Write the trace; a file that cannot be written is a warning, not the world's failure."""
        about = {"meshsim": "simulated ranks; times are the simulation's wall clock (us)"}
        if self.topology is not None:
            self.events += gpu_clock_events(self._priced, self.topology)
            about["estimated GPU clock"] = (
                f"process {_GPU_PID}: the collectives on {self.topology.name} as meshsim's cost model "
                "lays them out (critical path), compute left out: a gap is a wait for a slower rank"
            )
        document = {"displayTimeUnit": "ms", "otherData": about, "traceEvents": self.events}
        try:
            self.path.write_text(json.dumps(document, default=str))
        except OSError as exc:
            warnings.warn(
                f"meshsim could not write the trace {self.path}: {exc}", RuntimeWarning, stacklevel=2
            )


def _entry(group: GroupState, call: Call, seq: int) -> Collective:
    """The rank's side of a completed call as a ledger records it (numbered in its group's order)."""
    payload = call.payload
    dtype, bytes_in, bytes_out = payload.traffic(call.group_rank)
    peer = group.ranks[payload.root] if payload.root is not None else None
    return Collective(
        payload.op,
        payload.api,
        group.ranks,
        dtype,
        bytes_in,
        bytes_out,
        payload.reduce_op,
        seq,
        call.site,
        peer,
        via=call.entry.via if call.entry is not None else None,
    )


def gpu_clock_events(calls: list[list[Collective]], topology: Topology) -> list[dict[str, Any]]:
    """The second process: every rank's ``calls`` on the estimated GPU clock of ``topology``.

    Ledgers that do not line up (a world that failed mid-call) get one event that says so.
    """
    from meshsim._observe.cost import critical_path, format_seconds

    events = [_meta("process_name", None, {"name": f"estimated GPU clock, {topology.name}"}, _GPU_PID)]
    events.append(_meta("process_sort_index", None, {"sort_index": _GPU_PID}, _GPU_PID))
    for rank in range(len(calls)):
        events.append(_meta("thread_name", rank, {"name": f"rank {rank}"}, _GPU_PID))
        events.append(_meta("thread_sort_index", rank, {"sort_index": rank}, _GPU_PID))
    try:
        schedule = critical_path(calls, topology)
    except ValueError as error:
        why = {"error": str(error)}
        instant = {"name": "not priced", "cat": "error", "ph": "i", "ts": 0, "pid": _GPU_PID, "s": "p"}
        return [*events, {**instant, "args": why}]
    for rank in schedule.ranks:
        free = 0.0  # when the rank's previous call ended
        for span in schedule.of(rank):
            call = span.call
            args: dict[str, Any] = {
                "op": call.op,
                "api": call.api,
                "group": list(call.group),
                "bytes in": call.bytes_in,
                "bytes out": call.bytes_out,
                "site": call.site,
                "estimate": str(span.estimate),
            }
            if span.start > free:
                args["waited for a slower rank"] = format_seconds(span.start - free)
            events.append(
                {
                    "name": call.api,
                    "cat": "estimate",
                    "ph": "X",
                    "ts": span.start * 1e6,
                    "dur": (span.end - span.start) * 1e6,
                    "pid": _GPU_PID,
                    "tid": rank,
                    "args": args,
                }
            )
            free = span.end
    return events


def _meta(name: str, tid: int | None, args: dict[str, Any], pid: int = _PID) -> dict[str, Any]:
    event: dict[str, Any] = {"name": name, "ph": "M", "pid": pid, "args": args}
    if tid is not None:
        event["tid"] = tid
    return event


def checked_path(trace: object) -> Path:
    """``trace`` as a path whose folder exists, or a clear error."""
    if not isinstance(trace, (str, os.PathLike)):
        raise TypeError(f"trace must be a file path (str or os.PathLike) or None, got {trace!r}")
    path = Path(trace)
    if not path.parent.is_dir():
        raise ValueError(f"trace={str(trace)!r}: the folder {str(path.parent)!r} does not exist")
    if path.is_dir():
        raise ValueError(f"trace={str(trace)!r} is a folder; give the trace file's path")
    return path


def file_name(test_id: str) -> str:
    """A test id as a file name: path separators and brackets become safe characters."""
    name = re.sub(r"[^A-Za-z0-9_.=,+-]+", "_", test_id.replace("::", "."))
    return name.strip("_.")[:200] or "test"
