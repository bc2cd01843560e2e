"""Hugging Face folders out of training: from a live engine (every rank calls, rank 0 writes) or from a
saved checkpoint (one process, no Ray, no process group).

A checkpoint's role folder (`iter_N/actor`, `iter_N/critic`: see FsdpEngine.save) holds the sharded
DCP weights and, beside them, the `config.json`, `generation_config.json` and tokenizer files of the
folder the role was loaded from (`copy_model_files`), so a checkpoint copied to another machine still
exports without the original folder. The export class follows the role, not the source folder: a
critic started from a causal-LM folder is exported as a scalar-head model. The weights are written
in the dtype the source's config.json names (the fp32 training weights rounded, for a bf16 model),
so an exported model is the size of the one it started from.

A LoRA role (models/lora_files.py) is exported merged — the plain model with W + scale·B·A, which
transformers loads as it is — and its adapters beside it in peft's format, `<folder>/adapter`, for the base
model its adapter_config.json names (`PeftModel.from_pretrained(base, "<folder>/adapter")`). Its checkpoint
folder holds the same `adapter` folder, from which `export` learns the adapters' shapes.
"""

from __future__ import annotations

import tempfile
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import torch

from hybridflow.runtime.controller.locations import Location
from hybridflow.runtime.models.decoder import CausalLM, ScoreModel, rope_inv_freq
from hybridflow.runtime.models.folder_check import CONFIG_FILE, read_json
from hybridflow.runtime.models.hf_format import CARRIED_FILES, read_config, save_pretrained
from hybridflow.runtime.models.lora_files import (
    ADAPTER_FOLDER,
    lora_shapes,
    merged_state,
    read_peft_adapter_config,
    write_peft_adapter,
)
from hybridflow.simulator.errors import HflowError
from hybridflow.simulator.vocabulary.roles import role_head

MODEL_CLASS = {"lm": CausalLM, "scalar": ScoreModel}
# What a checkpoint keeps of the folder its weights came from: everything but the weights.
MODEL_FILES = (CONFIG_FILE, *CARRIED_FILES)
EXPORT_DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


def copy_model_files(source: str | Path, dest: str | Path) -> None:
    """Copy the source folder's config and tokenizer files (those it has) into `dest` (a folder or a URL)."""
    dest = Location(dest).makedirs()
    for name in MODEL_FILES:
        f = Path(source) / name
        if f.is_file():
            (dest / name).write(f.read_bytes())


def export_dtype(source: str | Path) -> torch.dtype | None:
    """The dtype the source folder's config.json names (a bf16 model comes back bf16); None: the weights' own."""
    hf = read_json(Path(source) / CONFIG_FILE, "a Hugging Face config.json")
    return EXPORT_DTYPES.get(hf.get("dtype") or hf.get("torch_dtype"))


def export(model, folder: str | Path, source: str | Path) -> Path | Location:
    """Write `model` as an HF folder (atomically, as a whole) in the source's dtype, carrying the source's
    generation config, tokenizer files and token ids. At a URL: written in a local temporary folder,
    then sent (Location.upload)."""
    target = Location(folder)
    if not target.is_remote:
        return save_pretrained(model, folder, source=source, dtype=export_dtype(source))
    with tempfile.TemporaryDirectory(prefix="hflow-export-") as tmp:
        save_pretrained(model, Path(tmp) / "model", source=source, dtype=export_dtype(source))
        return target.upload(Path(tmp) / "model")


def model_for_export(role: str, config, state: dict[str, torch.Tensor]):
    """The role's model holding `state` without a second copy: built on the meta device, the whole
    tensors assigned (a tied LM head re-tied to the embedding)."""
    with torch.device("meta"):
        model = MODEL_CLASS[role_head(role)](config)
    missing, unexpected = model.load_state_dict(state, strict=False, assign=True)
    model.tie_weights()
    if config.tie_word_embeddings:
        missing = [k for k in missing if k != "lm_head.weight"]
    if missing or unexpected:
        what = f"missing {missing[:3]}" if missing else f"unexpected {unexpected[:3]}"
        raise HflowError(f"{role}: the weights do not match the model's config ({what})")
    model.model.inv_freq = rope_inv_freq(config)  # a non-persistent buffer: not in any state dict
    return model


