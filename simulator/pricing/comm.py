"""Ring collectives and the links a process group crosses.

Times follow the ring algorithm (Patarasuk & Yuan 2009; what NCCL runs for large messages):
all-reduce moves 2(n-1)/n·S per device, all-gather and reduce-scatter (n-1)/n·S, where S is the
full (gathered / reduced) size, over the slowest link the ring crosses; plus a fixed latency per
collective (NCCL launch and the first hops, from the hardware spec).

Layout (parallel.py): a parallel config over W devices sits on consecutive devices of a
node-aligned block, rank order (pp, dp, tp) with tp fastest. A group is described by the ranks of
its first instance; the other instances are its translates and run the same collective at the
same time, so groups that leave a node share that node's network interface.
"""

from __future__ import annotations

import math
from functools import lru_cache
from typing import NamedTuple

from hybridflow.simulator.pricing.efficiency import EfficiencyParams
from hybridflow.simulator.vocabulary.hardware import ClusterSpec
from hybridflow.simulator.vocabulary.parallel import ParallelConfig


def ring_allreduce_seconds(size_bytes: float, n: int, bandwidth: float, latency: float = 0.0) -> float:
    """Ring all-reduce of `size_bytes` over `n` devices: 2(n-1)/n·S/B + latency (0 when n == 1)."""
    if n <= 1 or size_bytes <= 0:
        return 0.0
    return 2.0 * (n - 1) / n * size_bytes / bandwidth + latency


def ring_allgather_seconds(size_bytes: float, n: int, bandwidth: float, latency: float = 0.0) -> float:
    """Ring all-gather whose gathered result is `size_bytes`: (n-1)/n·S/B + latency."""
    if n <= 1 or size_bytes <= 0:
        return 0.0
    return (n - 1) / n * size_bytes / bandwidth + latency


# A reduce-scatter is an all-gather run backwards: same volume, same time.
ring_reduce_scatter_seconds = ring_allgather_seconds


# An all-to-all in which each of n devices holds S split evenly over the n keeps its own 1/n and sends the
# rest, (n-1)/n·S/B (pairwise exchanges, each device sending and receiving at once): the all-gather's volume.
alltoall_seconds = ring_allgather_seconds


class Link(NamedTuple):
    bandwidth: float  # achieved bytes/s per device along the ring's slowest hop
    latency: float  # seconds per collective
    crosses_nodes: bool


@lru_cache(maxsize=4096)
def group_spread(devices_per_node: int, world: int, ranks: tuple[int, ...]) -> tuple[bool, int]:
    """(crosses nodes, most rings sharing one node's NIC) for a group whose first instance is `ranks`
    inside a config of `world` consecutive ranks. A ring enters and leaves each node it touches once,
    so the rings sharing a NIC = the config's devices in that node / the group's members there."""
    per_node: dict[int, int] = {}
    for r in ranks:
        per_node[r // devices_per_node] = per_node.get(r // devices_per_node, 0) + 1
    if len(per_node) <= 1:
        return False, 1
    flows = 1
    for node, members in per_node.items():
        in_node = min(world, (node + 1) * devices_per_node) - node * devices_per_node
        flows = max(flows, -(-in_node // members))
    return True, flows


def group_link(cluster: ClusterSpec, params: EfficiencyParams, world: int, ranks: tuple[int, ...]) -> Link:
    """The link a collective over `ranks` sees: NVLink inside a node, the shared NIC across nodes."""
    hw = cluster.hardware
    intra = hw.intra_node_bandwidth * params.intra_link_efficiency
    crosses, flows = group_spread(cluster.devices_per_node, world, ranks)
    if not crosses:
        return Link(intra, hw.intra_node_latency, False)
    inter = hw.inter_node_bandwidth * params.inter_link_efficiency / flows
    return Link(min(intra, inter), hw.inter_node_latency, True)


# ---- the groups of a parallel config (first instance, as ranks) ----------------------------------
def tp_ranks(cfg: ParallelConfig) -> tuple[int, ...]:
    return tuple(range(cfg.tp))


def dp_ranks(cfg: ParallelConfig) -> tuple[int, ...]:
    return tuple(j * cfg.tp for j in range(cfg.dp))


def sp_ranks(cfg: ParallelConfig) -> tuple[int, ...]:
    """A sequence-parallel (Ulysses) group: `sp` consecutive data-parallel ranks (parallel.py)."""
    return tuple(j * cfg.tp for j in range(cfg.sp))


def ep_ranks(cfg: ParallelConfig) -> tuple[int, ...]:
    """An expert-parallel group: `ep` consecutive data-parallel ranks (parallel.py)."""
    return tuple(j * cfg.tp for j in range(cfg.ep))


def expert_dp_ranks(cfg: ParallelConfig) -> tuple[int, ...]:
    """The dp ranks holding the same experts (one per ep group), over which their gradients reduce."""
    return tuple(j * cfg.tp * cfg.ep for j in range(cfg.dp // cfg.ep))


def pp_ranks(cfg: ParallelConfig) -> tuple[int, ...]:
    return tuple(k * cfg.tp * cfg.dp for k in range(cfg.pp))


def model_parallel_ranks(cfg: ParallelConfig) -> tuple[int, ...]:
    """One model replica: its tp × pp devices (HybridFlow-V gathers over these)."""
    return tuple(k * cfg.tp * cfg.dp + j for k in range(cfg.pp) for j in range(cfg.tp))


class Collectives:
    """(bandwidth seconds, latency seconds) of one collective over a group of ranks on one cluster: what
    the cost model and the expert-parallel terms (expert_parallel.py) price collectives with."""

    def __init__(self, cluster: ClusterSpec, params: EfficiencyParams):
        self.cluster, self.params = cluster, params

    def link(self, world: int, ranks: tuple[int, ...]) -> Link:
        return group_link(self.cluster, self.params, world, ranks)

    def latency(self, link: Link, n: int) -> float:
        """A collective's fixed latency over `n` ranks (EfficiencyParams.collective_latency_growth)."""
        g = self.params.collective_latency_growth
        return link.latency * (1.0 + g * math.log2(n / 2)) if g and n > 2 else link.latency

    def allreduce(self, size_bytes: float, world: int, ranks: tuple[int, ...]) -> tuple[float, float]:
        """One ring all-reduce over `ranks`."""
        if len(ranks) <= 1:
            return 0.0, 0.0
        lk = self.link(world, ranks)
        return ring_allreduce_seconds(size_bytes, len(ranks), lk.bandwidth), self.latency(lk, len(ranks))

    def allgather(self, size_bytes: float, world: int, ranks: tuple[int, ...]) -> tuple[float, float]:
        if len(ranks) <= 1:
            return 0.0, 0.0
        lk = self.link(world, ranks)
        return ring_allgather_seconds(size_bytes, len(ranks), lk.bandwidth), self.latency(lk, len(ranks))

    # One all-to-all of `size_bytes` per device over `ranks` moves the all-gather's volume (alltoall_seconds).
    alltoall = allgather

    def p2p(self, size_bytes: float, world: int, ranks: tuple[int, ...]) -> tuple[float, float]:
        """One pipeline send between adjacent stages (the first two ranks of `ranks`)."""
        if len(ranks) <= 1:
            return 0.0, 0.0
        lk = self.link(world, ranks[:2])
        return size_bytes / lk.bandwidth, lk.latency
