"""Every failure a world reports: the right class, the right rank, the message pinned, and no hang.

No test here measures time. A world that failed to notice a problem would hit
its ``timeout`` and raise a *timeout* DeadlockError instead, so asserting the
class and ``timed_out`` proves that detection was immediate.
"""

from __future__ import annotations

import pickle
import random
import re
import threading
import time

import pytest
import torch
import torch.distributed as dist

import meshsim

SERIALIZE = pytest.mark.parametrize("serialize", [True, False], ids=["serialized", "free"])


def _run(fn: object, ws: int = 4, **kw: object) -> BaseException:
    with pytest.raises(meshsim.MeshError) as info:
        meshsim.run(fn, ws, timeout=30, **kw)  # type: ignore[arg-type]
    return info.value


@SERIALIZE
def test_rank_error_names_the_rank_and_keeps_the_cause(serialize: bool) -> None:
    def body() -> None:
        x = torch.ones(2)
        dist.all_reduce(x)
        if dist.get_rank() == 2:
            raise ValueError("boom on two")
        dist.all_reduce(x)

    error = _run(body, serialize=serialize)
    assert type(error) is meshsim.RankError
    assert error.rank == 2 and error.world_size == 4
    assert isinstance(error.__cause__, ValueError)
    assert str(error.__cause__) == "boom on two"
    message = str(error)
    assert message.startswith("rank 2 of 4 raised; its traceback:\nTraceback (most recent call last):")
    assert 'raise ValueError("boom on two")' in message
    assert message.rstrip().endswith("ValueError: boom on two")
    assert error.failures == ((2, error.__cause__),)


def test_rank_error_lists_every_rank_that_raised_on_its_own() -> None:
    def body() -> None:
        raise RuntimeError(f"rank {dist.get_rank()} gives up")

    error = _run(body, 3)
    assert isinstance(error, meshsim.RankError)
    assert error.rank == 0
    assert "rank 0 of 3 raised" in str(error)
    assert str(error.__cause__) == "rank 0 gives up"


def test_rank_error_for_an_error_before_any_collective_releases_the_others() -> None:
    def body() -> None:
        if dist.get_rank() == 3:
            raise KeyError("early")
        dist.barrier()

    error = _run(body)
    assert isinstance(error, meshsim.RankError) and error.rank == 3


MISMATCHES = {
    "op": (
        lambda r, x: dist.broadcast(x, 0) if r == 1 else dist.all_reduce(x),
        r"rank 1: broadcast\(float32\[4\], src=0\)\s+at test_errors.py:\d+ in <lambda>   <- differs",
    ),
    "dtype": (
        lambda r, x: dist.all_reduce(x.double() if r == 1 else x),
        r"rank 1: all_reduce\(float64\[4\], SUM\)\s+at .*<- differs",
    ),
    "shape": (
        lambda r, x: dist.all_reduce(x[:3].contiguous() if r == 1 else x),
        r"rank 1: all_reduce\(float32\[3\], SUM\)\s+at .*<- differs",
    ),
    "reduce_op": (
        lambda r, x: dist.all_reduce(x, op=dist.ReduceOp.MAX if r == 1 else dist.ReduceOp.SUM),
        r"rank 1: all_reduce\(float32\[4\], MAX\)\s+at .*<- differs",
    ),
    "root": (
        lambda r, x: dist.broadcast(x, src=1 if r == 1 else 0),
        r"rank 1: broadcast\(float32\[4\], src=1\)\s+at .*<- differs",
    ),
}


@SERIALIZE
@pytest.mark.parametrize("kind", list(MISMATCHES))
def test_mismatch_table_names_the_odd_rank(kind: str, serialize: bool) -> None:
    call, row = MISMATCHES[kind]

    def body() -> None:
        call(dist.get_rank(), torch.ones(4))

    error = _run(body, serialize=serialize)
    assert type(error) is meshsim.CollectiveMismatchError
    assert error.ranks == (1,)
    assert error.group == (0, 1, 2, 3) and error.seq == 0
    message = str(error)
    assert message.startswith("ranks entered different collectives in call #0 of group [0, 1, 2, 3]:\n")
    assert re.search(row, message), message
    assert "Rank 1 differs from the others. Every rank of a group must issue the same collectives" in message
    assert set(error.calls) == {0, 1, 2, 3}