def export_engine(engine, role: str, folder: str | Path, source: str | Path, rank: int) -> Path | None:
    """Write a training engine's current weights as an HF folder. A collective (gathering the shards):
    call it on every rank of the engine's group; rank 0 writes and returns the folder."""
    state = engine.full_state_dict(rank0_only=True)
    if rank != 0:
        return None
    lora = getattr(engine, "lora", None)
    if lora is None:
        return export(model_for_export(role, engine.decoder_config, state), folder, source)
    written = export(model_for_export(role, engine.decoder_config, merged_state(state, lora)), folder, source)
    write_peft_adapter(Location(folder) / ADAPTER_FOLDER, state, lora, lora_targets(engine), str(source))
    return written


def lora_targets(engine) -> tuple[str, ...]:
    """The layers a LoRA engine's adapters wrap (its config's, else its family's default)."""
    from hybridflow.simulator.vocabulary.families import family

    return engine.lora.target_modules or family(engine.decoder_config.family).lora_default


# ---- from a saved checkpoint -------------------------------------------------------------------


@contextmanager
def local_model_files(folder: Location) -> Iterator[Path]:
    """A local folder with the checkpoint role folder's config and tokenizer files: the folder itself,
    or for a URL a temporary copy of those small files (the weights stay where they are)."""
    if folder.on_local_disk:
        yield Path(folder.path)
        return
    with tempfile.TemporaryDirectory(prefix="hflow-model-files-") as tmp:
        for name in MODEL_FILES:
            if (folder / name).is_file():
                (Path(tmp) / name).write_bytes((folder / name).read_bytes())
        yield Path(tmp)


def load_checkpoint_model(role_folder: str | Path | Location, role: str, files: Path | None = None):
    """A role's model from its checkpoint folder (a path or a URL), whole, in this process: DCP reads
    every shard of the saved layout into the unsharded state dict (only the model's entries; the
    optimizer stays where it is). `files`: a local copy of the folder's config (local_model_files)."""
    import torch.distributed.checkpoint as dcp

    folder = Location(role_folder)
    config, _ = read_config(files or folder.path)
    with torch.device("meta"):
        shapes = MODEL_CLASS[role_head(role)](config).state_dict()
    lora = read_peft_adapter_config(folder / ADAPTER_FOLDER)  # a LoRA role's checkpoint: its adapters' shapes
    if lora is not None:
        dtypes = {k: v.dtype for k, v in shapes.items()}
        shapes = {k: torch.empty(s, dtype=dtypes.get(k.replace(".base_layer.", "."), torch.float32), device="meta")
                  for k, s in lora_shapes({k: v.shape for k, v in shapes.items()}, *lora).items()}
    state = {k: torch.empty(v.shape, dtype=v.dtype) for k, v in shapes.items()}
    if config.tie_word_embeddings:
        state.pop("lm_head.weight", None)
    try:
        with warnings.catch_warnings():  # "assuming the intent is to load in a single process": it is
            warnings.filterwarnings("ignore", message=".*single process.*")
            dcp.load({"model": state}, checkpoint_id=str(folder / "dcp"), no_dist=True)
    except Exception as e:  # DCP wraps every failure (missing key, size mismatch, unreadable file) in its own
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise HflowError(f"{folder / 'dcp'}: cannot read the {role}'s weights ({first[:200]})") from None
    if lora is not None:
        state = merged_state(state, lora[0])
    return model_for_export(role, config, state)


def export_checkpoint(roles: dict[str, Location], out: str | Path | Location) -> dict[str, Path | Location]:
    """A checkpoint's trained roles ({role: its folder in the checkpoint}) as HF folders out/role; both
    may be paths or URLs."""
    written = {}
    for role, folder in roles.items():
        with local_model_files(folder) as files:
            written[role] = export(load_checkpoint_model(folder, role, files), str(Location(out) / role), files)
        adapter = Location(folder) / ADAPTER_FOLDER
        if adapter.is_dir():  # a LoRA role: its peft adapters beside the merged model
            dest = (Location(out) / role / ADAPTER_FOLDER).makedirs()
            for f in adapter.children():
                (dest / f.name).write(f.read_bytes())
    return written
