"""meshsim.run(..., trace=path): a world as Chrome trace-event JSON (Perfetto, chrome://tracing)."""

from __future__ import annotations

import json
import threading
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist

import meshsim

WS = 4

# the programs below send the same bytes everywhere, as tests do; the findings are pinned elsewhere
pytestmark = pytest.mark.allow_redundant()


REQUIRED = {  # the trace-event format's keys, per phase
    "M": {"name", "ph", "pid", "args"},
    "X": {"name", "cat", "ph", "ts", "dur", "pid", "tid", "args"},
    "s": {"name", "cat", "ph", "id", "ts", "pid", "tid"},
    "f": {"name", "cat", "ph", "id", "ts", "pid", "tid", "bp"},
    "i": {"name", "cat", "ph", "ts", "pid", "s", "args"},
}


def _load(path: Path) -> list[dict[str, Any]]:
    """The file's events, checked against the format: keys per phase, numbers where numbers go."""
    document = json.loads(path.read_text())
    assert document["displayTimeUnit"] == "ms"
    events: list[dict[str, Any]] = document["traceEvents"]
    for event in events:
        assert REQUIRED[event["ph"]] <= event.keys(), event
        assert all(isinstance(event[k], (int, float)) and event[k] >= 0 for k in ("ts", "dur") if k in event)
    return events


def _slices(events: list[dict[str, Any]], cat: str) -> list[dict[str, Any]]:
    return [e for e in events if e["ph"] == "X" and e.get("cat") == cat]


def _program() -> None:
    rank = dist.get_rank()
    x = torch.full((4,), float(rank))
    dist.all_reduce(x)  # 16 bytes
    pair = dist.new_group([0, 1])
    if rank < 2:
        dist.broadcast(torch.ones(2), 0, group=pair)
    dist.all_gather_into_tensor(torch.empty(2 * WS), torch.ones(2))  # the same bytes everywhere


def test_one_track_per_rank_with_a_slice_per_collective_from_arrival_to_release(tmp_path: Path) -> None:
    path = tmp_path / "world.json"
    meshsim.run(_program, WS, trace=path)
    events = _load(path)

    names = {e["tid"]: e["args"]["name"] for e in events if e["ph"] == "M" and e["name"] == "thread_name"}
    assert names == {r: f"rank {r}" for r in range(WS)}
    process = [e["args"]["name"] for e in events if e["ph"] == "M" and e["name"] == "process_name"]
    assert process == ["meshsim world: _program on 4 ranks"]

    per_rank = {r: sorted(_slices(events, "collective"), key=lambda e: e["ts"]) for r in range(WS)}
    for rank in range(WS):
        mine = [e for e in per_rank[rank] if e["tid"] == rank]
        expected = (
            ["all_reduce", "broadcast", "all_gather_into_tensor"]
            if rank < 2
            else [
                "all_reduce",
                "all_gather_into_tensor",
            ]
        )
        assert [e["name"] for e in mine] == expected
        ends = [e["ts"] + e["dur"] for e in mine]
        assert all(e["dur"] >= 0 for e in mine)
        assert all(end <= nxt["ts"] for end, nxt in zip(ends, mine[1:]))  # one after the other
        (function,) = [e for e in _slices(events, "rank") if e["tid"] == rank]
        assert function["name"] == "_program"
        assert function["args"] == {"outcome": "finished: its function returned"}
        assert function["ts"] <= mine[0]["ts"] and ends[-1] <= function["ts"] + function["dur"]

    reduce = next(e for e in per_rank[2] if e["tid"] == 2 and e["name"] == "all_reduce")
    args = reduce["args"]
    assert {k: args[k] for k in ("op", "api", "group", "bytes in", "bytes out", "reduce op")} == {
        "op": "all_reduce",
        "api": "all_reduce",
        "group": [0, 1, 2, 3],
        "bytes in": 16,
        "bytes out": 16,
        "reduce op": "SUM",
    }
    assert args["site"].startswith("test_trace.py:") and args["site"].endswith("in _program")
    assert args["call"] == "all_reduce(float32[4], SUM)"
    assert "redundant" not in args
    gather = [e for e in _slices(events, "collective") if e["name"] == "all_gather_into_tensor"]
    assert {e["args"]["redundant"] for e in gather} == {
        "every rank contributed the same 8 bytes: each rank could build the result from its own input"
    }
    broadcast = [e for e in _slices(events, "collective") if e["name"] == "broadcast"]
    assert [e["args"]["group"] for e in broadcast] == [[0, 1], [0, 1]]


