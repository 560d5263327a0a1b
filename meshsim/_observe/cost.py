"""What a ledger's collectives would cost on GPUs: an NCCL-like latency-bandwidth model.

:func:`estimate` prices one :class:`~meshsim.Collective` on a
:class:`~meshsim.Topology` from the fields the ledger records (op, group, bytes in
and out, root or peer) as ``latency + bandwidth``:

- latency: the topology's ``base_latency`` + the steps inside a node x
  ``intra_latency`` + the steps that cross nodes x ``inter_latency``;
- bandwidth: the bytes x the algorithm's factor / the bandwidth of the group's
  slowest hop.

With ``n`` ranks on ``k`` nodes, ``m`` the fewest of them on one node and ``M`` the
most, ``S`` the call's bytes (below), the algorithms are NCCL's:

======================== ==================== ====================== ================ =======
op                       algorithm            steps (in + across)    bytes factor     link
======================== ==================== ====================== ================ =======
all_reduce               ring                 2(n-k) + 2(k-1)        2(n-1)/n         ring
all_reduce               tree                 2 lg(M) + 2 lg(k)      2                ring
all_gather, reduce_sc.   ring                 (n-k) + (k-1)          (n-1)/n          ring
broadcast, reduce        ring (a chain)       (n-k) + (k-1)          1                ring
all_to_all               pairwise exchange    (m-1) + (n-m)          see below        NIC
scatter, gather          pairwise from root   (r-1) + (n-r)          see below        NIC
send, recv               direct               1                      1                the pair's
barrier                  all_reduce of 4 B    as all_reduce
======================== ==================== ====================== ================ =======

``lg(j)`` is ``ceil(log2(j))``, the depth of a binary tree over ``j`` members. all_reduce
takes whichever of ring and tree has the lower total, as NCCL's tuner does with its
own model; ties go to the ring. NCCL's tree chains the ranks inside a node, but on
NVSwitch systems it reduces small messages in the switch (NVLS) in fewer steps still;
the model's tree is binary inside nodes too, a stand-in for both, so that a call on
one node never costs more than the same call spread over several.

Links: inside one node every hop is ``intra_bandwidth``. A ring or tree that spans
nodes is bound by its network hops, but NCCL runs one ring per NIC, so a node's ``m``
GPUs drive ``m`` NICs at once: ``min(intra_bandwidth, m x inter_bandwidth)`` (the
2-node nccl-tests results in NVIDIA/nccl-tests#119 and NVIDIA/nccl#1048 reach the
node's whole NIC bandwidth). An exchange cannot share NICs ("Alltoall cannot aggregate
the bandwidth of multiple NICs", NVIDIA/nccl-tests#267): each GPU sends its off-node
share, ``(n-m)/n x S``, through its own NIC (``inter_bandwidth``) while its on-node
share, ``(m-1)/n x S``, goes over ``intra_bandwidth``; the slower of the two is the
bandwidth term (in one node: ``(n-1)/n x S / intra_bandwidth``). A rooted scatter or
gather is the same exchange seen from the root, with ``r`` the group's ranks on the
root's node.

Bytes ``S``: all_reduce and reduce ``bytes_in``; all_gather ``bytes_out`` (the whole
gathered buffer); reduce_scatter ``bytes_in`` (the whole input); all_to_all and
broadcast the larger of in and out (what the rank sends or receives); scatter the
root's ``bytes_in`` (another rank's ``bytes_out`` x n); gather the root's
``bytes_out`` (another rank's ``bytes_in`` x n); send ``bytes_in``, recv ``bytes_out``.

What the model ignores: congestion between groups that run at once, overlap with
compute, in-switch reductions (SHARP, NVLS), NCCL's protocol switch points (it takes
the LL protocol's latency and the Simple protocol's bandwidth at once, so mid-size
calls come out optimistic), channel counts and chunking, and everything on the host:
kernel launches, Python, synchronisations that wait for the GPU.

The model is swappable: a :class:`CostModel` is any callable ``(call, topology, *,
rank) -> Estimate``; set it as ``Topology.model`` or pass ``model=`` here.
:func:`critical_path` lays every rank's ledger out on one estimated GPU clock.
"""

