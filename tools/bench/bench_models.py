"""The benchmarks' models: the built-in tiny policy and a Qwen2-shaped model of ~10 M parameters with a
byte-level BPE vocabulary, built here (nothing is downloaded) as a user's HF folder would look.

    folder, spec = bench_model("qwen2-bpe", workdir, seed=0)   # an HF folder (weights + tokenizer)
    folder, spec = bench_model("tiny", workdir, seed=0)        # None: the built-in warmed-up policy

The Qwen2 model is random (no supervised warm-up): the benchmarks time it, they do not ask it to
solve the task. Its tokenizer is trained with the `tokenizers` library on the built-in `sort` task's
prompts and answers, so the task's prompts encode into a few BPE tokens each; the embedding has more
rows than the tokenizer has tokens, as released checkpoints do (Qwen2's is padded to a multiple of 128).
"""

from __future__ import annotations

from pathlib import Path

from hybridflow.simulator.errors import HflowError
from hybridflow.simulator.vocabulary.model import ModelSpec, model_preset

BENCH_MODELS = ("tiny", "qwen2-bpe")
SPECIALS = ["<pad>", "<s>", "</s>"]
# ~10 M parameters: 8 layers of hidden 256 (4 heads of 64, 2 KV heads, q/k/v biases) and a tied
# 8,192-row embedding (2.1 M of them).
QWEN2_SHAPE = dict(vocab_size=8192, hidden_size=256, intermediate_size=1024, num_hidden_layers=8,
                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                   tie_word_embeddings=True, rope_theta=1000000.0)


def _corpus(task: str, rows: int, seed: int) -> list[str]:
    from hybridflow.runtime.tasks.data import PromptDataset

    data = PromptDataset.from_task(task, rows, seed).rows
    return [f"{r['prompt']} {r['answer']}" for r in data]


def qwen2_bpe_folder(folder: Path, task: str = "sort", seed: int = 0) -> Path:
    """Write a random Qwen2ForCausalLM of QWEN2_SHAPE and a byte-level BPE tokenizer (BOS prepended,
    `</s>` the EOS) to `folder` (created); returns it."""
    import torch
    import transformers
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    folder.mkdir(parents=True, exist_ok=True)
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(_corpus(task, 4000, seed), trainers.BpeTrainer(
        vocab_size=2048, special_tokens=SPECIALS, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 1)])
    fast = transformers.PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>",
                                                pad_token="<pad>")
    fast.save_pretrained(folder)
    torch.manual_seed(seed)
    cfg = transformers.Qwen2Config(**QWEN2_SHAPE, bos_token_id=fast.bos_token_id, eos_token_id=fast.eos_token_id,
                                   pad_token_id=fast.pad_token_id)
    transformers.Qwen2ForCausalLM(cfg).save_pretrained(folder)
    transformers.GenerationConfig(bos_token_id=fast.bos_token_id, eos_token_id=fast.eos_token_id,
                                  pad_token_id=fast.pad_token_id).save_pretrained(folder)
    return folder


def bench_model(name: str, workdir: Path, seed: int = 0) -> tuple[str | None, ModelSpec]:
    """(HF folder or None for the built-in warmed-up policy, its ModelSpec) of benchmark model `name`."""
    if name == "tiny":
        return None, model_preset("tiny")
    if name == "qwen2-bpe":
        folder = qwen2_bpe_folder(Path(workdir) / "qwen2-bpe", seed=seed)
        return str(folder), ModelSpec.from_hf_config(folder, name="qwen2-bpe")
    raise HflowError(f"unknown benchmark model '{name}'; choose one of {', '.join(BENCH_MODELS)}")
