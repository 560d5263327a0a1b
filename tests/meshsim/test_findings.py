"""Wasted collectives: calls that could not have told any rank anything new (sim backend).

Each rule is pinned both ways: the wasted call is flagged with its reason in every
rank's ledger entry, and the cases the rule must not flag (different data, uneven
shapes, Partial sums, bit patterns that merely compare equal) are not.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Partial

import meshsim
from meshsim._observe.findings import collecting

WS = 4

# these tests waste collectives on purpose; the session's report is for the ones nobody meant
pytestmark = pytest.mark.allow_redundant()


def _reasons(body: Callable[[], None], world_size: int = WS, **kw: object) -> list[list[str | None]]:
    """Every rank's ``redundant`` field, call by call."""

    def rank() -> list[str | None]:
        with meshsim.record() as ledger:
            body()
        return [call.redundant for call in ledger]

    return meshsim.run(rank, world_size, **kw)  # type: ignore[arg-type]


def _only(reasons: list[list[str | None]]) -> list[str | None]:
    """The one list of reasons every rank agrees on."""
    assert all(r == reasons[0] for r in reasons), reasons
    return reasons[0]


def _rank() -> int:
    return dist.get_rank()


# -- all_gather and gather: every rank contributed the same bytes ----------------------------


def test_an_all_gather_of_the_same_bytes_everywhere_is_flagged_in_both_forms() -> None:
    def body() -> None:
        shape = torch.tensor([8, 16, 3, 3])  # 32 bytes of int64, equal on every rank
        dist.all_gather_into_tensor(torch.empty(4 * WS, dtype=torch.int64), shape)
        dist.all_gather([torch.empty(4, dtype=torch.int64) for _ in range(WS)], shape)
        dist.gather(
            shape, [torch.empty(4, dtype=torch.int64) for _ in range(WS)] if _rank() == 0 else None, 0
        )

    each = "every rank contributed the same 32 bytes: each rank could build the result from its own input"
    root = "every rank contributed the same 32 bytes: the root could build the result from its own input"
    assert _only(_reasons(body)) == [each, each, root]


def test_calls_that_move_nothing_say_so_and_one_empty_rank_is_not_enough() -> None:
    def body() -> None:
        dist.all_gather_into_tensor(torch.empty(0), torch.empty(0))
        dist.all_reduce(torch.empty(0, 3))
        dist.broadcast(torch.empty(0), 0)
        some = torch.ones(0 if _rank() == 0 else 2)  # rank 0 holds nothing, the others do
        dist.all_gather([torch.empty(0 if r == 0 else 2) for r in range(WS)], some * _rank())

    nothing = "every rank's input is empty (0 bytes): the call moves nothing"
    assert _only(_reasons(body)) == [nothing, nothing, nothing, None]


def test_all_gathers_of_different_or_uneven_data_are_not_flagged() -> None:
    def body() -> None:
        mine = torch.tensor([8, 16 + _rank()])  # different data, same shape
        dist.all_gather_into_tensor(torch.empty(2 * WS, dtype=torch.int64), mine)
        uneven = torch.ones(_rank() + 1)  # same values, different shapes
        dist.all_gather([torch.empty(r + 1) for r in range(WS)], uneven)

    assert _only(_reasons(body)) == [None, None]


def test_one_differing_rank_is_enough_to_not_flag() -> None:
    def body() -> None:
        x = torch.ones(4) if _rank() != 3 else torch.tensor([1.0, 1.0, 1.0, 2.0])
        dist.all_gather_into_tensor(torch.empty(4 * WS), x)

    assert _only(_reasons(body)) == [None]


def test_equal_values_with_different_bits_are_not_the_same_bytes() -> None:
    def body() -> None:
        zero = torch.tensor([0.0]) if _rank() % 2 == 0 else torch.tensor([-0.0])  # equal, not identical
        dist.all_gather_into_tensor(torch.empty(WS), zero)
        one = torch.tensor([1.0])
        dist.all_gather_into_tensor(torch.empty(WS), one)
        # the same bytes everywhere, but a NaN is not equal to itself: two ranks' values are
        # compared first, so such a payload is missed (never flagged wrongly)
        nan = torch.tensor([float("nan")])
        dist.all_gather_into_tensor(torch.empty(WS), nan)

    reasons = _only(_reasons(body))
    assert reasons[0] is None
    assert reasons[1] is not None and reasons[1].startswith("every rank contributed the same 4 bytes")
    assert reasons[2] is None


# -- reductions: identical inputs are computable locally --------------------------------------


