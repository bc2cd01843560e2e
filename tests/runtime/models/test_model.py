"""The decoder (Llama options) against transformers' LlamaForCausalLM, the HF format round trip, the
config mapping to the simulator's ModelSpec, the KV cache and the scalar head. Every other family:
test_family_parity.py."""

from __future__ import annotations

import json

import pytest
import torch

transformers = pytest.importorskip("transformers")

from hybridflow.runtime.models.decoder import (  # noqa: E402
    CausalLM,
    ScoreModel,
    last_token_values,
    num_params,
    positions_from_mask,
)
from hybridflow.runtime.models.hf_format import load_pretrained, save_pretrained  # noqa: E402
from hybridflow.simulator.errors import HflowError  # noqa: E402
from hybridflow.simulator.vocabulary.families import read_hf_config  # noqa: E402
from hybridflow.simulator.vocabulary.model import ModelSpec, model_preset  # noqa: E402

torch.set_num_threads(1)

HF_SHAPES = {
    "gqa": dict(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, rope_theta=500000.0),
    "mha_bias_tied": dict(hidden_size=64, intermediate_size=80, num_hidden_layers=2, num_attention_heads=2,
                          num_key_value_heads=2, attention_bias=True, tie_word_embeddings=True),
    "head_dim": dict(hidden_size=48, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4,
                     num_key_value_heads=1, head_dim=16),
}


def _hf_model(shape: str, seed: int = 0):
    torch.manual_seed(seed)
    cfg = transformers.LlamaConfig(vocab_size=61, rms_norm_eps=1e-5, **HF_SHAPES[shape])
    model = transformers.LlamaForCausalLM(cfg).eval()
    with torch.no_grad():  # norms start at 1: perturb them so a wrong norm weight would show
        for name, p in model.named_parameters():
            if "norm" in name or name.endswith("bias"):
                p.add_(0.1 * torch.randn_like(p))
    return model


def _batch(vocab: int, seed: int = 1):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, vocab, (3, 13), generator=g)
    mask = torch.ones_like(ids)
    mask[0, :4] = 0  # left padding
    mask[2, :1] = 0
    return ids, mask


@pytest.mark.parametrize("shape", list(HF_SHAPES))
def test_logits_equal_transformers_loading_hf_checkpoint(tmp_path, shape):
    hf = _hf_model(shape)
    hf.save_pretrained(tmp_path)
    ours = load_pretrained(tmp_path).eval()
    ids, mask = _batch(61)
    with torch.no_grad():
        assert (hf(ids).logits - ours(ids)).abs().max() <= 1e-5
        # Left padding: both sides get the same positions; compare the real tokens only.
        ref = hf(ids, attention_mask=mask, position_ids=positions_from_mask(mask)).logits
        got = ours(ids, attention_mask=mask)
    assert ((ref - got).abs() * mask[..., None]).max() <= 1e-5


@pytest.mark.parametrize("shape", ["gqa", "mha_bias_tied"])
def test_transformers_loads_what_we_save(tmp_path, shape):
    torch.manual_seed(3)
    hf_cfg = transformers.LlamaConfig(vocab_size=61, **HF_SHAPES[shape])
    ours = CausalLM(read_hf_config(hf_cfg.to_dict()).decoder).eval()
    save_pretrained(ours, tmp_path)
    hf = transformers.LlamaForCausalLM.from_pretrained(tmp_path, dtype=torch.float32).eval()
    ids, _ = _batch(61)
    with torch.no_grad():
        assert (hf(ids).logits - ours(ids)).abs().max() <= 1e-5
    again = load_pretrained(tmp_path)
    for (n1, p1), (n2, p2) in zip(ours.state_dict().items(), again.state_dict().items(), strict=True):
        assert n1 == n2 and torch.equal(p1, p2)


def test_parameter_names_are_hugging_face_names():
    hf = _hf_model("gqa")
    ours = load_pretrained_from_model(hf)
    assert list(ours.state_dict()) == list(hf.state_dict())
    for name in ("model.embed_tokens", "model.layers.0.self_attn.q_proj", "model.layers.1.mlp.down_proj",
                 "model.layers.0.input_layernorm", "model.layers.0.post_attention_layernorm", "model.norm",
                 "lm_head"):
        assert ours.get_submodule(name) is not None


