"""Read and write the Hugging Face format: `config.json` + safetensors (one file, or shards + index).

Our parameter names are HF's, so a checkpoint is the state dict as is. `config.json` is read and
written through the family registry (simulator/vocabulary/families.py): a causal LM is written as its
family's `*ForCausalLM`, a scalar-head model as `*ForSequenceClassification` with one label (HF's
`score` has no bias: ours has one, written as `score.bias`, which transformers ignores with a
warning; reading an HF checkpoint without it starts the bias at 0). Weights are read in any
floating dtype (bf16, fp16, fp32) into the one requested.

A folder is written as a whole (simulator.io.atomic_folder): an existing one is replaced only once
the new one is complete. `source` carries over what a re-save must not drop: the generation
config, the tokenizer files and the bos/eos/pad ids of the source's config.json.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file

from hybridflow.runtime.models.decoder import CausalLM, ScoreModel
from hybridflow.runtime.models.folder_check import (
    CONFIG_FILE,
    HFLOW_TOKENIZER_FILE,
    IGNORED_TENSOR_SUFFIXES,
    INDEX_FILE,
    WEIGHTS_FILE,
    read_folder_config,
    read_json,
    weight_files,
)
from hybridflow.simulator.errors import HflowError
from hybridflow.simulator.io import atomic_folder
from hybridflow.simulator.vocabulary.decoder_config import DecoderConfig, Head
from hybridflow.simulator.vocabulary.families import hf_config

# What a model folder holds besides config and weights, copied as it is on a re-save.
CARRIED_FILES = ("generation_config.json", "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
                 "vocab.json", "merges.txt", "tokenizer.model", "added_tokens.json", "chat_template.jinja",
                 "chat_template.json", HFLOW_TOKENIZER_FILE)
TOKEN_ID_KEYS = ("bos_token_id", "eos_token_id", "pad_token_id")
DEFAULT_MAX_SHARD_BYTES = 5 * 10**9  # transformers' long-standing default ("5GB")


def read_config(path: str | Path) -> tuple[DecoderConfig, Head]:
    """(decoder config, head) of an HF model folder; one-line HflowError for what we cannot run."""
    cfg = read_folder_config(path)
    return cfg.decoder, cfg.head


def read_weights(path: str | Path, dtype: torch.dtype = torch.float32,
                    device: str | torch.device = "cpu") -> dict[str, torch.Tensor]:
    """Every tensor of a folder's safetensors file(s), floating ones in `dtype`."""
    state: dict[str, torch.Tensor] = {}
    for f in weight_files(path):
        try:
            part = load_file(str(f), device=str(device))
        except (SafetensorError, OSError) as e:
            raise HflowError(f"{f}: unreadable safetensors file ({str(e).splitlines()[0]}); re-copy it") from None
        state |= {k: v.to(dtype) if v.is_floating_point() else v for k, v in part.items()}
    return state


def load_pretrained(path: str | Path, dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu",
                    head: Head | None = None) -> CausalLM | ScoreModel:
    """Build the model a folder describes and load its weights (strictly: every tensor must fit).

    `head` None: the folder's own. `head="scalar"` on a causal-LM folder gives its backbone with a
    zero scalar head (values start at 0: the usual critic initialisation from the policy).
    """
    cfg, own = read_config(path)
    head = head or own
    if head == "lm" and own == "scalar":
        raise HflowError(f"{path}: a score model (*ForSequenceClassification) cannot be a causal LM; give a "
                         "*ForCausalLM folder for the policy")
    state = {k: v for k, v in read_weights(path, dtype, device).items()
             if not k.endswith(IGNORED_TENSOR_SUFFIXES)}
    if head == "scalar":
        state = {k: v for k, v in state.items() if not k.startswith("lm_head.")}
        fresh = {"score.weight": torch.zeros(1, cfg.hidden_size, dtype=dtype, device=device)} if own == "lm" else {}
        state = fresh | {"score.bias": torch.zeros(1, dtype=dtype, device=device)} | state
    elif cfg.tie_word_embeddings:
        state.pop("lm_head.weight", None)  # the head is the embedding
    model = (CausalLM if head == "lm" else ScoreModel).empty(cfg, device, dtype)
    shapes = {k: v.shape for k, v in model.state_dict().items()}
    wrong = [k for k, shape in shapes.items() if k in state and state[k].shape != shape]
    if wrong:
        k = wrong[0]
        raise HflowError(f"{path}: tensor {k} has shape {list(state[k].shape)} but config.json implies "
                         f"{list(shapes[k])}; the checkpoint and config.json must describe the same model")
    missing, unexpected = model.load_state_dict(state, strict=False)
    if cfg.tie_word_embeddings:
        missing = [k for k in missing if k != "lm_head.weight"]
    if missing or unexpected:
        what = f"missing {missing[:3]}" if missing else f"unexpected {unexpected[:3]}"
        raise HflowError(f"{path}: weights do not match config.json ({what}); the checkpoint and config.json "
                         "must describe the same model")
    return model


