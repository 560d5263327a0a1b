"""The cost model: topologies by name, each collective's latency and bandwidth terms, ledger estimates.

The expected terms are written out from the table in ``meshsim/_observe/cost.py``'s
docstring: latency = base + steps inside a node x intra latency + steps across nodes x
inter latency; bandwidth = bytes x the algorithm's factor / the slowest hop's bandwidth.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.distributed as dist
from hypothesis import given
from hypothesis import strategies as st

import meshsim
from meshsim import Collective, Topology
from meshsim._observe import cost
from meshsim._observe.topology import PRESETS

PRESET_NAMES = sorted(PRESETS)
MiB = 1 << 20


def call(
    op: str,
    group: tuple[int, ...] = (0, 1, 2, 3),
    *,
    bytes_in: int = 0,
    bytes_out: int = 0,
    peer: int | None = None,
    seq: int = 0,
) -> Collective:
    dtype = None if op == "barrier" else torch.float32
    return Collective(op, op, group, dtype, bytes_in, bytes_out, None, seq, "test_cost.py:1 in test", peer)


def sized(op: str, size: int, group: tuple[int, ...]) -> Collective:
    """``op`` over ``group`` moving ``size`` bytes as the model counts them, seen from group[0]."""
    n, root, last = len(group), group[0], group[-1]
    shard = size // n
    traffic = {
        "all_reduce": (size, size, None),
        "all_gather": (shard, size, None),
        "reduce_scatter": (size, shard, None),
        "all_to_all": (size, size, None),
        "broadcast": (size, 0, root),
        "reduce": (size, size, root),
        "scatter": (size, shard, root),
        "gather": (shard, size, root),
        "send": (size, 0, last),
        "recv": (0, size, last),
        "barrier": (0, 0, None),
    }
    bytes_in, bytes_out, peer = traffic[op]
    return call(op, group, bytes_in=bytes_in, bytes_out=bytes_out, peer=peer)


OPS = (
    "all_reduce",
    "all_gather",
    "reduce_scatter",
    "all_to_all",
    "broadcast",
    "reduce",
    "scatter",
    "gather",
    "send",
    "recv",
    "barrier",
)

# (gpus_per_node, group size): one node; two full nodes; three uneven nodes (3, 3, 2)
PLACEMENTS = {"one node": (8, 4), "two nodes": (4, 8), "uneven nodes": (3, 8)}


def latency(topo: Topology, inside: int, across: int) -> float:
    return topo.base_latency + inside * topo.intra_latency + across * topo.inter_latency


def ring_link(topo: Topology, nodes: int, fewest: int) -> float:
    if nodes == 1:
        return topo.intra_bandwidth
    return min(topo.intra_bandwidth, fewest * topo.inter_bandwidth)


def lg(j: int) -> int:
    return math.ceil(math.log2(j)) if j > 1 else 0


def expected(op: str, topo: Topology, n: int, size: int) -> tuple[str, float, float]:
    """(algorithm, latency, bandwidth) by the docstring's table, for ranks 0..n-1."""
    per_node = [sum(1 for r in range(n) if r // topo.gpus_per_node == node) for node in range(n)]
    counts = [c for c in per_node if c]
    k, m, most = len(counts), min(counts), max(counts)
    link = ring_link(topo, k, m)
    if op in ("all_reduce", "barrier"):
        size = 4 if op == "barrier" else size
        ring = ("ring", latency(topo, 2 * (n - k), 2 * (k - 1)), 2 * (n - 1) / n * size / link)
        tree = ("tree", latency(topo, 2 * lg(most), 2 * lg(k)), 2 * size / link)
        return tree if sum(tree[1:]) < sum(ring[1:]) else ring
    if op in ("all_gather", "reduce_scatter"):
        return "ring", latency(topo, n - k, k - 1), (n - 1) / n * size / link
    if op in ("broadcast", "reduce"):
        return "ring", latency(topo, n - k, k - 1), size / link
    if op in ("send", "recv"):  # rank 0 and rank n-1: apart whenever the group spans nodes
        if k == 1:
            return "direct", latency(topo, 1, 0), size / topo.intra_bandwidth
        return "direct", latency(topo, 0, 1), size / topo.inter_bandwidth
    local = m if op == "all_to_all" else per_node[0]  # a rooted call: the root's node (rank 0's)
    inside = (local - 1) / n * size / topo.intra_bandwidth
    across = (n - local) / n * size / topo.inter_bandwidth
    name = "pairwise" if op == "all_to_all" else "pairwise from the root"
    return name, latency(topo, local - 1, n - local), max(inside, across)


# -- each collective's terms on each preset -------------------------------------------------


@pytest.mark.parametrize("size", [24, 24 * MiB, 3 << 30], ids=["24B", "24MiB", "3GiB"])
@pytest.mark.parametrize("placement", list(PLACEMENTS))
@pytest.mark.parametrize("op", OPS)
@pytest.mark.parametrize("preset", PRESET_NAMES)
def test_terms_follow_the_documented_steps_and_factors(
    preset: str, op: str, placement: str, size: int
) -> None:
    gpus, n = PLACEMENTS[placement]
    topo = meshsim.topology(preset, gpus_per_node=gpus)
    got = cost.estimate(sized(op, size, tuple(range(n))), topo, rank=0)
    algorithm, lat, bw = expected(op, topo, n, size)
    assert got.algorithm == algorithm
    assert got.latency == pytest.approx(lat, rel=1e-12)
    assert got.bandwidth == pytest.approx(bw, rel=1e-12)
    assert got.seconds == pytest.approx(lat + bw, rel=1e-12)


def test_ring_all_reduce_in_one_dgx_h100_is_2_n_minus_1_over_n_bytes_at_nvlink_speed() -> None:
    got = cost.estimate(sized("all_reduce", 1 << 30, tuple(range(8))), "dgx-h100")
    assert got.algorithm == "ring"
    assert got.bandwidth == pytest.approx(2 * 7 / 8 * (1 << 30) / 450e9, rel=1e-12)
    assert got.latency == pytest.approx(6.6e-6 + 14 * 0.6e-6, rel=1e-12)


def test_small_all_reduces_across_many_nodes_take_the_tree() -> None:
    topo = meshsim.topology("dgx-h100")
    got = cost.estimate(sized("all_reduce", 8, tuple(range(64))), topo)
    assert got.algorithm == "tree"  # 2 lg(8) + 2 lg(8) steps, where the ring takes 126
    assert got.latency == pytest.approx(6.6e-6 + 6 * 0.6e-6 + 6 * 2.7e-6, rel=1e-12)
    # the ring moves 2(n-1)/n of the bytes, the tree 2: at 1 GiB on 16 ranks that outweighs latency
    big = cost.estimate(sized("all_reduce", 1 << 30, tuple(range(16))), topo)
    assert big.algorithm == "ring"


def test_a_ring_across_nodes_runs_one_ring_per_nic_up_to_nvlink_speed() -> None:
    one_nic = cost.estimate(sized("all_gather", 1 << 30, (0, 8)), "dgx-h100")  # a GPU on each node
    eight_nics = cost.estimate(sized("all_gather", 1 << 30, tuple(range(16))), "dgx-h100")
    assert one_nic.bandwidth == pytest.approx(1 / 2 * (1 << 30) / 50e9, rel=1e-12)
    assert eight_nics.bandwidth == pytest.approx(15 / 16 * (1 << 30) / 400e9, rel=1e-12)
    nvl = cost.estimate(sized("all_gather", 1 << 30, tuple(range(144))), "gb200-nvl72")
    assert nvl.bandwidth == pytest.approx(143 / 144 * (1 << 30) / 900e9, rel=1e-12)  # 72 NICs > NVLink


def test_a_group_of_one_costs_nothing() -> None:
    assert cost.estimate(sized("all_reduce", MiB, (3,)), "pcie") == cost.Estimate(0.0, 0.0, 0.0, "local")


def test_scatter_and_gather_off_the_root_count_every_ranks_share() -> None:
    topo = meshsim.topology("dgx-a100")
    at_root = cost.estimate(call("gather", (0, 1, 2, 3), bytes_in=8, bytes_out=32, peer=0), topo)
    elsewhere = cost.estimate(call("gather", (0, 1, 2, 3), bytes_in=8, bytes_out=0, peer=0), topo)
    assert cost.message_bytes(call("gather", bytes_in=8, bytes_out=0, peer=0)) == 32
    assert cost.message_bytes(call("scatter", bytes_in=0, bytes_out=8, peer=0)) == 32
    assert at_root == elsewhere


def test_a_send_is_priced_on_the_pair_it_joins() -> None:
    topo = meshsim.topology("dgx-h100", gpus_per_node=2)
    send = call("send", (0, 1, 2, 3), bytes_in=MiB, peer=1)
    near = cost.estimate(send, topo, rank=0)
    far = cost.estimate(send, topo, rank=3)
    assert near.bandwidth == pytest.approx(MiB / 450e9) and near.latency == pytest.approx(latency(topo, 1, 0))
    assert far.bandwidth == pytest.approx(MiB / 50e9) and far.latency == pytest.approx(latency(topo, 0, 1))
    # without the caller's rank, any of ranks 0, 2, 3 could be this end: the slowest hop
    assert cost.estimate(send, topo) == far


# -- properties ---------------------------------------------------------------------------------

sizes = st.integers(0, 1 << 34)


@given(op=st.sampled_from(OPS), preset=st.sampled_from(PRESET_NAMES), a=sizes, b=sizes, n=st.integers(2, 24))
def test_estimates_grow_with_the_bytes(op: str, preset: str, a: int, b: int, n: int) -> None:
    small, big = sorted((a, b))
    topo = meshsim.topology(preset, gpus_per_node=8)
    group = tuple(range(n))
    low = cost.estimate(sized(op, small * n, group), topo, rank=0)
    high = cost.estimate(sized(op, big * n, group), topo, rank=0)
    assert low.seconds <= high.seconds
    assert low.latency == high.latency or op in ("all_reduce", "barrier")  # only all_reduce switches


@given(
    op=st.sampled_from(OPS), preset=st.sampled_from(PRESET_NAMES), a=st.integers(2, 8), b=st.integers(2, 8)
)
def test_estimates_grow_with_the_group_inside_a_node(op: str, preset: str, a: int, b: int) -> None:
    small, big = sorted((a, b))
    low = cost.estimate(sized(op, 24 * MiB, tuple(range(small))), preset, rank=0)
    high = cost.estimate(sized(op, 24 * MiB, tuple(range(big))), preset, rank=0)
    assert low.seconds <= high.seconds


@given(
    op=st.sampled_from(OPS), preset=st.sampled_from(PRESET_NAMES), a=st.integers(1, 16), b=st.integers(1, 16)
)
def test_estimates_grow_with_the_group_in_whole_nodes(op: str, preset: str, a: int, b: int) -> None:
    # Between the two regimes they need not: 8 ranks on one node, then a 9th alone on a
    # second node (one NIC for the whole ring), then 16 (eight NICs) is faster again.
    small, big = sorted((a, b))
    topo = meshsim.topology(preset, gpus_per_node=4)
    low = cost.estimate(sized(op, 48 * MiB, tuple(range(4 * small))), topo, rank=0)
    high = cost.estimate(sized(op, 48 * MiB, tuple(range(4 * big))), topo, rank=0)
    assert low.seconds <= high.seconds


@pytest.mark.parametrize("size", [8, MiB, 1 << 30], ids=["8B", "1MiB", "1GiB"])
@pytest.mark.parametrize("spread", ["two nodes", "eight nodes"])
@pytest.mark.parametrize("op", OPS)
@pytest.mark.parametrize("preset", PRESET_NAMES)
def test_the_same_call_costs_less_on_one_node(preset: str, op: str, spread: str, size: int) -> None:
    placed = {"two nodes": lambda r: r // 4, "eight nodes": lambda r: r}[spread]
    one_node = meshsim.topology(preset, gpus_per_node=8)
    apart = meshsim.topology(preset, gpus_per_node=8, rank_to_node=placed)
    c = sized(op, size * 8, tuple(range(8)))
    assert cost.estimate(c, one_node, rank=0).seconds < cost.estimate(c, apart, rank=0).seconds


# -- topologies -----------------------------------------------------------------------------------


def test_presets_by_name_and_with_overrides() -> None:
    h100 = meshsim.topology("dgx-h100")
    assert (h100.gpus_per_node, h100.intra_bandwidth, h100.inter_bandwidth) == (8, 450e9, 50e9)
    assert meshsim.topology("gb200-nvl72").gpus_per_node == 72
    half = meshsim.topology("dgx-h100", gpus_per_node=4, inter_bandwidth=25e9, name="half")
    assert (half.name, half.gpus_per_node, half.inter_bandwidth, half.intra_bandwidth) == (
        "half",
        4,
        25e9,
        450e9,
    )
    assert str(h100) == (
        "dgx-h100: 8 GPUs a node; in a node 450 GB/s, 0.6 us a step; between nodes 50 GB/s, "
        "2.7 us a step; 6.6 us a call"
    )


def test_a_custom_topology_from_bandwidths_and_latencies() -> None:
    mine = Topology(
        "mine", 2, intra_bandwidth=100e9, intra_latency=1e-6, inter_bandwidth=10e9, inter_latency=5e-6
    )
    got = cost.estimate(sized("all_gather", 4 * MiB, (0, 1, 2, 3)), mine)
    assert got.latency == pytest.approx(mine.base_latency + 2 * 1e-6 + 1 * 5e-6)
    assert got.bandwidth == pytest.approx(3 / 4 * 4 * MiB / 20e9)  # two NICs a node carry the ring


def test_ranks_sit_on_consecutive_nodes_unless_mapped() -> None:
    topo = meshsim.topology("dgx-a100")
    assert [topo.node(r) for r in (0, 7, 8, 17)] == [0, 0, 1, 2]
    listed = meshsim.topology("dgx-a100", rank_to_node=[1, 0, 1, 0])
    assert [listed.node(r) for r in range(4)] == [1, 0, 1, 0]
    assert listed.rank_to_node == (1, 0, 1, 0)
    striped = meshsim.topology("dgx-a100", rank_to_node=lambda r: r % 2)
    assert [striped.node(r) for r in range(4)] == [0, 1, 0, 1]


@pytest.mark.parametrize(
    ("overrides", "error", "match"),
    [
        ({"intra_bandwidth": 0}, ValueError, r"intra_bandwidth must be a finite number above 0 .*got 0"),
        ({"inter_bandwidth": math.inf}, ValueError, r"inter_bandwidth must be a finite number above 0"),
        (
            {"intra_latency": -1e-6},
            ValueError,
            r"intra_latency must be finite seconds, 0 or more, got -1e-06",
        ),
        ({"inter_latency": math.nan}, ValueError, r"inter_latency must be finite seconds"),
        ({"base_latency": "6us"}, TypeError, r"base_latency must be a number, got '6us'"),
        ({"intra_bandwidth": True}, TypeError, r"intra_bandwidth must be a number, got True"),
        ({"gpus_per_node": 0}, ValueError, r"gpus_per_node must be at least 1, got 0"),
        ({"gpus_per_node": 8.0}, TypeError, r"gpus_per_node must be an int, got 8.0"),
        ({"name": ""}, ValueError, r"a topology's name must be a non-empty string"),
        ({"model": "nccl"}, TypeError, r"model must be a cost model \(a callable\) or None, got 'nccl'"),
        (
            {"rank_to_node": "0011"},
            TypeError,
            r"rank_to_node must be None, a function of the rank or a sequence",
        ),
        ({"rank_to_node": [0, -1]}, ValueError, r"rank_to_node\[1\] must be a node number .*got -1"),
        ({"rank_to_node": [0] * 9}, ValueError, r"puts 9 ranks on node 0, more than gpus_per_node=8"),
        (
            {"nics": 8},
            TypeError,
            r"unexpected keyword\(s\) nics; it takes the fields of meshsim.Topology: name, ",
        ),
    ],
)
def test_bad_topologies_say_what_was_wrong(overrides: dict[str, object], error: type, match: str) -> None:
    with pytest.raises(error, match=match):
        meshsim.topology("dgx-h100", **overrides)  # type: ignore[arg-type]


def test_an_unknown_name_lists_the_known_ones() -> None:
    known = "dgx-a100, dgx-h100, gb200-nvl72, pcie"
    with pytest.raises(ValueError, match=f"unknown topology 'dgx-h200'; known topologies: {known}"):
        meshsim.topology("dgx-h200")
    with pytest.raises(ValueError, match="unknown topology 'dgx'"):
        meshsim.Ledger().estimated_time("dgx")
    with pytest.raises(TypeError, match=rf"expected a meshsim.Topology or a preset name \({known}\), got 8"):
        cost.estimate(call("barrier"), 8)  # type: ignore[arg-type]


def test_a_mapping_that_misses_a_rank_says_which() -> None:
    topo = meshsim.topology("dgx-h100", rank_to_node=[0, 0, 1, 1])
    with pytest.raises(
        ValueError,
        match=r"rank 4 is not in the rank-to-node mapping of topology 'dgx-h100', which covers ranks 0-3",
    ):
        cost.estimate(call("all_reduce", (0, 1, 4, 5), bytes_in=8, bytes_out=8), topo)
    broken = meshsim.topology("dgx-h100", rank_to_node=lambda r: None if r > 2 else 0)  # type: ignore[arg-type, return-value]
    with pytest.raises(ValueError, match=r"rank_to_node\(3\) returned None; it must return a node number"):
        broken.node(3)
    with pytest.raises(ValueError, match=r"a rank is an int of at least 0, got -1"):
        topo.node(-1)


def test_bad_calls_say_what_was_wrong() -> None:
    with pytest.raises(ValueError, match=r"the cost model does not know op 'allreduce'"):
        cost.estimate(call("allreduce"), "pcie")
    with pytest.raises(ValueError, match=r"rank 9 is not in the call's group \[0, 1, 2, 3\]"):
        cost.estimate(call("all_reduce", bytes_in=8, bytes_out=8), "pcie", rank=9)


# -- a model of one's own -------------------------------------------------------------------------


def flat_model(c: Collective, topology: Topology, /, *, rank: int | None = None) -> cost.Estimate:
    return cost.Estimate(1.0, 1.0, 0.0, f"flat on {topology.name}")


def test_the_model_is_swappable_on_the_topology_or_per_call() -> None:
    c = sized("all_reduce", MiB, (0, 1))
    assert c.estimated_time(meshsim.topology("pcie", model=flat_model)) == 1.0
    assert cost.estimate(c, "pcie", model=flat_model).algorithm == "flat on pcie"
    assert cost.estimate(c, "pcie").algorithm == "ring"
    assert cost.estimate(c, "pcie") == cost.nccl_model(c, meshsim.topology("pcie"))


# -- ledgers of a real world ----------------------------------------------------------------------


def program() -> meshsim.Ledger:
    rank = dist.get_rank()
    with meshsim.record() as ledger:
        x = torch.full((1024,), float(rank))  # 4 KiB, different on every rank
        dist.all_reduce(x)
        dist.all_gather_into_tensor(torch.zeros(4 * 1024), x + rank)
        if rank == 0:
            dist.send(torch.full((256,), 1.0), 1)
        if rank == 1:
            dist.recv(torch.zeros(256), 0)
        dist.barrier()
    return ledger


@pytest.fixture(scope="module")
def ledgers() -> list[meshsim.Ledger]:
    return meshsim.run(program, 4)


def test_a_ledger_estimate_is_the_sum_of_its_calls(ledgers: list[meshsim.Ledger]) -> None:
    topo = meshsim.topology("dgx-h100")
    for rank, ledger in enumerate(ledgers):
        each = [c.estimated_time(topo, rank=rank) for c in ledger]
        assert ledger.estimated_time(topo, rank=rank) == pytest.approx(sum(each))
        assert ledger.estimated_time("dgx-h100", rank=rank) == ledger.estimated_time(topo, rank=rank)
    all_reduce = ledgers[2].calls[0]  # 4 KiB on 4 ranks: the tree's 4 steps beat the ring's 6
    assert all_reduce.estimated_time("dgx-h100") == pytest.approx(
        latency(topo, 4, 0) + 2 * 4096 / 450e9, rel=1e-12
    )


def test_the_table_gains_an_estimate_column_only_when_asked(ledgers: list[meshsim.Ledger]) -> None:
    ledger = ledgers[0]
    plain = str(ledger)
    assert plain == ledger.table() and "estimate" not in plain
    priced = ledger.table("gb200-nvl72", rank=0)
    header, *rows = priced.splitlines()[: len(ledger) + 1]
    assert header.split() == ["#", "op", "api", "group", "dtype", "in", "out", "reduce", "estimate", "site"]
    for row, c in zip(rows, ledger):
        assert cost.format_seconds(c.estimated_time("gb200-nvl72", rank=0)) in row
    total = cost.format_seconds(ledger.estimated_time("gb200-nvl72", rank=0))
    assert (
        priced.splitlines()[len(ledger) + 1]
        == f"4 collectives, 20.0 KiB received, estimated {total} on gb200-nvl72"
    )
    assert meshsim.Ledger().table("pcie") == "0 collectives"


def test_the_critical_path_waits_for_the_last_rank_of_each_call(ledgers: list[meshsim.Ledger]) -> None:
    schedule = cost.critical_path(ledgers, "dgx-h100")
    assert schedule.ranks == (0, 1, 2, 3)
    send, recv = schedule.of(0)[2], schedule.of(1)[2]
    assert (send.call.op, recv.call.op) == ("send", "recv")
    assert send.start == recv.start and send.end == recv.end
    barrier_starts = {schedule.of(r)[-1].start for r in schedule.ranks}
    assert barrier_starts == {send.end}  # ranks 2 and 3 wait for the pair
    assert schedule.total == schedule.finish(2) == schedule.of(2)[-1].end
    assert schedule.total > ledgers[2].estimated_time("dgx-h100", rank=2)


# -- the critical path on hand-made ledgers -------------------------------------------------------


def test_a_call_starts_when_its_last_rank_reaches_it() -> None:
    pair = sized("all_reduce", MiB, (0, 1))
    world = sized("all_reduce", MiB, (0, 1, 2))
    schedule = cost.critical_path({0: [pair, world], 1: [pair, world], 2: [world]}, "pcie")
    first = cost.estimate(pair, "pcie").seconds
    assert [s.start for s in schedule.of(2)] == [first]
    assert schedule.total == pytest.approx(first + cost.estimate(world, "pcie").seconds)


def test_a_call_ends_with_its_slowest_rank() -> None:
    light = call("all_to_all", (0, 1), bytes_in=MiB, bytes_out=MiB)
    heavy = call("all_to_all", (0, 1), bytes_in=64 * MiB, bytes_out=MiB)  # uneven splits
    schedule = cost.critical_path([[light], [heavy]], "pcie")
    assert schedule.of(0)[0].end == schedule.of(1)[0].end == cost.estimate(heavy, "pcie").seconds
    assert schedule.of(0)[0].estimate == cost.estimate(light, "pcie")


def test_groups_over_the_same_ranks_repeating_a_seq_match_in_order() -> None:
    a = sized("all_reduce", 8, (0, 1))
    b = sized("all_gather", MiB, (0, 1))  # the second group's seq 0
    schedule = cost.critical_path([[a, b], [a, b]], "dgx-a100")
    assert [s.call.op for s in schedule.of(1)] == ["all_reduce", "all_gather"]


def test_a_recv_from_any_source_starts_on_its_own_clock() -> None:
    anyone = call("recv", (0, 1), bytes_out=8)
    schedule = cost.critical_path([[], [anyone]], "dgx-a100")
    assert schedule.of(1)[0].start == 0.0 and schedule.finish(0) == 0.0


def test_a_batch_where_both_ranks_send_first_is_priced() -> None:
    """batch_isend_irecv, pipeline schedules: each rank of the pair sends, then receives."""
    to_1, to_0 = call("send", (0, 1), bytes_in=MiB, peer=1), call("send", (0, 1), bytes_in=MiB, peer=0)
    from_1, from_0 = call("recv", (0, 1), bytes_out=MiB, peer=1), call("recv", (0, 1), bytes_out=MiB, peer=0)
    schedule = cost.critical_path([[to_1, from_1], [to_0, from_0]], "pcie")
    one = cost.estimate(to_1, "pcie", rank=0).seconds
    for rank in (0, 1):
        send, recv = schedule.of(rank)
        assert (send.start, send.end) == (0.0, one)  # posted as its rank reaches it
        assert recv.start == one and recv.end == 2 * one  # after its own send; its partner's began at 0
    with pytest.raises(ValueError, match="do not line up"):  # a send whose recv never comes still fails
        cost.critical_path([[to_1, from_1], [to_0]], "pcie")


def test_ledgers_that_do_not_line_up_name_the_ranks() -> None:
    mine = sized("all_reduce", 8, (0, 1))
    other = call("all_gather", (0, 1), bytes_in=4, bytes_out=8, seq=3)
    with pytest.raises(
        ValueError, match=r"do not line up(.|\n)*rank 0 at #0 all_reduce(.|\n)*rank 1 next: #0 all_gather"
    ):
        cost.critical_path([[mine], [other]], "pcie")
    with pytest.raises(ValueError, match=r"rank 1 next: nothing \(its ledger ends\)"):
        cost.critical_path([[mine], []], "pcie")
    with pytest.raises(
        ValueError, match=r"takes part with rank 1, which has no ledger; .*ranks given: \[0\]"
    ):
        cost.critical_path({0: [mine]}, "pcie")
    with pytest.raises(TypeError, match=r"rank 0's ledger holds 'x'; expected meshsim.Collective records"):
        cost.critical_path([["x"]], "pcie")  # type: ignore[list-item]
    with pytest.raises(ValueError, match=r"rank 7 has no ledger in this schedule; ranks: \[0\]"):
        cost.critical_path([[]], "pcie").of(7)