def test_mismatch_from_swapped_order_is_caught_at_the_first_call() -> None:
    def body() -> None:
        x = torch.ones(4)
        if dist.get_rank() == 0:
            dist.all_gather_into_tensor(torch.zeros(12), x)
            dist.all_reduce(x)
        else:
            dist.all_reduce(x)
            dist.all_gather_into_tensor(torch.zeros(12), x)

    error = _run(body, 3)
    assert isinstance(error, meshsim.CollectiveMismatchError)
    assert error.ranks == (0,)
    assert "rank 0: all_gather_into_tensor(float32[4] -> float32[12])" in str(error)


def test_all_to_all_split_mismatch_is_explained() -> None:
    def body() -> None:
        rank = dist.get_rank()
        dist.all_to_all_single(torch.zeros(4), torch.ones(4), [2, 2], [1, 3] if rank == 1 else [2, 2])

    error = _run(body, 2)
    assert isinstance(error, meshsim.CollectiveMismatchError)
    assert error.ranks == (1,)
    message = str(error)
    assert message.startswith(
        "the ranks' all_to_all arguments do not fit together in call #0 of group [0, 1]:"
    )
    assert "What does not fit:\n  - rank 0 expects 2 rows from rank 1, which sends 1\n" in message


def test_mismatch_is_raised_on_every_rank_at_the_rendezvous() -> None:
    def body() -> str:
        x = torch.ones(4)
        try:
            if dist.get_rank() == 2:
                dist.all_reduce(x, op=dist.ReduceOp.MIN)
            else:
                dist.all_reduce(x)
        except meshsim.CollectiveMismatchError as error:
            return f"{error.ranks}"
        return "no error"

    assert meshsim.run(body, 3) == ["(2,)"] * 3


def test_mismatch_in_a_sub_group_names_global_ranks() -> None:
    def body() -> None:
        group = dist.new_group([1, 2, 3])
        if dist.get_rank() == 0:
            return
        size = 5 if dist.get_rank() == 3 else 4
        dist.all_reduce(torch.ones(size), group=group)

    error = _run(body)
    assert isinstance(error, meshsim.CollectiveMismatchError)
    assert error.group == (1, 2, 3) and error.ranks == (3,)
    assert "call #0 of group [1, 2, 3]" in str(error)


def test_send_recv_mismatch() -> None:
    def body() -> None:
        if dist.get_rank() == 0:
            dist.send(torch.ones(3), 1)
        else:
            dist.recv(torch.zeros(4), 0)

    error = _run(body, 2)
    assert isinstance(error, meshsim.CollectiveMismatchError)
    message = str(error)
    assert message.startswith(
        "send and recv do not fit together in group [0, 1]: sent float32[3], receiving into float32[4]\n"
    )
    assert error.ranks == (0, 1)


@SERIALIZE
def test_deadlock_when_a_rank_skips_a_collective(serialize: bool) -> None:
    def body() -> None:
        if dist.get_rank() == 2:
            return
        dist.all_reduce(torch.ones(2))

    error = _run(body, serialize=serialize)
    assert type(error) is meshsim.DeadlockError
    assert not error.timed_out and error.ranks == (2,)
    message = str(error)
    assert message.startswith("deadlock: no rank of the 4-rank world can make progress.\n")
    assert re.search(
        r"  rank 0: waiting in all_reduce\(float32\[2\], SUM\), call #0 of group \[0, 1, 2, 3\] "
        r"at test_errors.py:\d+ in body; waiting for rank 2\n",
        message,
    )
    assert "  rank 2: finished: its function returned\n" in message
    assert message.endswith("Ranks wait for rank 2, which finished.")
    assert error.states[2] == "finished: its function returned"


def test_deadlock_across_groups_names_the_cycle() -> None:
    def body() -> None:
        pair = dist.new_group([0, 1])
        if dist.get_rank() == 1:
            dist.all_reduce(torch.ones(1), group=pair)
        else:
            dist.all_reduce(torch.ones(1))

    error = _run(body)
    assert isinstance(error, meshsim.DeadlockError)
    assert error.ranks == (0, 1)
    assert "rank 1: waiting in all_reduce(float32[1], SUM), call #0 of group [0, 1]" in str(error)
    assert str(error).endswith("Ranks wait for ranks 0, 1, which wait in another call (see above).")