from __future__ import annotations

import math
import re
import sys
from collections import Counter
from collections.abc import Hashable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Protocol, cast

from meshsim._observe.topology import Topology, resolve
from meshsim._record.ledger import Collective, Ledger, Pricing, install_pricing

__all__ = [
    "CostModel",
    "Estimate",
    "Schedule",
    "Span",
    "critical_path",
    "estimate",
    "format_seconds",
    "message_bytes",
    "nccl_model",
    "parse_seconds",
    "table_column",
    "total",
]

# torch's ProcessGroupNCCL implements barrier as an all_reduce of one float32
BARRIER_BYTES = 4


@dataclass(frozen=True)
class Estimate:
    """What one call would cost on a topology.

    Attributes:
        seconds: the whole estimate, ``latency + bandwidth`` for meshsim's model.
        latency: the part that does not grow with the bytes.
        bandwidth: the part that does.
        algorithm: what the model priced, e.g. ``"ring"``, ``"tree"``, ``"pairwise"``.
    """

    seconds: float
    latency: float
    bandwidth: float
    algorithm: str

    def __str__(self) -> str:
        return (
            f"{self.algorithm} {format_seconds(self.seconds)} (latency {format_seconds(self.latency)}"
            f" + bandwidth {format_seconds(self.bandwidth)})"
        )


class CostModel(Protocol):
    """Prices one ledger entry on a topology; :func:`nccl_model` is meshsim's."""

    def __call__(self, call: Collective, topology: Topology, /, *, rank: int | None = None) -> Estimate:
        """The estimate for ``call``, as seen from global rank ``rank`` where known."""
        ...


def estimate(
    call: Collective, topology: Topology | str, *, rank: int | None = None, model: CostModel | None = None
) -> Estimate:
    """What ``call`` would cost on ``topology``.

    Args:
        call: a ledger entry.
        topology: a :class:`~meshsim.Topology` or a preset name (``"dgx-h100"``, ...).

    Keyword args:
        rank: the global rank that recorded ``call``; only a send or recv in a group of
            more than two ranks needs it (the record names the other end only). Without
            it such a call is priced on the slowest hop it could take.
        model: the cost model; by default the topology's own (``Topology.model``), else
            :func:`nccl_model`.

    Returns:
        an :class:`Estimate`.

    Raises:
        ValueError: an unknown preset name, an op the model does not know, a ``rank``
            outside the call's group, or a rank the topology's mapping does not cover.
        TypeError: ``topology`` is neither a Topology nor a string.
    """
    topo = resolve(topology)
    if rank is not None and rank not in call.group:
        raise ValueError(f"rank {rank!r} is not in the call's group {list(call.group)}: {call}")
    price = model or topo.model or nccl_model
    return price(call, topo, rank=rank)


def message_bytes(call: Collective) -> int:
    """The bytes ``S`` the model prices ``call`` on (see the module's docstring).

    Raises:
        ValueError: an op the model does not know.
    """
    op, n = call.op, len(call.group)
    if op in ("all_reduce", "reduce", "reduce_scatter", "send"):
        return call.bytes_in
    if op in ("all_gather", "recv"):
        return call.bytes_out
    if op in ("all_to_all", "broadcast"):
        return max(call.bytes_in, call.bytes_out)
    if op == "scatter":
        return call.bytes_in or call.bytes_out * n
    if op == "gather":
        return call.bytes_out or call.bytes_in * n
    if op == "barrier":
        return BARRIER_BYTES
    raise ValueError(f"the cost model does not know op {op!r} (in {call})")


@dataclass(frozen=True)
class _Group:
    """How a group sits on the topology."""

    size: int  # n
    nodes: int  # k
    fewest: int  # m: the fewest of the group's ranks on one node
    most: int  # M: the most


def _group(topo: Topology, ranks: Sequence[int]) -> _Group:
    per_node = Counter(topo.node(r) for r in ranks)
    return _Group(len(ranks), len(per_node), min(per_node.values()), max(per_node.values()))


