"""Named GPU topologies: how fast the links are that a collective's bytes would cross.

A :class:`Topology` says how many GPUs share a node (one NVLink or PCIe domain), the
bandwidth and per-step latency of the links inside a node and between nodes, which
node each rank sits on, and which cost model prices a call on it (see
:mod:`meshsim._observe.cost`). :func:`topology` returns a preset by name, with any
field overridden; ``Topology(...)`` builds a custom one. Units are SI throughout:
bytes per second and seconds.

Every preset's figures are written beside it with their public source. Bandwidths
are the hardware's peak in one direction, per GPU; measured NCCL bus bandwidths come
out some 10-20% lower (``benchmarks/RESULTS.md`` compares the model with torch's
Inductor estimator). The latencies are NCCL's own tuning constants.

Non-goals: contention between groups that run at once, the switch levels inside a
fabric (every pair of nodes is one hop apart), NICs shared unevenly between GPUs.
"""

from __future__ import annotations

import dataclasses
import math
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from meshsim._observe.cost import CostModel

__all__ = ["PRESETS", "RankToNode", "Topology", "resolve", "topology"]

# rank -> node: a function of the global rank, or a sequence indexed by it
RankToNode = Callable[[int], int] | Sequence[int]

# Latencies shared by the presets: NCCL's tuning constants (NVIDIA/nccl
# src/graph/tuning.cc, the baseLat and hwLat tables; torch 2.13 copies the same figures
# into torch/_inductor/comm_analysis.py). We take the ring algorithm's LL-protocol
# column, NCCL's lowest-latency one: 6.6 us a call, 0.6 us a step over NVLink, 1.0 us
# over PCIe, 2.7 us a step over the network.
_NCCL_BASE = 6.6e-6
_NCCL_NVLINK_STEP = 0.6e-6
_NCCL_PCI_STEP = 1.0e-6
_NCCL_NET_STEP = 2.7e-6

_NUMBERS = ("intra_bandwidth", "intra_latency", "inter_bandwidth", "inter_latency", "base_latency")


@dataclass(frozen=True)
class Topology:
    """GPUs, the nodes they sit in, and the links between them, as a cost model sees them.

    Attributes:
        name: what tables and messages call this topology.
        gpus_per_node: GPUs that share a node's fast fabric (an NVLink domain, or one
            PCIe host). By default ranks ``0 .. g-1`` are node 0, ``g .. 2g-1`` node 1, ...
        intra_bandwidth: bytes per second one GPU sends to the other GPUs of its node,
            in one direction.
        intra_latency: seconds per algorithm step between two GPUs of one node.
        inter_bandwidth: bytes per second one GPU sends off its node (its own share of
            the node's NICs), in one direction.
        inter_latency: seconds per algorithm step that crosses from one node to another.
        base_latency: seconds every collective pays once, whatever its size (NCCL's
            base latency: the kernel's start and the protocol's first handshake);
            NCCL's 6.6 us unless given.
        rank_to_node: the node of each global rank: None (consecutive ranks share a
            node, ``gpus_per_node`` each), a sequence indexed by rank, or a function
            of the rank.
        model: the cost model that prices calls on this topology; None is meshsim's
            NCCL-like model (:func:`meshsim._observe.cost.nccl_model`).
    """

    name: str
    gpus_per_node: int
    intra_bandwidth: float
    intra_latency: float
    inter_bandwidth: float
    inter_latency: float
    base_latency: float = _NCCL_BASE
    rank_to_node: RankToNode | None = None
    model: CostModel | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not self.name:
            raise ValueError(f"a topology's name must be a non-empty string, got {self.name!r}")
        if isinstance(self.gpus_per_node, bool) or not isinstance(self.gpus_per_node, int):
            raise TypeError(f"gpus_per_node must be an int, got {self.gpus_per_node!r}")
        if self.gpus_per_node < 1:
            raise ValueError(f"gpus_per_node must be at least 1, got {self.gpus_per_node}")
        for field in _NUMBERS:
            _check_number(self.name, field, getattr(self, field))
        if self.model is not None and not callable(self.model):
            raise TypeError(f"model must be a cost model (a callable) or None, got {self.model!r}")
        if self.rank_to_node is not None and not callable(self.rank_to_node):
            object.__setattr__(self, "rank_to_node", _node_table(self))

    def node(self, rank: int) -> int:
        """The node that global rank ``rank`` sits on.

        Raises:
            ValueError: ``rank`` is negative, the mapping does not cover it, or the
                mapping's function returned something other than a node number.
        """
        if isinstance(rank, bool) or not isinstance(rank, int) or rank < 0:
            raise ValueError(f"a rank is an int of at least 0, got {rank!r}")
        mapping = self.rank_to_node
        if mapping is None:
            return rank // self.gpus_per_node
        if callable(mapping):
            return _called_node(self.name, mapping, rank)
        if rank >= len(mapping):
            raise ValueError(
                f"rank {rank} is not in the rank-to-node mapping of topology {self.name!r}, which "
                f"covers ranks 0-{len(mapping) - 1}; give a mapping with an entry for every rank of the world"
            )
        return mapping[rank]

    def __str__(self) -> str:
        return (
            f"{self.name}: {self.gpus_per_node} GPUs a node; in a node {_rate(self.intra_bandwidth)}, "
            f"{_us(self.intra_latency)} a step; between nodes {_rate(self.inter_bandwidth)}, "
            f"{_us(self.inter_latency)} a step; {_us(self.base_latency)} a call"
        )


