"""The pure parts of a collective, without a world: what moves (meshsim._sim.movement) and each
description's execution, ledger traffic, signature and cross-rank checks (meshsim._sim.collectives).

Entry ``r`` of every list is group rank ``r``'s; expected values are written out by hand.
"""

from __future__ import annotations

import pytest
import torch

from meshsim._sim import collectives as co
from meshsim._sim import movement as mv

# -- reduce -------------------------------------------------------------------------------


def _ranks(*values: list[float], dtype: torch.dtype = torch.float32) -> list[torch.Tensor]:
    return [torch.tensor(v, dtype=dtype) for v in values]


@pytest.mark.parametrize(
    ("op", "expected"),
    [
        ("SUM", [6.0, -1.0]),
        ("AVG", [2.0, -1.0 / 3.0]),
        ("PRODUCT", [6.0, 0.0]),
        ("MIN", [1.0, -2.0]),
        ("MAX", [3.0, 1.0]),
    ],
)
def test_reduce_combines_every_rank_elementwise(op: str, expected: list[float]) -> None:
    result = mv.reduce(_ranks([1.0, 1.0], [2.0, -2.0], [3.0, 0.0]), op)
    assert result.dtype == torch.float32
    torch.testing.assert_close(result, torch.tensor(expected))


def test_reduce_never_writes_its_inputs() -> None:
    inputs = _ranks([1.0], [2.0])
    mv.reduce(inputs, "SUM")
    assert [t.tolist() for t in inputs] == [[1.0], [2.0]]


def test_premul_sum_scales_each_rank_by_its_own_factor_and_needs_one_per_rank() -> None:
    inputs = _ranks([1.0, 2.0], [10.0, 20.0])
    assert mv.reduce(inputs, "PREMUL_SUM", [0.5, torch.tensor(0.1)]).tolist() == pytest.approx([1.5, 3.0])
    with pytest.raises(ValueError, match="one factor per rank"):
        mv.reduce(inputs, "PREMUL_SUM", [0.5])


def test_integer_sums_wrap_in_their_own_dtype_as_on_the_wire() -> None:
    result = mv.reduce(_ranks([100.0], [100.0], dtype=torch.int8), "SUM")
    assert result.dtype == torch.int8 and result.tolist() == [-56]


def test_bitwise_and_bool_reductions() -> None:
    ints = [torch.tensor([0b1100]), torch.tensor([0b1010])]
    assert [mv.reduce(ints, op).item() for op in ("BAND", "BOR", "BXOR")] == [0b1000, 0b1110, 0b0110]
    flags = [torch.tensor([True, False, False]), torch.tensor([True, True, False])]
    assert mv.reduce(flags, "SUM").tolist() == [True, True, False]  # any
    assert mv.reduce(flags, "MIN").tolist() == [True, False, False]  # all


def test_low_precision_sums_round_once_so_rank_order_does_not_matter() -> None:
    values = [torch.tensor([1.0], dtype=torch.bfloat16), torch.tensor([2.0**-8], dtype=torch.bfloat16)] * 2
    forward, backward = mv.reduce(values, "SUM"), mv.reduce(values[::-1], "SUM")
    assert forward.dtype == torch.bfloat16
    assert torch.equal(forward, backward)


@pytest.mark.parametrize(
    ("op", "dtype", "why"),
    [
        ("AVG", torch.int32, "needs a floating point or complex tensor, got torch.int32"),
        ("MAX", torch.complex64, "is not defined for complex tensors"),
        ("BAND", torch.float32, "needs an integer or bool tensor, got torch.float32"),
        ("MEDIAN", torch.float32, "unsupported reduce op MEDIAN; expected one of SUM, AVG"),
    ],
)
def test_check_reduce_dtype_names_what_is_refused(op: str, dtype: torch.dtype, why: str) -> None:
    assert why in (mv.check_reduce_dtype(op, dtype) or "")


def test_check_reduce_dtype_accepts_what_nccl_reduces() -> None:
    assert mv.check_reduce_dtype("SUM", torch.int64) is None
    assert mv.check_reduce_dtype("AVG", torch.complex64) is None
    assert mv.check_reduce_dtype("BXOR", torch.bool) is None


