import pytest

from hybridflow.simulator import ClusterSpec, ParallelConfig, hardware_preset
from hybridflow.simulator.pricing.comm import (
    dp_ranks,
    group_link,
    group_spread,
    model_parallel_ranks,
    pp_ranks,
    ring_allgather_seconds,
    ring_allreduce_seconds,
    ring_reduce_scatter_seconds,
    tp_ranks,
)
from hybridflow.simulator.pricing.cost import CostModel
from hybridflow.simulator.pricing.efficiency import EfficiencyParams

A100 = hardware_preset("a100-80g")


def test_ring_allreduce_by_hand():
    # 1 GB over 8 devices at 100 GB/s: each device sends 2·7/8 GB → 17.5 ms, plus 10 us latency.
    assert ring_allreduce_seconds(1e9, 8, 100e9, 1e-5) == pytest.approx(0.0175 + 1e-5)
    assert ring_allreduce_seconds(1e9, 2, 100e9) == pytest.approx(0.01)  # 2·1/2 GB / 100 GB/s


def test_ring_allgather_and_reduce_scatter_by_hand():
    # gathered size 1 GB over 4 devices at 50 GB/s: 3/4 GB each → 15 ms.
    assert ring_allgather_seconds(1e9, 4, 50e9) == pytest.approx(0.015)
    assert ring_reduce_scatter_seconds(1e9, 4, 50e9, 2e-5) == pytest.approx(0.015 + 2e-5)
    # all-reduce = reduce-scatter + all-gather
    assert ring_allreduce_seconds(3e8, 6, 80e9) == pytest.approx(2 * ring_allgather_seconds(3e8, 6, 80e9))


def test_single_device_collectives_are_free():
    assert ring_allreduce_seconds(1e9, 1, 1e9, 1.0) == 0.0
    assert ring_allgather_seconds(1e9, 1, 1e9, 1.0) == 0.0


def test_group_ranks_follow_tp_fastest_layout():
    cfg = ParallelConfig(pp=2, tp=4, dp=3)
    assert tp_ranks(cfg) == (0, 1, 2, 3)
    assert dp_ranks(cfg) == (0, 4, 8)
    assert pp_ranks(cfg) == (0, 12)
    assert model_parallel_ranks(cfg) == (0, 1, 2, 3, 12, 13, 14, 15)


def test_group_spread_counts_rings_sharing_a_nic():
    assert group_spread(8, 16, (0, 1, 2, 3)) == (False, 1)  # a tp group inside a node
    # dp group of tp=4 dp=4 on 8-device nodes: 0,4 | 8,12 → 2 members per node, 8 devices → 4 rings per NIC
    assert group_spread(8, 16, (0, 4, 8, 12)) == (True, 4)
    assert group_spread(8, 16, tuple(range(16))) == (True, 1)  # one ring over everything
    assert group_spread(8, 16, (0, 8)) == (True, 8)  # 8 pipeline pairs share each NIC


def test_group_link_bandwidths():
    p = EfficiencyParams()
    cl = ClusterSpec(hardware=A100, nodes=2, devices_per_node=8)
    inside = group_link(cl, p, 16, (0, 1, 2, 3))
    assert not inside.crosses_nodes
    assert inside.bandwidth == pytest.approx(300e9 * p.intra_link_efficiency)
    assert inside.latency == A100.intra_node_latency
    across = group_link(cl, p, 16, (0, 4, 8, 12))
    assert across.crosses_nodes and across.latency == A100.inter_node_latency
    assert across.bandwidth == pytest.approx(25e9 * p.inter_link_efficiency / 4)


def test_cost_model_allreduce_matches_hand_value_on_a100():
    cm = CostModel(ClusterSpec(hardware=A100, nodes=1, devices_per_node=8))
    bw, lat = cm.allreduce(1e9, 8, tuple(range(8)))
    assert bw == pytest.approx(2 * 7 / 8 * 1e9 / (300e9 * 0.78))
    assert lat == A100.intra_node_latency
    # the same 8-device all-reduce spread over two 4-device nodes goes through the 25 GB/s NICs
    cm2 = CostModel(ClusterSpec(hardware=A100, nodes=2, devices_per_node=4))
    bw2, lat2 = cm2.allreduce(1e9, 8, tuple(range(8)))
    assert bw2 == pytest.approx(2 * 7 / 8 * 1e9 / (25e9 * 0.9)) and bw2 > 10 * bw
    assert lat2 == A100.inter_node_latency