def _check_number(name: str, field: str, value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"topology {name!r}: {field} must be a number, got {value!r}")
    positive = field.endswith("bandwidth")
    if not math.isfinite(value) or value < 0 or (positive and value == 0):
        wanted = "a finite number above 0 (bytes per second)" if positive else "finite seconds, 0 or more"
        raise ValueError(f"topology {name!r}: {field} must be {wanted}, got {value!r}")


def _node_table(topo: Topology) -> tuple[int, ...]:
    """The sequence form of ``rank_to_node``, checked: node numbers, none over-full."""
    mapping = topo.rank_to_node
    if isinstance(mapping, (str, bytes)) or not isinstance(mapping, Sequence):
        raise TypeError(
            f"topology {topo.name!r}: rank_to_node must be None, a function of the rank or a "
            f"sequence of node numbers indexed by rank, got {mapping!r}"
        )
    table = tuple(mapping)
    for rank, node in enumerate(table):
        if isinstance(node, bool) or not isinstance(node, int) or node < 0:
            raise ValueError(
                f"topology {topo.name!r}: rank_to_node[{rank}] must be a node number (an int of at "
                f"least 0), got {node!r}"
            )
    for node, count in sorted(Counter(table).items()):
        if count > topo.gpus_per_node:
            raise ValueError(
                f"topology {topo.name!r}: rank_to_node puts {count} ranks on node {node}, more than "
                f"gpus_per_node={topo.gpus_per_node}; raise gpus_per_node or spread the ranks"
            )
    return table


def _called_node(name: str, mapping: Callable[[int], int], rank: int) -> int:
    node = mapping(rank)
    if isinstance(node, bool) or not isinstance(node, int) or node < 0:
        raise ValueError(
            f"topology {name!r}: rank_to_node({rank}) returned {node!r}; it must return a node "
            "number (an int of at least 0) for every rank of the world"
        )
    return node


def _rate(bytes_per_second: float) -> str:
    return f"{bytes_per_second / 1e9:g} GB/s"


def _us(seconds: float) -> str:
    return f"{seconds * 1e6:g} us"


def _preset(name: str, gpus: int, intra: float, step: float, inter: float) -> Topology:
    return Topology(name, gpus, intra, step, inter, _NCCL_NET_STEP, _NCCL_BASE)


