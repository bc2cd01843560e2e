"""A LoRA model's weights as state dicts and files (engines/train/lora.py injects the adapters; this is what
they look like at rest): our names, the merged plain model, and peft's adapter folder.

A LoRA model names a wrapped layer's frozen weight `…q_proj.base_layer.weight` and its adapters
`…q_proj.lora_A.default.weight` (rank × in) and `…q_proj.lora_B.default.weight` (out × rank). Folded into
the plain model, W' = W + (alpha / rank)·B·A under `…q_proj.weight`. peft's own folder
(`adapter_config.json` + `adapter_model.safetensors`, keys `base_model.model.<name>.lora_A.weight`) applies the
adapters to the base model its config names (`PeftModel.from_pretrained(base, folder)`).
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path

import torch

from hybridflow.simulator.errors import HflowError
from hybridflow.simulator.vocabulary.lora import LoraConfig

ADAPTER = "default"  # peft's adapter name
ADAPTER_FOLDER = "adapter"  # inside an exported role folder and a checkpoint's role folder
_A, _B = f".lora_A.{ADAPTER}.weight", f".lora_B.{ADAPTER}.weight"


def is_adapter(name: str) -> bool:
    return ".lora_A." in name or ".lora_B." in name


def plain_name(name: str) -> str:
    """A LoRA model's base-weight name as the plain model names it (`…q_proj.base_layer.weight` → `…q_proj.weight`)."""
    return name.replace(".base_layer.", ".")


@torch.no_grad()
def merged_state(state: Mapping[str, torch.Tensor], lora: LoraConfig) -> dict[str, torch.Tensor]:
    """The plain model's weights from a LoRA model's (whole or tensor-parallel-local) tensors: each wrapped
    layer's W + (alpha / rank)·B·A, computed in fp32 and stored in W's dtype; the adapters dropped. On a
    tensor-parallel shard B's rows (column-wise layer) or A's columns (row-wise) are the local ones, so the
    local product is the shard's slice of B·A."""
    out = {}
    for name, t in state.items():
        if is_adapter(name):
            continue
        if name.endswith(".base_layer.weight"):
            prefix = name[: -len(".base_layer.weight")]
            a, b = state[prefix + _A], state[prefix + _B]
            t = (t.float() + lora.scale * (b.float() @ a.float())).to(t.dtype)
        out[plain_name(name)] = t
    return out


def lora_shapes(plain: Mapping[str, torch.Size], lora: LoraConfig, targets: tuple[str, ...]
                ) -> dict[str, torch.Size]:
    """A LoRA model's state-dict shapes from the plain model's: each target layer's weight (and bias) under
    `base_layer`, and its A (rank × in) and B (out × rank)."""
    out = {}
    for name, shape in plain.items():
        module, _, kind = name.rpartition(".")
        if module.rpartition(".")[2] not in targets:
            out[name] = shape
            continue
        out[f"{module}.base_layer.{kind}"] = shape
        if kind == "weight":
            out[module + _A] = torch.Size((lora.rank, shape[1]))
            out[module + _B] = torch.Size((shape[0], lora.rank))
    return out


def peft_config_dict(lora: LoraConfig, targets: tuple[str, ...], base_model: str | None) -> dict:
    """peft's adapter_config.json for `lora` (the fields PeftModel.from_pretrained reads)."""
    from peft import LoraConfig as PeftLoraConfig

    cfg = PeftLoraConfig(r=lora.rank, lora_alpha=lora.lora_alpha, lora_dropout=lora.dropout,
                         target_modules=list(targets), bias="none", base_model_name_or_path=base_model)
    return cfg.to_dict()


def save_peft_adapter(folder: str | Path, adapters: Mapping[str, torch.Tensor], lora: LoraConfig,
                      targets: tuple[str, ...], base_model: str | None) -> Path:
    """Write the adapters (our names, whole tensors) as peft's folder: adapter_config.json +
    adapter_model.safetensors, for the base model at `base_model`."""
    from safetensors.torch import save_file

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    cfg = peft_config_dict(lora, targets, base_model)
    cfg = {k: (sorted(v) if isinstance(v, set) else v) for k, v in cfg.items()}
    (folder / "adapter_config.json").write_text(json.dumps(cfg, indent=2, default=str))
    tensors = {"base_model.model." + n.replace(f".{ADAPTER}.", "."): t.detach().contiguous().cpu()
               for n, t in adapters.items() if is_adapter(n)}
    save_file(tensors, str(folder / "adapter_model.safetensors"), metadata={"format": "pt"})
    return folder


def write_peft_adapter(where, adapters: Mapping[str, torch.Tensor], lora: LoraConfig, targets: tuple[str, ...],
                       base_model: str | None) -> None:
    """save_peft_adapter at a path or a URL (written locally, then sent: Location.upload)."""
    import tempfile

    from hybridflow.runtime.controller.locations import Location

    target = Location(where)
    if not target.is_remote:
        save_peft_adapter(target.path, adapters, lora, targets, base_model)
        return
    with tempfile.TemporaryDirectory(prefix="hflow-adapter-") as tmp:
        target.upload(save_peft_adapter(Path(tmp) / ADAPTER_FOLDER, adapters, lora, targets, base_model))


def read_peft_adapter_config(folder) -> tuple[LoraConfig, tuple[str, ...]] | None:
    """(LoraConfig, target modules) of a peft adapter folder (a path or a URL); None when it holds none."""
    from hybridflow.runtime.controller.locations import Location

    path = Location(folder) / "adapter_config.json"
    if not path.is_file():
        return None
    try:
        cfg = json.loads(path.read_text())
        targets = tuple(cfg["target_modules"])
        return LoraConfig(rank=cfg["r"], alpha=cfg["lora_alpha"], dropout=cfg.get("lora_dropout", 0.0),
                          target_modules=targets), targets
    except (ValueError, KeyError, TypeError) as e:
        raise HflowError(f"{path}: not a peft LoRA adapter config ({e}); re-export the adapters") from None
