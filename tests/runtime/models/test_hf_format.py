"""HF folders written as a whole, with what a model folder carries; heads loaded by role."""

from __future__ import annotations

import json

import pytest
import torch

transformers = pytest.importorskip("transformers")

from hybridflow.runtime.models import hf_format  # noqa: E402
from hybridflow.runtime.models.decoder import CausalLM, ScoreModel  # noqa: E402
from hybridflow.runtime.models.hf_format import CARRIED_FILES, load_pretrained, save_pretrained  # noqa: E402
from hybridflow.simulator.errors import HflowError  # noqa: E402
from hybridflow.simulator.vocabulary.model import model_preset  # noqa: E402


def _model(seed=0, **overrides) -> CausalLM:
    torch.manual_seed(seed)
    return CausalLM(model_preset("tiny").decoder_config(num_hidden_layers=2, **overrides)).eval()


def test_a_resave_carries_generation_config_tokenizer_files_and_token_ids(tmp_path):
    src = save_pretrained(_model(), tmp_path / "src")
    config = json.loads((src / "config.json").read_text())
    (src / "config.json").write_text(json.dumps(config | {"bos_token_id": 1, "eos_token_id": [2, 3],
                                                          "pad_token_id": 0}))
    transformers.GenerationConfig(bos_token_id=1, eos_token_id=[2, 3], pad_token_id=0).save_pretrained(src)
    for name in CARRIED_FILES[1:]:  # everything but generation_config.json: stand-ins, copied byte for byte
        (src / name).write_text(f"{name} of the source\n")
    out = save_pretrained(_model(seed=1), tmp_path / "out", source=src)
    for name in CARRIED_FILES:
        assert (out / name).read_bytes() == (src / name).read_bytes(), name
    written = json.loads((out / "config.json").read_text())
    assert (written["bos_token_id"], written["eos_token_id"], written["pad_token_id"]) == (1, [2, 3], 0)
    assert transformers.GenerationConfig.from_pretrained(out).eos_token_id == [2, 3]
    # Saving over the source itself keeps them too.
    save_pretrained(_model(seed=2), src, source=src)
    assert (src / "tokenizer.json").read_text() == "tokenizer.json of the source\n"


def test_a_folder_is_replaced_only_once_the_new_one_is_complete(tmp_path, monkeypatch):
    out = save_pretrained(_model(), tmp_path / "m")
    (out / "stale.txt").write_text("from an earlier save")
    before = {p.name: p.read_bytes() for p in out.iterdir()}
    real_save = hf_format.save_file
    calls = []

    def failing_save(tensors, filename, metadata=None):  # the disk fills up at the second shard
        calls.append(filename)
        if len(calls) == 2:
            raise OSError(28, "No space left on device")
        real_save(tensors, filename, metadata=metadata)

    monkeypatch.setattr(hf_format, "save_file", failing_save)
    with pytest.raises(OSError):
        save_pretrained(_model(seed=1), out, max_shard_bytes=50_000)
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before  # untouched
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m"]  # no temporary folder left behind
    monkeypatch.setattr(hf_format, "save_file", real_save)
    save_pretrained(_model(seed=1), out)
    assert not (out / "stale.txt").exists()  # the folder is the new one as a whole
    assert torch.equal(load_pretrained(out).lm_head.weight, _model(seed=1).lm_head.weight)
    with pytest.raises(HflowError, match="exists and is not a folder"):
        save_pretrained(_model(), out / "config.json")


def test_heads_by_role(tmp_path):
    policy = save_pretrained(_model(), tmp_path / "policy")
    critic = load_pretrained(policy, head="scalar")  # the policy's backbone, a zero value head
    assert type(critic) is ScoreModel and not critic.score.weight.any() and not critic.score.bias.any()
    assert torch.equal(critic.model.embed_tokens.weight, _model().model.embed_tokens.weight)
    scorer = save_pretrained(critic, tmp_path / "critic")
    with pytest.raises(HflowError, match="a score model .* cannot be a causal LM"):
        load_pretrained(scorer, head="lm")
    config = json.loads((policy / "config.json").read_text())
    (policy / "config.json").write_text(json.dumps(config | {"intermediate_size": 256}))
    with pytest.raises(HflowError, match=r"has shape \[512, 128\] but config.json implies \[256, 128\]"):
        load_pretrained(policy)
    (policy / "config.json").write_text(json.dumps(config | {"model_type": "qwen3", "architectures": ["Qwen3ForCausalLM"]}))
    with pytest.raises(HflowError, match=r"weights do not match config.json \(missing \['model.layers.0.self_attn.q_norm"):
        load_pretrained(policy)
