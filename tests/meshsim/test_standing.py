"""Real ranks' standings: who the others wait for, in the simulated backend's own table."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

import meshsim
from meshsim._base.errors import CollectiveMismatchError, DeadlockError
from meshsim._record.recorder import DispatchRecorder, Entered
from meshsim._record.standing import (
    FAILED,
    FINISHED,
    RUNNING,
    SILENT,
    WAITING,
    Standing,
    standing_of,
    verdict,
    verdict_error,
)

GROUP = ("0", (0, 1))
SITE = "test_x.py:12 in test_y"


def _call(
    text: str = "all_reduce(float32[4], SUM)", seq: int = 0, ranks: tuple[int, ...] = (0, 1)
) -> Entered:
    return Entered(text, "0", ranks, seq, SITE)


def _counts(n: int) -> dict[str, tuple[tuple[int, ...], int]]:
    return {"0": ((0, 1), n)} if n else {}


SIM_TABLE = (
    "deadlock: no rank of the 2-rank world can make progress.\n"
    "  rank 0: waiting in all_reduce(float32[4], SUM), call #0 of group [0, 1] at test_x.py:12 in test_y; "
    "waiting for rank 1\n"
    "  rank 1: finished: its function returned\n"
    "Ranks wait for rank 1, which finished."
)


def test_a_rank_that_finished_while_another_waits_is_the_culprit() -> None:
    standings = [
        Standing(0, WAITING, "RuntimeError: Connection closed by peer", _call()),
        Standing(1, FINISHED, "its function returned"),
    ]
    found = verdict(standings, 2)
    assert found is not None and (found.kind, found.culprits) == ("deadlock", (1,))
    error = verdict_error(found, "gloo")
    assert isinstance(error, DeadlockError) and error.ranks == (1,)
    assert (
        str(error)
        == SIM_TABLE + "\n(seen on gloo) rank 0's call ended with RuntimeError: Connection closed by peer"
    )


def test_the_table_is_the_one_sim_prints() -> None:
    def body() -> None:
        if dist.get_rank() == 0:
            dist.all_reduce(torch.ones(4))

    with pytest.raises(DeadlockError) as sim:
        meshsim.run(body, 2)
    sim_rows = str(sim.value).splitlines()
    real = verdict([Standing(0, WAITING, "", _call()), Standing(1, FINISHED, "its function returned")], 2)
    assert real is not None
    real_rows = real.message.splitlines()
    # the same lines but for each call site's file and line
    assert [row.split(" at ")[0] for row in real_rows] == [row.split(" at ")[0] for row in sim_rows]


def test_a_rank_that_raised_is_named_and_the_table_is_its_note() -> None:
    standings = [Standing(0, WAITING, "", _call()), Standing(1, FAILED, "ValueError: rank 1 broke")]
    found = verdict(standings, 2)
    assert found is not None and (found.kind, found.culprits) == ("failed", (1,))
    assert found.message.splitlines() == [
        "where every rank stood:",
        "  rank 0: waiting in all_reduce(float32[4], SUM), call #0 of group [0, 1] at "
        f"{SITE}; waiting for rank 1",
        "  rank 1: failed: ValueError: rank 1 broke",
    ]


def test_ranks_in_different_collectives_are_a_mismatch() -> None:
    standings = [Standing(0, WAITING, "", _call()), Standing(1, WAITING, "", _call("all_gather(float32[4])"))]
    found = verdict(standings, 2)
    assert found is not None and (found.kind, found.culprits) == ("mismatch", (1,))
    error = verdict_error(found, "torchrun")
    assert isinstance(error, CollectiveMismatchError) and (error.group, error.seq, error.ranks) == (
        (0, 1),
        0,
        (1,),
    )
    assert str(error).splitlines()[:3] == [
        "ranks entered different collectives in call #0 of group [0, 1]:",
        f"  rank 0: all_reduce(float32[4], SUM)  at {SITE}",
        f"  rank 1: all_gather(float32[4])       at {SITE}   <- differs",
    ]


def test_ranks_that_ended_with_fewer_calls_on_a_group_are_the_culprits() -> None:
    """NCCL: the collective returns at once, so both bodies end; rank 1 issued one call fewer."""
    standings = [
        Standing(0, FINISHED, "its function returned", last=_call(), counts=_counts(1)),
        Standing(1, FINISHED, "its function returned", counts=_counts(0)),
    ]
    found = verdict(standings, 2)
    assert found is not None and (found.kind, found.culprits) == ("deadlock", (1,))
    assert "rank 0: waiting in all_reduce(float32[4], SUM), call #0 of group [0, 1]" in found.message
    assert "(its body ended; the call did not complete on the others)" in found.message


def test_a_rank_that_never_reported_is_named() -> None:
    standings = [Standing(0, WAITING, "", _call()), Standing(1, SILENT, "no report within 15 s")]
    found = verdict(standings, 2)
    assert found is not None and found.culprits == (1,)
    assert found.message.endswith("Ranks wait for rank 1, which did not report.")
    assert "  rank 1: did not report: no report within 15 s" in found.message


def test_a_rank_still_running_its_code_is_named() -> None:
    standings = [Standing(0, WAITING, "", _call()), Standing(1, RUNNING, "")]
    found = verdict(standings, 2)
    assert found is not None and found.message.endswith(
        "Ranks wait for rank 1, which is still running its own code."
    )


@pytest.mark.parametrize(
    "standings",
    [
        [
            Standing(0, FINISHED, "its function returned", counts=_counts(2)),
            Standing(1, FINISHED, "", counts=_counts(2)),
        ],
        [Standing(0, WAITING, "", _call()), Standing(1, WAITING, "", _call())],
    ],
    ids=["both-finished-alike", "both-in-the-same-call"],
)
def test_ranks_that_agree_have_no_verdict(standings: list[Standing]) -> None:
    assert verdict(standings, 2) is None


def test_a_recorder_knows_the_call_its_rank_is_in_and_its_last() -> None:
    def body() -> Standing:
        recorder = DispatchRecorder()
        with recorder:
            dist.all_reduce(torch.ones(4))
            dist.broadcast(torch.ones(2), src=0)
        return standing_of(dist.get_rank(), recorder, ended=True)

    standings = meshsim.run(body, 2, backend="gloo")
    assert [s.state for s in standings] == [FINISHED, FINISHED]
    last = standings[1].last
    assert last is not None and (last.text, last.seq, last.ranks) == (
        "broadcast(float32[2], root=0)",
        1,
        (0, 1),
    )
    assert last.site.startswith("test_standing.py:")
    assert list(standings[0].counts.values()) == [((0, 1), 2)]


def test_a_backend_error_puts_the_rank_in_its_last_call() -> None:
    """c10d's op returns a Work at once: the wait that raised is on the rank's last call."""
    recorder = DispatchRecorder()
    recorder.last = _call()
    timed_out = standing_of(0, recorder, ended=True, error=dist.DistError("Timed out"))
    assert (timed_out.state, timed_out.pending) == (WAITING, _call())
    own = standing_of(0, recorder, ended=True, error=ValueError("bad shape"))
    assert (own.state, own.detail, own.pending) == (FAILED, "ValueError: bad shape", None)
    blocked = standing_of(0, recorder, ended=False, blocked=True)
    assert (blocked.state, blocked.pending) == (WAITING, _call())