# -- gathers, scatters, exchanges -----------------------------------------------------------


def test_all_gather_flat_concatenates_flattened_inputs_in_rank_order() -> None:
    result = mv.all_gather_flat([torch.tensor([[1, 2]]), torch.tensor([[3], [4]])])
    assert result.tolist() == [1, 2, 3, 4]


def test_all_gather_rows_holds_the_flat_gather_in_the_inputs_row_layout() -> None:
    inputs = [torch.arange(6).reshape(2, 3).t(), torch.arange(6, 12).reshape(3, 2)]  # one not contiguous
    result = mv.all_gather_rows(inputs)
    assert result.shape == (6, 2)
    assert result.reshape(-1).tolist() == mv.all_gather_flat(inputs).tolist()


def test_reduce_scatter_flat_gives_rank_r_the_r_th_chunk_of_the_reduction() -> None:
    chunks = mv.reduce_scatter_flat([torch.tensor([1, 2, 3, 4]), torch.tensor([10, 20, 30, 40])], "SUM")
    assert [c.tolist() for c in chunks] == [[11, 22], [33, 44]]


def test_split_sizes_are_the_given_splits_or_equal_parts() -> None:
    assert mv.split_sizes(6, [1, 5], 2) == [1, 5]
    assert mv.split_sizes(6, [], 3) == [2, 2, 2]


def test_all_to_all_single_sends_each_receiver_its_piece_in_sender_order() -> None:
    inputs = [torch.tensor([0, 1, 2]), torch.tensor([10, 11, 12])]
    splits = [[1, 2], [2, 1]]  # rank 0 sends 1 row to rank 0 and 2 to rank 1; rank 1 sends 2 and 1
    assert [t.tolist() for t in mv.all_to_all_single(inputs, splits)] == [[0, 10, 11], [1, 2, 12]]


def test_all_to_all_gives_rank_r_entry_r_of_every_list() -> None:
    a, b, c, d = (torch.tensor([i]) for i in range(4))
    assert mv.all_to_all([[a, b], [c, d]]) == [[a, c], [b, d]]


# -- cross-rank checks ------------------------------------------------------------------------


def test_compat_all_to_all_single_names_both_ends_of_a_mismatched_piece() -> None:
    problems = mv.compat_all_to_all_single(
        input_shapes=[(3,), (3,)],
        input_splits=[[1, 2], [2, 1]],
        output_shapes=[(3,), (3,)],
        output_splits=[[1, 2], [1, 2]],  # rank 1 expects 1 row from rank 0, which sends 2
    )
    assert [p.text for p in problems] == [
        "rank 1 expects 1 rows from rank 0, which sends 2",
        "rank 1 expects 2 rows from rank 1, which sends 1",
    ]
    assert mv.culprits(problems) == (1,)


def test_compat_all_to_all_single_blames_the_rank_whose_rows_differ_from_most() -> None:
    problems = mv.compat_all_to_all_single(
        input_shapes=[(2, 4), (2, 4), (2, 5)],
        input_splits=[[1, 1, 0]] * 3,
        output_shapes=[(3, 4), (3, 4), (0, 4)],
        output_splits=[[1, 1, 1], [1, 1, 1], [0, 0, 0]],
    )
    assert "rank 2 sends rows of shape [5], most ranks' rows have shape [4]" in [p.text for p in problems]


def test_compat_exchange_ignores_pieces_that_do_not_move() -> None:
    sent = [[(2,), None], [(3,), (1,)]]
    expected = [[(2,), (4,)], [None, (1,)]]  # rank 0 expects 4 from rank 1, which sends 3
    problems = mv.compat_exchange(sent, expected, "a tensor")
    assert problems == [
        mv.Problem("rank 0 expects a tensor of shape [4] from rank 1, which sends shape [3]", (0, 1))
    ]
    assert mv.culprits([]) == ()


# -- descriptions: execution on every rank's payload, and the ledger's traffic ---------------


