"""Tokenizers: what the runtime asks of one, and the character tokenizer of the built-in tiny model.

`Tokenizer` is the interface the trainer and the dataflow use: prompts (text or chat messages)
to left-padded ids, response ids back to text without special tokens, the EOS ids generation
stops on (any of them) and the pad id. Two implement it: a model folder's own Hugging Face
tokenizer (model_tokenizer.py, which also holds `load_tokenizer`, the one place that picks), and
`CharTokenizer` below, for the built-in tiny model only (folders holding `hflow_tokenizer.json`).

CharTokenizer: ids 0–3 are `<pad>`, `<bos>`, `<eos>`, `<unk>`; then digits, lower-case letters,
space and punctuation, one id per character. Upper-case letters are folded to lower case; any
other character becomes `<unk>` (or raises with `strict=True`). It has no chat template.
"""

from __future__ import annotations

import json
from abc import ABC, abstractmethod
from collections.abc import Sequence
from pathlib import Path

import torch

from hybridflow.runtime.engines.rollout.generation import left_pad
from hybridflow.runtime.tasks.char_vocab import CHARS, SPECIALS, TOKENIZER_FILE
from hybridflow.runtime.tasks.data import Prompt, is_chat, prompt_preview
from hybridflow.simulator.errors import HflowError
from hybridflow.simulator.io import write_atomic


class Tokenizer(ABC):
    """Prompts in, responses out, for one model. Subclasses set `vocab_size` (every id it can produce
    or read is below it), `pad_id`, `eos_ids` and `has_chat_template`."""

    name: str  # for messages
    vocab_size: int
    pad_id: int
    eos_ids: list[int]
    has_chat_template: bool = False

    @abstractmethod
    def encode_prompt(self, prompt: Prompt, chat: bool = False) -> list[int]:
        """The ids generation continues from: chat messages through the chat template with the
        generation prompt added; text as is, or (`chat`) as one user message through the template."""

    @abstractmethod
    def decode(self, ids: Sequence[int]) -> str:
        """Text of token ids, special tokens dropped."""

    def encode_prompts(self, prompts: Sequence[Prompt], chat: bool = False, max_len: int | None = None,
                       overlong: str = "error") -> tuple[torch.Tensor, torch.Tensor]:
        """Left-padded rows (every row's last prompt token in the same column, as batched generation
        wants): (input_ids [B, L], attention_mask [B, L]), L the longest row; a row longer than
        `max_len` is an error naming it, or (`overlong` truncate-left / truncate-right) cut to its last /
        first `max_len` ids."""
        rows = [self.encode_prompt(p, chat) for p in prompts]
        if max_len is not None and overlong in ("truncate-left", "truncate-right"):
            rows = [r[-max_len:] if overlong == "truncate-left" else r[:max_len] for r in rows]
        if max_len is not None:
            for p, r in zip(prompts, rows, strict=True):
                if len(r) > max_len:
                    raise HflowError(f"a prompt has {len(r)} tokens but prompt_len is {max_len} "
                                     f"({prompt_preview(p)!r}); raise workload.prompt_len or shorten the prompts")
        return left_pad(rows, self.pad_id)

    def decode_responses(self, responses: torch.Tensor, mask: torch.Tensor | None = None) -> list[str]:
        """Text of each response row: up to its first EOS (and within `mask`, the real tokens)."""
        eos = set(self.eos_ids)
        out = []
        for i, row in enumerate(responses.tolist()):
            keep = row if mask is None else [t for t, m in zip(row, mask[i].tolist(), strict=True) if m]
            cut = next((j for j, t in enumerate(keep) if t in eos), len(keep))
            out.append(self.decode(keep[:cut]))
        return out

    def require_chat_template(self) -> None:
        if not self.has_chat_template:
            raise HflowError(f"{self.name} has no chat template to render chat prompts: give plain-text prompts "
                             "(and chat_template: false), or a tokenizer with a 'chat_template' in tokenizer_config.json")

    def check_fits(self, model_vocab: int, folder: str | Path) -> None:
        """A one-line error when the model's embedding has fewer rows than the tokenizer has ids."""
        if self.vocab_size > model_vocab:
            raise HflowError(f"{folder}: the tokenizer has {self.vocab_size} tokens but the model's embedding has "
                             f"{model_vocab} rows (config.json vocab_size); save the model's own tokenizer with it")


class CharTokenizer(Tokenizer):
    name = "the built-in character tokenizer"
    pad_id, bos_id, eos_id, unk_id = 0, 1, 2, 3
    eos_ids = [2]

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

    def encode_prompt(self, prompt: Prompt, chat: bool = False) -> list[int]:
        if chat or is_chat(prompt):
            self.require_chat_template()
        return self.encode(prompt, bos=True)

    def decode(self, ids, stop_at_eos: bool = True) -> str:
        out = []
        for i in (ids.tolist() if isinstance(ids, torch.Tensor) else ids):
            if i == self.eos_id and stop_at_eos:
                break
            if len(SPECIALS) <= i < self.vocab_size:
                out.append(self.chars[i - len(SPECIALS)])
            elif i == self.unk_id or i >= self.vocab_size:  # an id past the vocabulary reads as unknown
                out.append("?")
        return "".join(out)

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