def nccl_model(call: Collective, topology: Topology, /, *, rank: int | None = None) -> Estimate:
    """meshsim's cost model: NCCL's algorithms on a latency-bandwidth model (module docstring).

    Args:
        call: a ledger entry.
        topology: where it runs.

    Keyword args:
        rank: the global rank that recorded ``call``, where known.

    Returns:
        an :class:`Estimate`.

    Raises:
        ValueError: an op the model does not know, or a rank the topology does not map.
    """
    size = message_bytes(call)
    if len(call.group) < 2:
        return Estimate(0.0, 0.0, 0.0, "local")  # nothing crosses a link
    if call.op in ("send", "recv"):
        return _direct(topology, call, size, rank)
    group = _group(topology, call.group)
    if call.op in ("all_reduce", "barrier"):
        return _all_reduce(topology, group, size)
    if call.op in ("all_gather", "reduce_scatter"):
        return _ring(topology, group, size, (group.size - 1) / group.size)
    if call.op in ("broadcast", "reduce"):
        return _ring(topology, group, size, 1.0)
    if call.op == "all_to_all":
        return _exchange(topology, group, size, group.fewest, "pairwise")
    local = _root_local(topology, call, group)
    return _exchange(topology, group, size, local, "pairwise from the root")


def _latency(topo: Topology, inside: int, across: int) -> float:
    return topo.base_latency + inside * topo.intra_latency + across * topo.inter_latency


def _ring_bandwidth(topo: Topology, group: _Group) -> float:
    """A ring's or tree's bytes per second: the network hops, one ring per NIC of a node."""
    if group.nodes == 1:
        return topo.intra_bandwidth
    return min(topo.intra_bandwidth, group.fewest * topo.inter_bandwidth)


def _ring(topo: Topology, group: _Group, size: int, factor: float, rounds: int = 1) -> Estimate:
    """``rounds`` passes of ``n - 1`` steps around a ring, ``k - 1`` of them across nodes."""
    across = rounds * (group.nodes - 1)
    inside = rounds * (group.size - 1) - across
    latency = _latency(topo, inside, across)
    bandwidth = factor * size / _ring_bandwidth(topo, group)
    return Estimate(latency + bandwidth, latency, bandwidth, "ring")


def _all_reduce(topo: Topology, group: _Group, size: int) -> Estimate:
    n = group.size
    ring = _ring(topo, group, size, 2 * (n - 1) / n, rounds=2)
    latency = _latency(topo, 2 * _depth(group.most), 2 * _depth(group.nodes))
    bandwidth = 2 * size / _ring_bandwidth(topo, group)
    tree = Estimate(latency + bandwidth, latency, bandwidth, "tree")
    return tree if tree.seconds < ring.seconds else ring


def _depth(members: int) -> int:
    """The steps from the leaves to the root of a binary tree over ``members``: ceil(log2)."""
    return (members - 1).bit_length()


def _exchange(topo: Topology, group: _Group, size: int, local: int, algorithm: str) -> Estimate:
    """One step per peer; ``local`` of the ``n`` ranks (this one included) share its node."""
    n = group.size
    latency = _latency(topo, local - 1, n - local)
    inside = (local - 1) / n * size / topo.intra_bandwidth
    across = (n - local) / n * size / topo.inter_bandwidth
    bandwidth = max(inside, across)  # the two run at once, on different links
    return Estimate(latency + bandwidth, latency, bandwidth, algorithm)


def _root_local(topo: Topology, call: Collective, group: _Group) -> int:
    """The group's ranks on the root's node (the fewest on any node if the root is unknown)."""
    if call.peer is None:
        return group.fewest
    root_node = topo.node(call.peer)
    return sum(1 for r in call.group if topo.node(r) == root_node)


def _direct(topo: Topology, call: Collective, size: int, rank: int | None) -> Estimate:
    """A send or recv: one step on the pair's link (the slowest it could be, if unsure)."""
    if rank is not None:
        ends = [rank]
    else:  # the record names the other end only: any other rank of the group could be this one
        ends = [r for r in call.group if r != call.peer]
    peers = list(call.group) if call.peer is None else [call.peer]
    crosses = any(topo.node(a) != topo.node(b) for a in ends for b in peers if a != b)
    inside, across = (0, 1) if crosses else (1, 0)
    latency = _latency(topo, inside, across)
    bandwidth = size / (topo.inter_bandwidth if crosses else topo.intra_bandwidth)
    return Estimate(latency + bandwidth, latency, bandwidth, "direct")


