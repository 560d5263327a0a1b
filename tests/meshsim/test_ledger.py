"""The collective ledger: exact records of what each rank put on the wire."""

from __future__ import annotations

import re

import pytest
import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol

import meshsim
from meshsim import Collective, Ledger


def fixed_program() -> Ledger:
    rank, ws = dist.get_rank(), dist.get_world_size()
    pair = dist.new_group([0, 1])
    with meshsim.record() as ledger:
        x = torch.ones(8)  # 32 bytes of float32
        dist.all_reduce(x)
        dist.all_gather_into_tensor(torch.zeros(8 * ws), x)
        dist.reduce_scatter_tensor(
            torch.zeros(2, dtype=torch.float64), torch.ones(2 * ws, dtype=torch.float64)
        )
        dist.broadcast(x, src=1)
        if rank in (0, 1):
            dist.all_reduce(x, group=pair, op=dist.ReduceOp.MAX)
        if rank == 0:
            dist.send(torch.ones(3, dtype=torch.int64), 3)
        if rank == 3:
            dist.recv(torch.zeros(3, dtype=torch.int64), 0)
        dist.barrier()
    return ledger


def test_fixed_program_ledger_is_exact() -> None:
    ledgers = meshsim.run(fixed_program, 4)
    world = (0, 1, 2, 3)
    assert ledgers[0].counts() == {
        "all_reduce": 2,
        "all_gather": 1,
        "reduce_scatter": 1,
        "broadcast": 1,
        "send": 1,
        "barrier": 1,
    }
    assert ledgers[2].counts() == {
        "all_reduce": 1,
        "all_gather": 1,
        "reduce_scatter": 1,
        "broadcast": 1,
        "barrier": 1,
    }
    assert ledgers[3].counts() == {
        "all_reduce": 1,
        "all_gather": 1,
        "reduce_scatter": 1,
        "broadcast": 1,
        "recv": 1,
        "barrier": 1,
    }
    assert ledgers[0].project(
        "op", "api", "group", "dtype", "bytes_in", "bytes_out", "reduce_op", "seq", "peer"
    ) == [
        ("all_reduce", "all_reduce", world, torch.float32, 32, 32, "SUM", 0, None),
        ("all_gather", "all_gather_into_tensor", world, torch.float32, 32, 128, None, 1, None),
        ("reduce_scatter", "reduce_scatter_tensor", world, torch.float64, 64, 16, "SUM", 2, None),
        ("broadcast", "broadcast", world, torch.float32, 0, 32, None, 3, 1),
        ("all_reduce", "all_reduce", (0, 1), torch.float32, 32, 32, "MAX", 0, None),
        ("send", "send", world, torch.int64, 24, 0, None, 0, 3),
        ("barrier", "barrier", world, None, 0, 0, None, 4, None),
    ]
    # the broadcast root contributes and receives nothing back
    assert ledgers[1].calls[3].bytes_in == 32 and ledgers[1].calls[3].bytes_out == 0
    assert ledgers[3].project("op", "bytes_in", "bytes_out", "peer")[4] == ("recv", 0, 24, 0)
    assert ledgers[0].bytes() == 32 + 128 + 16 + 32 + 32
    assert ledgers[0].bytes("all_reduce", direction="in") == 64
    assert ledgers[0].count("all_reduce") == 2 and ledgers[0].count() == 7


def test_site_points_at_the_user_call() -> None:
    def body() -> str:
        with meshsim.record() as ledger:
            dist.barrier()
        return ledger.calls[0].site

    site = meshsim.run(body, 2)[0]
    assert re.fullmatch(r"test_ledger.py:\d+ in body", site)


def test_recording_nests_and_is_per_rank() -> None:
    def body() -> tuple[int, int, int]:
        with meshsim.record() as outer:
            dist.barrier()
            with meshsim.record() as inner:
                if dist.get_rank() == 0:
                    dist.send(torch.ones(1), 1)
                else:
                    dist.recv(torch.ones(1), 0)
            dist.barrier()
        return len(outer), len(inner), inner.count("send")

    assert meshsim.run(body, 2) == [(3, 1, 1), (3, 1, 0)]


