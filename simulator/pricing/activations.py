"""What a token holds: the activation bytes one token leaves per layer for the backward, or holds in a forward
without gradients, by backend and element size; and the tokens one micro-batch of a data-parallel rank holds
(memory.py adds them up per device).

Each count is this runtime's, checked against the decoder itself (tests/runtime/engines/train/
test_activation_memory.py: the tensors autograd saves, the peak of live tensors op by op): the FSDP engine runs an
eager decoder (models/decoder.py), whose RMSNorms normalise in fp32; a fused backend (megatron with Transformer
Engine) keeps Korthikanti et al. 2022's count.
"""

from __future__ import annotations

import functools

from hybridflow.simulator.vocabulary.model import ModelSpec
from hybridflow.simulator.vocabulary.units import BF16, FP32
from hybridflow.simulator.vocabulary.workload import Workload


def norm_saved_bytes(model: ModelSpec, backend: str, element_bytes: int) -> float:
    """Bytes per token an RMSNorm leaves for the backward, with the matmul input it feeds. Fused (megatron's
    Transformer Engine): its input and its output, the next matmul's input. Eager (the FSDP runtime's decoder,
    HF's for deepspeed): normalising in fp32 keeps an fp32 copy of the input (the input itself in fp32), the
    normalised tensor and its product with the weight."""
    if backend == "megatron":
        return 2 * element_bytes * model.hidden
    return (FP32 + 2 * element_bytes) * model.hidden


def activation_bytes_per_token_layer(model: ModelSpec, tp: int, backend: str = "fsdp",
                                     element_bytes: int = BF16) -> float:
    """Activation bytes one token leaves in one layer for the backward (no s×s scores: FlashAttention, or
    attention per packed sequence). Replicated over tp: the two norms' (norm_saved_bytes); sharded: q, k, v
    and the attention output, and the SwiGLU's gate, up, act(gate) and product (4·ffn). A fused backend is
    Korthikanti et al. 2022's count (34·h for GPT; Llama's SwiGLU gives ~37·h for 7B); the eager decoder also
    keeps the attention output's copy laid out for the output projection."""
    q_dim = model.heads * model.dim_head
    kv_dim = model.kv_heads * model.dim_head
    attention = (2 if backend == "megatron" else 3) * q_dim + 2 * kv_dim
    return 2 * norm_saved_bytes(model, backend, element_bytes) + element_bytes * (attention + 4 * model.ffn) / tp


def layer_working_bytes_per_token(model: ModelSpec, tp: int, element_bytes: int = BF16) -> float:
    """Bytes per token a forward without gradients holds, one layer at a time: at its largest step the SwiGLU's
    act(gate), up and their product (3·ffn, sharded) beside the residual stream, the normed input and the
    block's output (3·h)."""
    return element_bytes * (3 * model.ffn / tp + 3 * model.hidden)


def backward_working_bytes_per_token(model: ModelSpec, tp: int, element_bytes: int = BF16) -> float:
    """Bytes per token the backward adds to what the forward saved, at its peak — its start, while every saved
    tensor still lives: the gradients of the last block's output (h) and of its SwiGLU product (ffn, sharded).
    Later layers' gradients take the place of saved tensors already freed."""
    return element_bytes * (model.ffn / tp + model.hidden)


def _rows_per_step(workload: Workload, dp: int, mini_batches: int) -> int:
    """Sequences one data-parallel rank takes in one optimizer step (at least one)."""
    return max(1, -(-workload.sequences // (mini_batches * dp)))


def micro_batch_split(workload: Workload, dp: int, mini_batches: int) -> tuple[int, int]:
    """(sequences per micro-batch, micro-batches per mini-batch) on one data-parallel rank."""
    per_rank = _rows_per_step(workload, dp, mini_batches)
    b = min(workload.micro_batch_size, per_rank)
    return b, -(-per_rank // b)


@functools.lru_cache(maxsize=4096)
def _rank_step_tokens(workload: Workload, dp: int, mini_batches: int) -> float:
    """Tokens of the largest mini-batch the most loaded data-parallel rank takes, for a length distribution: the
    batch's representative lengths (prompt + LengthDistribution.sample) dealt in equal counts with about equal
    tokens (the runtime's balanced partition, rl/batches.py dp_balanced_order), whose most loaded part holds at
    least the mean share and at least the longest sequence beside the shortest others (the optimum's lower bound:
    the partition lies within a few % of it, closer the more rows a rank holds); the rank's rows then cut in
    order into mini-batches, the one holding its longest sequence filled with average ones."""
    lengths = [workload.prompt_len + r for r in workload.response_lengths.sample(workload.sequences)]
    rows = -(-len(lengths) // dp)
    part = max(sum(lengths) / dp, lengths[-1] + sum(lengths[:rows - 1]))
    per_step = -(-rows // mini_batches)
    if rows == 1:
        return float(part)
    return lengths[-1] + (part - lengths[-1]) * (per_step - 1) / (rows - 1)


def micro_batch_tokens_held(workload: Workload, dp: int, mini_batches: int, micro_batch_tokens: int | None) -> float:
    """Tokens one micro-batch of a data-parallel rank holds: b rows of seq_len, or packed (a token budget) the
    budget, but never more than the rank holds in a step (_rank_step_tokens for a length distribution)."""
    if micro_batch_tokens is None:
        return float(micro_batch_split(workload, dp, mini_batches)[0] * workload.seq_len)
    if workload.response_lengths is None:
        held = _rows_per_step(workload, dp, mini_batches) * workload.seq_len
    else:
        held = _rank_step_tokens(workload, dp, mini_batches)
    return float(min(micro_batch_tokens, held))
