"""Every supported family against transformers on the same random weights (family_util.CASES):
logits (fp32, ≤ 1e-5), greedy generation token-exact (native engine, batched, left-padded), the
scalar head of each family's ForSequenceClassification, save → transformers reload, sharded save →
our reload, bf16 folders. tp = 2 / dp = 2 training: test_family_training.py."""

from __future__ import annotations

import pytest
import torch

transformers = pytest.importorskip("transformers")

from family_util import CASES, SCORE_CASES, hf_config, hf_model, token_batch  # noqa: E402

from hybridflow.runtime.engines.rollout.generation import GenerationEngine, SamplingParams  # noqa: E402
from hybridflow.runtime.models.decoder import CausalLM, ScoreModel, num_params  # noqa: E402
from hybridflow.runtime.models.folder_check import INDEX_FILE, WEIGHTS_FILE  # noqa: E402
from hybridflow.runtime.models.hf_format import load_pretrained, save_pretrained  # noqa: E402
from hybridflow.simulator.vocabulary.families import read_hf_config, tensor_shapes  # noqa: E402
from hybridflow.simulator.vocabulary.model import ModelSpec  # noqa: E402

torch.set_num_threads(1)


def _ours_from_hf(hf, tmp_path, **load):
    hf.save_pretrained(tmp_path / "hf")
    return load_pretrained(tmp_path / "hf", **load).eval()


def _max_diff(a, b, mask=None):
    d = (a - b).abs()
    if mask is not None:
        d = d * mask.reshape(*mask.shape, *([1] * (d.dim() - mask.dim())))
    return d.max().item()


@pytest.mark.parametrize("case", list(CASES))
def test_logits_equal_transformers(tmp_path, case):
    hf = hf_model(case)
    ours = _ours_from_hf(hf, tmp_path)
    assert type(ours) is CausalLM and ours.config.family == type(hf).__name__.removesuffix("ForCausalLM").lower()
    ids, mask = token_batch()
    with torch.no_grad():
        assert _max_diff(hf(ids).logits, ours(ids)) <= 1e-5
        # Left padding: both sides get the same positions; compare the real tokens only.
        ref = hf(ids, attention_mask=mask, position_ids=(mask.cumsum(-1) - 1).clamp(min=0)).logits
        assert _max_diff(ref, ours(ids, attention_mask=mask), mask) <= 1e-5
    # The same parameters, counted three ways: ours, transformers', the simulator's.
    spec = ModelSpec.from_decoder_config(ours.config, case)
    assert num_params(ours) == hf.num_parameters() == spec.num_params("lm")
    expected = tensor_shapes(ours.config, "lm")
    if ours.config.tie_word_embeddings:
        expected["lm_head.weight"] = expected["model.embed_tokens.weight"]
    assert {k: tuple(v.shape) for k, v in ours.state_dict().items()} == expected


@pytest.mark.parametrize("case", SCORE_CASES)
def test_score_head_equals_transformers_sequence_classification(tmp_path, case):
    hf = hf_model(case, head="scalar")
    ours = _ours_from_hf(hf, tmp_path)
    assert type(ours) is ScoreModel and not ours.score.bias.detach().any()  # HF's score has no bias
    ids, mask = token_batch()
    with torch.no_grad():
        hidden = hf.model(ids, attention_mask=mask, position_ids=(mask.cumsum(-1) - 1).clamp(min=0)).last_hidden_state
        ref = (hidden @ hf.score.weight.T).squeeze(-1)
        assert _max_diff(ref, ours(ids, attention_mask=mask), mask) <= 1e-5
    assert num_params(ours) == hf.num_parameters() + 1 == ModelSpec.from_decoder_config(ours.config, case).num_params(
        "scalar")
    # transformers reads what we write (ignoring our score bias), with the same scores.
    with torch.no_grad():
        ours.score.bias.zero_()
    save_pretrained(ours, tmp_path / "ours")
    again = transformers.AutoModelForSequenceClassification.from_pretrained(tmp_path / "ours", dtype=torch.float32)
    with torch.no_grad():
        assert _max_diff(again.model(ids).last_hidden_state @ again.score.weight.T, ours(ids)[..., None]) <= 1e-5


@pytest.mark.parametrize("case", list(CASES))
def test_greedy_generation_equals_transformers_generate(tmp_path, case):
    hf = hf_model(case)
    ours = _ours_from_hf(hf, tmp_path)
    ids, mask = token_batch(length=9)
    new = 10  # 9 + 10 positions: past Mistral's window of 6, so the windowed module path runs there
    with torch.no_grad():
        ref = hf.generate(ids, attention_mask=mask, max_new_tokens=new, do_sample=False, eos_token_id=2,
                          pad_token_id=0)[:, ids.shape[1]:]
    got = GenerationEngine(ours).generate(ids, mask, SamplingParams(max_new_tokens=new, greedy=True, eos_token_id=2,
                                                                    pad_token_id=0)).response
    assert torch.equal(got[:, :ref.shape[1]], ref) and (got[:, ref.shape[1]:] == 0).all()


@pytest.mark.parametrize("case", list(CASES))
def test_save_reloads_in_transformers_and_sharded(tmp_path, case):
    torch.manual_seed(3)
    ours = CausalLM(read_hf_config(hf_config(case).to_dict()).decoder).eval()
    save_pretrained(ours, tmp_path / "one")
    assert (tmp_path / "one" / WEIGHTS_FILE).is_file()
    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "one", dtype=torch.float32).eval()
    assert type(hf).__name__ == read_hf_config(hf.config.to_dict()).family.causal_lm
    ids, _ = token_batch()
    with torch.no_grad():
        assert _max_diff(hf(ids).logits, ours(ids)) <= 1e-5
    # Sharded (a small limit per shard) and read back exactly; the index names every tensor.
    save_pretrained(ours, tmp_path / "sharded", max_shard_bytes=40_000)
    assert not (tmp_path / "sharded" / WEIGHTS_FILE).exists() and (tmp_path / "sharded" / INDEX_FILE).is_file()
    assert len(list((tmp_path / "sharded").glob("model-*-of-*.safetensors"))) > 2
    again = load_pretrained(tmp_path / "sharded")
    assert again.config == ours.config
    for (n1, p1), (n2, p2) in zip(ours.state_dict().items(), again.state_dict().items(), strict=True):
        assert n1 == n2 and torch.equal(p1, p2)
    sharded_hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "sharded", dtype=torch.float32)
    with torch.no_grad():
        assert torch.equal(sharded_hf(ids).logits, hf(ids).logits)


@pytest.mark.parametrize("case", ["llama3.1", "qwen3-tied"])
def test_bf16_folders_read_into_the_requested_dtype(tmp_path, case):
    hf = hf_model(case).to(torch.bfloat16)
    hf.save_pretrained(tmp_path / "bf16")
    fp32 = load_pretrained(tmp_path / "bf16")
    bf16 = load_pretrained(tmp_path / "bf16", dtype=torch.bfloat16)
    ref = hf.state_dict()
    for name, p in fp32.state_dict().items():
        assert p.dtype == torch.float32 and torch.equal(p, ref[name].float()), name
        assert bf16.state_dict()[name].dtype == torch.bfloat16
    assert fp32.model.inv_freq.dtype == bf16.model.inv_freq.dtype == torch.float32  # RoPE stays exact
    save_pretrained(fp32, tmp_path / "again", dtype=torch.bfloat16)  # and written back as bf16
    for name, p in load_pretrained(tmp_path / "again", dtype=torch.bfloat16).state_dict().items():
        assert torch.equal(p, ref[name]), name
