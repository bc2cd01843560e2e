"""What another system's generation loop costs over a serving engine's, where it is documented (vocabulary/mechanics.py).

Hugging Face `generate` drives the decode loop of DeepSpeed-Chat (with its Hybrid Engine, over DeepSpeed's fused
inference kernels; without it, over the HF model in eager PyTorch) and of OpenRLHF v0.2 without vLLM; Megatron's
own generation loop drives NeMo-Aligner v0.2's (in its training layout, eager PyTorch, each step through the
pipeline's stages one after another). Such a step differs from a serving engine's in documented ways, priced here
per decode step on top of the serving engine's own step (generation.py `decode_step`):

- **CPU-bound launches.** The loop issues every layer's kernels from Python, one at a time, with no CUDA graph; a
  small decode step's GPU work finishes before the CPU has issued the next kernel, so a step costs the larger of the
  CPU's time issuing the layers and the GPU's work (the CPU times of Megatron's loop and the Hybrid Engine's are
  whole batch-1 steps, GPU work included). The CPU's time per layer, measured:
  - a model in eager PyTorch (Megatron's): PyTorch's "Accelerating Generative AI with PyTorch II: GPT, Fast"
    (pytorch.org blog, 2023-11-30; A100-80GB, batch 1) measured an eager Llama-7B (32 layers) at 25.5 tok/s,
    "heavily CPU overhead bound" (107 tok/s once compiled with CUDA graphs): 1/25.5 s over 32 layers.
  - HF `generate` (`hf-eager`, `hf-eager-fa2`): the CPU does not run ahead, so a step costs the CPU's time issuing
    the layers *plus* the GPU's work (`HOST_WAITS`). With FlashAttention-2 on a padded batch the host waits for the
    GPU in every layer: `LlamaFlashAttention2._upad_input` (transformers v4.38) calls `_get_unpad_data`, whose
    `torch.nonzero` and `.max().item()` synchronise. OpenRLHF's benchmark table (benchmark/README.md at commit
    dbdd43b0, 8 A800) times HF generate on both paths — DeepSpeed-Chat's (SDPA) at 2, 4 and 8 sequences, OpenRLHF's
    (FlashAttention-2) at 8 and 16 — and host + GPU with one host time per layer fits its rows (each row's own
    within ±25 % of the median), where max(host, GPU) fits none with a common one: DS-Chat's 7B step grows from
    29.8 ms at 4 sequences to 42.5 ms at 8, which a batch-independent host floor over the GPU's step cannot give.
    The host time per layer is the median of what the five generation phases leave once the GPU's work is priced
    (DS-Chat's 7B w/o offload, 4 sequences, held out; docs/cost-model.md lists each), about 40 % of GPT-Fast's
    eager figure: a faster host, and transformers' kernels rather than GPT-Fast's.
  - DeepSpeed-Chat's Hybrid Engine (fused inference containers, `DeepSpeedHybridEngine.generate` calling HF
    `generate`), per container, since DeepSpeed maps each model class to its own (DS_OPTContainer; HF Llama's
    DS_LLAMAContainer, whose split q/k/v and gated MLP and rotary embedding are kernels of their own):
    - OPT: DeepSpeed-Chat's published step-3 log (DeepSpeedExamples, training_log_output/
      actor_opt-1.3b_critic_opt-350m_globalBatchSize64.log, a 32 GB V100 node) prints "Generate time=2.54s" for
      OPT-1.3B (24 layers), 4 sequences per device, 256 new tokens — a GPU step of that size takes a few ms, so
      2.54 s / 256 / 24 is the CPU's time per layer.
    - Llama: DeepSpeed's Llama-2 release blog (ds-chat-release-8-31, Figure 1) measured Llama-2-7B's generation on
      A100s 7.1x faster with the Hybrid Engine than the 50 s without it, as DeepSpeed-Chat's run_llama2_7b.sh runs
      it: 1 sequence per device, 256 new tokens. One sequence's 7B step reads 13.5 GB of weights, under 9 ms on
      an A100, so 50 / 7.1 s / 256 / 32 is the CPU's time per layer (its 13B bar, 12 s over 40 layers, says more).
- **A KV cache that is concatenated.** transformers' `DynamicCache.update` (v4.36–4.38, cache_utils.py) appends
  each step's keys and values with `torch.cat`, which reads and writes the whole cache again every step: twice
  the cache's bytes of HBM traffic per step on top of attention's own read. With FlashAttention-2 on a left-padded
  batch (OpenRLHF loads its models with `use_flash_attention_2`), `LlamaFlashAttention2.forward` (v4.38,
  modeling_llama.py) transposes the cache's keys and values to FlashAttention's layout ("These transpose are
  quite inefficient", its own comment) and `_upad_input` reshapes that non-contiguous view, a copy, then gathers
  the unpadded rows (`index_first_axis`), another: each step reads and writes the whole cache four times more.
  The Hybrid Engine's containers and Megatron keep a preallocated cache (`max_out_tokens`, `InferenceParams`).

`eager_decode_step` is one step's price by part; `eager_generate_extra` the seconds a whole generate call adds
to the serving engine's price; `hf_generate_slowdown` the plan's generate op over its serving-engine price
(the `decode_slowdown` the baseline's Mechanics carries, so `compare`'s breakdown shows it on `generate`).
"""