def _shards(state: dict[str, torch.Tensor], max_bytes: int) -> list[dict[str, torch.Tensor]]:
    """Tensors in order, a new shard whenever the next would take this one over `max_bytes` (a
    tensor larger than the limit gets a shard of its own)."""
    shards: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    for name, t in state.items():
        n = t.numel() * t.element_size()
        if shards[-1] and size + n > max_bytes:
            shards.append({})
            size = 0
        shards[-1][name] = t
        size += n
    return shards


def save_pretrained(model: CausalLM | ScoreModel, path: str | Path, *, max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES,
                    dtype: torch.dtype | None = None, source: str | Path | None = None) -> Path:
    """Write the folder `path` (as a whole): `config.json`, the weights (`model.safetensors`, or
    shards of at most `max_shard_bytes` and `model.safetensors.index.json`), in `dtype` (default:
    the model's), and from the folder `source`, if given, the files a model folder carries.

    A sharded (DTensor) model is gathered first: `full_tensor` is a collective, so call this on
    every rank of its mesh (writing from rank 0 only is enough, the others may pass a scratch path).
    """
    if max_shard_bytes <= 0:
        raise HflowError(f"max_shard_bytes must be positive, got {max_shard_bytes}")
    head: Head = "scalar" if isinstance(model, ScoreModel) else "lm"
    state = {}
    for name, t in model.state_dict().items():
        if name == "lm_head.weight" and model.config.tie_word_embeddings:
            continue  # safetensors refuses shared storage; HF re-ties on load
        if hasattr(t, "full_tensor"):  # a DTensor shard (tensor-/data-parallel): gather the whole
            t = t.full_tensor()
        t = t.detach().to("cpu")
        state[name] = (t.to(dtype) if dtype is not None and t.is_floating_point() else t).contiguous()
    config = hf_config(model.config, head, str(next(iter(state.values())).dtype).removeprefix("torch."))
    src = Path(source) if source is not None else None
    if src is not None and (src / CONFIG_FILE).is_file():
        config |= {k: v for k, v in read_json(src / CONFIG_FILE, "a config.json").items() if k in TOKEN_ID_KEYS}
    out = Path(path)
    with atomic_folder(out) as tmp:
        shards = _shards(state, max_shard_bytes)
        if len(shards) == 1:
            save_file(shards[0], str(tmp / WEIGHTS_FILE), metadata={"format": "pt"})
        else:
            weight_map = {}
            for i, shard in enumerate(shards):
                name = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
                save_file(shard, str(tmp / name), metadata={"format": "pt"})
                weight_map |= dict.fromkeys(shard, name)
            total = sum(t.numel() * t.element_size() for t in state.values())
            index = {"metadata": {"total_size": total}, "weight_map": weight_map}
            (tmp / INDEX_FILE).write_text(json.dumps(index, indent=2) + "\n")
        (tmp / CONFIG_FILE).write_text(json.dumps(config, indent=2) + "\n")
        for name in CARRIED_FILES if src is not None else ():
            if (src / name).is_file():
                shutil.copy2(src / name, tmp / name)
    return out
