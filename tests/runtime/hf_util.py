"""A Hugging Face model folder built here, as a user would bring one: a BPE tokenizer trained with the
`tokenizers` library on small arithmetic text (chat template in tokenizer_config.json), a tiny
Llama-shaped model from transformers' config class (random init, seeded), and a
generation_config.json with two EOS ids."""

from __future__ import annotations

import json
from pathlib import Path

SPECIALS = ["<pad>", "<s>", "</s>", "<|im_start|>", "<|im_end|>"]
CHAT_TEMPLATE = ("{{ bos_token }}{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
                 "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
SHAPE = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, head_dim=16)


def corpus() -> list[str]:
    return [f"what is {a} plus {b}? the answer is {a + b}." for a in range(40) for b in range(40)]


def build_tokenizer(folder: Path, chat_template: bool = True, pad: bool = True):
    """A byte-level BPE tokenizer (BOS added to plain text), saved to `folder`; the transformers object."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(corpus(), trainers.BpeTrainer(vocab_size=320, special_tokens=SPECIALS,
                                                          initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 1)])
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>",
                                   pad_token="<pad>" if pad else None,
                                   additional_special_tokens=["<|im_start|>", "<|im_end|>"])
    fast.save_pretrained(folder)
    cfg_file = folder / "tokenizer_config.json"
    cfg = json.loads(cfg_file.read_text())
    (folder / "chat_template.jinja").unlink(missing_ok=True)
    if chat_template:
        cfg["chat_template"] = CHAT_TEMPLATE
    cfg_file.write_text(json.dumps(cfg, indent=2))
    return fast


def build_hf_folder(folder: Path, seed: int = 0, chat_template: bool = True, eos_ids: list[int] | None = None,
                    vocab_size: int | None = None) -> Path:
    """Tokenizer + tiny LlamaForCausalLM (+ generation_config.json with EOS ids `eos_ids`, by default
    `</s>` and `<|im_end|>`) in `folder`."""
    import torch
    import transformers

    folder.mkdir(parents=True, exist_ok=True)
    fast = build_tokenizer(folder, chat_template)
    torch.manual_seed(seed)
    cfg = transformers.LlamaConfig(vocab_size=vocab_size or len(fast), bos_token_id=fast.bos_token_id,
                                   eos_token_id=fast.eos_token_id, pad_token_id=fast.pad_token_id, **SHAPE)
    transformers.LlamaForCausalLM(cfg).save_pretrained(folder)
    eos = eos_ids if eos_ids is not None else [fast.eos_token_id, fast.convert_tokens_to_ids("<|im_end|>")]
    transformers.GenerationConfig(bos_token_id=fast.bos_token_id, eos_token_id=eos,
                                  pad_token_id=fast.pad_token_id).save_pretrained(folder)
    return folder
