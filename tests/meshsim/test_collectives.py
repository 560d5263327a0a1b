"""Every collective on the simulated backend, against a single-process reference.

Each rank's input is a deterministic function of its rank, so the reference is
computed in the test's own thread from all ranks' inputs, with plain torch ops
applied one rank after another (not with meshsim's own reduction code).
"""

from __future__ import annotations

import functools
import operator

import pytest
import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
from torch.distributed.distributed_c10d import _coalescing_manager

import meshsim

WS = 3  # odd, so that nothing works by symmetry by accident

FLOATS = [torch.float32, torch.float64, torch.bfloat16, torch.float16]
INTS = [torch.int8, torch.uint8, torch.int32, torch.int64]
ALL_DTYPES = [*FLOATS, torch.complex64, *INTS, torch.bool]


def data(rank: int, dtype: torch.dtype, n: int = 6, salt: int = 0) -> torch.Tensor:
    """Rank ``rank``'s input: small exact values, different on every rank."""
    base = torch.arange(n, dtype=torch.int64) + 3 * rank + salt
    if dtype == torch.bool:
        return (base % 3) == 0
    if dtype.is_complex:
        return torch.complex(base.float(), (base % 4).float()).to(dtype)
    if dtype in (torch.int8, torch.uint8):
        return (base % 5 + 1).to(dtype)
    if dtype.is_floating_point:
        return (base.to(torch.float64) / 2).to(dtype)
    return (base - 4).to(dtype)


_ELEMENTWISE = {
    "SUM": operator.add,
    "PRODUCT": operator.mul,
    "MIN": torch.minimum,
    "MAX": torch.maximum,
    "BAND": operator.and_,
    "BOR": operator.or_,
    "BXOR": operator.xor,
}


def reference_reduce(tensors: list[torch.Tensor], op: str) -> torch.Tensor:
    """Reduce one rank at a time, as the ranks' data would combine on the wire."""
    dtype = tensors[0].dtype
    if dtype == torch.bool and op in ("SUM", "PRODUCT", "MIN", "MAX"):
        op = {"SUM": "BOR", "MAX": "BOR", "PRODUCT": "BAND", "MIN": "BAND"}[op]
    if op == "AVG":
        return (
            functools.reduce(
                operator.add,
                [t.to(torch.float64) if not t.is_complex() else t.to(torch.complex128) for t in tensors],
            )
            / len(tensors)
        ).to(dtype)
    wide = [t.to(torch.float64) if dtype in (torch.bfloat16, torch.float16) else t for t in tensors]
    return functools.reduce(_ELEMENTWISE[op], wide).to(dtype)


def ops_for(dtype: torch.dtype) -> list[str]:
    if dtype == torch.bool:
        return ["SUM", "PRODUCT", "MIN", "MAX", "BAND", "BOR", "BXOR"]
    if dtype.is_complex:
        return ["SUM", "AVG"]  # torch rejects the others for complex tensors
    if dtype.is_floating_point:
        return ["SUM", "AVG", "PRODUCT", "MIN", "MAX"]
    return ["SUM", "PRODUCT", "MIN", "MAX", "BAND", "BOR", "BXOR"]


CASES = [(dtype, op) for dtype in ALL_DTYPES for op in ops_for(dtype)]


def _id(case: tuple[torch.dtype, str]) -> str:
    return f"{str(case[0]).removeprefix('torch.')}-{case[1]}"


def check(actual: torch.Tensor, expected: torch.Tensor) -> None:
    if expected.dtype in (torch.bfloat16, torch.float16):
        torch.testing.assert_close(actual, expected, rtol=1e-2, atol=1e-2)
    else:
        torch.testing.assert_close(actual, expected, rtol=1e-6, atol=1e-6)
    assert actual.dtype == expected.dtype


@pytest.mark.parametrize("case", CASES, ids=[_id(c) for c in CASES])
def test_all_reduce_every_dtype_and_op(case: tuple[torch.dtype, str]) -> None:
    dtype, op = case

    def body() -> torch.Tensor:
        x = data(dist.get_rank(), dtype)
        dist.all_reduce(x, op=getattr(dist.ReduceOp, op))
        return x

    results = meshsim.run(body, WS)
    expected = reference_reduce([data(r, dtype) for r in range(WS)], op)
    for result in results:
        check(result, expected)


