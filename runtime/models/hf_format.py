"""Read and write the Hugging Face format: a folder with `config.json` + `model.safetensors`.

Our parameter names are HF's, so a checkpoint is the state dict as is. A causal LM is written
as `LlamaForCausalLM`; a scalar-head model as `LlamaForSequenceClassification` with
`num_labels = 1` (HF's `score` has no bias: ours has one, written as `score.bias`, which
transformers ignores with a warning; reading an HF checkpoint without it starts the bias at 0).
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save

from hybridflow.simulator.errors import HflowError
from hybridflow.simulator.io import write_atomic

from .llama import LlamaConfig, LlamaForCausalLM, LlamaForScore

CONFIG_FILE = "config.json"
WEIGHTS_FILE = "model.safetensors"
_ARCH = {"LlamaForCausalLM": LlamaForCausalLM, "LlamaForSequenceClassification": LlamaForScore}


def config_to_hf(cfg: LlamaConfig, architecture: str = "LlamaForCausalLM", dtype: str = "float32") -> dict:
    """A transformers-compatible `config.json` mapping (readable by transformers 4.x and 5.x)."""
    d = cfg.model_dump()
    theta = d.pop("rope_theta")
    d["head_dim"] = cfg.dim_head
    d.update(
        architectures=[architecture], model_type="llama", hidden_act="silu", torch_dtype=dtype, dtype=dtype,
        rope_theta=theta, rope_parameters={"rope_type": "default", "rope_theta": theta},
        attention_dropout=0.0, use_cache=True,
    )
    if architecture == "LlamaForSequenceClassification":
        d.update(num_labels=1, id2label={"0": "LABEL_0"}, label2id={"LABEL_0": 0})
    return d


def config_from_hf(hf: dict, source: str = "config.json") -> LlamaConfig:
    """Our config from an HF `config.json` mapping; one-line HflowError for what we cannot run."""
    if hf.get("model_type", "llama") != "llama":
        raise HflowError(f"{source}: model_type '{hf.get('model_type')}' is not supported; only 'llama' "
                         "(Llama-architecture) checkpoints can be loaded")
    if hf.get("hidden_act", "silu") != "silu":
        raise HflowError(f"{source}: hidden_act '{hf['hidden_act']}' is not supported; Llama uses 'silu'")
    rope = hf.get("rope_parameters") or hf.get("rope_scaling") or {}
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    if rope_type != "default":
        raise HflowError(f"{source}: rope_type '{rope_type}' is not supported; only default RoPE is "
                         "implemented (remove rope_scaling or use a model without it)")
    theta = rope.get("rope_theta", hf.get("rope_theta", 10000.0))
    fields = {k: hf[k] for k in LlamaConfig.model_fields if k in hf and hf[k] is not None}
    fields["rope_theta"] = theta
    fields.setdefault("num_key_value_heads", hf.get("num_attention_heads"))
    try:
        return LlamaConfig(**fields)
    except Exception as e:  # pydantic ValidationError or a missing field
        first = str(e).splitlines()
        raise HflowError(f"{source}: not a valid Llama config ({' '.join(first[:3])})") from None


def save_pretrained(model: LlamaForCausalLM | LlamaForScore, path: str | Path) -> Path:
    """Write `config.json` and `model.safetensors` to the folder `path` (atomically, each file).

    A sharded (DTensor) model is gathered first: `full_tensor` is a collective, so call this on
    every rank of its mesh (writing from rank 0 only is enough, the others may pass a scratch path).
    """
    arch = "LlamaForSequenceClassification" if isinstance(model, LlamaForScore) else "LlamaForCausalLM"
    state = {}
    for name, t in model.state_dict().items():
        if name == "lm_head.weight" and model.config.tie_word_embeddings:
            continue  # safetensors refuses shared storage; HF re-ties on load
        if hasattr(t, "full_tensor"):  # a DTensor shard (tensor-/data-parallel): gather the whole
            t = t.full_tensor()
        state[name] = t.detach().to("cpu").contiguous()
    out = Path(path)
    write_atomic(out / WEIGHTS_FILE, save(state, metadata={"format": "pt"}))
    dtype = str(next(iter(state.values())).dtype).removeprefix("torch.")
    write_atomic(out / CONFIG_FILE, json.dumps(config_to_hf(model.config, arch, dtype), indent=2) + "\n")
    return out


def read_config(path: str | Path) -> tuple[LlamaConfig, str]:
    """(config, architecture) of an HF model folder."""
    p = Path(path) / CONFIG_FILE
    if not p.is_file():
        raise HflowError(f"{Path(path)}: no {CONFIG_FILE} here; pass a folder written by save_pretrained "
                         "or by transformers")
    try:
        hf = json.loads(p.read_text())
    except json.JSONDecodeError:
        raise HflowError(f"{p}: not valid JSON; a Hugging Face config.json is expected") from None
    arch = (hf.get("architectures") or ["LlamaForCausalLM"])[0]
    if arch not in _ARCH:
        raise HflowError(f"{p}: architecture '{arch}' is not supported; expected one of {', '.join(_ARCH)}")
    return config_from_hf(hf, str(p)), arch


def load_pretrained(path: str | Path, dtype: torch.dtype = torch.float32,
                    device: str | torch.device = "cpu") -> LlamaForCausalLM | LlamaForScore:
    """Build the model a folder describes and load its weights (strictly: every tensor must fit)."""
    cfg, arch = read_config(path)
    wfile = Path(path) / WEIGHTS_FILE
    if not wfile.is_file():
        raise HflowError(f"{Path(path)}: no {WEIGHTS_FILE} here; sharded or .bin checkpoints are not "
                         "supported, re-save with save_pretrained(safe_serialization=True)")
    try:
        state = load_file(str(wfile), device=str(device))
    except SafetensorError as e:
        raise HflowError(f"{wfile}: unreadable safetensors file ({e})") from None
    model = _ARCH[arch](cfg)
    if isinstance(model, LlamaForScore) and "score.bias" not in state:
        state["score.bias"] = torch.zeros(1)
    if cfg.tie_word_embeddings:
        state.pop("lm_head.weight", None)
    model = model.to(device=device, dtype=dtype)
    missing, unexpected = model.load_state_dict(state, strict=False)
    if cfg.tie_word_embeddings:
        missing = [k for k in missing if k != "lm_head.weight"]
    if missing or unexpected:
        what = f"missing {missing[:3]}" if missing else f"unexpected {unexpected[:3]}"
        raise HflowError(f"{wfile}: weights do not match the config ({what}); the checkpoint and "
                         "config.json must describe the same model")
    return model
