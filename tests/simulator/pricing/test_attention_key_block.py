"""Mechanisms the long-tail benchmark found (issue 34): an attention kernel that computes whole key blocks, the
slowest packed rank holding the longest sequence, FSDP's collectives once per call in the fsdp engine, and a
device's element size in the memory model. Each against a hand-computed figure."""

import pytest

from hybridflow.simulator import ClusterSpec, ModelSpec, ParallelConfig, Workload
from hybridflow.simulator.calibration.fit import calibrate_file
from hybridflow.simulator.calibration.profiled_cost import EngineOverheads, ProfiledCostModel
from hybridflow.simulator.pricing.efficiency import CPU_ATTENTION_KEY_BLOCK, EfficiencyParams
from hybridflow.simulator.pricing.memory import at_element_bytes, memory_parts
from hybridflow.simulator.pricing.op_cost import causal_keys, mean_seq_flops, seq_flops
from hybridflow.simulator.pricing.sequence_batches import packed_seq_flops
from hybridflow.simulator.vocabulary.hardware import hardware_preset

LINE = {"quantiles": {0.0: 10, 1.0: 100}}  # uniform response lengths 10..100
MODEL = ModelSpec(name="m", layers=4, hidden=128, heads=4, kv_heads=4, ffn=512, vocab=64)
CLUSTER = ClusterSpec(hardware=hardware_preset("a100-80g"), nodes=1, devices_per_node=8)


def _kernel_keys(s: int, block: int) -> float:
    """What a blocked causal kernel computes, query by query: every key of the blocks up to its own."""
    return sum(min(s, -(-(m + 1) // block) * block) for m in range(s)) / s


@pytest.mark.parametrize("s", [1, 100, 512, 1024, 1536, 2048])
def test_a_blocked_kernel_computes_whole_key_blocks(s):
    assert causal_keys(s) == (s + 1) / 2  # no block: the causal half
    assert causal_keys(s, 512) == _kernel_keys(s, 512)  # exact at multiples of the block, and below one
    assert seq_flops(10.0, 2.0, s, 1.0, 512) == s * (20.0 + 2.0 * causal_keys(s, 512))
    assert causal_keys(100, 512) == 100 and causal_keys(1024, 512) == 768  # by hand: (1024 + 512) / 2


def test_mean_over_a_length_distribution_integrates_the_blocked_keys():
    w = Workload(prompts=8, prompt_len=20, response_lengths=LINE)  # X = 20 + L uniform on [30, 120]
    block, pm, attn = 64, 10.0, 2.0
    # E[X · keys(X)] by hand: ∫ x² over [30, 64], ∫ (x² + 64x)/2 over [64, 120], over the width 90
    pairs = ((64**3 - 30**3) / 3 + ((120**3 - 64**3) / 3 + 32 * (120**2 - 64**2)) / 2) / 90
    assert mean_seq_flops(pm, attn, w, 1.0, block) == pytest.approx(2 * pm * 75 + attn * pairs, rel=1e-12)
    # without a block the moments' closed form stands: E[X(X+1)/2]
    assert mean_seq_flops(pm, attn, w) == pytest.approx(2 * pm * 75 + attn * (75**2 + 90**2 / 12 + 75) / 2, rel=1e-12)


def test_the_slowest_packed_rank_holds_the_longest_sequence_whole():
    w = Workload(prompts=16, prompt_len=20, response_lengths=LINE)
    pm, attn = 10.0, 2.0
    mean_attention = mean_seq_flops(pm, attn, w) - 2 * pm * 75
    top = 120 * attn * 121 / 2  # the longest, 20 + 100 tokens
    # 8 sequences a rank on 2 ranks: the longest and 7 of the other 15's mean attention
    by_hand = 2 * pm * 75 + (top + 7 * (16 * mean_attention - top) / 15) / 8
    assert packed_seq_flops(pm, attn, w, 8, 2) == pytest.approx(by_hand, rel=1e-12)
    assert packed_seq_flops(pm, attn, w, 16, 1) == pytest.approx(mean_seq_flops(pm, attn, w), rel=1e-12)
    # every sequence alike: no rank holds more than its share
    one = Workload(prompts=16, prompt_len=20, response_lengths={"quantiles": {1.0: 100}})
    assert packed_seq_flops(pm, attn, one, 8, 2) == pytest.approx(seq_flops(pm, attn, 120), rel=1e-12)


def test_fsdp_engine_collectives_run_once_per_call_not_per_micro_batch():
    o = EngineOverheads(dp_layer_seconds=1e-3)
    w = Workload(prompts=64, prompt_len=32, response_len=32, micro_batch_size=4, ppo_epochs=1, mini_batches=2)
    cm = ProfiledCostModel(CLUSTER, EfficiencyParams(), o)
    bare = ProfiledCostModel(CLUSTER, EfficiencyParams(), EngineOverheads())
    dp2, pp2 = ParallelConfig(dp=2), ParallelConfig(dp=2, pp=2)
    # 32 sequences a rank in micro-batches of 4: 8 micro-batches, yet one gather per layer for the call
    extra = cm.forward(MODEL, "lm", dp2, w).seconds - bare.forward(MODEL, "lm", dp2, w).seconds
    assert extra == pytest.approx(4 * 1e-3, rel=1e-9)
    # an update: per optimizer step (2) a gather and a reduce-scatter's two hooks per layer
    extra = cm.train(MODEL, "lm", dp2, w).seconds - bare.train(MODEL, "lm", dp2, w).seconds
    assert extra == pytest.approx(2 * 4 * 3 * 1e-3, rel=1e-9)
    # the pipeline runner gathers per micro-batch: the same 8 micro-batches, 2 layers a stage
    extra = cm.forward(MODEL, "lm", pp2, w).seconds - bare.forward(MODEL, "lm", pp2, w).seconds
    assert extra == pytest.approx(8 * 2 * 1e-3, rel=1e-9)


def test_a_cpu_profile_prices_pytorch_s_cpu_attention_blocks():
    assert calibrate_file("cpu-2core").params.attention_key_block == CPU_ATTENTION_KEY_BLOCK == 512
    assert EfficiencyParams().attention_key_block == 0  # GPU presets: the causal half


def test_fp32_states_double_all_but_adam_which_loses_the_master_copy():
    bf16 = memory_parts(weights=2.0, gradients=2.0, optimizer=12.0)
    fp32 = at_element_bytes(bf16, 4)
    assert fp32.model_dump() == {"weights": 4.0, "gradients": 4.0, "optimizer": 8.0, "activations": 0.0,
                                 "kv_cache": 0.0, "buffers": 0.0}
    assert at_element_bytes(bf16, 2) == bf16