def test_object_collectives_record_the_two_all_gathers_torch_issues() -> None:
    def body() -> list[tuple[object, ...]]:
        out: list[object] = [None, None]
        with meshsim.record() as ledger:
            dist.all_gather_object(out, "hello")
        return ledger.project("op", "api", "dtype")

    got = meshsim.run(body, 2)[0]
    # the list all_gather up to torch 2.14; from 2.15 both travel as single tensors
    api = "all_gather" if torch.__version__ < "2.15" else "all_gather_into_tensor"
    assert got == [("all_gather", api, torch.int64), ("all_gather", api, torch.uint8)]


def test_functional_collectives_are_recorded_with_their_wire_names() -> None:
    def body() -> list[tuple[object, ...]]:
        group = dist.group.WORLD
        with meshsim.record() as ledger:
            funcol.all_gather_tensor(torch.ones(2), 0, group).wait()
            funcol.all_reduce(torch.ones(2), "avg", group).wait()
            funcol.reduce_scatter_tensor(torch.ones(4), "sum", 0, group).wait()
            funcol.all_to_all_single(torch.ones(2), [1, 1], [1, 1], group).wait()
        return ledger.project("op", "api", "reduce_op", "bytes_in", "bytes_out")

    assert meshsim.run(body, 2)[0] == [
        ("all_gather", "all_gather_into_tensor", None, 8, 16),
        ("all_reduce", "all_reduce", "AVG", 8, 8),
        ("reduce_scatter", "reduce_scatter_tensor", "SUM", 16, 8),
        ("all_to_all", "all_to_all_single", None, 8, 8),
    ]


def test_coalesced_calls_are_one_record() -> None:
    from torch.distributed.distributed_c10d import _coalescing_manager

    def body() -> list[tuple[object, ...]]:
        with meshsim.record() as ledger:
            with _coalescing_manager():
                dist.all_reduce(torch.ones(2))
                dist.all_reduce(torch.ones(3))
        return ledger.project("op", "api", "bytes_in")

    assert meshsim.run(body, 2)[0] == [("all_reduce", "all_reduce_coalesced", 20)]


def test_str_and_repr() -> None:
    call = Collective(
        "all_gather", "all_gather_into_tensor", (0, 1), torch.float32, 1024, 2048, None, 3, "t.py:9 in f"
    )
    assert str(call) == "all_gather_into_tensor float32 group=[0, 1] in=1.0 KiB out=2.0 KiB #3 at t.py:9 in f"
    assert repr(call).startswith(
        "Collective(op='all_gather', api='all_gather_into_tensor', group=(0, 1), dtype=torch.float32"
    )
    ledger = Ledger()
    ledger.calls.append(call)
    assert str(ledger).splitlines() == [
        "#  op          api                     group  dtype    in       out      reduce  site",
        "0  all_gather  all_gather_into_tensor  [0,1]  float32  1.0 KiB  2.0 KiB  -       t.py:9 in f",
        "1 collectives, 2.0 KiB received",
    ]
    with pytest.raises(AttributeError):
        call.op = "x"  # type: ignore[misc]


@pytest.mark.parametrize(
    ("call", "message"),
    [
        (
            lambda led: led.count("allreduce"),
            "unknown collective op 'allreduce'; expected one of all_gather, all_reduce",
        ),
        (lambda led: led.bytes("x"), "unknown collective op 'x'"),
        (lambda led: led.bytes(direction="up"), "direction must be 'in' or 'out', got 'up'"),
        (lambda led: led.project("size"), "project() takes field names from ['op', 'api', "),
        (lambda led: led.project(), "project() takes field names from"),
    ],
    ids=["count", "bytes-op", "bytes-direction", "project-field", "project-empty"],
)
def test_bad_queries_say_what_is_expected(call: object, message: str) -> None:
    with pytest.raises(ValueError, match=re.escape(message)):
        call(Ledger())  # type: ignore[operator]


def test_recording_outside_a_world_is_empty_and_harmless() -> None:
    with meshsim.record() as ledger:
        torch.ones(2).sum()
    assert ledger.calls == []
