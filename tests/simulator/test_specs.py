import json

import pytest

from hybridflow.simulator import MODEL_PRESETS, HflowError, ModelSpec, ParallelConfig, model_preset

# Published totals (model cards / HF safetensors index), in billions of parameters.
PUBLISHED = {
    "llama2-7b": 6.738, "llama2-13b": 13.016, "llama2-70b": 68.977, "codellama-34b": 33.744,
    "llama3-8b": 8.030, "llama3-70b": 70.554, "qwen2.5-7b": 7.616, "qwen2.5-72b": 72.706,
}


@pytest.mark.parametrize("name,billions", PUBLISHED.items())
def test_preset_param_counts_within_half_a_percent(name, billions):
    n = MODEL_PRESETS[name].num_params() / 1e9
    assert abs(n - billions) / billions < 0.005


def test_llama2_7b_exact_count_by_hand():
    # embed 32000·4096 twice (untied), 32 layers of 4·4096² + 3·4096·11008 + 2·4096, final norm.
    per_layer = 4 * 4096**2 + 3 * 4096 * 11008 + 2 * 4096
    assert model_preset("llama2-7b").num_params() == 2 * 32000 * 4096 + 32 * per_layer + 4096


def test_unknown_preset_lists_known_ones():
    with pytest.raises(HflowError, match="known presets: .*llama2-7b"):
        model_preset("gpt5")


def test_from_hf_config(tmp_path):
    cfg = {"num_hidden_layers": 2, "hidden_size": 64, "num_attention_heads": 4, "num_key_value_heads": 2,
           "intermediate_size": 128, "vocab_size": 100, "tie_word_embeddings": True}
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    m = ModelSpec.from_hf_config(tmp_path, name="t")
    assert (m.layers, m.kv_heads, m.tied_embeddings) == (2, 2, True)
    assert m.kv_bytes_per_token() == 2 * 2 * 2 * 16 * 2


def test_parallel_config_must_divide():
    m = model_preset("llama2-70b")
    ParallelConfig(pp=4, tp=8, dp=2).validate_for(m, 8)
    with pytest.raises(HflowError, match="pp=3 must divide layers=80"):
        ParallelConfig(pp=3, tp=8).validate_for(m, 8)
    with pytest.raises(HflowError, match="tp=16 exceeds 8 devices per node"):
        ParallelConfig(tp=16).validate_for(model_preset("llama2-13b").model_copy(update={"heads": 64, "kv_heads": 16}), 8)