def test_deadlock_on_recv_without_send_shows_unmatched_messages() -> None:
    def body() -> None:
        if dist.get_rank() == 1:
            dist.send(torch.ones(2), 0, tag=7)
        elif dist.get_rank() == 0:
            dist.recv(torch.zeros(2), 1, tag=0)

    error = _run(body, 2)
    assert isinstance(error, meshsim.DeadlockError)
    assert re.search(
        r"rank 0: waiting in recv\(float32\[2\]\) from rank 1 \(tag 0\) at test_errors.py:\d+ in body; "
        r"unmatched messages to it: from rank 1 with tag 7 \(send\(float32\[2\], dst=0, tag=7\) at ",
        str(error),
    )


def test_busy_rank_past_the_timeout_reports_every_stack() -> None:
    def spin_forever() -> None:
        while True:
            time.sleep(0.001)

    def body() -> None:
        if dist.get_rank() == 1:
            spin_forever()
        dist.barrier()

    with pytest.raises(meshsim.DeadlockError) as info:
        meshsim.run(body, 3, timeout=0.3)
    error = info.value
    assert error.timed_out and error.ranks == (1,)
    message = str(error)
    assert message.startswith("timeout: the 3-rank world made no progress for ")
    assert "(timeout=0.3 s) while ranks waited; ranks still running their own code: 1." in message
    assert "  rank 1: running its own code\n" in message
    assert "in spin_forever" in message  # rank 1's stack
    assert "dist.barrier()" in message  # rank 0's stack


def test_next_world_runs_after_failures() -> None:
    def bad() -> None:
        if dist.get_rank() == 0:
            raise RuntimeError("x")
        dist.barrier()

    def good() -> float:
        x = torch.ones(1)
        dist.all_reduce(x)
        return x.item()

    for _ in range(3):
        _run(bad)
        assert meshsim.run(good, 4) == [4.0] * 4


@pytest.mark.parametrize(
    ("kwargs", "error", "message"),
    [
        ({"world_size": 0}, ValueError, "world_size must be at least 1, got 0"),
        ({"world_size": "4"}, TypeError, "world_size must be an int, got '4'"),
        ({"world_size": True}, TypeError, "world_size must be an int, got True"),
        ({"timeout": -1}, ValueError, "timeout must be a positive, finite number of seconds, got -1"),
        ({"backend": "nccl"}, ValueError, "backend must be one of 'sim', 'gloo', got 'nccl'"),
        ({"num_threads": 0}, ValueError, "num_threads must be a positive int, 'auto' or None, got 0"),
        ({"num_threads": "all"}, ValueError, "num_threads must be a positive int, 'auto' or None, got 'all'"),
    ],
    ids=["ws0", "ws-str", "ws-bool", "timeout", "backend", "threads", "threads-str"],
)
def test_bad_arguments_to_run(kwargs: dict[str, object], error: type[Exception], message: str) -> None:
    args = {"world_size": 2, **kwargs}
    with pytest.raises(error, match=re.escape(message)):
        meshsim.run(lambda: None, **args)  # type: ignore[arg-type]


def test_fn_must_be_callable() -> None:
    with pytest.raises(TypeError, match=re.escape("run() needs a callable to run on every rank, got 3")):
        meshsim.run(3, 2)  # type: ignore[arg-type]


def test_backend_outside_a_world_says_so() -> None:
    import threading

    from meshsim._sim.backend import BACKEND_NAME, create_process_group

    errors: list[BaseException] = []

    def outside() -> None:
        try:
            create_process_group(None, None)
        except RuntimeError as exc:
            errors.append(exc)

    thread = threading.Thread(target=outside)
    thread.start()
    thread.join(10)
    assert str(errors[0]).startswith(f"the {BACKEND_NAME!r} backend only works inside meshsim.run()")