@pytest.mark.parametrize(
    ("op", "result"),
    [
        (dist.ReduceOp.SUM, "4 x the input"),
        (dist.ReduceOp.AVG, "the input itself"),
        (dist.ReduceOp.MAX, "the input itself"),
        (dist.ReduceOp.MIN, "the input itself"),
        (dist.ReduceOp.PRODUCT, "the input to the power 4"),
    ],
    ids=["sum", "avg", "max", "min", "product"],
)
def test_an_all_reduce_of_identical_inputs_names_the_local_result(op: dist.ReduceOp, result: str) -> None:
    def body() -> None:
        dist.all_reduce(torch.full((3,), 2.0), op=op)

    name = str(op).rsplit(".", 1)[-1]
    expected = (
        f"every rank's input is the same 12 bytes: the {name} is {result}, "
        "which each rank could compute locally"
    )
    assert _only(_reasons(body)) == [expected]


def test_bitwise_reductions_of_identical_inputs_are_flagged() -> None:
    def body() -> None:
        for op in (dist.ReduceOp.BAND, dist.ReduceOp.BOR, dist.ReduceOp.BXOR):
            dist.all_reduce(torch.tensor([5, 3]), op=op)

    reasons = _only(_reasons(body))
    assert [r.split(": the ", 1)[1] for r in reasons if r] == [
        "BAND is the input itself, which each rank could compute locally",
        "BOR is the input itself, which each rank could compute locally",
        "BXOR is zero, which each rank could compute locally",  # an even number of ranks
    ]


def test_reduce_scatter_and_reduce_of_identical_inputs_are_flagged() -> None:
    def body() -> None:
        dist.reduce_scatter_tensor(torch.empty(2), torch.arange(2.0 * WS))
        dist.reduce_scatter(torch.empty(2), [torch.ones(2) for _ in range(WS)])
        dist.reduce(torch.ones(2), 0)

    reasons = _only(_reasons(body))
    assert reasons[0] == (
        "every rank's input is the same 32 bytes: the SUM is 4 x the input, "
        "which each rank could compute locally"
    )
    assert reasons[1] is not None and reasons[1].endswith("which each rank could compute locally")
    assert reasons[2] == (
        "every rank's input is the same 8 bytes: the SUM is 4 x the input, "
        "which the root could compute locally"
    )


def test_reductions_of_different_data_and_premul_sums_are_not_flagged() -> None:
    def body() -> None:
        dist.all_reduce(torch.full((3,), float(_rank())))
        dist.reduce_scatter_tensor(torch.empty(1), torch.arange(float(WS)) * _rank())
        dist.all_reduce(torch.ones(2), op=dist._make_nccl_premul_sum(0.5))  # type: ignore[attr-defined]

    assert _only(_reasons(body)) == [None, None, None]


def test_a_partial_sum_is_not_flagged() -> None:
    def body() -> None:
        mesh = init_device_mesh("cpu", (WS,))
        partial = DTensor.from_local(torch.full((2, 2), float(_rank())), mesh, [Partial()])
        with meshsim.record() as ledger:
            partial.full_tensor()
        assert ledger.counts() == {"all_reduce": 1}

    assert _only(_reasons(body)) == [None]


# -- broadcast and all_to_all -------------------------------------------------------------------


def test_a_broadcast_to_ranks_that_hold_the_roots_bytes_is_flagged_only_then() -> None:
    def body() -> None:
        x = torch.arange(4.0) if _rank() == 0 else torch.zeros(4)
        dist.broadcast(x, 0)  # ranks 1-3 learn something
        dist.broadcast(x, 0)  # now they hold it already

    assert _only(_reasons(body)) == [None, "every rank already held the root's 16 bytes"]


def test_all_to_all_where_each_rank_receives_its_own_bytes_is_flagged() -> None:
    def body() -> None:
        same = torch.arange(8.0)  # every rank sends the same tensor
        dist.all_to_all_single(torch.empty(8), same)
        # rank r sends r*10 + d to rank d; rank d receives the same value d from every rank
        # only when what it gets is what it sends itself: a column of equal pieces
        column = torch.tensor([float(d) for d in range(WS)])
        dist.all_to_all_single(torch.empty(WS), column)
        dist.all_to_all([torch.empty(1) for _ in range(WS)], [torch.tensor([float(d)]) for d in range(WS)])
        differs = torch.tensor([float(10 * _rank() + d) for d in range(WS)])
        dist.all_to_all_single(torch.empty(WS), differs)

    reasons = _only(_reasons(body))
    assert reasons[0] == (
        "every rank contributed the same 32 bytes: each rank could build the result from its own input"
    )
    assert reasons[1] is not None and reasons[1].startswith("every rank contributed the same 16 bytes")
    assert reasons[2] is not None and reasons[2].startswith("every rank contributed the same 16 bytes")
    assert reasons[3] is None


