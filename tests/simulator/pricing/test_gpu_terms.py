"""The cost-model terms the GPU fit moves (simulator/calibration/gpu_fit.py), each on hand-computed values:
attention's slower FLOPs, the decode step's KV reads, a collective's latency growing with its group, a serving
engine's per-sequence cost and an older vLLM's un-overlapped host work, the weight sync's per-tensor cost and
tensor count, the weight broadcast through the sender's own NIC across nodes, and the defaults a cluster gets
(the shipped fit on a GPU family, the analytic model elsewhere)."""

import pytest
from pricing_toys import HW, LAYER, PARAMS, TOY, cluster

from hybridflow.simulator import ClusterSpec, ParallelConfig, Workload, hardware_preset, model_preset
from hybridflow.simulator.calibration.gpu_fit import FAMILIES, default_cost_model, stored_terms
from hybridflow.simulator.calibration.profiled_cost import EngineOverheads, ProfiledCostModel
from hybridflow.simulator.pricing import generation
from hybridflow.simulator.pricing.cost import CostModel
from hybridflow.simulator.pricing.efficiency import EfficiencyParams, engine_params
from hybridflow.simulator.vocabulary.hardware import HardwareSpec
from hybridflow.simulator.vocabulary.model import ModelSpec

PM = 2 * LAYER + 100 * 64  # matmul parameters: the layers and the LM head (the embedding lookup is no matmul)
ATTN = 4 * 2 * 4 * 16  # attention FLOPs per token per context token: 2·2·layers·heads·head_dim
KV_TOKEN = 2 * 2 * 4 * 16 * 2  # k and v · layers · kv heads · head_dim · bf16 bytes


def test_the_toy_shape_by_hand():
    assert TOY.matmul_params() == PM and TOY.num_params() == PARAMS and TOY.kv_bytes_per_token() == KV_TOKEN


# ---- attention_efficiency -----------------------------------------------------------------------------
# matmul efficiency 0.5 · width 64/(64 + 64) · rows 256/(256 + 256) = 0.125 of the 1 TFLOP/s peak
EFF = 0.5 * 0.5 * 0.5
ROWS = dict(matmul_efficiency=0.5, width_half=64.0, tokens_half=256.0)


def attention_split(seq_len: int, sequences: int) -> tuple[float, float]:
    """(matmul seconds, attention seconds) of `sequences` causal forwards of `seq_len` tokens at EFF."""
    matmul = sequences * seq_len * 2 * PM / (1e12 * EFF)
    attention = sequences * seq_len * ATTN * (seq_len + 1) / 2 / (1e12 * EFF)
    return matmul, attention


@pytest.mark.parametrize("ae", [1.0, 0.5, 0.25])
def test_attention_efficiency_weights_the_prefills_attention_share(ae):
    # 4 prompts of 64 tokens: one 256-token chunk, compute-bound (the weights' read is ~2 us)
    cm = CostModel(cluster(), EfficiencyParams(attention_efficiency=ae, **ROWS))
    parts = generation.prefill(cm, TOY, ParallelConfig(), batch=4, prompt_len=64)
    matmul, attention = attention_split(64, 4)
    assert parts["compute"] == pytest.approx(matmul + attention / ae)
    assert parts["memory"] == 0.0


def test_attention_efficiency_half_doubles_the_forward_passes_attention_share_not_its_flops():
    # 4 sequences of 32 + 32 tokens, one micro-batch of 4: 256 rows per matmul, as above
    w = Workload(prompts=4, prompt_len=32, response_len=32, micro_batch_size=4)
    full, half = (CostModel(cluster(), EfficiencyParams(attention_efficiency=ae, **ROWS)).forward(
        TOY, "lm", ParallelConfig(), w) for ae in (1.0, 0.5))
    matmul, attention = attention_split(64, 4)
    assert full.breakdown["compute"] == pytest.approx(matmul + attention)
    assert half.breakdown["compute"] == pytest.approx(matmul + 2 * attention)
    assert half.breakdown["compute"] - full.breakdown["compute"] == pytest.approx(attention)
    # the FLOPs reported stay the model's own: the efficiency only prices them
    assert half.flops == full.flops == pytest.approx(4 * 64 * (2 * PM + ATTN * 65 / 2))


