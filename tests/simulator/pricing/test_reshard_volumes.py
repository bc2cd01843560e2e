import itertools

import pytest

from hybridflow.simulator import ClusterSpec, HflowError, ParallelConfig, hardware_preset, model_preset
from hybridflow.simulator.pricing.cost import CostModel
from hybridflow.simulator.pricing.reshard import reshard_peak_memory, reshard_spec, reshard_volume
from hybridflow.simulator.vocabulary.plan import RESHARD_MODES

M = 1.0
# Paper Fig. 8: 2 nodes × 4 GPUs, training 1-4-2 (p=1, t=4, d=2), generation t_g=2 (so d_g=4).
TRAIN = ParallelConfig(pp=1, tp=4, dp=2)
GEN = ParallelConfig(pp=1, tp=2, dp=4)


def test_fig8_volumes():
    assert reshard_volume(M, TRAIN, GEN, "ds-chat") == pytest.approx(7 / 8)
    assert reshard_volume(M, TRAIN, GEN, "hybridflow-v") == pytest.approx(3 / 4)
    assert reshard_volume(M, TRAIN, GEN, "hybridflow") == pytest.approx(1 / 4)


def test_fig8_peak_memory_and_redundancy():
    assert reshard_peak_memory(M, TRAIN, GEN, "hybridflow") == pytest.approx(1 / 2)
    assert reshard_peak_memory(M, TRAIN, GEN, "hybridflow-v") == pytest.approx(1.0)
    assert reshard_peak_memory(M, TRAIN, GEN, "ds-chat") == pytest.approx(1.0)
    assert reshard_spec(M, TRAIN, GEN, "ds-chat").redundancy == pytest.approx(1 / 8)
    assert reshard_spec(M, TRAIN, GEN, "hybridflow-v").redundancy == pytest.approx(1 / 4)
    assert reshard_spec(M, TRAIN, GEN, "hybridflow").redundancy == 0.0


@pytest.mark.parametrize("p,t,d,pg,tg", [(p, t, d, pg, tg) for p, t, d in itertools.product((1, 2, 4), (1, 2, 8), (1, 3))
                                         for pg in (1, 2, 4) for tg in (1, 2, 8) if p % pg == 0 and t % tg == 0])
def test_table2_formulas(p, t, d, pg, tg):
    train = ParallelConfig(pp=p, tp=t, dp=d)
    gen = ParallelConfig(pp=pg, tp=tg, dp=train.world_size // (pg * tg))
    M = 140e9
    tp = t * p  # Table 2's "tp" is the product t·p
    assert reshard_volume(M, train, gen, "ds-chat") == pytest.approx((tp * d - 1) / (tp * d) * M)
    assert reshard_volume(M, train, gen, "hybridflow-v") == pytest.approx((tp - 1) / tp * M)
    hf = reshard_spec(M, train, gen, "hybridflow")
    assert hf.volume == pytest.approx((tp - tg * pg) / (tg * pg * tp) * M)
    assert hf.peak_memory == pytest.approx(M / (tg * pg))
    # the micro-DP group has t·p/(t_g·p_g) members, each gathering a generation shard
    assert len(hf.ranks) == tp // (tg * pg) and hf.gathered_bytes == pytest.approx(M / (tg * pg))
    # HybridFlow never moves more than HybridFlow-V, which never moves more than DS-Chat
    assert hf.volume <= reshard_volume(M, train, gen, "hybridflow-v") + 1e-6 <= reshard_volume(
        M, train, gen, "ds-chat") + 2e-6


def test_bad_generation_layout_and_unknown_mode():
    with pytest.raises(HflowError, match="generation tp=3"):
        reshard_spec(M, TRAIN, ParallelConfig(tp=3), "hybridflow")
    with pytest.raises(HflowError, match="known modes: " + ", ".join(RESHARD_MODES)):
        reshard_spec(M, TRAIN, GEN, "nccl-magic")


def test_reshard_seconds_fig8_cluster():
    cl = ClusterSpec(hardware=hardware_preset("a100-80g"), nodes=2, devices_per_node=4)
    cm = CostModel(cl)
    model = model_preset("llama2-7b")
    m_bytes = 2 * model.num_params()
    t = {mode: cm.reshard(model, TRAIN, GEN, mode) for mode in RESHARD_MODES}
    assert t["hybridflow"].seconds < t["hybridflow-v"].seconds < t["ds-chat"].seconds
    assert t["hybridflow"].bytes == pytest.approx(m_bytes / 4)
    # HybridFlow: pairs of neighbouring GPUs inside a node all-gather M/2 each, layer by layer
    hw = cl.hardware
    expected = 0.5 * (m_bytes / 2) / (hw.intra_node_bandwidth * 0.78) + (model.layers + 1) * hw.intra_node_latency
    assert t["hybridflow"].seconds == pytest.approx(expected)
    # DS-Chat gathers over both nodes: the 25 GB/s NIC bounds it
    assert t["ds-chat"].seconds > 7 / 8 * m_bytes / hw.inter_node_bandwidth
    # OpenRLHF-style broadcast sends the full model to other devices every iteration
    assert t["broadcast"].bytes == pytest.approx(m_bytes)
    assert t["broadcast"].seconds > m_bytes / hw.inter_node_bandwidth


def test_same_layout_needs_no_transfer():
    cm = CostModel(ClusterSpec(hardware=hardware_preset("a100-80g")))
    c = cm.reshard(model_preset("llama2-7b"), TRAIN, ParallelConfig(pp=1, tp=4, dp=2), "hybridflow")
    assert c.seconds == 0.0 and c.bytes == 0.0