def test_all_to_all_of_the_same_bytes_cut_differently_is_not_flagged() -> None:
    def body() -> None:
        # the same four values everywhere, but rank 0 sends 1 + 3 and rank 1 sends 2 + 2:
        # what each receives depends on the other's splits, which it cannot know alone
        splits = [1, 3] if _rank() == 0 else [2, 2]
        received = [1, 2] if _rank() == 0 else [3, 2]
        dist.all_to_all_single(torch.empty(sum(received)), torch.arange(4.0), received, splits)

    assert _only(_reasons(body, world_size=2)) == [None]


# -- the same call again ----------------------------------------------------------------------


def test_a_repeated_small_call_with_the_same_bytes_is_flagged_and_a_changed_one_is_not() -> None:
    def body() -> None:
        out = torch.empty(2 * WS, dtype=torch.int64)
        for value in (7, 7, 8):  # shapes that differ between ranks: no single call is wasted
            dist.all_gather_into_tensor(out, torch.tensor([value, _rank()]))

    assert _only(_reasons(body)) == [
        None,
        "the same call as #0 on this group, with the same bytes from every rank: "
        "each rank could reuse that call's result",
        None,
    ]


def test_repeated_large_calls_are_not_compared() -> None:
    def body() -> None:
        big = torch.full((1024,), float(_rank()))  # 4 KiB per rank: not copied for comparison
        dist.all_gather_into_tensor(torch.empty(1024 * WS), big)
        dist.all_gather_into_tensor(torch.empty(1024 * WS), big)

    assert _only(_reasons(body)) == [None, None]


# -- where findings are not looked for -------------------------------------------------------


def _everything_wasted() -> None:
    dist.all_reduce(torch.ones(2))
    dist.all_gather_into_tensor(torch.empty(2 * dist.get_world_size()), torch.ones(2))


def test_a_group_of_one_rank_is_never_flagged() -> None:
    assert _reasons(_everything_wasted, 1) == [[None, None]]


def test_the_gloo_backend_leaves_redundant_unset() -> None:
    assert _only(_reasons(_everything_wasted, 2, backend="gloo")) == [None, None]


def test_the_switch_turns_the_findings_off(monkeypatch: pytest.MonkeyPatch) -> None:
    assert _only(_reasons(_everything_wasted, redundant=False)) == [None, None]
    monkeypatch.setenv("MESHSIM_REDUNDANT", "0")
    assert _only(_reasons(_everything_wasted)) == [None, None]
    assert _only(_reasons(_everything_wasted, redundant=True))[0] is not None


def test_a_bad_switch_value_is_refused() -> None:
    with pytest.raises(TypeError, match="redundant must be True, False or None, got 'yes'"):
        meshsim.run(_everything_wasted, 2, redundant="yes")  # type: ignore[arg-type]


# -- ledgers and collectors -------------------------------------------------------------------


def test_ledgers_list_and_mark_the_flagged_calls_and_compare_equal_without_them() -> None:
    def body() -> tuple[str, list[str], list[object]]:
        with meshsim.record() as ledger:
            dist.all_reduce(torch.full((2,), float(_rank())))
            dist.all_reduce(torch.ones(2))
        return str(ledger), [c.api for c in ledger.redundant()], list(ledger)

    text, flagged, calls = meshsim.run(body, 2)[0]
    assert flagged == ["all_reduce"]
    lines = text.splitlines()
    assert not lines[1].endswith("]") and lines[2].endswith("[redundant 1]")
    assert lines[3] == "2 collectives, 16 B received, 1 redundant"
    assert lines[4] == (
        "[redundant 1] #1: every rank's input is the same 8 bytes: the SUM is 2 x the input, "
        "which each rank could compute locally"
    )
    assert "[redundant: every rank's input is the same 8 bytes" in str(calls[1])
    # the same calls recorded without findings compare equal: the reason is an annotation
    quiet = meshsim.run(body, 2, redundant=False)[0][2]
    assert quiet == calls


def test_collectors_receive_each_wasted_call_once_with_its_site() -> None:
    with collecting() as found:
        meshsim.run(_everything_wasted, 2)
    assert [(f.api, f.group, f.seq) for f in found] == [
        ("all_reduce", (0, 1), 0),
        ("all_gather_into_tensor", (0, 1), 1),
    ]
    assert all(
        f.site.startswith("test_findings.py:") and f.site.endswith("in _everything_wasted") for f in found
    )
    assert str(found[0]).startswith("all_reduce on group [0, 1] (call #0) at test_findings.py:")
