"""How the backend reads a collective's reduce op from c10d's options: every kind, each time."""

from __future__ import annotations

from typing import Any

import torch.distributed as dist

from meshsim._sim.backend import reduce_op_names_by_hash, reduce_op_of


def _fresh_options(op: Any) -> Any:
    opts = dist.AllreduceOptions()
    opts.reduceOp = op  # torch reads it back as a new ReduceOp object on every access
    return opts


def test_reduce_op_names_by_hash_cover_every_kind_but_premul_sum() -> None:
    expected = {name for name in dist.ReduceOp.RedOpType.__members__ if name != "PREMUL_SUM"}
    # empty would mean the slow path on every collective, silently
    assert set(reduce_op_names_by_hash().values()) == expected


def test_reduce_op_reads_every_kind_from_fresh_options() -> None:
    for name, kind in dist.ReduceOp.RedOpType.__members__.items():
        if name == "PREMUL_SUM":
            continue
        assert reduce_op_of(_fresh_options(kind)) == (name, None)
        assert reduce_op_of(_fresh_options(dist.ReduceOp(kind))) == (name, None)
    premul = dist._make_nccl_premul_sum(2.5)  # type: ignore[attr-defined]
    assert reduce_op_of(_fresh_options(premul)) == ("PREMUL_SUM", 2.5)
    assert reduce_op_of(None) == ("SUM", None)
