"""A tiny tool-calling model built here, as a user would bring a Hugging Face folder: a byte-level BPE
tokenizer trained with `tokenizers` on the calculator task's text, a Qwen2.5-style chat template with
tool support (tools listed in a system turn, `<tool_call>` JSON in assistant turns, tool results as
`<tool_response>` in a user turn), a tiny Llama-shaped model from transformers' config class (seeded
random init) and generation_config.json (EOS `<|im_end|>` and `</s>`).

`warm_up` teaches it the format by supervised steps on demonstrations built exactly as a rollout builds
conversations (chat_format.py), a share of them calling the calculator: a policy that sometimes uses the
tool, for RL to improve (the example in examples/agents/, the tests)."""

from __future__ import annotations

import random
from pathlib import Path

SPECIALS = ["<pad>", "<s>", "</s>", "<|im_start|>", "<|im_end|>"]
TOOL_TOKENS = ["<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>"]
TOOL_TEMPLATE = (
    "{% if tools %}<|im_start|>system\nTools:\n{% for t in tools %}{{ t['function']['name'] }}("
    "{{ t['function']['parameters']['properties'] | list | join(', ') }}): {{ t['function']['description'] }}\n"
    "{% endfor %}"
    "Call a tool as <tool_call>\n{\"name\": ..., \"arguments\": ...}\n</tool_call><|im_end|>\n{% endif %}"
    "{% for m in messages %}"
    "{% if m['role'] == 'tool' %}<|im_start|>user\n<tool_response>\n{{ m['content'] }}\n</tool_response><|im_end|>\n"
    "{% else %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
PLAIN_TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
                  "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
SHAPE = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, head_dim=16, max_position_embeddings=512)


def _corpus() -> list[str]:
    from hybridflow.runtime.agents.builtin_tools import calculator_tool
    from hybridflow.runtime.agents.word_problems import tool_call_text, word_problems

    fn = calculator_tool().schema["function"]
    rows = word_problems(400, seed=12345)
    scaffold = f"system\nuser\nassistant\nTools:\n{fn['name']}(expression): {fn['description']}\nCall a tool as"
    return [*[scaffold] * 100, *(r["prompt"] for r in rows), *(tool_call_text(r["expression"]) for r in rows),
            *(str(n) for n in range(200)), "higher lower Correct! Guess my number between 1 and 16. Answer with one number."]


def build_tool_model(folder: str | Path, seed: int = 0, template: str = TOOL_TEMPLATE, **shape) -> Path:
    """Tokenizer (with `template` as its chat template) + tiny random model (SHAPE, `shape` over it) +
    generation config."""
    import torch
    import transformers
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(_corpus(), trainers.BpeTrainer(
        vocab_size=600, special_tokens=SPECIALS + TOOL_TOKENS, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", pad_token="<pad>",
                                   additional_special_tokens=["<|im_start|>", "<|im_end|>"])
    fast.add_tokens(TOOL_TOKENS)  # already in the vocabulary: kept as ordinary (decoded) tokens
    fast.chat_template = template
    fast.save_pretrained(folder)
    torch.manual_seed(seed)
    end = fast.convert_tokens_to_ids("<|im_end|>")
    cfg = transformers.LlamaConfig(vocab_size=len(fast), bos_token_id=fast.bos_token_id, eos_token_id=end,
                                   pad_token_id=fast.pad_token_id, tie_word_embeddings=False, **(SHAPE | shape))
    transformers.LlamaForCausalLM(cfg).save_pretrained(folder)
    transformers.GenerationConfig(bos_token_id=fast.bos_token_id, eos_token_id=[end, fast.eos_token_id],
                                  pad_token_id=fast.pad_token_id).save_pretrained(folder)
    return folder


def demo_tokens(chat, row: dict, turns: list[str], tool) -> tuple[list[int], list[int], list[int]]:
    """(prompt ids, ids after the prompt, 1 where the model would have generated) of one demonstration:
    each assistant turn tokenized with its end-of-turn token, tool results appended as a rollout would."""
    from hybridflow.runtime.agents.tool_calls import parse_tool_calls

    messages = [{"role": "user", "content": row["prompt"]}]
    prompt = chat.prompt_ids(messages)
    end = chat.eos_ids[0]
    ids, gen = [], []
    for k, text in enumerate(turns):
        turn = list(chat.hf(text, add_special_tokens=False)["input_ids"]) + [end]
        ids += turn
        gen += [1] * len(turn)
        messages.append({"role": "assistant", "content": text})
        if k + 1 < len(turns):
            calls = parse_tool_calls(text)
            results = [{"role": "tool", "name": c.name, "content": tool.run(c.arguments, None)} for c in calls]
            ctx = chat.next_turn_ids(results, end)
            ids += ctx
            gen += [0] * len(ctx)
            messages += results
    return prompt, ids, gen


def warm_up(folder: str | Path, steps: int = 300, tool_share: float = 0.3, seed: int = 0, lr: float = 3e-3,
            batch: int = 16, problems: int = 600) -> dict:
    """Supervised steps on calculator demonstrations (`tool_share` of them call the tool); the model in
    `folder` is overwritten (`problems` word problems, each demonstrated with and without the tool).
    Returns the last loss."""
    import torch
    import torch.nn.functional as F
    from transformers import AutoTokenizer

    from hybridflow.runtime.agents.builtin_tools import calculator_tool
    from hybridflow.runtime.agents.chat_format import ChatFormat
    from hybridflow.runtime.agents.word_problems import demonstration, word_problems
    from hybridflow.runtime.engines.rollout.generation import left_pad
    from hybridflow.runtime.models.hf_format import load_pretrained, save_pretrained
    from hybridflow.runtime.tasks.model_tokenizer import generation_ids

    torch.manual_seed(seed)
    rng = random.Random(seed)
    hf = AutoTokenizer.from_pretrained(str(folder), local_files_only=True)
    tool = calculator_tool()
    chat = ChatFormat(hf, [tool.schema], generation_ids(folder)[0])
    model = load_pretrained(folder)
    opt = torch.optim.AdamW(model.parameters(), lr=lr)
    demos = []  # each problem once with the tool and once without: (prompt + rest, loss mask)
    for row in word_problems(problems, seed=seed + 1):
        for use in (True, False):
            p, ids, gen = demo_tokens(chat, row, demonstration(row, use, rng), tool)
            demos.append((use, p + ids, [0] * len(p) + gen))
    with_tool, without = [d for d in demos if d[0]], [d for d in demos if not d[0]]
    loss = torch.tensor(0.0)
    for _ in range(steps):
        picked = [rng.choice(with_tool if rng.random() < tool_share else without) for _ in range(batch)]
        seqs, masks = [d[1] for d in picked], [d[2] for d in picked]
        ids, attn = left_pad(seqs, hf.pad_token_id)
        target_mask, _ = left_pad(masks, 0)
        logits = model(ids, attention_mask=attn, position_ids=(attn.cumsum(-1) - 1).clamp(min=0))
        lp = F.cross_entropy(logits[:, :-1].transpose(1, 2), ids[:, 1:], reduction="none")
        m = target_mask[:, 1:].float()
        loss = (lp * m).sum() / m.sum()
        opt.zero_grad()
        loss.backward()
        opt.step()
    save_pretrained(model, folder, source=folder)  # the tokenizer and generation config kept
    return {"loss": float(loss.detach())}
