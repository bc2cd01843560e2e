"""`host_adam_bandwidth` from the published runs that isolate ZeRO-Offload's host step.

Each pair is one training setup measured with and without `offload_optimizer` and nothing else changed (stage,
checkpointing, micro-batch, global batch): the extra seconds per optimizer step are the offloaded step's, the
gradients copied out and the weights copied back (priced by `CostModel.train`'s `host_copy`) plus CPU Adam over
the node's parameters, which is what the term prices. Source: chenyaofo, GitHub gist
d4cd6a20ab4b95cb3a49491747e2139a, "Benchmark of LLaMA-7B models using deepspeed-based training code" (LLaMA-7B,
sequence length 4096, 8 A800, 2x Intel Xeon 8358, DeepSpeed 0.14.2, HF gradient checkpointing on); its Th.put
read as samples/s of the machine (profiles/published.yaml, the gist's op-tier records) and its "batch size for
gradient descent" of 64 as the sequences per optimizer step.
"""

from __future__ import annotations

import statistics

from hybridflow.simulator.vocabulary.model import model_preset

# (ZeRO stage, per-device micro-batch, samples per optimizer step, samples/s without, with offload_optimizer)
GIST_OFFLOAD_PAIRS = ((2, 1, 64, 4.19, 1.81), (3, 2, 64, 4.45, 2.05))
GIST_MODEL = "llama2-7b"  # LLaMA-7B's shape
GIST_DEVICES = 8


def offload_step_seconds(pair: tuple) -> float:
    """Seconds an optimizer step gains when its optimizer is offloaded."""
    _, _, samples, without, offloaded = pair
    return samples / offloaded - samples / without


def host_adam_bandwidth(adam_bytes_per_param: float, host_copy_seconds: float) -> float:
    """Adam bytes/s of the node's CPU: the node's parameters × `adam_bytes_per_param` over each pair's extra
    seconds less `host_copy_seconds` (the priced gradient and weight copies of one step), mean over the pairs."""
    params = model_preset(GIST_MODEL).num_params("lm")  # all 8 shards are on the one node
    host = statistics.mean(offload_step_seconds(p) - host_copy_seconds for p in GIST_OFFLOAD_PAIRS)
    return params * adam_bytes_per_param / host