def test_local_argument_errors_name_the_values() -> None:
    def body() -> None:
        dist.all_gather_into_tensor(torch.zeros(5), torch.ones(2))

    error = _run(body, 2)
    assert isinstance(error, meshsim.RankError)
    assert str(error.__cause__) == (
        "all_gather_into_tensor: the output tensor float32[5] must hold 2 times the elements "
        "of the input tensor float32[2] (4), got 5"
    )


def test_interrupting_ranks_never_breaks_an_import(tmp_path: object, monkeypatch: pytest.MonkeyPatch) -> None:
    """Regression (found by the fault-injection campaign): ranks still running after a
    failure were interrupted with an asynchronous exception even inside an import; one
    landing in importlib's own code leaves the module's import lock held, and every later
    import of the module (torch._dynamo, first imported by dist.broadcast) blocked forever.
    A thread that is importing is now never interrupted."""
    import sys
    import threading
    import traceback
    from pathlib import Path

    from meshsim._engine.interrupt import interrupt

    folder = Path(str(tmp_path))
    (folder / "meshsim_blocking_import.py").write_text("import meshsim_gate\nmeshsim_gate.wait(30)\n")
    gate = threading.Event()
    monkeypatch.setitem(sys.modules, "meshsim_gate", gate)
    monkeypatch.syspath_prepend(str(folder))
    errors: list[BaseException] = []

    def importer() -> None:
        try:
            import meshsim_blocking_import  # noqa: F401
        except BaseException as exc:
            errors.append(exc)

    thread = threading.Thread(target=importer)
    thread.start()
    try:
        for _ in range(1000):  # until the thread is inside the module's import
            frame = sys._current_frames().get(thread.ident or 0)
            files = [entry.filename for entry in traceback.extract_stack(frame)] if frame else []
            if any("meshsim_blocking_import" in name for name in files):
                break
            time.sleep(0.005)
        done: set[int] = set()
        interrupt([thread.ident or 0], done)  # must decline: the thread is importing
        assert done == set()
    finally:
        gate.set()
        thread.join(30)
        sys.modules.pop("meshsim_blocking_import", None)
    assert errors == []