from __future__ import annotations

from typing import Literal

from hybridflow.simulator.pricing.generation import decode_step, decode_waves
from hybridflow.simulator.pricing.memory import kv_bytes_per_sequence
from hybridflow.simulator.pricing.plan_memory import kv_free_bytes
from hybridflow.simulator.vocabulary.model import ModelSpec
from hybridflow.simulator.vocabulary.parallel import ParallelConfig
from hybridflow.simulator.vocabulary.workload import Workload

# CPU seconds to issue one decoder layer of a decode step (module docstring):
# https://pytorch.org/blog/accelerating-generative-ai-2/ "Starting Point (25.5 tok/s)": eager Llama-7B, 32 layers
EAGER_LAYER_SECONDS = 1.0 / 25.5 / 32
# https://github.com/microsoft/DeepSpeedExamples/blob/91863475/applications/DeepSpeed-Chat/training/step3_rlhf_finetuning/
# training_log_output/actor_opt-1.3b_critic_opt-350m_globalBatchSize64.log: "Generate time=2.54s", 256 tokens, 24 layers
HYBRID_ENGINE_OPT_LAYER_SECONDS = 2.54 / 256 / 24
# https://github.com/microsoft/DeepSpeed/blob/fd405169/blogs/deepspeed-chat/ds-chat-release-8-31/README.md Figure 1
# (assets/images/llama2-with-he.png): "7.1x faster generation for Llama-2-7B", the bar without it 50 s; 256 tokens,
# 32 layers (DeepSpeedExamples step3 training_scripts/llama2/run_llama2_7b.sh: 1 sequence per device, 256 + 256)
HYBRID_ENGINE_LLAMA_LAYER_SECONDS = 50.0 / 7.1 / 256 / 32
# Host seconds per layer of an HF generate step, the host not overlapping the GPU (module docstring): the median over
# OpenRLHF's benchmark table's HF-generate generation phases (tests/planner/test_hf_generate_host.py recomputes it)
HF_GENERATE_LAYER_SECONDS = 0.476e-3
Loop = Literal["hf-eager", "hf-eager-fa2", "hybrid-engine", "megatron"]
LOOP_LAYER_SECONDS = {"hf-eager": HF_GENERATE_LAYER_SECONDS, "hf-eager-fa2": HF_GENERATE_LAYER_SECONDS,
                      "hybrid-engine": HYBRID_ENGINE_LLAMA_LAYER_SECONDS, "megatron": EAGER_LAYER_SECONDS}
# Times a step reads or writes the whole KV cache beyond attention's own read (module docstring): torch.cat's read
# and write; with FlashAttention-2 and left padding, also the reshape's copy and the unpadding gather, each a read
# and a write.
KV_COPIES = {"hf-eager": 2, "hf-eager-fa2": 6, "hybrid-engine": 0, "megatron": 0}
# Loops whose host waits for the GPU within a step, so their step is host + GPU (module docstring)
HOST_WAITS = frozenset({"hf-eager", "hf-eager-fa2"})
# Contexts a call's decode steps are sampled at (the step's price is piecewise linear in the context).
CONTEXT_SAMPLES = 16


