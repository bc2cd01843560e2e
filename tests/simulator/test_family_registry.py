"""The model-family registry (torch-free): release configs read into the right decoder options and
exact parameter counts, presets against the published totals, config.json round trips, one-line
errors for what the runtime cannot run, and `search` refusing such a folder at plan time."""

from __future__ import annotations

import json

import pytest

from hybridflow.simulator import MODEL_PRESETS, HflowError, ModelSpec
from hybridflow.simulator.vocabulary.families import FAMILIES, hf_config, read_hf_config, tensor_shapes
from hybridflow.tools.cli import main

# The config.json of each release (Hugging Face hub, fields that matter) and its published total:
# the parameter count of its safetensors (the model card's "Model size").
RELEASES = {
    "Llama-3.1-8B": (8_030_261_248, dict(
        architectures=["LlamaForCausalLM"], model_type="llama", attention_bias=False, mlp_bias=False,
        hidden_act="silu", hidden_size=4096, intermediate_size=14336, max_position_embeddings=131072,
        num_attention_heads=32, num_hidden_layers=32, num_key_value_heads=8, rms_norm_eps=1e-05,
        rope_scaling={"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                      "original_max_position_embeddings": 8192, "rope_type": "llama3"},
        rope_theta=500000.0, tie_word_embeddings=False, vocab_size=128256)),
    "Llama-3.2-1B": (1_235_814_400, dict(
        architectures=["LlamaForCausalLM"], model_type="llama", hidden_act="silu", hidden_size=2048,
        intermediate_size=8192, max_position_embeddings=131072, num_attention_heads=32, num_hidden_layers=16,
        num_key_value_heads=8, rms_norm_eps=1e-05, head_dim=64,
        rope_scaling={"factor": 32.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                      "original_max_position_embeddings": 8192, "rope_type": "llama3"},
        rope_theta=500000.0, tie_word_embeddings=True, vocab_size=128256)),
    "Mistral-7B-v0.1": (7_241_732_096, dict(
        architectures=["MistralForCausalLM"], model_type="mistral", hidden_act="silu", hidden_size=4096,
        intermediate_size=14336, max_position_embeddings=32768, num_attention_heads=32, num_hidden_layers=32,
        num_key_value_heads=8, rms_norm_eps=1e-05, rope_theta=10000.0, sliding_window=4096,
        tie_word_embeddings=False, vocab_size=32000)),
    "Qwen2.5-7B": (7_615_616_512, dict(
        architectures=["Qwen2ForCausalLM"], model_type="qwen2", hidden_act="silu", hidden_size=3584,
        intermediate_size=18944, max_position_embeddings=131072, max_window_layers=28, num_attention_heads=28,
        num_hidden_layers=28, num_key_value_heads=4, rms_norm_eps=1e-06, rope_theta=1000000.0,
        sliding_window=131072, tie_word_embeddings=False, use_sliding_window=False, vocab_size=152064)),
    "Qwen2.5-1.5B": (1_543_714_304, dict(
        architectures=["Qwen2ForCausalLM"], model_type="qwen2", hidden_act="silu", hidden_size=1536,
        intermediate_size=8960, max_position_embeddings=131072, max_window_layers=28, num_attention_heads=12,
        num_hidden_layers=28, num_key_value_heads=2, rms_norm_eps=1e-06, rope_theta=1000000.0,
        sliding_window=131072, tie_word_embeddings=True, use_sliding_window=False, vocab_size=151936)),
    "Qwen3-8B": (8_190_735_360, dict(
        architectures=["Qwen3ForCausalLM"], model_type="qwen3", attention_bias=False, head_dim=128,
        hidden_act="silu", hidden_size=4096, intermediate_size=12288, max_position_embeddings=40960,
        max_window_layers=36, num_attention_heads=32, num_hidden_layers=36, num_key_value_heads=8,
        rms_norm_eps=1e-06, rope_scaling=None, rope_theta=1000000, sliding_window=None,
        tie_word_embeddings=False, use_sliding_window=False, vocab_size=151936)),
    "Mixtral-8x7B-v0.1": (46_702_792_704, dict(
        architectures=["MixtralForCausalLM"], model_type="mixtral", hidden_act="silu", hidden_size=4096,
        intermediate_size=14336, max_position_embeddings=32768, num_attention_heads=32, num_experts_per_tok=2,
        num_hidden_layers=32, num_key_value_heads=8, num_local_experts=8, output_router_logits=False,
        rms_norm_eps=1e-05, rope_theta=1000000.0, router_aux_loss_coef=0.02, sliding_window=None,
        tie_word_embeddings=False, vocab_size=32000)),
}

# Published totals of the presets (the same sources), in parameters.
PRESET_TOTALS = {
    "llama3.1-8b": 8_030_261_248, "llama3.1-70b": 70_553_706_496, "qwen2.5-7b": 7_615_616_512,
    "qwen2.5-32b": 32_763_876_352, "qwen2.5-72b": 72_706_203_648, "qwen3-8b": 8_190_735_360,
    "qwen3-32b": 32_762_123_264, "mixtral-8x7b": 46_702_792_704,
}


@pytest.mark.parametrize("release", list(RELEASES))
def test_release_configs_count_their_published_parameters(tmp_path, release):
    total, cfg = RELEASES[release]
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    spec = ModelSpec.from_hf_config(tmp_path, name=release)
    assert spec.num_params() == total
    assert sum(_numel(s) for s in tensor_shapes(read_hf_config(cfg).decoder).values()) == total


def _numel(shape):
    n = 1
    for d in shape:
        n *= d
    return n


def test_release_configs_read_into_their_decoder_options():
    llama = read_hf_config(RELEASES["Llama-3.1-8B"][1]).decoder
    assert llama.rope_scaling.rope_type == "llama3" and llama.rope_scaling.original_max_position_embeddings == 8192
    assert llama.rope_theta == 500000.0 and not (llama.qkv_bias or llama.o_bias or llama.qk_norm)
    mistral = read_hf_config(RELEASES["Mistral-7B-v0.1"][1]).decoder
    assert mistral.sliding_window == 4096 and mistral.attention_window(31) == 4096
    qwen2 = read_hf_config(RELEASES["Qwen2.5-7B"][1]).decoder
    assert qwen2.qkv_bias and not qwen2.o_bias and qwen2.sliding_window is None  # use_sliding_window false
    qwen3 = read_hf_config(RELEASES["Qwen3-8B"][1])
    assert qwen3.decoder.qk_norm and qwen3.decoder.dim_head == 128 and qwen3.family.tp_plan.head_norms
    # Qwen3's head_dim defaults to 128 (transformers' Qwen3Config), not hidden / heads.
    no_head_dim = {k: v for k, v in RELEASES["Qwen3-8B"][1].items() if k != "head_dim"} | {"hidden_size": 2048}
    assert read_hf_config(no_head_dim).decoder.dim_head == 128
    # Qwen2 with a window on the layers from max_window_layers up.
    windowed = read_hf_config(RELEASES["Qwen2.5-7B"][1] | {"use_sliding_window": True, "sliding_window": 64,
                                                            "max_window_layers": 20}).decoder
    assert [windowed.attention_window(i) for i in (19, 20)] == [None, 64]


@pytest.mark.parametrize("name,total", PRESET_TOTALS.items())
def test_new_presets_within_half_a_percent_of_published(name, total):
    assert abs(MODEL_PRESETS[name].num_params() - total) / total < 0.005


def test_q_k_norm_and_bias_parameters_are_counted_exactly():
    base = ModelSpec(name="b", layers=2, hidden=64, heads=4, kv_heads=2, ffn=96, vocab=100)
    d = 16
    assert base.model_copy(update={"qk_norm": True}).num_params() - base.num_params() == 2 * 2 * d
    assert base.model_copy(update={"attention_bias": True}).num_params() - base.num_params() == 2 * (4 + 2 * 2) * d
    assert base.model_copy(update={"o_bias": True, "mlp_bias": True}).num_params() - base.num_params() == \
        2 * (64 + 2 * 96 + 64)


def test_moe_counts_every_expert_in_parameters_and_the_routed_ones_in_flops():
    moe = MODEL_PRESETS["mixtral-8x7b"]
    assert moe.decoder_config().num_local_experts == 8 and moe.decoder_config().num_experts_per_tok == 2
    # Per token: the router plus two experts, i.e. a dense model of twice the ffn plus the router.
    dense = moe.model_copy(update={"experts": None, "ffn": 2 * moe.ffn})
    assert moe.matmul_params() == dense.matmul_params() + moe.layers * moe.hidden * 8
    assert moe.num_params() - moe.matmul_params() > 6 * moe.layers * 3 * moe.hidden * moe.ffn  # 6 idle experts
    mixtral = read_hf_config(RELEASES["Mixtral-8x7B-v0.1"][1])
    assert mixtral.family.name == "mixtral" and mixtral.decoder.num_local_experts == 8
    for bad, message in ((dict(num_local_experts=None), "needs num_local_experts"),
                         (dict(router_jitter_noise=0.1), "router_jitter_noise 0.1 is not supported")):
        with pytest.raises(HflowError, match=message):
            read_hf_config(RELEASES["Mixtral-8x7B-v0.1"][1] | bad)


@pytest.mark.parametrize("release", list(RELEASES))
def test_config_json_round_trip(release):
    read = read_hf_config(RELEASES[release][1])
    written = hf_config(read.decoder, "scalar", "bfloat16")
    again = read_hf_config(written)
    assert again.decoder == read.decoder and again.head == "scalar"
    assert written["architectures"] == [read.family.score_model] and written["model_type"] == read.family.model_types[0]


def test_unrunnable_configs_are_one_line_errors():
    base = dict(vocab_size=8, hidden_size=8, intermediate_size=8, num_hidden_layers=1, num_attention_heads=2)
    cases = [
        (dict(model_type="gpt2"), "model_type 'gpt2' is not supported; supported: llama, mistral, qwen2, qwen3, mixtral"),
        (dict(architectures=["LlamaForTokenClassification"]), "architecture 'LlamaForTokenClassification' is not "
                                                              "supported; supported: LlamaForCausalLM"),
        (dict(model_type="qwen2", architectures=["LlamaForCausalLM"]), "does not match model_type 'qwen2'"),
        (dict(hidden_act="gelu"), "hidden_act 'gelu' is not supported; supported: silu"),
        (dict(rope_scaling={"rope_type": "yarn", "factor": 4.0}), "rope_type 'yarn' is not supported for llama; "
                                                                   "supported: default, linear, llama3"),
        (dict(model_type="qwen3", rope_scaling={"type": "linear", "factor": 2.0}), "rope_type 'linear' is not "
                                                                                    "supported for qwen3"),
        (dict(partial_rotary_factor=0.5), "partial_rotary_factor 0.5 is not supported"),
        (dict(vocab_size=None), "missing vocab_size"),
        (dict(num_attention_heads=3), "not a valid llama config"),
    ]
    for extra, message in cases:
        with pytest.raises(HflowError, match=message.replace("(", r"\(")) as e:
            read_hf_config(base | extra)
        assert "\n" not in str(e.value)


def test_a_config_json_says_only_what_its_family_can():
    cfg = read_hf_config(RELEASES["Qwen2.5-7B"][1]).decoder
    with pytest.raises(HflowError, match="a llama config.json cannot hold q/k/v bias True with o bias False"):
        hf_config(cfg.model_copy(update={"family": "llama"}))
    with pytest.raises(HflowError, match="a llama config.json cannot hold experts"):
        hf_config(read_hf_config(RELEASES["Mixtral-8x7B-v0.1"][1]).decoder.model_copy(update={"family": "llama"}))
    assert set(FAMILIES) == {"llama", "mistral", "qwen2", "qwen3", "mixtral"}


def test_search_refuses_an_unsupported_folder_at_plan_time(tmp_path, capsys):
    (tmp_path / "config.json").write_text(json.dumps({
        "architectures": ["GPT2LMHeadModel"], "model_type": "gpt2", "n_layer": 2, "n_embd": 64}))
    assert main(["search", "--nodes", "1", "--model", str(tmp_path)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "model_type 'gpt2' is not supported; supported: llama, mistral, qwen2, qwen3" in err[0]
    # A supported family plans.
    (tmp_path / "config.json").write_text(json.dumps(RELEASES["Qwen3-8B"][1]))
    assert main(["search", "--nodes", "1", "--model", str(tmp_path), "--batch", "64", "--json", "--top", "1"]) == 0


def test_expert_parallelism_is_megatrons_and_divides_experts_and_dp():
    from pydantic import ValidationError

    from hybridflow.simulator.vocabulary.parallel import ParallelConfig

    with pytest.raises(ValidationError, match="expert parallelism runs on the megatron backend"):
        ParallelConfig(dp=4, ep=2)
    moe, dense = MODEL_PRESETS["mixtral-8x7b"], MODEL_PRESETS["llama2-7b"]
    ok = ParallelConfig(tp=2, dp=4, ep=4, backend="megatron")
    assert ok.problems(moe) == [] and ok.world_size == 8 and str(ok) == "pp1·tp2·dp4·ep4"
    assert ok.generation_layout() == ParallelConfig(tp=2, dp=4)
    assert "ep=4 must divide the experts (8) and dp=2" in ParallelConfig(dp=2, ep=4, backend="megatron").problems(moe)[0]
    assert "a dense model" in ParallelConfig(dp=2, ep=2, backend="megatron").problems(dense)[0]


def test_megatron_memory_splits_the_experts_over_ep():
    from hybridflow.simulator.pricing.memory import state_bytes
    from hybridflow.simulator.vocabulary.parallel import ParallelConfig

    moe = MODEL_PRESETS["mixtral-8x7b"]
    assert moe.expert_params() == 32 * 8 * 3 * 4096 * 14336 and MODEL_PRESETS["llama2-7b"].expert_params() == 0
    one, four = (state_bytes(moe, "lm", ParallelConfig(tp=2, dp=4, ep=ep, backend="megatron"), True) for ep in (1, 4))
    assert one.weights - four.weights == 2 * moe.expert_params() * 3 / 4 / 2  # bf16, 3/4 of the experts, over tp
    assert one.optimizer == four.optimizer