# ---- kv_read_efficiency -------------------------------------------------------------------------------
@pytest.mark.parametrize("kre", [1.0, 0.25])
def test_kv_read_efficiency_divides_the_decode_steps_kv_slope_only(kre):
    cm = CostModel(cluster(), EfficiencyParams(hbm_efficiency=0.5, kv_read_efficiency=kre))
    hbm = 1e11 * 0.5
    at = {c: generation.decode_step(cm, TOY, ParallelConfig(), batch=8, context=c)["memory"] for c in (0, 1000)}
    assert at[0] == pytest.approx(2 * PM / hbm)  # the weights streamed once per step: untouched
    assert at[1000] - at[0] == pytest.approx(8 * 1000 * KV_TOKEN / (hbm * kre))


# ---- collective_latency_growth ------------------------------------------------------------------------
def test_collective_latency_grows_with_log2_of_the_group():
    grown = CostModel(cluster(nodes=2), EfficiencyParams(collective_latency_growth=0.5))
    flat = CostModel(cluster(nodes=2), EfficiencyParams(collective_latency_growth=0.0))
    # inside a node (10 us): 2 ranks 10 us, 4 ranks 10·(1 + 0.5·1), 8 ranks 10·(1 + 0.5·2)
    for n, lat in ((2, 1e-5), (4, 1.5e-5), (8, 2e-5)):
        ranks = tuple(range(n))
        link = grown.link(16, ranks)
        assert grown.latency(link, n) == pytest.approx(lat)
        assert grown.allreduce(1e6, 16, ranks)[1] == pytest.approx(lat)
        assert grown.allgather(1e6, 16, ranks)[1] == pytest.approx(lat)
        assert flat.allreduce(1e6, 16, ranks)[1] == pytest.approx(1e-5)
        assert grown.allreduce(1e6, 16, ranks)[0] == flat.allreduce(1e6, 16, ranks)[0]  # bandwidth untouched
    # across both nodes (20 us): 16 ranks 20·(1 + 0.5·3)
    assert grown.allreduce(1e6, 16, tuple(range(16)))[1] == pytest.approx(5e-5)
    assert grown.p2p(1e6, 16, (0, 8))[1] == pytest.approx(2e-5)  # a pipeline send is one hop whatever the group
    # priced ops see it: a tp=4 decode step runs two all-reduces per layer
    step = generation.decode_step(grown, TOY, ParallelConfig(tp=4), batch=1, context=10)
    assert step["latency"] == pytest.approx(2 * 2 * 1.5e-5)


# ---- decode_sequence_seconds --------------------------------------------------------------------------
def test_decode_sequence_seconds_per_sequence_per_pass_on_each_replica():
    params = EfficiencyParams(max_decode_batch=2)  # 5 sequences per replica: 3 waves of 2, 2, 1
    gen = ParallelConfig(dp=2)

    def overhead(prompts, **terms):
        w = Workload(prompts=prompts, prompt_len=8, response_len=16)
        return ProfiledCostModel(cluster(), params, EngineOverheads(**terms)).generate(TOY, gen, w)

    base = overhead(10)
    assert "overhead" in base.breakdown
    per_seq = overhead(10, decode_sequence_seconds=1e-3)
    # 10 sequences on 2 replicas: 5 each, a prefill and 15 decode steps (16 passes) each: 5·16 ms
    assert per_seq.seconds - base.seconds == pytest.approx(5 * 16 * 1e-3)
    assert per_seq.breakdown["overhead"] - base.breakdown["overhead"] == pytest.approx(0.08)
    # twice the sequences, twice the cost; the per-layer term instead counts passes (3 waves · 16 · 2 layers)
    assert overhead(20, decode_sequence_seconds=1e-3).seconds - overhead(20).seconds == pytest.approx(0.16)
    assert overhead(10, decode_layer_seconds=1e-3).seconds - base.seconds == pytest.approx(3 * 16 * 2 * 1e-3)