PRESETS: dict[str, Topology] = {
    # DGX A100: 8 A100 SXM4 on NVSwitch. NVLink 3: 12 links, "a total bandwidth of
    # 600 GB/s" both ways, so 300 GB/s each way:
    # https://www.nvidia.com/en-us/data-center/nvlink/
    # "eight single-port Mellanox ConnectX-6 200Gb/s HDR InfiniBand ports", one a GPU,
    # so 25 GB/s a GPU off the node:
    # https://developer.nvidia.com/blog/defining-ai-innovation-with-dgx-a100/
    "dgx-a100": _preset("dgx-a100", 8, 300e9, _NCCL_NVLINK_STEP, 25e9),
    # DGX H100: 8 H100 SXM5 on four NVSwitches, NVLink 4 "at the NVLink bidirectional
    # speed of 900 gigabytes per second", so 450 GB/s each way:
    # https://developer.nvidia.com/blog/introducing-nvidia-hgx-h100-an-accelerated-server-platform-for-ai-and-high-performance-computing/
    # "Four OSFP ports serving eight single-port NVIDIA ConnectX-7 VPI ... up to 400 Gb/s",
    # so 50 GB/s a GPU off the node:
    # https://docs.nvidia.com/dgx-basepod/reference-architecture-infrastructure-foundation-enterprise-ai/latest/core-components.html
    "dgx-h100": _preset("dgx-h100", 8, 450e9, _NCCL_NVLINK_STEP, 50e9),
    # GB200 NVL72: one NVLink domain of 72 Blackwell GPUs, 18 compute trays of 4 GPUs and
    # 9 NVLink switch trays, so one "node" here (NCCL also treats a multi-node NVLink
    # domain as one node). Each compute tray has "4x NVIDIA ConnectX-7 single port 400G
    # OSFP NIC" for the cluster network, so 50 GB/s a GPU between racks:
    # https://docs.nvidia.com/dgx/dgxgb200-user-guide/hardware.html
    # NVLink 5: "1.8 TB/s chip-to-chip", so 900 GB/s each way:
    # https://docs.nvidia.com/datacenter/cloud-native/gpu-operator/latest/dra-cds.html
    # NCCL has no latency of its own for the switch trays: NVLink's step is used.
    "gb200-nvl72": _preset("gb200-nvl72", 72, 900e9, _NCCL_NVLINK_STEP, 50e9),
    # 8 PCIe GPUs (H100 PCIe class), no NVLink: PCIe Gen5 x16, about 128 GB/s both ways
    # (NVLink 4's 900 GB/s is "over 7X the bandwidth of PCIe Gen5"), so 64 GB/s each way,
    # at NCCL's PCI step latency:
    # https://www.nvidia.com/en-us/data-center/technologies/hopper-architecture/
    # Between nodes: NVIDIA's "PCIe Optimized 2-8-5" reference server (2 CPUs, 8 GPUs,
    # 5 network adapters); our reading: four 400 Gb/s adapters carry the GPUs' traffic,
    # one for two GPUs, so 25 GB/s a GPU:
    # https://docs.nvidia.com/ai-enterprise/reference-architecture/latest/compute-node-hardware.html
    "pcie": _preset("pcie", 8, 64e9, _NCCL_PCI_STEP, 25e9),
}


def topology(name: str, /, *, gpus_per_node: int | None = None, **overrides: Any) -> Topology:
    """A preset topology by name, with any of its fields overridden.

    ``topology("dgx-h100")`` is 8 H100 GPUs a node on NVLink, 400 Gb/s InfiniBand
    between nodes; ``topology("dgx-h100", gpus_per_node=4, inter_bandwidth=25e9)`` the
    same GPUs four to a node on half the network. Presets: ``"dgx-a100"``,
    ``"dgx-h100"``, ``"gb200-nvl72"``, ``"pcie"`` (their figures and sources are
    beside them in ``meshsim/_observe/topology.py``).

    Args:
        name: a preset's name.

    Keyword args:
        gpus_per_node: GPUs a node, where the preset's default does not fit.
        overrides: any other :class:`Topology` field: ``intra_bandwidth``,
            ``inter_latency``, ``rank_to_node``, ``model``, ``name``, ...

    Returns:
        a :class:`Topology`.

    Raises:
        ValueError: ``name`` is not a preset (the message lists them), or an override
            is out of range.
        TypeError: an override names no field of :class:`Topology`, or has the wrong type.
    """
    if not isinstance(name, str) or name not in PRESETS:
        raise ValueError(f"unknown topology {name!r}; known topologies: {', '.join(sorted(PRESETS))}")
    fields = [f.name for f in dataclasses.fields(Topology)]
    unknown = sorted(set(overrides) - set(fields))
    if unknown:
        raise TypeError(
            f"topology() got unexpected keyword(s) {', '.join(unknown)}; it takes the fields of "
            f"meshsim.Topology: {', '.join(fields)}"
        )
    if gpus_per_node is not None:
        overrides["gpus_per_node"] = gpus_per_node
    return dataclasses.replace(PRESETS[name], **overrides)


def resolve(topo: Topology | str) -> Topology:
    """``topo`` itself, or the preset it names.

    Raises:
        ValueError: an unknown preset name.
        TypeError: neither a :class:`Topology` nor a string.
    """
    if isinstance(topo, Topology):
        return topo
    if isinstance(topo, str):
        return topology(topo)
    raise TypeError(
        f"expected a meshsim.Topology or a preset name ({', '.join(sorted(PRESETS))}), got {topo!r}"
    )
