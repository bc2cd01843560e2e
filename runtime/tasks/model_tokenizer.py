"""A model folder's own tokenizer: `load_tokenizer(folder)` picks it.

- A folder written by hybridflow's warm-up (`hflow_tokenizer.json`): the character tokenizer.
- A Hugging Face folder (`tokenizer.json` / `tokenizer_config.json`): `HFTokenizer`, through
  transformers' `AutoTokenizer` from local files only. Its chat template renders chat-message
  prompts (and plain-text ones when the run asks for it) with the generation prompt added; text
  prompts get the tokenizer's own special tokens (a BOS where its post-processor adds one).
  EOS ids: every id in `generation_config.json`'s `eos_token_id` (one or a list) and the tokenizer's
  own, so generation stops on any of them; pad: the tokenizer's, else generation_config's, else the
  first EOS (what transformers' `generate` falls back to), else 0 — padding is masked out anyway.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from hybridflow.runtime.models.folder_check import HF_TOKENIZER_FILES
from hybridflow.runtime.tasks.char_vocab import TOKENIZER_FILE
from hybridflow.runtime.tasks.data import Prompt, is_chat, prompt_preview
from hybridflow.runtime.tasks.tokenizer import CharTokenizer, Tokenizer
from hybridflow.simulator.errors import HflowError

GENERATION_CONFIG = "generation_config.json"


def _one_line(e: Exception) -> str:
    text = str(e).strip()
    return f"{type(e).__name__}: {text.splitlines()[0] if text else ''}"


def generation_ids(folder: str | Path) -> tuple[list[int], int | None]:
    """(EOS ids, pad id) that `generation_config.json` names ([] and None without one)."""
    p = Path(folder) / GENERATION_CONFIG
    if not p.is_file():
        return [], None
    from transformers import GenerationConfig

    try:
        cfg = GenerationConfig.from_pretrained(str(folder), local_files_only=True)
    except Exception as e:
        raise HflowError(f"{p}: not a readable generation config ({_one_line(e)}); fix or remove it") from None
    eos = cfg.eos_token_id
    return ([] if eos is None else [eos] if isinstance(eos, int) else list(eos)), cfg.pad_token_id


class HFTokenizer(Tokenizer):
    def __init__(self, folder: str | Path):
        from transformers import AutoTokenizer

        self.folder = Path(folder)
        self.name = f"the tokenizer in {folder}"
        try:
            self.hf = AutoTokenizer.from_pretrained(str(folder), local_files_only=True)
        except Exception as e:
            raise HflowError(f"{folder}: transformers cannot load its tokenizer ({_one_line(e)}); save the model's "
                             "tokenizer there with tokenizer.save_pretrained(folder)") from None
        self.vocab_size = len(self.hf)  # the base vocabulary and the added tokens
        gen_eos, gen_pad = generation_ids(folder)
        eos = [*gen_eos, self.hf.eos_token_id]
        self.eos_ids = list(dict.fromkeys(i for i in eos if i is not None))
        pads = (self.hf.pad_token_id, gen_pad, *self.eos_ids, 0)
        self.pad_id = next(i for i in pads if i is not None)
        self.has_chat_template = bool(getattr(self.hf, "chat_template", None))

    def encode_prompt(self, prompt: Prompt, chat: bool = False) -> list[int]:
        if not (chat or is_chat(prompt)):
            return list(self.hf(prompt)["input_ids"])
        self.require_chat_template()
        messages = prompt if is_chat(prompt) else [{"role": "user", "content": prompt}]
        try:
            out = self.hf.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=True)
        except Exception as e:
            raise HflowError(f"{self.folder}: its chat template failed on the prompt {prompt_preview(prompt)!r} "
                             f"({_one_line(e)})") from None
        return list(out["input_ids"])

    def decode(self, ids: Sequence[int]) -> str:
        return self.hf.decode(list(ids), skip_special_tokens=True)


def load_tokenizer(folder: str | Path, model_vocab: int | None = None) -> Tokenizer:
    """The tokenizer saved with the model in `folder`; with `model_vocab` (the embedding's rows), a
    tokenizer with more ids than that is a one-line error."""
    p = Path(folder)
    if (p / TOKENIZER_FILE).is_file():
        tok: Tokenizer = CharTokenizer.load(p)
    elif any((p / f).is_file() for f in HF_TOKENIZER_FILES):
        tok = HFTokenizer(p)
    else:
        raise HflowError(f"{p}: no tokenizer here ({' / '.join(HF_TOKENIZER_FILES)}); save the model's tokenizer "
                         "next to its weights (tokenizer.save_pretrained(folder))")
    if model_vocab is not None:
        tok.check_fits(model_vocab, p)
    return tok