def test_arrows_run_from_each_waiting_rank_to_the_last_to_arrive(tmp_path: Path) -> None:
    path = tmp_path / "world.json"
    meshsim.run(_program, WS, trace=path)
    events = _load(path)
    collectives = _slices(events, "collective")
    starts = {e["id"]: e for e in events if e["ph"] == "s"}
    finishes = {e["id"]: e for e in events if e["ph"] == "f"}
    assert starts and starts.keys() == finishes.keys()
    # per call: the ranks' slices, keyed by (api, group); each api is called once per group here
    calls: dict[tuple[str, tuple[int, ...]], list[dict[str, Any]]] = {}
    for e in collectives:
        calls.setdefault((e["name"], tuple(e["args"]["group"])), []).append(e)
    arrows = 0
    for (_, group), slices in calls.items():
        assert sorted(e["tid"] for e in slices) == list(group)
        last = max(slices, key=lambda e: e["ts"])  # the latest arrival
        assert {e["args"]["last to arrive"] for e in slices} == {last["tid"]}
        assert "waited for" not in last["args"]
        for e in slices:
            if e is last:
                continue
            assert e["args"]["waited for"].startswith(f"rank {last['tid']}, ")
            (flow,) = [s for s in starts.values() if s["tid"] == e["tid"] and s["ts"] == e["ts"]]
            end = finishes[flow["id"]]
            assert (end["tid"], end["ts"], end["bp"]) == (last["tid"], last["ts"], "e")
            arrows += 1
    assert arrows == len(starts) == (WS - 1) * 2 + 1  # two world-wide calls, one pair broadcast


def test_a_failed_world_ends_with_the_error_on_the_failing_ranks_track(tmp_path: Path) -> None:
    def body() -> None:
        dist.all_reduce(torch.ones(2))
        if dist.get_rank() == 2:
            raise ValueError("rank 2 fails")
        dist.barrier()

    path = tmp_path / "failed.json"
    with pytest.raises(meshsim.RankError):
        meshsim.run(body, WS, trace=path)
    events = _load(path)
    (error,) = [e for e in events if e.get("cat") == "error"]
    assert (error["ph"], error["s"], error["tid"]) == ("i", "t", 2)
    assert error["args"] == {"error": "ValueError: rank 2 fails"}
    functions = {e["tid"]: e for e in _slices(events, "rank")}
    assert functions[2]["args"]["outcome"] == "failed: ValueError: rank 2 fails"
    assert error["ts"] <= functions[2]["ts"] + functions[2]["dur"]
    # the others were stopped in the barrier rank 2 never entered
    stopped = [e for e in _slices(events, "collective") if e["name"] == "barrier"]
    assert sorted(e["tid"] for e in stopped) == [0, 1, 3]
    assert {e["args"]["error"] for e in stopped} == {"stopped: the world failed (see its error event)"}


def test_a_mismatch_is_an_error_on_the_track_of_the_rank_that_found_it(tmp_path: Path) -> None:
    def body() -> None:
        if dist.get_rank() == 0:
            dist.all_reduce(torch.ones(2))
        else:
            dist.broadcast(torch.ones(2), 0)

    path = tmp_path / "mismatch.json"
    with pytest.raises(meshsim.CollectiveMismatchError):
        meshsim.run(body, 2, trace=path)
    events = _load(path)
    (error,) = [e for e in events if e.get("cat") == "error"]
    assert error["args"]["error"].startswith("CollectiveMismatchError: ")
    # the last to arrive found it; the other rank's call ends as stopped
    calls = {e["tid"]: e for e in _slices(events, "collective")}
    assert calls[error["tid"]]["args"]["error"].startswith("CollectiveMismatchError: ")
    assert calls[1 - error["tid"]]["args"]["error"] == "stopped: the world failed (see its error event)"


