"""Check a Hugging Face model folder before anything starts: torch-free, well under a second.

`check_model_folder(path, role)` reads only `config.json`, the safetensors headers (8-byte
little-endian length + JSON) and the tokenizer files, and raises a one-line HflowError for: no
config.json, invalid JSON, a family / architecture / option the runtime cannot run (through
simulator/vocabulary/families.py), a role the folder's head cannot play, no weights, a missing shard named in
the index, a truncated or malformed shard (file size vs the header's last data offset), tensors
the config needs missing or misshapen (or others it does not describe), no tokenizer, and a tokenizer whose largest token id does
not fit the model's embedding. It also holds the folder layout (file names, where the weights
are) that runtime/models/hf_format.py reads and writes. Imports no torch, directly or not.
"""

from __future__ import annotations

import json
import struct
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict

from hybridflow.runtime.tasks.char_vocab import TOKENIZER_FILE as HFLOW_TOKENIZER_FILE
from hybridflow.simulator.errors import HflowError
from hybridflow.simulator.vocabulary.families import HFModelConfig, read_hf_config, tensor_shapes
from hybridflow.simulator.vocabulary.roles import ROLE_HEADS, Role, role_head
from hybridflow.simulator.vocabulary.units import MiB

CONFIG_FILE = "config.json"
WEIGHTS_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
HF_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")
TOKENIZER_FILES = (*HF_TOKENIZER_FILES, HFLOW_TOKENIZER_FILE)
# Tensors a checkpoint may hold that the config does not ask for (old Llama exports kept RoPE buffers).
IGNORED_TENSOR_SUFFIXES = ("rotary_emb.inv_freq",)
_MAX_HEADER_BYTES = 100 * MiB  # safetensors' own limit



class ModelFolder(BaseModel):
    """What `check_model_folder` found."""

    model_config = ConfigDict(frozen=True)

    path: Path
    config: HFModelConfig  # family, decoder config, head, architecture
    weight_files: tuple[Path, ...]
    tensors: dict[str, tuple[int, ...]]  # every tensor in the weight files, by name: its shape
    tokenizer_file: Path | None
    max_token_id: int | None  # the tokenizer's largest id (None: no tokenizer, or none it names)


def read_json(path: Path, what: str) -> Any:
    try:
        return json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError):
        raise HflowError(f"{path}: not valid JSON; {what} is expected") from None
    except OSError as e:
        raise HflowError(f"{path}: unreadable ({e.strerror}); check the file's permissions") from None


def read_folder_config(path: str | Path) -> HFModelConfig:
    """The family, decoder config and head that a folder's config.json describes."""
    folder = Path(path)
    if not folder.is_dir():
        raise HflowError(f"{folder}: no such folder; pass a Hugging Face model folder (config.json + safetensors)")
    p = folder / CONFIG_FILE
    if not p.is_file():
        raise HflowError(f"{folder}: no {CONFIG_FILE} here; pass a folder written by save_pretrained or by "
                         "transformers")
    return read_hf_config(read_json(p, "a Hugging Face config.json"), str(p))


def weight_files(path: str | Path) -> tuple[Path, ...]:
    """The safetensors files of a folder: `model.safetensors`, or the shards its index names."""
    folder = Path(path)
    if (folder / WEIGHTS_FILE).is_file():
        return (folder / WEIGHTS_FILE,)
    index = folder / INDEX_FILE
    if not index.is_file():
        other = [n for n in ("pytorch_model.bin", "pytorch_model.bin.index.json") if (folder / n).exists()]
        hint = (f"{other[0]} (PyTorch pickle) is not read; re-save it with save_pretrained(safe_serialization=True)"
                if other else f"expected {WEIGHTS_FILE} or {INDEX_FILE}")
        raise HflowError(f"{folder}: no weights here; {hint}")
    weight_map = read_json(index, "a safetensors index ({'weight_map': {tensor: file}})").get("weight_map")
    if not isinstance(weight_map, dict) or not weight_map:
        raise HflowError(f"{index}: no 'weight_map' of tensor names to shard files; re-save the checkpoint")
    files = tuple(dict.fromkeys(folder / name for name in weight_map.values()))
    for f in files:
        if not f.is_file():
            raise HflowError(f"{index}: names shard {f.name}, which is not in the folder; copy every shard "
                             "of the checkpoint")
    return files


def safetensors_header(file: Path) -> dict[str, dict]:
    """The tensor entries of a safetensors file's header ({name: {dtype, shape, data_offsets}}), after
    checking the file holds every byte the header promises."""
    size = file.stat().st_size
    with file.open("rb") as f:
        head = f.read(8)
        n = struct.unpack("<Q", head)[0] if len(head) == 8 else None
        if n is None or n > min(size - 8, _MAX_HEADER_BYTES):
            raise HflowError(f"{file}: truncated or not a safetensors file (no complete header); re-copy it")
        try:
            header = json.loads(f.read(n))
        except (json.JSONDecodeError, UnicodeDecodeError):
            raise HflowError(f"{file}: malformed safetensors header (not JSON); re-copy the file") from None
    if not isinstance(header, dict):
        raise HflowError(f"{file}: malformed safetensors header (not a mapping); re-copy the file")
    tensors = {k: v for k, v in header.items() if k != "__metadata__"}
    try:
        end = max((int(v["data_offsets"][1]) for v in tensors.values()), default=0)
    except (KeyError, IndexError, TypeError, ValueError):
        raise HflowError(f"{file}: malformed safetensors header (a tensor without data_offsets)") from None
    if size != 8 + n + end:
        what = "truncated" if size < 8 + n + end else "longer than its header says"
        raise HflowError(f"{file}: {what} ({size} bytes, its header describes {8 + n + end}); re-copy the file")
    return tensors