# ---- host_sequence_seconds: vLLM before 0.6 ------------------------------------------------------------
@pytest.mark.parametrize(("engine", "version", "overlap"), [
    ("vllm", "0.3.1", False), ("vllm", "0.5.4", False), ("vllm", "0.6.0", True), ("vllm", "0.11.2", True),
    ("vllm", None, True), ("tensorrt-llm", "0.5.0", True), ("sglang", "0.3.0", True)])
def test_engine_params_marks_vllm_before_0_6_as_not_overlapping_its_host_work(engine, version, overlap):
    params = EfficiencyParams(**engine_params(engine, version))
    assert params.generation_host_overlap is overlap


def test_host_sequence_seconds_per_sequence_per_pass_only_where_the_engine_does_not_overlap_it():
    params = EfficiencyParams(max_decode_batch=2)  # 5 sequences per replica: 3 waves of 2, 2, 1
    legacy = params.model_copy(update={"generation_host_overlap": False})
    gen, w = ParallelConfig(dp=2), Workload(prompts=10, prompt_len=8, response_len=16)
    terms = EngineOverheads(host_sequence_seconds=2e-3)

    def cost(p, o=terms):
        return ProfiledCostModel(cluster(), p, o).generate(TOY, gen, w)

    # 5 sequences on the slowest replica, a prefill and 15 decode steps each: 5·16 passes · 2 ms, its own part
    assert cost(legacy).breakdown["host"] == pytest.approx(5 * 16 * 2e-3)
    assert cost(legacy).seconds - cost(params).seconds == pytest.approx(0.16)
    assert "host" not in cost(params).breakdown  # an overlapping engine pays none of it
    assert cost(params).seconds == cost(params, EngineOverheads()).seconds


def test_host_seconds_per_step_is_the_fixed_step_cost_and_each_sequences_work():
    params = EfficiencyParams(decode_step_overhead=1e-4)
    o = EngineOverheads(decode_sequence_seconds=5e-5, host_sequence_seconds=4e-5)
    assert CostModel(cluster(), params).host_seconds_per_step(200) == pytest.approx(1e-4)
    assert ProfiledCostModel(cluster(), params, o).host_seconds_per_step(200) == pytest.approx(1e-4 + 200 * 5e-5)
    legacy = params.model_copy(update={"generation_host_overlap": False})
    assert ProfiledCostModel(cluster(), legacy, o).host_seconds_per_step(200) == pytest.approx(1e-4 + 200 * 9e-5)


def test_default_cost_model_takes_a_runs_engine_params():
    c = ClusterSpec(hardware=hardware_preset("a100-80g"), nodes=1, devices_per_node=8)
    assert default_cost_model(c).params.generation_host_overlap is True
    old = default_cost_model(c, **engine_params("vllm", "0.3.1"))
    assert old.params.generation_host_overlap is False
    assert old.overheads.host_sequence_seconds == stored_terms()["a100"].overheads["host_sequence_seconds"] > 0
    assert CostModel(cluster()).params.generation_host_overlap is True  # the analytic defaults overlap


def test_the_cost_models_generate_is_generation_pricing_on_it():
    cm = CostModel(cluster(), EfficiencyParams(max_decode_batch=3))
    w = Workload(prompts=10, prompt_len=8, response_len=16)
    assert cm.generate(TOY, ParallelConfig(dp=2), w) == generation.generate(cm, TOY, ParallelConfig(dp=2), w, 10)
    assert cm.generate(TOY, ParallelConfig(dp=2), w, sequences=4) == generation.generate(
        cm, TOY, ParallelConfig(dp=2), w, 4)


# ---- ModelSpec.num_tensors and weight_tensor_seconds ----------------------------------------------------
QWEN3_LIKE = ModelSpec(name="toy-qwen3", layers=2, hidden=64, heads=4, kv_heads=2, ffn=128, vocab=100,
                       qk_norm=True, head_dim=32, tied_embeddings=True, family="qwen3")


