"""The torch-free model-folder check: a good sharded folder passes, each bad folder is one line."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import textwrap

import pytest
import torch

transformers = pytest.importorskip("transformers")
tokenizers = pytest.importorskip("tokenizers")

from hybridflow.runtime.models.folder_check import INDEX_FILE, check_model_folder  # noqa: E402
from hybridflow.simulator.errors import HflowError  # noqa: E402

SHAPE = dict(vocab_size=61, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2)


def _tokenizer(n_tokens: int):
    from tokenizers.models import WordLevel
    from tokenizers.pre_tokenizers import Whitespace

    vocab = {"<unk>": 0} | {f"w{i}": i for i in range(1, n_tokens)}
    tok = tokenizers.Tokenizer(WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = Whitespace()
    return tok


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    """A sharded Qwen2 causal-LM folder with a tokenizer, and a Qwen2 score-model folder."""
    root = tmp_path_factory.mktemp("folders")
    torch.manual_seed(0)
    lm = transformers.Qwen2ForCausalLM(transformers.Qwen2Config(**SHAPE))
    lm.save_pretrained(root / "lm", max_shard_size="20KB")
    _tokenizer(50).save(str(root / "lm" / "tokenizer.json"))
    score = transformers.Qwen2ForSequenceClassification(transformers.Qwen2Config(num_labels=1, **SHAPE))
    score.save_pretrained(root / "score")
    _tokenizer(50).save(str(root / "score" / "tokenizer.json"))
    return root


def _copy(folders, name, tmp_path):
    return shutil.copytree(folders / name, tmp_path / name)


def test_a_good_sharded_folder_passes(folders):
    info = check_model_folder(folders / "lm", "actor")
    assert info.config.family.name == "qwen2" and info.config.head == "lm"
    assert len(info.weight_files) > 1 and (folders / "lm" / INDEX_FILE).is_file()
    assert info.max_token_id == 49 and info.tokenizer_file.name == "tokenizer.json"
    assert "model.layers.1.self_attn.q_proj.bias" in info.tensors
    # A critic may start from a causal LM or a score model; reward and cost need a score model.
    assert check_model_folder(folders / "lm", "critic").config.head == "lm"
    for role in ("critic", "reward", "cost"):
        assert check_model_folder(folders / "score", role).config.head == "scalar"


def test_the_check_is_torch_free_and_fast(folders):
    code = textwrap.dedent(f"""
        import sys, time
        from hybridflow.runtime.models.folder_check import check_model_folder
        start = time.perf_counter()
        check_model_folder({str(folders / "lm")!r}, "actor")
        took = time.perf_counter() - start
        assert "torch" not in sys.modules, "folder_check imported torch"
        print(took)
    """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=os.environ, timeout=60)
    assert out.returncode == 0, out.stderr
    assert float(out.stdout) < 0.5


def _one_line(path, role, match):
    with pytest.raises(HflowError, match=match) as e:
        check_model_folder(path, role)
    assert "\n" not in str(e.value)


def test_config_errors(folders, tmp_path):
    _one_line(tmp_path / "nowhere", "actor", "no such folder")
    (tmp_path / "empty").mkdir()
    _one_line(tmp_path / "empty", "actor", "no config.json")
    bad = _copy(folders, "lm", tmp_path)
    (bad / "config.json").write_text("{not json")
    _one_line(bad, "actor", "not valid JSON")
    cfg = json.loads((folders / "lm" / "config.json").read_text())
    (bad / "config.json").write_text(json.dumps(cfg | {"model_type": "gpt2", "architectures": ["GPT2LMHeadModel"]}))
    _one_line(bad, "actor", "model_type 'gpt2' is not supported; supported: llama, mistral, qwen2, qwen3")
    (bad / "config.json").write_text(json.dumps(cfg | {"architectures": ["Qwen2ForTokenClassification"]}))
    _one_line(bad, "actor", "architecture 'Qwen2ForTokenClassification' is not supported; supported: .*Qwen3ForCausalLM")


def test_role_and_architecture_must_agree(folders):
    _one_line(folders / "lm", "reward", "the reward needs a .*ForSequenceClassification model, but config.json says "
              "Qwen2ForCausalLM")
    _one_line(folders / "score", "actor", "the actor needs a causal LM")
    _one_line(folders / "lm", "policy", "unknown role 'policy'")


def test_weight_errors(folders, tmp_path):
    bad = _copy(folders, "lm", tmp_path)
    shards = sorted(bad.glob("model-*.safetensors"))
    # Truncated: the last shard loses its tail.
    data = shards[-1].read_bytes()
    shards[-1].write_bytes(data[:-100])
    _one_line(bad, "actor", f"{shards[-1].name}: truncated")
    shards[-1].write_bytes(data[:5])
    _one_line(bad, "actor", "truncated or not a safetensors file")
    # A shard the index names is gone.
    shards[-1].unlink()
    _one_line(bad, "actor", f"names shard {shards[-1].name}, which is not in the folder")
    # No weights at all.
    for f in [*bad.glob("*.safetensors"), bad / INDEX_FILE]:
        f.unlink()
    _one_line(bad, "actor", "no weights here")


def test_tensors_the_config_needs(folders, tmp_path):
    bad = _copy(folders, "lm", tmp_path)
    cfg = json.loads((bad / "config.json").read_text())
    (bad / "config.json").write_text(json.dumps(cfg | {"num_hidden_layers": 3, "layer_types": None}))
    _one_line(bad, "actor", r"lack 1[0-9] tensor\(s\) config.json needs \(model.layers.2.")
    (bad / "config.json").write_text(json.dumps(cfg | {"intermediate_size": 64}))
    _one_line(bad, "actor", "has shape .* but config.json implies")
    (bad / "config.json").write_text(json.dumps(cfg | {"num_hidden_layers": 1, "layer_types": None}))
    _one_line(bad, "actor", r"hold 1[0-9] tensor\(s\) config.json does not describe \(model.layers.1.")


def test_tokenizer_present_and_consistent(folders, tmp_path):
    bad = _copy(folders, "lm", tmp_path)
    (bad / "tokenizer.json").unlink()
    _one_line(bad, "actor", "no tokenizer here")
    assert check_model_folder(bad, "actor", tokenizer=False).max_token_id is None
    _tokenizer(80).save(str(bad / "tokenizer.json"))
    _one_line(bad, "actor", "largest token id 79 does not fit the model's embedding \\(vocab_size 61\\)")
    (bad / "tokenizer.json").unlink()
    (bad / "hflow_tokenizer.json").write_text(json.dumps({"type": "char", "specials": ["<pad>"], "chars": "a" * 70}))
    _one_line(bad, "actor", "largest token id 70 does not fit")