@pytest.mark.parametrize("case", CASES, ids=[_id(c) for c in CASES])
def test_all_reduce_on_a_one_rank_group_every_dtype_and_op(case: tuple[torch.dtype, str]) -> None:
    dtype, op = case

    def body() -> torch.Tensor:
        # one group per rank, as a mesh dimension of size 1 gives (every rank makes them all)
        alone = [dist.new_group([r]) for r in range(dist.get_world_size())][dist.get_rank()]
        x = data(dist.get_rank(), dtype)
        dist.all_reduce(x, op=getattr(dist.ReduceOp, op), group=alone)
        return x

    for rank, result in enumerate(meshsim.run(body, 2)):
        check(result, reference_reduce([data(rank, dtype)], op))


@pytest.mark.parametrize("dtype", [*FLOATS, torch.complex64], ids=lambda d: str(d).removeprefix("torch."))
def test_all_reduce_premul_sum_scales_each_rank_by_its_own_factor(dtype: torch.dtype) -> None:
    def body() -> torch.Tensor:
        rank = dist.get_rank()
        x = data(rank, dtype)
        dist.all_reduce(x, op=dist._make_nccl_premul_sum(float(rank + 1)))
        return x

    results = meshsim.run(body, WS)
    expected = reference_reduce([data(r, dtype) * (r + 1) for r in range(WS)], "SUM")
    for result in results:
        check(result, expected)


@pytest.mark.parametrize("dtype", [torch.int64, torch.bool], ids=["int64", "bool"])
@pytest.mark.parametrize("op", ["AVG", "PREMUL_SUM"])
def test_all_reduce_rejects_average_of_integers(dtype: torch.dtype, op: str) -> None:
    reduce_op = dist.ReduceOp.AVG if op == "AVG" else dist._make_nccl_premul_sum(2.0)

    def body() -> None:
        dist.all_reduce(data(dist.get_rank(), dtype), op=reduce_op)

    with pytest.raises(meshsim.RankError) as info:
        meshsim.run(body, 2)
    assert isinstance(info.value.__cause__, ValueError)
    assert f"ReduceOp.{op} needs a floating point or complex tensor, got {dtype}" in str(info.value.__cause__)


def test_a_synchronous_call_gets_a_completed_work() -> None:
    # What dist.all_reduce(async_op=False) gets back from the backend, and what C++ would.
    def body() -> tuple[bool, bool, bool, list[torch.Tensor], list[float]]:
        x = torch.full((3,), float(dist.get_rank()))
        opts = dist.AllreduceOptions()
        opts.asyncOp = False
        work = dist.group.WORLD.allreduce([x], opts)  # type: ignore[union-attr]
        future = work.get_future()
        return work.is_completed(), work.is_success(), work.wait(), future.wait(), x.tolist()

    total = float(sum(range(WS)))
    assert meshsim.run(body, WS) == [(True, True, True, [], [total] * 3)] * WS


def test_all_reduce_async_wait_and_coalesced() -> None:
    def body() -> list[torch.Tensor]:
        rank = dist.get_rank()
        a, b = data(rank, torch.float32), data(rank, torch.int64, salt=1)
        work = dist.all_reduce(a, async_op=True)
        work.wait()
        c, d = data(rank, torch.float32, salt=2), data(rank, torch.float32, n=3, salt=3)
        dist.all_reduce_coalesced([c, d])
        with _coalescing_manager():
            dist.all_reduce(b)
        return [a, b, c, d]

    results = meshsim.run(body, WS)
    expected = [
        reference_reduce([data(r, torch.float32) for r in range(WS)], "SUM"),
        reference_reduce([data(r, torch.int64, salt=1) for r in range(WS)], "SUM"),
        reference_reduce([data(r, torch.float32, salt=2) for r in range(WS)], "SUM"),
        reference_reduce([data(r, torch.float32, n=3, salt=3) for r in range(WS)], "SUM"),
    ]
    for result in results:
        for got, want in zip(result, expected):
            check(got, want)


@pytest.mark.parametrize("dtype", ALL_DTYPES, ids=lambda d: str(d).removeprefix("torch."))
def test_broadcast_and_reduce(dtype: torch.dtype) -> None:
    op = {torch.bool: "BOR", torch.complex64: "SUM"}.get(dtype, "MAX")

    def body() -> tuple[torch.Tensor, torch.Tensor]:
        rank = dist.get_rank()
        x = data(rank, dtype)
        dist.broadcast(x, src=2)
        y = data(rank, dtype, salt=5)
        dist.reduce(y, dst=1, op=getattr(dist.ReduceOp, op))
        return x, y

    results = meshsim.run(body, WS)
    reduced = reference_reduce([data(r, dtype, salt=5) for r in range(WS)], op)
    for rank, (x, y) in enumerate(results):
        check(x, data(2, dtype))
        check(y, reduced if rank == 1 else data(rank, dtype, salt=5))