def test_all_reduce_writes_every_rank_without_a_version_bump() -> None:
    tensors = [torch.tensor([1.0, 2.0]), torch.tensor([3.0, 4.0])]
    versions = [t._version for t in tensors]
    payloads = [co.AllReduce([t], "SUM", None) for t in tensors]
    co.AllReduce.execute(payloads)
    assert [t.tolist() for t in tensors] == [[4.0, 6.0]] * 2
    assert [t._version for t in tensors] == versions  # as gloo and NCCL write outputs
    assert payloads[0].traffic(0) == (torch.float32, 8, 8)
    assert payloads[0].signature() == payloads[1].signature()
    assert payloads[0].describe() == "all_reduce(float32[2], SUM)"


def test_reduce_writes_only_the_root_and_the_ledger_counts_only_its_receipt() -> None:
    tensors = [torch.tensor([1]), torch.tensor([2]), torch.tensor([4])]
    payloads = [co.Reduce([t], 1, "SUM", None) for t in tensors]
    co.Reduce.execute(payloads)
    assert [t.item() for t in tensors] == [1, 7, 4]
    assert [p.traffic(r)[1:] for r, p in enumerate(payloads)] == [(8, 0), (8, 8), (8, 0)]


def test_broadcast_copies_the_root_into_every_rank() -> None:
    tensors = [torch.tensor([1]), torch.tensor([2]), torch.tensor([3])]
    co.Broadcast.execute([co.Broadcast([t], 2) for t in tensors])
    assert [t.item() for t in tensors] == [3, 3, 3]


def test_all_gather_into_tensor_is_safe_when_the_input_is_a_view_of_the_output() -> None:
    # FSDP's input is its own slot of the output buffer
    outputs = [torch.tensor([1, 0]), torch.tensor([0, 2])]
    payloads = [co.AllGatherIntoTensor([out], [out[r : r + 1]]) for r, out in enumerate(outputs)]
    co.AllGatherIntoTensor.execute(payloads)
    assert [o.tolist() for o in outputs] == [[1, 2], [1, 2]]
    assert payloads[0].traffic(0) == (torch.int64, 8, 16)


def test_reduce_scatter_tensor_gives_each_rank_its_chunk() -> None:
    inputs = [torch.tensor([1, 2, 3, 4]), torch.tensor([10, 20, 30, 40])]
    outputs = [torch.zeros(2, dtype=torch.int64) for _ in inputs]
    co.ReduceScatterTensor.execute(
        [co.ReduceScatterTensor([o], [i], "SUM", None) for o, i in zip(outputs, inputs)]
    )
    assert [o.tolist() for o in outputs] == [[11, 22], [33, 44]]


def test_all_to_all_single_description_checks_and_moves_uneven_pieces() -> None:
    inputs = [torch.tensor([0, 1, 2]), torch.tensor([10, 11, 12])]
    outputs = [torch.zeros(3, dtype=torch.int64), torch.zeros(3, dtype=torch.int64)]
    payloads = [
        co.AllToAllSingle(outputs[0], inputs[0], [1, 2], [1, 2]),
        co.AllToAllSingle(outputs[1], inputs[1], [2, 1], [2, 1]),
    ]
    assert co.AllToAllSingle.compat is not None and co.AllToAllSingle.compat(payloads) == []
    co.AllToAllSingle.execute(payloads)
    assert [o.tolist() for o in outputs] == [[0, 10, 11], [1, 2, 12]]


def test_gather_and_scatter_move_between_the_root_and_every_rank() -> None:
    gathered = [torch.zeros(1, dtype=torch.int64) for _ in range(3)]
    payloads = [co.Gather(gathered if r == 0 else None, torch.tensor([r * 10]), 0) for r in range(3)]
    co.Gather.execute(payloads)
    assert [t.item() for t in gathered] == [0, 10, 20]

    outputs = [torch.zeros(1, dtype=torch.int64) for _ in range(3)]
    pieces = [torch.tensor([7]), torch.tensor([8]), torch.tensor([9])]
    co.Scatter.execute([co.Scatter(outputs[r], pieces if r == 1 else None, 1) for r in range(3)])
    assert [t.item() for t in outputs] == [7, 8, 9]