def load_pretrained_from_model(hf) -> CausalLM:
    ours = CausalLM(read_hf_config(hf.config.to_dict()).decoder)
    ours.load_state_dict(hf.state_dict())
    return ours


def test_config_maps_to_and_from_model_spec():
    spec = model_preset("tiny")
    cfg = spec.decoder_config()
    assert (cfg.num_hidden_layers, cfg.hidden_size, cfg.num_attention_heads, cfg.intermediate_size,
            cfg.vocab_size) == (4, 128, 4, 512, 64)
    assert ModelSpec.from_decoder_config(cfg, "tiny") == spec
    # ModelSpec's parameter count is the model's real one, for both heads.
    assert num_params(CausalLM(cfg)) == spec.num_params("lm")
    assert num_params(ScoreModel(cfg)) == spec.num_params("scalar")
    gqa = spec.decoder_config(num_key_value_heads=2)
    assert num_params(CausalLM(gqa)) == ModelSpec.from_decoder_config(gqa, "gqa").num_params()


def test_kv_cache_matches_full_forward():
    torch.manual_seed(0)
    model = CausalLM(model_preset("tiny").decoder_config(num_key_value_heads=2)).eval()
    ids, mask = _batch(64)
    with torch.no_grad():
        full = model(ids, attention_mask=mask)
        cache = model.new_cache(ids.shape[1])
        parts = [model(ids[:, :7], attention_mask=mask, cache=cache)]
        for t in range(7, ids.shape[1]):  # one token at a time, as generation does
            parts.append(model(ids[:, t:t + 1], attention_mask=mask, cache=cache))
    assert cache.length == ids.shape[1]
    assert cache.keys[0].shape == (3, 2, ids.shape[1], 32)  # sized from the (kv-head) keys it saw
    got = torch.cat(parts, dim=1)
    assert ((got - full).abs() * mask[..., None]).max() < 1e-5


def test_scalar_head_round_trip_and_last_token(tmp_path):
    torch.manual_seed(0)
    critic = ScoreModel(model_preset("tiny").decoder_config()).eval()
    with torch.no_grad():
        critic.score.bias.fill_(0.25)
    save_pretrained(critic, tmp_path)
    assert json.loads((tmp_path / "config.json").read_text())["architectures"] == ["LlamaForSequenceClassification"]
    again = load_pretrained(tmp_path).eval()
    assert isinstance(again, ScoreModel) and torch.equal(again.score.bias, critic.score.bias)
    ids, mask = _batch(64)
    with torch.no_grad():
        values = critic(ids, attention_mask=mask)
    assert values.shape == ids.shape and values.dtype == torch.float32
    right = torch.tensor([[1, 1, 0], [1, 1, 1], [0, 1, 1]])
    v = torch.arange(9.0).view(3, 3)
    assert last_token_values(v, right).tolist() == [1.0, 5.0, 8.0]
    # transformers reads the same backbone and score weight (it has no score bias).
    hf = transformers.LlamaForSequenceClassification.from_pretrained(tmp_path, dtype=torch.float32).eval()
    with torch.no_grad():
        hf_logits = hf.model(ids).last_hidden_state @ hf.score.weight.T
        assert (hf_logits.squeeze(-1) + 0.25 - critic(ids)).abs().max() <= 1e-5


def test_bad_checkpoints_raise_one_line_errors(tmp_path):
    with pytest.raises(HflowError, match="no config.json"):
        load_pretrained(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "gpt2"}))
    with pytest.raises(HflowError, match="model_type 'gpt2'"):
        load_pretrained(tmp_path)
    cfg = dict(model_type="llama", vocab_size=8, hidden_size=8, intermediate_size=8, num_hidden_layers=1,
               num_attention_heads=2, rope_scaling={"rope_type": "yarn", "factor": 8.0})
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(HflowError, match="rope_type 'yarn' is not supported for llama; supported: default, linear, "
                                         "llama3"):
        load_pretrained(tmp_path)
    cfg.pop("rope_scaling")
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(HflowError, match="no weights here"):
        load_pretrained(tmp_path)
    cfg["num_attention_heads"] = 3
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(HflowError, match="not a valid llama config"):
        load_pretrained(tmp_path)