def total(calls: Iterable[Collective], topology: Topology | str, *, rank: int | None = None) -> float:
    """Seconds ``calls`` would take one after another on ``topology`` (see :func:`estimate`)."""
    topo = resolve(topology)
    return sum(estimate(c, topo, rank=rank).seconds for c in calls)


def table_column(
    calls: Sequence[Collective], topology: Topology | str, *, rank: int | None = None
) -> tuple[list[str], str]:
    """A ledger table's ``estimate`` cells and the clause its total line ends with."""
    topo = resolve(topology)
    seconds = [estimate(c, topo, rank=rank).seconds for c in calls]
    return [format_seconds(s) for s in seconds], f", estimated {format_seconds(sum(seconds))} on {topo.name}"


def format_seconds(seconds: float) -> str:
    """``12.3 us``, ``1.234 ms`` or ``1.234 s``: a table's time column."""
    if seconds < 1e-3:
        return f"{seconds * 1e6:.1f} us"
    if seconds < 1.0:
        return f"{seconds * 1e3:.3f} ms"
    return f"{seconds:.3f} s"


_DURATION = re.compile(r"([0-9]*\.?[0-9]+(?:[eE][-+]?[0-9]+)?)\s*(us|ms|s)?")
_UNITS = {"us": 1e-6, "ms": 1e-3, "s": 1.0, None: 1.0}


def parse_seconds(text: str) -> float:
    """A duration as :func:`format_seconds` writes it (``12.3 us``, ``1.234 ms``) or as a
    user types it (``0.002``, ``2ms``, ``500us``), in seconds; a bare number is seconds.

    Raises:
        ValueError: ``text`` is not a duration of 0 or more; the message quotes it.
    """
    match = _DURATION.fullmatch(text.strip()) if isinstance(text, str) else None
    value = float(match.group(1)) * _UNITS[match.group(2)] if match else math.nan
    if not math.isfinite(value):
        raise ValueError(
            f"{text!r} is not a duration; expected seconds of 0 or more, as a number (0.002) "
            "or with a unit: us, ms or s (500us, 2ms, 1.5 s)"
        )
    return value


# -- every rank's ledger on one clock ------------------------------------------------------


@dataclass(frozen=True)
class Span:
    """One call of one rank on the estimated GPU clock.

    Attributes:
        rank: the global rank.
        call: its ledger entry.
        start: seconds from the start when the last rank of the call could start it.
        end: when the call ends for every rank in it (the slowest rank's estimate).
        estimate: this rank's own estimate of the call.
    """

    rank: int
    call: Collective
    start: float
    end: float
    estimate: Estimate


@dataclass(frozen=True)
class Schedule:
    """Every rank's calls on one estimated GPU clock, compute taking no time.

    Attributes:
        ranks: the global ranks, ascending.
        spans: each rank's :class:`Span` records, in call order, in the order of ``ranks``.
    """

    ranks: tuple[int, ...]
    spans: tuple[tuple[Span, ...], ...]

    @property
    def total(self) -> float:
        """Seconds until the last rank's last call ends: the critical path."""
        return max((self.finish(r) for r in self.ranks), default=0.0)

    def of(self, rank: int) -> tuple[Span, ...]:
        """The spans of global rank ``rank``.

        Raises:
            ValueError: ``rank`` has no ledger in this schedule.
        """
        if rank not in self.ranks:
            raise ValueError(f"rank {rank!r} has no ledger in this schedule; ranks: {list(self.ranks)}")
        return self.spans[self.ranks.index(rank)]

    def finish(self, rank: int) -> float:
        """When global rank ``rank``'s last call ends (0 if it made none)."""
        spans = self.of(rank)
        return spans[-1].end if spans else 0.0


LedgerLike = Ledger | Sequence[Collective]


