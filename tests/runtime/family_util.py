"""Tiny models of every supported family, built through transformers' own config classes.

Each case is a family with the options its real releases use (Llama-3.1/3.2 llama3 RoPE scaling,
tied and untied; Llama-2-style linear scaling with biases; Mistral's sliding window, small enough
that it bites; Qwen2.5's q/k/v biases; Qwen3's q/k norms with a head_dim apart from hidden/heads; Mixtral's top-2 of 4 experts).
Norm weights and biases are perturbed off their initial 1 / 0, so a misplaced one shows.
"""

from __future__ import annotations

import torch

SHAPE = dict(vocab_size=64, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, rms_norm_eps=1e-5)
LLAMA3_ROPE = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 16}

# case -> (transformers config class name, its options)
CASES = {
    "llama3.1": ("LlamaConfig", dict(rope_scaling=LLAMA3_ROPE, rope_theta=500000.0)),
    "llama3.2-tied": ("LlamaConfig", dict(rope_scaling=LLAMA3_ROPE, rope_theta=500000.0, tie_word_embeddings=True)),
    "llama2-linear-bias": ("LlamaConfig", dict(rope_scaling={"rope_type": "linear", "factor": 2.0},
                                               attention_bias=True, mlp_bias=True)),
    "mistral-window": ("MistralConfig", dict(sliding_window=6)),
    "qwen2.5-tied": ("Qwen2Config", dict(tie_word_embeddings=True, rope_theta=1000000.0)),
    "qwen3": ("Qwen3Config", dict(head_dim=32)),
    "qwen3-tied": ("Qwen3Config", dict(head_dim=16, tie_word_embeddings=True)),
    "mixtral": ("MixtralConfig", dict(num_local_experts=4, num_experts_per_tok=2, rope_theta=1000000.0)),
}
# One score-model (ForSequenceClassification) case per family.
SCORE_CASES = ("llama3.1", "mistral-window", "qwen2.5-tied", "qwen3", "mixtral")


def hf_config(case: str, **extra):
    import transformers

    cls, options = CASES[case]
    return getattr(transformers, cls)(**SHAPE, **options, **extra)


def hf_model(case: str, head: str = "lm", seed: int = 0):
    """A transformers model of the case (random init, seeded), in eval mode."""
    import transformers

    torch.manual_seed(seed)
    if head == "lm":
        model = transformers.AutoModelForCausalLM.from_config(hf_config(case))
    else:
        model = transformers.AutoModelForSequenceClassification.from_config(hf_config(case, num_labels=1))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name or name.endswith("bias"):
                p.add_(0.1 * torch.randn_like(p))
    return model.eval()


def token_batch(vocab: int = 64, seed: int = 1, rows: int = 3, length: int = 13):
    """Token ids [rows, length] and a left-padded attention mask (rows 0 and 2 padded)."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, vocab, (rows, length), generator=g)
    mask = torch.ones_like(ids)
    mask[0, :4] = 0
    mask[2, :1] = 0
    return ids, mask
