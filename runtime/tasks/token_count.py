"""How many tokens each prompt encodes to, torch-free — the same ids the run's tokenizer gives
(tasks/model_tokenizer.py, tasks/tokenizer.py), so `run` checks every prompt against the plan's
`prompt_len` before torch or Ray load.

- The built-in character tokenizer (no actor folder, or a folder with `hflow_tokenizer.json`): a BOS and
  one id per character; no chat template.
- A Hugging Face folder with `tokenizer.json`: the `tokenizers` library reads it as transformers' fast
  tokenizer does; text gets the post-processor's special tokens, chat messages the folder's chat template
  (tokenizer_config.json's `chat_template`, or `chat_template.jinja`) rendered as transformers renders it
  (a sandboxed Jinja environment, the generation prompt added), then encoded without special tokens.
- Anything else (a slow tokenizer without `tokenizer.json`): None — counted when the run encodes.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

from hybridflow.runtime.tasks.char_vocab import TOKENIZER_FILE
from hybridflow.runtime.tasks.prompt_files import Prompt, is_chat
from hybridflow.simulator.errors import HflowError

Counter = Callable[[Prompt, bool], int]  # (prompt, plain text through the chat template) -> tokens


def _token_text(value) -> str | None:
    if isinstance(value, dict):
        return value.get("content")
    return value if isinstance(value, str) else None


def chat_template_of(folder: str | Path) -> str | None:
    """The folder's chat template (the default one of a named list), or None."""
    p = Path(folder)
    if (p / "chat_template.jinja").is_file():
        return (p / "chat_template.jinja").read_text()
    cfg = _tokenizer_config(p)
    tpl = cfg.get("chat_template")
    if isinstance(tpl, list):  # [{"name": "default", "template": ...}, ...]
        named = {t.get("name"): t.get("template") for t in tpl if isinstance(t, dict)}
        tpl = named.get("default") or next(iter(named.values()), None)
    if tpl is None and (p / "chat_template.json").is_file():
        tpl = json.loads((p / "chat_template.json").read_text()).get("chat_template")
    return tpl if isinstance(tpl, str) and tpl.strip() else None


def _tokenizer_config(p: Path) -> dict:
    try:
        return json.loads((p / "tokenizer_config.json").read_text()) if (p / "tokenizer_config.json").is_file() else {}
    except ValueError:
        return {}


def has_chat_template(folder: str | Path | None) -> bool:
    """Whether the actor's tokenizer has a chat template (the built-in character tokenizer has none)."""
    return bool(folder) and not (Path(folder) / TOKENIZER_FILE).is_file() and chat_template_of(folder) is not None


def _render(template: str, folder: Path) -> Callable[[list], str]:
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message):
        raise ValueError(message)

    def strftime_now(fmt):
        import datetime

        return datetime.datetime.now().strftime(fmt)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"])
    env.filters["tojson"] = lambda x, indent=None, ensure_ascii=False, **_: json.dumps(x, indent=indent,
                                                                                      ensure_ascii=ensure_ascii)
    env.globals.update(raise_exception=raise_exception, strftime_now=strftime_now)
    compiled = env.from_string(template)
    cfg = _tokenizer_config(folder)
    specials = {k: _token_text(cfg.get(k)) for k in ("bos_token", "eos_token", "unk_token", "pad_token")}

    def render(messages: list) -> str:
        return compiled.render(messages=messages, add_generation_prompt=True, tools=None, documents=None,
                               **{k: v for k, v in specials.items() if v is not None})
    return render


def prompt_counter(actor_folder: str | Path | None) -> Counter | None:
    """A function giving a prompt's token count as the run will encode it (None: not countable here)."""
    if not actor_folder or (Path(actor_folder) / TOKENIZER_FILE).is_file():
        def count_chars(prompt: Prompt, chat: bool = False) -> int:
            if chat or is_chat(prompt):
                raise HflowError("the built-in character tokenizer has no chat template to render chat prompts: give "
                                 "plain-text prompts, or a model folder whose tokenizer has a chat template")
            return 1 + len(prompt)  # BOS + one id per character
        return count_chars
    folder = Path(actor_folder)
    if not (folder / "tokenizer.json").is_file():
        return None
    from tokenizers import Tokenizer

    try:
        tok = Tokenizer.from_file(str(folder / "tokenizer.json"))
    except Exception as e:
        raise HflowError(f"{folder / 'tokenizer.json'}: not a readable tokenizer ({type(e).__name__}: {e}); save the "
                         "model's tokenizer there with tokenizer.save_pretrained(folder)") from None
    template = chat_template_of(folder)
    render = _render(template, folder) if template else None

    def count(prompt: Prompt, chat: bool = False) -> int:
        if not (chat or is_chat(prompt)):
            return len(tok.encode(prompt, add_special_tokens=True).ids)
        if render is None:
            raise HflowError(f"the tokenizer in {folder} has no chat template to render chat prompts: give plain-text "
                             "prompts (and --no-chat-template), or a tokenizer with a 'chat_template' in "
                             "tokenizer_config.json")
        messages = prompt if is_chat(prompt) else [{"role": "user", "content": prompt}]
        return len(tok.encode(render(messages), add_special_tokens=False).ids)
    return count