@pytest.mark.parametrize("dtype", ALL_DTYPES, ids=lambda d: str(d).removeprefix("torch."))
def test_all_gather_forms(dtype: torch.dtype) -> None:
    def body() -> tuple[list[torch.Tensor], torch.Tensor, torch.Tensor]:
        rank = dist.get_rank()
        x = data(rank, dtype)
        listed = [torch.zeros(6, dtype=dtype) for _ in range(WS)]
        dist.all_gather(listed, x)
        flat = torch.zeros(6 * WS, dtype=dtype)
        dist.all_gather_into_tensor(flat, x)
        stacked = torch.zeros(WS, 6, dtype=dtype)
        dist.all_gather_into_tensor(stacked, x)
        return listed, flat, stacked

    everyone = [data(r, dtype) for r in range(WS)]
    for listed, flat, stacked in meshsim.run(body, WS):
        for got, want in zip(listed, everyone):
            check(got, want)
        check(flat, torch.cat(everyone))
        check(stacked, torch.stack(everyone))


def test_all_gather_list_with_uneven_sizes() -> None:
    def body() -> list[torch.Tensor]:
        rank = dist.get_rank()
        x = data(rank, torch.float32, n=rank + 1)
        out = [torch.zeros(r + 1) for r in range(WS)]
        dist.all_gather(out, x)
        return out

    for out in meshsim.run(body, WS):
        for r, got in enumerate(out):
            check(got, data(r, torch.float32, n=r + 1))


@pytest.mark.parametrize("case", [c for c in CASES if c[1] in ("SUM", "AVG", "MAX")], ids=_id)
def test_reduce_scatter_forms(case: tuple[torch.dtype, str]) -> None:
    dtype, op = case

    def body() -> tuple[torch.Tensor, torch.Tensor]:
        rank = dist.get_rank()
        pieces = [data(rank, dtype, n=4, salt=10 * r) for r in range(WS)]
        out = torch.zeros(4, dtype=dtype)
        dist.reduce_scatter(out, pieces, op=getattr(dist.ReduceOp, op))
        out2 = torch.zeros(4, dtype=dtype)
        dist.reduce_scatter_tensor(out2, torch.cat(pieces), op=getattr(dist.ReduceOp, op))
        return out, out2

    for rank, (out, out2) in enumerate(meshsim.run(body, WS)):
        want = reference_reduce([data(s, dtype, n=4, salt=10 * rank) for s in range(WS)], op)
        check(out, want)
        check(out2, want)


def test_all_to_all_even_uneven_and_list() -> None:
    def body() -> tuple[torch.Tensor, torch.Tensor, list[torch.Tensor]]:
        rank = dist.get_rank()
        even_in = torch.arange(2 * WS, dtype=torch.float32) + 100 * rank
        even_out = torch.zeros(2 * WS)
        dist.all_to_all_single(even_out, even_in)
        # rank r sends (dst + 1) rows to dst; so it receives (r + 1) rows from everyone
        in_splits = [d + 1 for d in range(WS)]
        out_splits = [rank + 1] * WS
        uneven_in = torch.arange(sum(in_splits) * 2, dtype=torch.float32).reshape(-1, 2) + 100 * rank
        uneven_out = torch.zeros(sum(out_splits), 2)
        dist.all_to_all_single(uneven_out, uneven_in, out_splits, in_splits)
        sent = [torch.full((d + 1,), float(10 * rank + d)) for d in range(WS)]
        got = [torch.zeros(rank + 1) for _ in range(WS)]
        dist.all_to_all(got, sent)
        return even_out, uneven_out, got

    results = meshsim.run(body, WS)
    for rank, (even, uneven, got) in enumerate(results):
        want_even = torch.cat(
            [torch.arange(2 * WS, dtype=torch.float32)[2 * rank : 2 * rank + 2] + 100 * s for s in range(WS)]
        )
        check(even, want_even)
        starts = [sum(d + 1 for d in range(rank))] * WS
        want_uneven = torch.cat(
            [
                (
                    torch.arange(sum(d + 1 for d in range(WS)) * 2, dtype=torch.float32).reshape(-1, 2)
                    + 100 * s
                )[starts[s] : starts[s] + rank + 1]
                for s in range(WS)
            ]
        )
        check(uneven, want_uneven)
        for s, piece in enumerate(got):
            check(piece, torch.full((rank + 1,), float(10 * s + rank)))


