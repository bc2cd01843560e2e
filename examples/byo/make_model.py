"""A tiny Qwen2-shaped model and a BPE tokenizer with a chat template, saved as a sharded HF folder.

    python examples/byo/make_model.py --out byo/model

Everything is built here, nothing is downloaded: the tokenizer is trained with the `tokenizers`
library on the kind of question this example asks, the model is initialised at random through
transformers' Qwen2 config and then trained for 150 supervised steps on such questions,
so that RL starts from a policy that sometimes answers right. The folder looks like a released
checkpoint: config.json, generation_config.json (two EOS ids), the tokenizer files with a ChatML
chat template, and the weights in several safetensors shards with model.safetensors.index.json.
"""

from __future__ import annotations

import argparse
import random
from pathlib import Path

SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
# ChatML, as Qwen2.5 writes it (without its default system prompt).
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


def question(rng: random.Random) -> dict:
    """One row of the example's data: a chat prompt and its answer."""
    a, b = rng.randrange(10), rng.randrange(10)
    return {"prompt": [{"role": "user", "content": f"What is {a} + {b}?"}], "answer": str(a + b)}


def train_tokenizer(rows: list[dict]):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    texts = [f"<|im_start|>user\n{r['prompt'][0]['content']}<|im_end|>\n<|im_start|>assistant\n{r['answer']}"
             for r in rows]
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(texts, trainers.BpeTrainer(vocab_size=300, special_tokens=SPECIALS,
                                                       initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<|endoftext|>",
                                   chat_template=CHAT_TEMPLATE, padding_side="left")


def supervised_steps(model, tokenizer, rows: list[dict], steps: int, seed: int) -> None:
    """Teacher-forced training on the answers (prompt tokens are not scored)."""
    import torch

    eos = tokenizer.convert_tokens_to_ids("<|im_end|>")
    pairs = []
    for r in rows:
        prompt = tokenizer.apply_chat_template(r["prompt"], add_generation_prompt=True, tokenize=True)
        prompt = prompt if isinstance(prompt, list) else prompt["input_ids"]
        pairs.append((prompt, tokenizer(r["answer"], add_special_tokens=False)["input_ids"] + [eos]))
    # One thread: on a model this small more threads only add their synchronisation (several times
    # slower on a busy machine), and the trained weights do not depend on the machine's core count.
    torch.set_num_threads(1)
    rng = random.Random(seed)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    model.train()
    for _ in range(steps):
        batch = [pairs[rng.randrange(len(pairs))] for _ in range(64)]
        width = max(len(p) + len(a) for p, a in batch)
        ids = torch.full((len(batch), width), tokenizer.pad_token_id)
        labels = torch.full_like(ids, -100)
        mask = torch.zeros_like(ids)
        for i, (p, a) in enumerate(batch):
            ids[i, :len(p) + len(a)] = torch.tensor(p + a)
            labels[i, len(p):len(p) + len(a)] = torch.tensor(a)
            mask[i, :len(p) + len(a)] = 1
        loss = model(input_ids=ids, attention_mask=mask, labels=labels).loss
        opt.zero_grad()
        loss.backward()
        opt.step()
    model.eval()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", required=True, help="folder to write (created)")
    p.add_argument("--sft-steps", type=int, default=150, help="supervised steps after random init (default 150)")
    p.add_argument("--seed", type=int, default=0, help="random seed (default 0)")
    args = p.parse_args()

    import torch
    from transformers import GenerationConfig, Qwen2Config, Qwen2ForCausalLM

    rng = random.Random(args.seed)
    rows = [question(rng) for _ in range(2000)]
    tokenizer = train_tokenizer(rows)
    vocab = 64 * ((len(tokenizer) + 63) // 64)  # padded as released checkpoints are: not every id is a token
    im_end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    config = Qwen2Config(vocab_size=vocab, hidden_size=64, intermediate_size=256, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                         tie_word_embeddings=True, bos_token_id=None, eos_token_id=im_end,
                         pad_token_id=tokenizer.pad_token_id)
    torch.manual_seed(args.seed)
    model = Qwen2ForCausalLM(config)
    supervised_steps(model, tokenizer, rows, args.sft_steps, args.seed)
    model.generation_config = GenerationConfig(eos_token_id=[im_end, tokenizer.pad_token_id],
                                               pad_token_id=tokenizer.pad_token_id)
    out = Path(args.out)
    model.save_pretrained(out, max_shard_size="100KB")  # several shards and an index, as 7B+ releases
    tokenizer.save_pretrained(out)
    print(f"wrote {out}: a Qwen2 of {sum(p.numel() for p in model.parameters()):,} parameters, a tokenizer of "
          f"{len(tokenizer)} tokens (embedding {vocab}), {len(list(out.glob('*.safetensors')))} weight shards")


if __name__ == "__main__":
    main()