def critical_path(
    ledgers: Sequence[LedgerLike] | Mapping[int, LedgerLike],
    topology: Topology | str,
    *,
    model: CostModel | None = None,
) -> Schedule:
    """Lay every rank's ledger out on one estimated GPU clock.

    A call starts when the last of its ranks reaches it and ends for all of them at
    that start plus the slowest rank's estimate; compute between calls takes no time.
    Entries of different ranks are the same call when they have the same group and
    ``seq`` (a send and a recv: the same pair, direction and ``seq``); a group's
    calls repeating a ``seq`` (two process groups over the same ranks) are matched in
    order. A recv from any source starts when its own rank reaches it. Sends that can
    only complete in a batch (each rank of a pair sends before it receives, as
    ``batch_isend_irecv`` and pipeline schedules do) are placed when nothing else can
    move: each such send starts when its rank reaches it, and its recv starts no earlier
    and after its own rank's send (a batch overlaps them on GPUs: this is an upper bound).

    Args:
        ledgers: each rank's ledger (or list of entries): a sequence indexed by global
            rank (what :func:`meshsim.run` returns when every rank returns its ledger), or
            a mapping from global rank.
        topology: a :class:`~meshsim.Topology` or a preset name.

    Keyword args:
        model: the cost model; by default the topology's own, else :func:`nccl_model`.

    Returns:
        a :class:`Schedule`; its ``total`` is the critical path in seconds.

    Raises:
        ValueError: a call names a rank with no ledger, or the ledgers do not line up
            (a rank waits for a call another rank never makes); the message names both.
        TypeError: a ledger holds something other than :class:`~meshsim.Collective` records.
    """
    calls = _per_rank(ledgers)
    clock = _Clock(calls, {r: _keys(r, entries) for r, entries in calls.items()}, resolve(topology), model)
    progressed = True
    while progressed:
        progressed = False
        for rank in calls:
            while clock.can_place(rank):
                clock.place(rank)
                progressed = True
        if not progressed:  # stuck: a batch of sends and receives completes together
            progressed = clock.post_sends()
    _check_finished(calls, clock.keys, clock.done)
    ranks = tuple(sorted(calls))
    return Schedule(ranks, tuple(tuple(clock.spans[r]) for r in ranks))


_Key = tuple[Hashable, ...]
_Keys = dict[int, list[tuple[_Key, tuple[int, ...]]]]  # per rank: each call's key and its ranks


def _per_rank(ledgers: Sequence[LedgerLike] | Mapping[int, LedgerLike]) -> dict[int, list[Collective]]:
    items = ledgers.items() if isinstance(ledgers, Mapping) else enumerate(ledgers)
    calls: dict[int, list[Collective]] = {}
    for rank, ledger in items:
        if not isinstance(ledger, Iterable):
            raise TypeError(f"rank {rank}'s ledger is {ledger!r}; expected a meshsim.Ledger or a list")
        entries = list(ledger)
        wrong = [e for e in entries if not isinstance(e, Collective)]
        if wrong:
            raise TypeError(f"rank {rank}'s ledger holds {wrong[0]!r}; expected meshsim.Collective records")
        calls[rank] = entries
    return calls


def _keys(rank: int, entries: list[Collective]) -> list[tuple[_Key, tuple[int, ...]]]:
    """Each entry's identity across ranks and the ranks that take part in it."""
    seen: Counter[_Key] = Counter()
    out = []
    for call in entries:
        if call.op in ("send", "recv") and call.peer is not None:
            pair = (rank, call.peer) if call.op == "send" else (call.peer, rank)
            base: _Key = ("p2p", *pair, call.seq)
            members = tuple(sorted(pair))
        elif call.op == "recv":  # from any source: nothing to match it with
            base, members = ("any", rank, call.seq), (rank,)
        else:
            base, members = ("group", call.group, call.seq), call.group
        out.append(((*base, seen[base]), members))
        seen[base] += 1
    return out


def _ready(rank: int, keys: _Keys, done: dict[int, int]) -> bool:
    key, members = keys[rank][done[rank]]
    for member in members:
        if member not in keys:
            raise ValueError(
                f"rank {rank}'s call #{done[rank]} takes part with rank {member}, which has no ledger; "
                f"give every rank's ledger (ranks given: {sorted(keys)})"
            )
        if not _at(member, key, keys, done):
            return False
    return True


