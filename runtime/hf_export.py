"""Hugging Face folders out of training: from a live engine (every rank calls, rank 0 writes) or from a
saved checkpoint (one process, no Ray, no process group).

A checkpoint's role folder (`iter_N/actor`, `iter_N/critic`: see TrainingEngine.save) holds the sharded
DCP weights and, beside them, the `config.json`, `generation_config.json` and tokenizer files of the
folder the role was loaded from (`copy_model_files`), so a checkpoint copied to another machine still
exports without the original folder. The export class follows the role, not the source folder: a
critic started from a causal-LM folder is exported as a scalar-head model.
"""

from __future__ import annotations

import shutil
import warnings
from pathlib import Path

import torch

from hybridflow.simulator.errors import HflowError
from hybridflow.simulator.plan import role_head

from .models.hf_format import read_config
from .models.hf_format import save_pretrained as _save_weights
from .models.llama import LlamaForCausalLM, LlamaForScore

MODEL_CLASS = {"lm": LlamaForCausalLM, "scalar": LlamaForScore}
# What travels with the weights: the model's description and its tokenizer (not the weights).
MODEL_FILES = ("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json",
               "special_tokens_map.json", "vocab.json", "merges.txt", "tokenizer.model", "added_tokens.json",
               "chat_template.jinja", "hflow_tokenizer.json")


def copy_model_files(source: str | Path, dest: str | Path) -> None:
    """Copy the source folder's config and tokenizer files (those it has) into `dest`."""
    dest = Path(dest)
    dest.mkdir(parents=True, exist_ok=True)
    for name in MODEL_FILES:
        f = Path(source) / name
        if f.is_file():
            tmp = dest / f".{name}.tmp"
            shutil.copyfile(f, tmp)
            tmp.replace(dest / name)


def save_pretrained(model, folder, *, source):  # TEMPORARY until branch `models`' save_pretrained(source=)
    out = _save_weights(model, folder)
    for name in MODEL_FILES[1:]:
        if (Path(source) / name).is_file():
            shutil.copyfile(Path(source) / name, Path(folder) / name)
    return out


def model_for_export(role: str, config, state: dict[str, torch.Tensor]):
    """The role's model class holding `state` without a second copy: built on the meta device and the
    whole tensors assigned. Only for writing: its non-persistent buffers (RoPE) stay on meta."""
    with torch.device("meta"):
        model = MODEL_CLASS[role_head(role)](config)
    if hasattr(model, "lm_head") and getattr(config, "tie_word_embeddings", False):
        state = {**state, "lm_head.weight": state["model.embed_tokens.weight"]}
    missing, unexpected = model.load_state_dict(state, strict=False, assign=True)
    if missing or unexpected:
        what = f"missing {missing[:3]}" if missing else f"unexpected {unexpected[:3]}"
        raise HflowError(f"{role}: the weights do not match the model's config ({what})")
    return model


def export_engine(engine, role: str, folder: str | Path, source: str | Path, rank: int) -> Path | None:
    """Write a training engine's current weights as an HF folder. A collective (gathering the shards):
    call it on every rank of the engine's group; rank 0 writes and returns the folder."""
    state = engine.full_state_dict(rank0_only=True)
    if rank != 0:
        return None
    config = engine.model.config
    return save_pretrained(model_for_export(role, config, state), folder, source=source)


# ---- from a saved checkpoint -------------------------------------------------------------------


def load_checkpoint_model(role_folder: str | Path, role: str):
    """A role's model from its checkpoint folder, whole, in this process: DCP reads every shard of the
    saved layout into the unsharded state dict (only the model's entries; the optimizer stays on disk)."""
    import torch.distributed.checkpoint as dcp

    folder = Path(role_folder)
    config, _ = read_config(folder)
    with torch.device("meta"):
        shapes = MODEL_CLASS[role_head(role)](config).state_dict()
    state = {k: torch.empty(v.shape, dtype=v.dtype) for k, v in shapes.items()}
    if getattr(config, "tie_word_embeddings", False):
        state.pop("lm_head.weight", None)
    try:
        with warnings.catch_warnings():  # "assuming the intent is to load in a single process": it is
            warnings.filterwarnings("ignore", message=".*single process.*")
            dcp.load({"model": state}, checkpoint_id=str(folder / "dcp"), no_dist=True)
    except Exception as e:  # DCP wraps every failure (missing key, size mismatch, unreadable file) in its own
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise HflowError(f"{folder / 'dcp'}: cannot read the {role}'s weights ({first[:200]})") from None
    return model_for_export(role, config, state)


def export_checkpoint(roles: dict[str, Path], out: str | Path) -> dict[str, Path]:
    """A checkpoint's trained roles ({role: its folder in the checkpoint}) as HF folders out/role."""
    return {role: save_pretrained(load_checkpoint_model(folder, role), Path(out) / role, source=folder)
            for role, folder in roles.items()}