def test_a_gloo_rank_that_enters_its_collective_after_the_stop_began_is_waited_for(
    tmp_path: object, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Regression (the gloo property test under load): ranks still importing when another
    rank failed entered their gloo collective more than a second after the world began to
    stop. gloo's timeout releases a collective that long after it *began*, but the world
    had fixed its give-up point when the stop began, left the ranks blocked in C, and the
    process aborted at exit with their threads alive. The give-up point now moves with
    the latest collective a rank entered. Ordered by an event: each import (which the
    stop never interrupts) starts its 2 s only once rank 2 has failed, then runs the
    collective."""
    import importlib
    import sys
    from pathlib import Path

    folder = Path(str(tmp_path))
    for rank in (0, 1):  # a module each: a rank never waits on another's import lock
        (folder / f"meshsim_late_import_{rank}.py").write_text(
            "import time, torch, torch.distributed as dist, meshsim_gate\n"
            "meshsim_gate.wait(30)\ntime.sleep(2)\n"
            "dist.all_reduce(torch.ones(2))  # rank 2 never comes: gloo's timeout releases it\n"
        )
    failed = threading.Event()
    monkeypatch.setitem(sys.modules, "meshsim_gate", failed)
    monkeypatch.syspath_prepend(str(folder))

    def body() -> None:
        if dist.get_rank() == 2:
            failed.set()
            raise ValueError("rank 2 fails")
        importlib.import_module(f"meshsim_late_import_{dist.get_rank()}")

    try:
        with pytest.raises(meshsim.RankError) as info:
            meshsim.run(body, 3, backend="gloo", timeout=3)
    finally:
        for rank in (0, 1):
            sys.modules.pop(f"meshsim_late_import_{rank}", None)
    assert (info.value.rank, _left_behind(info.value)) == (2, [])


class _SlowFinalizer:
    """Spends its __del__ in Python, where an asynchronous exception is swallowed."""

    def __init__(self, seconds: float) -> None:
        self.seconds = seconds

    def __del__(self) -> None:
        end = time.monotonic() + self.seconds
        while time.monotonic() < end:
            pass


def test_an_interrupt_swallowed_by_a_finalizer_is_raised_again() -> None:
    """Regression (found by the gloo property tests): a rank still running after another
    failed is stopped by raising WorldAborted in its thread once; when that landed in a
    __del__ (or a gc or weakref callback) Python swallowed it, printed an "Exception
    ignored" report that pytest turns into a warning, and the rank ran on and was left
    behind as a thread. meshsim's unraisable hook now hides it and the rank is
    interrupted again."""
    seen: list[str] = []
    durations = random.Random(0)  # irregular, so that interrupts cannot fall in step with the loop

    def body() -> None:
        if dist.get_rank() == 1:
            time.sleep(0.05)  # rank 0 is in its loop by now
            raise ValueError("rank 1 fails")
        end = time.monotonic() + 5.0  # bounded: without the fix it would run to the end
        try:
            while time.monotonic() < end:
                _SlowFinalizer(durations.uniform(0.001, 0.01))  # about half the time in __del__
                spin = time.monotonic() + durations.uniform(0.001, 0.01)
                while time.monotonic() < spin:
                    pass
        except BaseException as exc:  # meshsim's interrupt
            seen.append(type(exc).__name__)
            raise

    for _ in range(5):  # each interrupt lands in __del__ about half the time
        with pytest.raises(meshsim.RankError, match="rank 1 fails") as info:
            meshsim.run(body, 2, serialize=False, timeout=30)
        assert _left_behind(info.value) == []  # no rank thread left behind
    assert seen == ["WorldAborted"] * 5


# -- errors pickle whole: spawned ranks and xdist workers send them across processes ----


class _HoldsALock(Exception):
    """An exception that cannot be pickled (it holds a lock)."""

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.lock = threading.Lock()


def _raise_a_key_error() -> None:
    raise KeyError(f"rank {dist.get_rank()}'s key")


def test_a_rank_error_pickles_with_every_failure_its_cause_and_notes() -> None:
    with pytest.raises(meshsim.RankError) as info:
        meshsim.run(_raise_a_key_error, 2)
    first = info.value
    # as a world whose ranks both raised would report it; rank 1's exception cannot be pickled
    failures = [(first.rank, first.__cause__), (1 - first.rank, _HoldsALock("holds a lock"))]
    error = meshsim.RankError(first.rank, 2, first.rank_traceback, failures)
    error.__cause__ = first.__cause__
    error.add_note("a note added by the caller")

    copy = pickle.loads(pickle.dumps(error))

    assert type(copy) is meshsim.RankError
    assert (copy.rank, copy.world_size, copy.rank_traceback, str(copy), copy.__notes__) == (
        error.rank,
        2,
        error.rank_traceback,
        str(error),
        ["a note added by the caller"],
    )
    assert "raised too" in str(copy)
    copied = dict(copy.failures)
    assert type(copied[first.rank]) is KeyError
    assert copied[first.rank].args == (f"rank {first.rank}'s key",)
    assert copy.__cause__ is copied[first.rank]
    # the lock-holding exception comes back as a RuntimeError that names it
    assert type(copied[1 - first.rank]) is RuntimeError
    assert "_HoldsALock: holds a lock (the original could not be pickled: TypeError" in str(
        copied[1 - first.rank]
    )


def test_mismatch_and_deadlock_errors_pickle_with_their_fields_and_notes() -> None:
    def mismatch() -> None:
        if dist.get_rank() == 0:
            dist.all_reduce(torch.ones(2))
        else:
            dist.broadcast(torch.ones(2), 0)

    def deadlock() -> None:
        if dist.get_rank() == 0:
            dist.barrier()

    for body, kind in ((mismatch, meshsim.CollectiveMismatchError), (deadlock, meshsim.DeadlockError)):
        with pytest.raises(kind) as info:
            meshsim.run(body, 2)
        error = info.value
        error.add_note("a note added by the caller")
        copy = pickle.loads(pickle.dumps(error))
        assert type(copy) is kind
        assert str(copy) == str(error)
        assert vars(copy) == vars(error)  # every field, notes included


def _left_behind(error: BaseException) -> list[str]:
    """The notes saying rank threads could not be stopped (a gloo failure's table is another note)."""
    return [note for note in getattr(error, "__notes__", []) if "could not stop rank thread" in note]