def loop_layer_seconds(model: ModelSpec, loop: Loop) -> float:
    """The CPU's time to issue one layer of a decode step in `loop`; the Hybrid Engine's by its container (module
    docstring): OPT's for an OPT model (a ModelSpec names OPT only by its name, no preset family), else Llama's."""
    if loop == "hybrid-engine" and model.name.lower().startswith("opt"):
        return HYBRID_ENGINE_OPT_LAYER_SECONDS
    return LOOP_LAYER_SECONDS[loop]


def eager_decode_step(cm, model: ModelSpec, gen: ParallelConfig, batch: int, context: float,
                      loop: Loop = "hf-eager") -> dict[str, float]:
    """One decode step of a generation loop (`loop`: HF generate over the eager HF model or over the Hybrid Engine's
    containers, or Megatron's over its stages) of `batch` sequences at `context` tokens, by part: the serving engine's step on the GPU (`gpu`), the
    eager cache's concatenation (`kv_copy`: its bytes read and written), the CPU issuing the layers (`cpu_launch`);
    `step_seconds` = cpu_launch + gpu + kv_copy where the host waits for the GPU (`HOST_WAITS`: HF generate's
    loops), else max(cpu_launch, gpu + kv_copy)."""
    gpu = decode_step(cm, model, gen, batch, context)["step_seconds"]
    kv_copy = KV_COPIES[loop] * batch * kv_bytes_per_sequence(model, gen, context) / cm.hbm
    # Megatron's loop passes each step through the pipeline's stages one after another
    cpu = (model.layers if loop == "megatron" else model.layers / gen.pp) * loop_layer_seconds(model, loop)
    step = cpu + gpu + kv_copy if loop in HOST_WAITS else max(cpu, gpu + kv_copy)
    return {"gpu": gpu, "kv_copy": kv_copy, "cpu_launch": cpu, "step_seconds": step}


def eager_generate_extra(cm, model: ModelSpec, gen: ParallelConfig, workload: Workload, calls: int,
                         batch: int, loop: Loop = "hf-eager") -> float:
    """Seconds that `calls` generate calls of `batch` sequences each add over the serving engine's decode
    steps: per step its step_seconds − gpu, summed over the response's steps (sampled contexts)."""
    P, R = workload.prompt_len, max(1, round(workload.mean_response_len))
    steps = R - 1
    if steps <= 0:
        return 0.0
    n = min(CONTEXT_SAMPLES, steps)
    total = 0.0
    for i in range(n):  # midpoints of n equal spans of the steps 1 … R-1
        k = 1 + (i + 0.5) * steps / n
        s = eager_decode_step(cm, model, gen, batch, P + k, loop)
        total += (s["step_seconds"] - s["gpu"]) * steps / n
    return calls * total


def hf_generate_slowdown(cm, plan, loop: Loop = "hf-eager") -> float:
    """The plan's generate op, run by the system's generation loop, over its price on a serving engine (module docstring):
    1 + the calls' extra seconds / the serving-engine price. The plan's mechanics give the static batch and calls."""
    from hybridflow.simulator.pricing.cost import price_op

    base = price_op(cm, plan, "generate", "actor").seconds
    if base <= 0:
        return 1.0
    w, mech, gen = plan.workload, plan.mechanics, plan.generation_config()
    calls_per_op = w.mini_batches if mech.generate_per_minibatch else 1
    seqs = -(-w.sequences // calls_per_op)
    _, waves, batch = decode_waves(cm, plan.roles["actor"].model, gen, w, seqs, kv_free_bytes(plan, cm.params),
                                   mech.generation_batch)
    w = w.padded_per_batch(batch)  # the loop runs each batch until its longest response ends, every row in it
    extra = eager_generate_extra(cm, plan.roles["actor"].model, gen, w, waves * calls_per_op, batch, loop)
    return 1.0 + extra / base