def test_num_tensors_of_a_llama_like_spec():
    # per layer q, k, v, o + gate, up, down + two norms = 9; embedding, final norm, LM head
    assert TOY.num_tensors() == 2 * 9 + 3
    assert TOY.num_tensors("scalar") == 2 * 9 + 3  # the value head replaces the LM head
    assert model_preset("llama2-7b").num_tensors() == 32 * 9 + 3  # the HF checkpoint's 291 tensors


def test_num_tensors_of_a_qwen3_like_spec_with_tied_embeddings():
    # + q and k norms per layer = 11; a tied LM head is the embedding: no tensor of its own
    assert QWEN3_LIKE.num_tensors() == 2 * 11 + 2
    assert QWEN3_LIKE.num_tensors("scalar") == 2 * 11 + 3  # a value head is always its own tensor
    assert QWEN3_LIKE.model_copy(update={"tied_embeddings": False}).num_tensors() == 2 * 11 + 3


def test_num_tensors_counts_biases_and_experts():
    assert TOY.model_copy(update={"attention_bias": True}).num_tensors() == 2 * (9 + 3) + 3  # q, k, v biases
    assert TOY.model_copy(update={"attention_bias": True, "o_bias": True}).num_tensors() == 2 * (9 + 4) + 3
    moe = TOY.model_copy(update={"experts": 4, "experts_per_token": 2})
    assert moe.num_tensors() == 2 * (4 + 3 * 4 + 1 + 2) + 3  # each expert's three and the router


@pytest.mark.parametrize(("model", "tensors"), [(TOY, 21), (QWEN3_LIKE, 24)], ids=["llama-like", "qwen3-like"])
@pytest.mark.parametrize(("mode", "train", "gen"), [
    ("broadcast", ParallelConfig(dp=2), ParallelConfig(tp=2)),
    ("hybridflow", ParallelConfig(tp=2, dp=2), ParallelConfig(dp=4)),
])
def test_weight_tensor_seconds_per_tensor_of_a_weight_sync(model, tensors, mode, train, gen):
    base = ProfiledCostModel(cluster(), EfficiencyParams()).reshard(model, train, gen, mode)
    per_tensor = ProfiledCostModel(cluster(), EfficiencyParams(), EngineOverheads(weight_tensor_seconds=1e-3))
    cost = per_tensor.reshard(model, train, gen, mode)
    assert cost.seconds - base.seconds == pytest.approx(tensors * 1e-3)
    assert cost.breakdown["overhead"] - base.breakdown.get("overhead", 0.0) == pytest.approx(tensors * 1e-3)
    assert cost.bytes == base.bytes


# ---- the broadcast weight sync: the sender's NIC across nodes, NVLink inside one --------------------------
FOUR_NICS = HW.model_copy(update={"nics_per_node": 4})  # the node's 8 GB/s as four 2 GB/s NICs


def test_broadcast_goes_through_the_senders_nic_across_nodes_and_nvlink_inside_a_node():
    params = EfficiencyParams(intra_link_efficiency=0.5, inter_link_efficiency=0.5)
    m_bytes = 2 * PARAMS  # bf16; one bucket
    train, gen = ParallelConfig(), ParallelConfig(tp=4)  # one sender (no gather), 4 receivers
    # 1 + 4 devices on one 8-device node: NVLink, 10 GB/s · 0.5
    inside = CostModel(cluster(nodes=1, per_node=8, hw=FOUR_NICS), params).reshard(TOY, train, gen, "broadcast")
    assert inside.breakdown["reshard_comm"] == pytest.approx(m_bytes / 5e9)
    assert inside.breakdown["latency"] == pytest.approx(1e-5)
    # 1 + 4 devices over 4-device nodes: the sender's own NIC, the node's 8 GB/s / 4 NICs · 0.5 = 1 GB/s
    across = CostModel(cluster(nodes=2, per_node=4, hw=FOUR_NICS), params).reshard(TOY, train, gen, "broadcast")
    assert across.breakdown["reshard_comm"] == pytest.approx(m_bytes / 1e9)
    assert across.breakdown["latency"] == pytest.approx(2e-5)
    assert across.bytes == inside.bytes == pytest.approx(m_bytes)
    # a node with one NIC: a lone sender has all of it, 8 GB/s · 0.5
    one_nic = CostModel(cluster(nodes=2, per_node=4), params).reshard(TOY, train, gen, "broadcast")
    assert one_nic.breakdown["reshard_comm"] == pytest.approx(m_bytes / 4e9)