def test_a_world_that_times_out_gets_the_error_on_the_process(tmp_path: Path) -> None:
    release = threading.Event()
    stuck: list[threading.Thread] = []

    def body() -> None:  # rank 1 stuck in its own code while rank 0 waits for it
        if dist.get_rank() == 1:
            stuck.append(threading.current_thread())
            release.wait(30)  # stuck outside any collective, in C: left as a daemon thread
        else:
            dist.barrier()

    path = tmp_path / "timeout.json"
    try:
        with pytest.raises(meshsim.DeadlockError):
            meshsim.run(body, 2, trace=path, timeout=0.2)
    finally:  # let the stuck rank go, so that no later test finds its thread (or its doorbell)
        release.set()
        for thread in stuck:
            thread.join(30)
    assert not any(thread.is_alive() for thread in stuck)
    errors = [e for e in _load(path) if e.get("cat") == "error"]
    assert [(e["s"], "tid" in e) for e in errors] == [("p", False)]
    assert errors[0]["args"]["error"].startswith("DeadlockError: ")


def test_bad_trace_arguments_are_refused_with_what_was_expected(tmp_path: Path) -> None:
    with pytest.raises(TypeError, match=r"trace must be a file path \(str or os.PathLike\) or None, got 3"):
        meshsim.run(lambda: None, 2, trace=3)  # type: ignore[arg-type]
    missing = tmp_path / "nowhere" / "world.json"
    with pytest.raises(ValueError, match=r"the folder '.*nowhere' does not exist"):
        meshsim.run(lambda: None, 2, trace=missing)
    with pytest.raises(ValueError, match=r"is a folder; give the trace file's path"):
        meshsim.run(lambda: None, 2, trace=tmp_path)
    with pytest.raises(ValueError, match=r"draws a simulated world; backend='gloo'"):
        meshsim.run(lambda: None, 2, trace=tmp_path / "x.json", backend="gloo")
    assert not list(tmp_path.iterdir())  # nothing was written


def test_findings_appear_in_a_trace_without_a_ledger(tmp_path: Path) -> None:
    path = tmp_path / "world.json"
    meshsim.run(lambda: dist.broadcast(torch.ones(3), 0), 2, trace=path)
    (first, second) = _slices(_load(path), "collective")
    assert (
        first["args"]["redundant"]
        == second["args"]["redundant"]
        == "every rank already held the root's 12 bytes"
    )


def _all_reduce(group: tuple[int, ...], nbytes: int, seq: int = 0) -> meshsim.Collective:
    return meshsim.Collective(
        "all_reduce", "all_reduce", group, torch.float32, nbytes, nbytes, "SUM", seq, "a.py:1"
    )


def test_the_gpu_clock_lays_the_calls_out_by_the_critical_path() -> None:
    from meshsim._observe.cost import critical_path
    from meshsim._observe.trace import gpu_clock_events

    pair, world = _all_reduce((0, 1), 1 << 20), _all_reduce((0, 1, 2), 64)
    calls = [[pair, world], [pair, world], [world]]
    events = gpu_clock_events(calls, meshsim.topology("pcie"))
    for event in events:
        assert REQUIRED[event["ph"]] <= event.keys() and event["pid"] == 2, event
    schedule = critical_path(calls, "pcie")
    drawn = [e for e in events if e["ph"] == "X"]
    spans = [s for r in range(3) for s in schedule.of(r)]
    assert [e["tid"] for e in drawn] == [s.rank for s in spans]
    assert [e["ts"] for e in drawn] == pytest.approx([s.start * 1e6 for s in spans])
    assert [e["dur"] for e in drawn] == pytest.approx([(s.end - s.start) * 1e6 for s in spans])
    (waited,) = [e["args"] for e in events if e["ph"] == "X" and "waited for a slower rank" in e["args"]]
    assert waited["op"] == "all_reduce" and waited["group"] == [0, 1, 2]  # rank 2 waits for the pair


def test_ledgers_that_do_not_line_up_are_an_event_not_a_failure() -> None:
    from meshsim._observe.trace import gpu_clock_events

    events = gpu_clock_events([[_all_reduce((0, 1), 8)], []], meshsim.topology("pcie"))
    (note,) = [e for e in events if e["ph"] == "i"]
    assert REQUIRED["i"] <= note.keys()
    assert note["name"] == "not priced" and "the ledgers do not line up" in note["args"]["error"]