class _Clock:
    """Every rank's ledger being laid out on one clock: how far each rank is, and when it is free."""

    def __init__(
        self,
        calls: dict[int, list[Collective]],
        keys: _Keys,
        topo: Topology,
        model: CostModel | None,
    ) -> None:
        self.calls, self.keys, self.topo, self.model = calls, keys, topo, model
        self.time = dict.fromkeys(calls, 0.0)  # when each rank is free
        self.done = dict.fromkeys(calls, 0)  # how many of each rank's calls are placed
        self.spans: dict[int, list[Span]] = {r: [] for r in calls}
        self.posted: dict[_Key, float] = {}  # sends placed ahead of their recv (a batch): their starts

    def can_place(self, rank: int) -> bool:
        """Whether the call at the head of ``rank``'s ledger can start now."""
        if self.done[rank] >= len(self.calls[rank]):
            return False
        return _ready(rank, self.keys, self.done) or self.keys[rank][self.done[rank]][0] in self.posted

    def place(self, rank: int) -> None:
        """Start the call at the head of ``rank``'s ledger for every rank in it, and end it.

        A recv whose send was posted ahead is placed for its own rank alone.
        """
        key, members = self.keys[rank][self.done[rank]]
        sent = self.posted.pop(key, None)
        if sent is not None:
            members = (rank,)
        start = max([self.time[m] for m in members] + ([sent] if sent is not None else []))
        own = {m: self._estimate(m) for m in members}
        end = start + max(e.seconds for e in own.values())
        for m in members:
            self._add(m, start, end, own[m])

    def post_sends(self) -> bool:
        """Place every stuck send whose recv its peer makes later, each on its own rank; False if none."""
        stuck = []
        for rank, calls in self.calls.items():
            done = self.done[rank]
            if done >= len(calls):
                continue
            call, key = calls[done], self.keys[rank][done][0]
            if call.op != "send" or call.peer is None or call.peer not in self.keys:
                continue
            if any(later == key for later, _ in self.keys[call.peer][self.done[call.peer] :]):
                stuck.append((rank, key))  # else its recv never comes: reported as not lining up
        for rank, key in stuck:
            own = self._estimate(rank)
            self.posted[key] = start = self.time[rank]
            self._add(rank, start, start + own.seconds, own)
        return bool(stuck)

    def _estimate(self, rank: int) -> Estimate:
        return estimate(self.calls[rank][self.done[rank]], self.topo, rank=rank, model=self.model)

    def _add(self, rank: int, start: float, end: float, own: Estimate) -> None:
        self.spans[rank].append(Span(rank, self.calls[rank][self.done[rank]], start, end, own))
        self.time[rank] = end
        self.done[rank] += 1


def _check_finished(
    calls: dict[int, list[Collective]],
    keys: _Keys,
    done: dict[int, int],
) -> None:
    stuck = [r for r in calls if done[r] < len(calls[r])]
    if not stuck:
        return
    lines = []
    for rank in stuck:
        key, members = keys[rank][done[rank]]
        others = [m for m in members if m != rank and not _at(m, key, keys, done)]
        theirs = [_next(m, calls, done) for m in others]
        lines.append(
            f"rank {rank} at #{done[rank]} {calls[rank][done[rank]]}; "
            + "; ".join(f"rank {m} next: {t}" for m, t in zip(others, theirs))
        )
    raise ValueError(
        "the ledgers do not line up: these calls have no partner call on every rank they name "
        "(were the ledgers recorded over the same calls?):\n  " + "\n  ".join(lines)
    )


def _at(rank: int, key: _Key, keys: _Keys, done: dict[int, int]) -> bool:
    pending = keys[rank]
    return done[rank] < len(pending) and pending[done[rank]][0] == key


def _next(rank: int, calls: dict[int, list[Collective]], done: dict[int, int]) -> str:
    if done[rank] >= len(calls[rank]):
        return "nothing (its ledger ends)"
    return f"#{done[rank]} {calls[rank][done[rank]]}"


# The ledger prices itself with this module: it sits below and cannot import it.
install_pricing(cast(Pricing, sys.modules[__name__]))