def test_broadcast_across_nodes_adds_the_senders_gather_inside_its_node():
    params = EfficiencyParams(intra_link_efficiency=0.5, inter_link_efficiency=0.5)
    m_bytes = 2 * PARAMS
    # 4 FSDP ranks fill a 4-device node: their ring all-gather of M on NVLink (3/4·M / 5 GB/s), then the send
    cost = CostModel(cluster(nodes=2, per_node=4, hw=FOUR_NICS), params).reshard(
        TOY, ParallelConfig(dp=4), ParallelConfig(dp=4), "broadcast")
    assert cost.breakdown["reshard_comm"] == pytest.approx(0.75 * m_bytes / 5e9 + m_bytes / 1e9)
    # a gather per layer and one for the rest (10 us each), then one bucket's send across (20 us)
    assert cost.breakdown["latency"] == pytest.approx(3 * 1e-5 + 2e-5)


# ---- the defaults a cluster gets --------------------------------------------------------------------------
def test_the_shipped_fit_has_every_family():
    assert set(stored_terms()) == set(FAMILIES)
    for kinds in FAMILIES.values():
        for kind in kinds:
            assert hardware_preset(kind).name == kind


@pytest.mark.parametrize(("hardware", "family"), [("a100-80g", "a100"), ("h100-80g", "hopper")])
def test_default_cost_model_on_a_gpu_family_is_its_fitted_terms(hardware, family):
    hw = hardware_preset(hardware)
    cm = default_cost_model(cluster(nodes=2, hw=hw))
    terms = stored_terms()[family]
    assert isinstance(cm, ProfiledCostModel)
    for name, value in terms.params.items():
        assert getattr(cm.params, name) == value, name
    for name, value in terms.overheads.items():
        assert getattr(cm.overheads, name) == value, name
    for name, value in terms.hardware.items():  # the latencies it fits, over the datasheet's other figures
        assert getattr(cm.cluster.hardware, name) == value, name
    assert cm.cluster.hardware.peak_flops == hw.peak_flops and cm.hbm == hw.hbm_bandwidth * terms.params[
        "hbm_efficiency"]
    assert cm.cluster.nodes == 2
    # the device kind's own defaults the fit does not move (vLLM's larger batches on >= 70 GB Hopper parts)
    assert cm.params.max_decode_batch == EfficiencyParams.for_hardware(hw).max_decode_batch


def test_the_families_fits_differ_and_every_kind_of_a_family_gets_its_terms():
    a100, hopper = stored_terms()["a100"], stored_terms()["hopper"]
    assert a100.params["matmul_efficiency"] != hopper.params["matmul_efficiency"]
    for family, kinds in FAMILIES.items():
        for kind in kinds:
            cm = default_cost_model(cluster(hw=hardware_preset(kind)))
            assert cm.params.attention_efficiency == stored_terms()[family].params["attention_efficiency"], kind


def test_default_cost_model_elsewhere_is_the_plain_analytic_model():
    cpu = HardwareSpec(name="cpu-x", peak_flops=4e10, hbm_bandwidth=5e9, hbm_bytes=8e9, intra_node_bandwidth=1e9,
                       inter_node_bandwidth=1e9)
    for hw in (cpu, HW):
        cm = default_cost_model(ClusterSpec(hardware=hw, nodes=1, devices_per_node=2))
        assert type(cm) is CostModel
        assert cm.params == EfficiencyParams.for_hardware(hw)
        assert cm.cluster.hardware == hw
        # the new terms' defaults price as before they existed
        assert (cm.params.attention_efficiency, cm.params.kv_read_efficiency,
                cm.params.collective_latency_growth) == (1.0, 1.0, 0.0)