def test_scatter_gather_barrier() -> None:
    def body() -> tuple[torch.Tensor, list[torch.Tensor] | None]:
        rank = dist.get_rank()
        out = torch.zeros(3, dtype=torch.int32)
        pieces = [torch.full((3,), 7 * r, dtype=torch.int32) for r in range(WS)] if rank == 1 else None
        dist.scatter(out, pieces, src=1)
        dist.barrier()
        gathered = [torch.zeros(3, dtype=torch.int32) for _ in range(WS)] if rank == 2 else None
        dist.gather(out + rank, gathered, dst=2)
        return out, gathered

    for rank, (out, gathered) in enumerate(meshsim.run(body, WS)):
        assert torch.equal(out, torch.full((3,), 7 * rank, dtype=torch.int32))
        if rank == 2:
            assert gathered is not None
            assert [g.tolist() for g in gathered] == [[8 * r] * 3 for r in range(WS)]
        else:
            assert gathered is None


def test_coalescing_manager_gathers_and_scatters() -> None:
    def body() -> list[torch.Tensor]:
        rank = dist.get_rank()
        a_out, b_out = torch.zeros(2 * WS), torch.zeros(3 * WS)
        with _coalescing_manager():
            dist.all_gather_into_tensor(a_out, torch.full((2,), float(rank)))
            dist.all_gather_into_tensor(b_out, torch.full((3,), float(rank + 10)))
        c_out = torch.zeros(2)
        with _coalescing_manager():
            dist.reduce_scatter_tensor(c_out, torch.arange(2.0 * WS))
        return [a_out, b_out, c_out]

    for rank, (a, b, c) in enumerate(meshsim.run(body, WS)):
        check(a, torch.tensor([float(r) for r in range(WS) for _ in range(2)]))
        check(b, torch.tensor([float(r + 10) for r in range(WS) for _ in range(3)]))
        check(c, torch.arange(2.0 * WS)[2 * rank : 2 * rank + 2] * WS)


def test_object_collectives() -> None:
    def body() -> tuple[list[object], list[object], list[object] | None, list[object]]:
        rank = dist.get_rank()
        gathered: list[object] = [None] * WS
        dist.all_gather_object(gathered, {"rank": rank, "text": "x" * rank})
        objs: list[object] = [f"from {rank}", rank] if rank == 1 else [None, None]
        dist.broadcast_object_list(objs, src=1)
        to_root: list[object] | None = [None] * WS if rank == 0 else None
        dist.gather_object(("g", rank), to_root, dst=0)
        scattered: list[object] = [None]
        dist.scatter_object_list(scattered, [f"s{r}" for r in range(WS)] if rank == 2 else None, src=2)
        return gathered, objs, to_root, scattered

    for rank, (gathered, objs, to_root, scattered) in enumerate(meshsim.run(body, WS)):
        assert gathered == [{"rank": r, "text": "x" * r} for r in range(WS)]
        assert objs == ["from 1", 1]
        assert to_root == ([("g", r) for r in range(WS)] if rank == 0 else None)
        assert scattered == [f"s{rank}"]


def test_point_to_point() -> None:
    def body() -> tuple[torch.Tensor, list[torch.Tensor], torch.Tensor, int]:
        rank = dist.get_rank()
        nxt, prv = (rank + 1) % WS, (rank - 1) % WS
        # blocking ring: even ranks send first, odd ranks receive first
        got = torch.zeros(2)
        if rank % 2 == 0:
            dist.send(torch.full((2,), float(rank)), nxt)
            dist.recv(got, prv)
        else:
            dist.recv(got, prv)
            dist.send(torch.full((2,), float(rank)), nxt)
        # irecv posted before the matching isend, in a batch
        ring = torch.zeros(3)
        ops = [
            dist.P2POp(dist.irecv, ring, prv),
            dist.P2POp(dist.isend, torch.full((3,), float(10 + rank)), nxt),
        ]
        works = dist.batch_isend_irecv(ops)
        for w in works:
            w.wait()
        # receive from any source
        anything = torch.zeros(1)
        source = -1
        if rank == 0:
            source = dist.recv(anything)
        elif rank == 2:
            dist.send(torch.tensor([42.0]), 0)
        return got, [ring], anything, source

    results = meshsim.run(body, WS)
    for rank, (got, (ring,), anything, source) in enumerate(results):
        prv = (rank - 1) % WS
        check(got, torch.full((2,), float(prv)))
        check(ring, torch.full((3,), float(10 + prv)))
        if rank == 0:
            assert source == 2
            check(anything, torch.tensor([42.0]))