def tokenizer_max_id(folder: Path) -> tuple[Path | None, int | None]:
    """(the tokenizer file found, the largest token id it names) — tokenizer.json through the
    `tokenizers` library, tokenizer_config.json's added tokens and vocab.json, or ours."""
    found = [folder / n for n in TOKENIZER_FILES if (folder / n).is_file()]
    if not found:
        return None, None
    ids: list[int] = []
    if (folder / "tokenizer.json").is_file():
        from tokenizers import Tokenizer

        try:
            tok = Tokenizer.from_file(str(folder / "tokenizer.json"))
        except Exception as e:  # noqa: BLE001 - the library raises a bare Exception for any bad file
            raise HflowError(f"{folder / 'tokenizer.json'}: not a tokenizer the tokenizers library reads "
                             f"({str(e).splitlines()[0][:120]})") from None
        ids.append(max(tok.get_vocab(with_added_tokens=True).values(), default=0))
    if (folder / "tokenizer_config.json").is_file():
        added = read_json(folder / "tokenizer_config.json", "a tokenizer config").get("added_tokens_decoder") or {}
        ids += [int(k) for k in added if str(k).isdigit()]
    if (folder / "vocab.json").is_file():
        ids.append(max(read_json(folder / "vocab.json", "a token → id vocabulary").values(), default=0))
    if (folder / HFLOW_TOKENIZER_FILE).is_file():
        char = read_json(folder / HFLOW_TOKENIZER_FILE, "hybridflow's character tokenizer")
        ids.append(len(char.get("specials", [])) + len(char.get("chars", "")) - 1)
    return found[0], (max(ids) if ids else None)


def check_model_folder(path: str | Path, role: Role, *, tokenizer: bool = True) -> ModelFolder:
    """Check that the folder can be `role`'s model (see the module docstring); returns what it found.
    `tokenizer=False` skips the tokenizer checks (a score model read with the policy's tokenizer)."""
    if role not in ROLE_HEADS:
        raise HflowError(f"unknown role '{role}'; roles: {', '.join(ROLE_HEADS)}")
    folder = Path(path)
    cfg = read_folder_config(folder)
    if cfg.head not in ROLE_HEADS[role]:
        need = "a causal LM (*ForCausalLM)" if role_head(role) == "lm" else "a *ForSequenceClassification model"
        raise HflowError(f"{folder}: the {role} needs {need}, but config.json says {cfg.architecture}; "
                         f"give the {role} a {cfg.family.architecture(ROLE_HEADS[role][0])} folder")
    files = weight_files(folder)
    tensors: dict[str, tuple[int, ...]] = {}
    for f in files:
        tensors |= {name: tuple(entry.get("shape", ())) for name, entry in safetensors_header(f).items()}
    expected = tensor_shapes(cfg.decoder, cfg.head)
    missing = [n for n in expected if n not in tensors]
    if missing:
        raise HflowError(f"{folder}: the weights lack {len(missing)} tensor(s) config.json needs ({', '.join(missing[:3])}"
                         f"{', …' if len(missing) > 3 else ''}); the checkpoint and config.json must describe one model")
    # Beyond the config's tensors a checkpoint may hold a tied (or, read as a critic, unused) LM head,
    # our score bias and old RoPE buffers; anything else means config and weights disagree.
    extra = [n for n in tensors if n not in expected and n not in ("lm_head.weight", "score.bias")
             and not n.endswith(IGNORED_TENSOR_SUFFIXES)]
    if extra:
        raise HflowError(f"{folder}: the weights hold {len(extra)} tensor(s) config.json does not describe "
                         f"({', '.join(extra[:3])}{', …' if len(extra) > 3 else ''}); the checkpoint and "
                         "config.json must describe one model")
    wrong = [n for n, shape in expected.items() if tensors[n] != shape]
    if wrong:
        n = wrong[0]
        raise HflowError(f"{folder}: tensor {n} has shape {list(tensors[n])} but config.json implies "
                         f"{list(expected[n])}; the checkpoint and config.json must describe one model")
    tok_file, max_id = tokenizer_max_id(folder) if tokenizer else (None, None)
    if tokenizer and tok_file is None:
        raise HflowError(f"{folder}: no tokenizer here (expected one of {', '.join(TOKENIZER_FILES)}); save the "
                         "model's tokenizer into the folder (tokenizer.save_pretrained)")
    vocab = cfg.decoder.vocab_size
    if max_id is not None and max_id >= vocab:
        raise HflowError(f"{folder}: the tokenizer's largest token id {max_id} does not fit the model's "
                         f"embedding (vocab_size {vocab}); use the tokenizer the model was trained with")
    return ModelFolder(path=folder, config=cfg, weight_files=files, tensors=tensors, tokenizer_file=tok_file,
                       max_token_id=max_id)
