"""A character-level tokenizer small enough for the "tiny" model preset (vocab 64).

Ids 0–3 are `<pad>`, `<bos>`, `<eos>`, `<unk>`; then digits, lower-case letters, space and
punctuation, one id per character. Upper-case letters are folded to lower case; any other
character becomes `<unk>` (or raises with `strict=True`). Prompts are left-padded so that every
row's last prompt token sits in the same column, which is what batched generation wants.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from hybridflow.simulator.errors import HflowError
from hybridflow.simulator.io import write_atomic

SPECIALS = ("<pad>", "<bos>", "<eos>", "<unk>")
CHARS = "0123456789abcdefghijklmnopqrstuvwxyz +-*=:,.?!()[]/'\"#%&;<>_"
TOKENIZER_FILE = "hflow_tokenizer.json"


class CharTokenizer:
    pad_id, bos_id, eos_id, unk_id = 0, 1, 2, 3

    def __init__(self, chars: str = CHARS):
        if len(set(chars)) != len(chars):
            raise HflowError("tokenizer characters must be distinct")
        self.chars = chars
        self.vocab_size = len(SPECIALS) + len(chars)
        self._ids = {c: i + len(SPECIALS) for i, c in enumerate(chars)}

    # ---- text <-> ids -------------------------------------------------------------------------
    def encode(self, text: str, bos: bool = False, eos: bool = False, strict: bool = False) -> list[int]:
        ids = [self.bos_id] if bos else []
        for c in text.lower():
            i = self._ids.get(c)
            if i is None:
                if strict:
                    raise HflowError(f"character {c!r} in {text[:40]!r} is not in the tokenizer's vocabulary; "
                                     f"use only {self.chars!r}")
                i = self.unk_id
            ids.append(i)
        if eos:
            ids.append(self.eos_id)
        return ids

    def decode(self, ids, stop_at_eos: bool = True) -> str:
        out = []
        for i in (ids.tolist() if isinstance(ids, torch.Tensor) else ids):
            if i == self.eos_id and stop_at_eos:
                break
            if i >= len(SPECIALS):
                out.append(self.chars[i - len(SPECIALS)])
            elif i == self.unk_id:
                out.append("?")
        return "".join(out)

    def encode_prompts(self, texts: list[str], max_len: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Left-padded `<bos> prompt` rows: (input_ids [B, L], attention_mask [B, L]); L = longest row
        or `max_len` (a longer prompt is an error: raise the plan's prompt_len)."""
        rows = [self.encode(t, bos=True) for t in texts]
        width = max((len(r) for r in rows), default=0)
        if max_len is not None:
            if width > max_len:
                raise HflowError(f"a prompt has {width} tokens but prompt_len is {max_len}; "
                                 f"raise workload.prompt_len or shorten the prompts")
            width = max_len
        ids = torch.full((len(rows), width), self.pad_id, dtype=torch.long)
        mask = torch.zeros((len(rows), width), dtype=torch.long)
        for i, r in enumerate(rows):
            if r:
                ids[i, width - len(r):] = torch.tensor(r)
                mask[i, width - len(r):] = 1
        return ids, mask

    def decode_responses(self, ids: torch.Tensor) -> list[str]:
        return [self.decode(row) for row in ids]

    # ---- files --------------------------------------------------------------------------------
    def save(self, folder: str | Path) -> Path:
        return write_atomic(Path(folder) / TOKENIZER_FILE,
                            json.dumps({"type": "char", "specials": list(SPECIALS), "chars": self.chars}) + "\n")

    @classmethod
    def load(cls, folder: str | Path) -> CharTokenizer:
        p = Path(folder) / TOKENIZER_FILE
        if not p.is_file():
            raise HflowError(f"{folder}: no {TOKENIZER_FILE}; only models built by hybridflow's warm-up carry "
                             f"the character tokenizer")
        data = json.loads(p.read_text())
        return cls(data["chars"])