def test_functional_collectives() -> None:
    def body() -> list[torch.Tensor]:
        rank = dist.get_rank()
        group = dist.group.WORLD
        x = torch.arange(4.0) + rank
        gathered = funcol.all_gather_tensor(x, 0, group).wait()
        reduced = funcol.all_reduce(x, "sum", group).wait()
        scattered = funcol.reduce_scatter_tensor(torch.arange(3.0 * WS), "sum", 0, group).wait()
        swapped = funcol.all_to_all_single(
            torch.arange(float(WS)) + 10 * rank, [1] * WS, [1] * WS, group
        ).wait()
        broadcast = funcol.broadcast(x, 1, group).wait()
        return [gathered, reduced, scattered, swapped, broadcast]

    for rank, (gathered, reduced, scattered, swapped, broadcast) in enumerate(meshsim.run(body, WS)):
        everyone = [torch.arange(4.0) + r for r in range(WS)]
        check(gathered, torch.cat(everyone))
        check(reduced, sum(everyone))
        check(scattered, torch.arange(3.0 * WS)[3 * rank : 3 * rank + 3] * WS)
        check(swapped, torch.tensor([float(rank + 10 * s) for s in range(WS)]))
        check(broadcast, everyone[1])


def test_new_group_and_meshes_with_sub_groups() -> None:
    from torch.distributed.device_mesh import init_device_mesh

    def body() -> dict[str, object]:
        rank = dist.get_rank()
        evens = dist.new_group([0, 2, 4, 6])
        x = torch.tensor([float(rank)])
        if rank % 2 == 0:
            dist.all_reduce(x, group=evens)
        mesh2 = init_device_mesh("cpu", (2, 4), mesh_dim_names=("dp", "tp"))
        mesh3 = init_device_mesh("cpu", (2, 2, 2), mesh_dim_names=("a", "b", "c"))
        sums = {}
        for name, mesh in (
            ("dp", mesh2["dp"]),
            ("tp", mesh2["tp"]),
            ("a", mesh3["a"]),
            ("b", mesh3["b"]),
            ("c", mesh3["c"]),
        ):
            t = torch.tensor([float(rank)])
            dist.all_reduce(t, group=mesh.get_group())
            sums[name] = (t.item(), tuple(dist.get_process_group_ranks(mesh.get_group())))
        return {"evens": x.item(), **sums}

    for rank, out in enumerate(meshsim.run(body, 8)):
        if rank % 2 == 0:
            assert out["evens"] == 12.0
        for name in ("dp", "tp", "a", "b", "c"):
            total, members = out[name]  # type: ignore[misc]
            assert rank in members
            assert total == float(sum(members))
        assert out["tp"][1] == tuple(range(4 * (rank // 4), 4 * (rank // 4) + 4))  # type: ignore[index]
        assert out["dp"][1] == (rank % 4, rank % 4 + 4)  # type: ignore[index]


@pytest.mark.parametrize("world_size", [1, 2, 5])
def test_world_sizes_and_rank_identity(world_size: int) -> None:
    import ctypes
    import os

    libc = ctypes.CDLL(None)
    libc.getenv.restype = ctypes.c_char_p

    def body() -> tuple[int, int, str, str, list[bytes | None]]:
        seen = []
        for _ in range(3):  # each hand-over swaps RANK and LOCAL_RANK, for C code too
            seen += [libc.getenv(b"RANK"), libc.getenv(b"LOCAL_RANK"), libc.getenv(b"WORLD_SIZE")]
            dist.barrier()
        return dist.get_rank(), dist.get_world_size(), os.environ["RANK"], os.environ["WORLD_SIZE"], seen

    assert meshsim.run(body, world_size) == [
        (
            r,
            world_size,
            str(r),
            str(world_size),
            [str(r).encode(), str(r).encode(), str(world_size).encode()] * 3,
        )
        for r in range(world_size)
    ]


def test_256_ranks_all_reduce() -> None:
    def body() -> float:
        x = torch.ones(2)
        dist.all_reduce(x)
        return x.sum().item()

    assert meshsim.run(body, 256) == [512.0] * 256


def test_args_and_kwargs_reach_every_rank() -> None:
    def body(a: int, *, b: str) -> tuple[int, int, str]:
        return dist.get_rank(), a, b

    assert meshsim.run(body, 2, args=(7,), kwargs={"b": "x"}) == [(0, 7, "x"), (1, 7, "x")]


def test_free_running_mode_gives_the_same_results() -> None:
    def body() -> list[float]:
        x = torch.arange(4.0) + dist.get_rank()
        dist.all_reduce(x)
        out = torch.zeros(8)
        dist.all_gather_into_tensor(out, x[:2].contiguous())
        return out.tolist()

    assert meshsim.run(body, 4, serialize=False) == meshsim.run(body, 4)
