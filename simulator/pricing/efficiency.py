"""EfficiencyParams: every tunable efficiency, latency and overhead term of the cost and memory model.

The hardware spec says what a device *could* do (datasheet peak, link bandwidth); these terms say
what it really achieves. Defaults come from published measurements (each field says which, and
docs/cost-model.md explains the reasoning); a measured profile refits them (scipy) later, so every
term lives here in one pydantic model and nowhere else.
"""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field, PositiveFloat, PositiveInt

from hybridflow.simulator.vocabulary.units import GiB

CPU_ATTENTION_KEY_BLOCK = 512  # PyTorch's CPU flash-attention key block (attention_key_block)


class EfficiencyParams(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    # ---- compute --------------------------------------------------------------------------
    matmul_efficiency: float = Field(
        0.75, gt=0, le=1,
        description="fraction of dense bf16 peak a transformer layer reaches on large shapes. cuBLAS bf16 "
                    "GEMMs reach ~80-90% of A100/H100 peak at large sizes (NVIDIA 'Matrix Multiplication "
                    "Background' guide); norms, softmax and elementwise kernels pull a whole layer lower. "
                    "llm-foundry's FSDP benchmarks of MPT-7B on 8 A100s measure 64-77% hardware FLOP "
                    "utilization; this gives ~70% for those runs.")
    tokens_half: PositiveFloat = Field(
        128.0,
        description="rows (tokens per device per matmul) at which matmul efficiency is half its maximum: "
                    "the roofline ridge of an A100 is 312e12/2.0e12 ~ 150 FLOP/byte, and a bf16 GEMM with "
                    "M rows has an arithmetic intensity of about M, so GEMMs with fewer rows are "
                    "bandwidth-bound. Decode steps model their memory bound explicitly and skip this term.")
    deepspeed_efficiency: float = Field(
        1.0, gt=0, le=1,
        description="a DeepSpeed ZeRO-3 run of Hugging Face model code (backend 'deepspeed': DS-Chat's and OpenRLHF's "
                    "training) against the fused-kernel FSDP and Megatron runs the other terms are fitted to: HF's "
                    "unfused norms, rotary and gated MLP, ZeRO-3's per-parameter hooks. Scales its compute's "
                    "efficiency; 1: alike.")
    attention_efficiency: float = Field(
        1.0, gt=0, le=2,
        description="attention's FLOP/s relative to the matmuls' (QKᵀ and AV; flash-attention kernels reach a lower "
                    "share of peak than large GEMMs, most visibly at long sequences). 1: priced alike.")
    prefill_attention_efficiency: float | None = Field(
        None, gt=0, le=2,
        description="the rollout engine's prefill attention FLOP/s relative to the matmuls', where its kernel is not "
                    "the training passes' (the native engine's own C kernel on CPU, whose rate falls as the prompts' "
                    "score rows outgrow the caches). None: attention_efficiency.")
    attention_key_block: float = Field(
        0.0, ge=0,
        description="keys per block of the training passes' attention kernel: a causal query computes every key of "
                    "each block it enters, the diagonal block whole, so a sequence of s tokens computes "
                    "s·min(s, (s + block)/2) query-key pairs, not s(s + 1)/2 (op_cost.causal_keys). PyTorch's CPU "
                    "flash-attention kernel walks keys in blocks of 512 (aten/src/ATen/native/cpu/"
                    "FlashAttentionKernel.cpp, kv_split_size); a CPU profile's calibration sets it. 0: the causal half.")
    width_half: PositiveFloat = Field(
        256.0,
        description="shard width (hidden / tp) at which matmul efficiency is half its maximum: thin "
                    "shards under high tensor parallelism suffer tile and wave quantization. Chosen so "
                    "that tp=8 on a 4096-wide model keeps ~70% of tp=1's per-device efficiency, in line "
                    "with Megatron-LM's tensor-parallel weak-scaling (~77% at tp=8, Shoeybi et al. 2019).")
    # ---- memory traffic -------------------------------------------------------------------
    hbm_efficiency: float = Field(
        0.8, gt=0, le=1,
        description="achieved fraction of datasheet HBM bandwidth for streaming reads. With "
                    "decode_step_overhead it reproduces a public vLLM sweep (Llama-3.1-8B, batch 1, A100-40GB, "
                    "1024-token prompts: ~75 tokens/s): (15.0 GB of matmul weights + 0.13 GB of KV) / "
                    "(0.8 × 1.555 TB/s) + 1 ms = 13.2 ms per token = 76 tokens/s.")
    kv_read_efficiency: float = Field(
        1.0, gt=0, le=1,
        description="a decode step's KV-cache reads relative to its weight streaming (attention kernels gather the "
                    "cache in pages and per head, below a GEMV's streaming rate at long contexts). 1: alike.")
    decode_cache_bytes: float = Field(
        0.0, ge=0,
        description="bytes (bf16-equivalent, as the model counts them) of the device's last-level cache: a decode "
                    "step whose reads (its weights and the batch's KV cache) fit it reads them at cache_read_speedup "
                    "times the memory's rate, one whose reads outgrow it streams them all from memory. A CPU core's "
                    "share of its L3 holds a small model whole (a profile's Fingerprint.cache_bytes sets it); a GPU's "
                    "L2 holds a sliver of a model's weights. 0: every byte from memory.")
    cache_read_speedup: float = Field(
        1.0, ge=1,
        description="how many times faster than memory a decode step reads the bytes its cache keeps "
                    "(decode_cache_bytes); fitted to a profile's generate points.")
    adam_bytes_per_param: PositiveFloat = Field(
        28.0,
        description="HBM bytes an Adam step moves per parameter: read fp32 master, m, v (12) and the bf16 "
                    "gradient (2), write master, m, v (12) and the bf16 weight copy (2). Memory-bound.")
    # ---- links ------------------------------------------------------------------------------
    intra_link_efficiency: float = Field(
        0.78, gt=0, le=1,
        description="NCCL bus bandwidth / link bandwidth inside a node: nccl-tests all-reduce busbw "
                    "~230-240 GB/s on DGX A100 NVLink3 (300 GB/s each way).")
    inter_link_efficiency: float = Field(
        0.9, gt=0, le=1,
        description="NCCL bus bandwidth / NIC line rate across nodes: InfiniBand HDR 200 Gb/s reaches "
                    "~22-24 GB/s in nccl-tests.")
    collective_latency_growth: float = Field(
        0.0, ge=0,
        description="how a collective's fixed latency grows with its group: latency · (1 + growth · log2(n/2)) for n "
                    "ranks (a ring or tree of more ranks takes more hops per small message). 0: the hardware's "
                    "latency whatever the group.")
    host_adam_bandwidth: PositiveFloat = Field(
        10.3e9,
        description="Adam bytes/s a node's CPU streams when the optimizer is offloaded (ZeRO-Offload's CPU-Adam: "
                    "adam_bytes_per_param per parameter, the node's devices' shards one after another). From the "
                    "published pairs that change nothing but offload_optimizer (calibration/host_adam.py: a gist's "
                    "LLaMA-7B ZeRO-2 and ZeRO-3 runs on 8 A800, 20.1 s and 16.8 s more per step of 64 sequences, less "
                    "the priced gradient and weight copies): about 0.37 G parameters/s.")
    host_link_efficiency: float = Field(
        0.9, gt=0, le=1, description="achieved fraction of the device<->host copy bandwidth (pinned memory).")
    fsdp_overlap: float = Field(
        0.8, ge=0, le=1,
        description="fraction of compute time under which FSDP/ZeRO-3 all-gathers and reduce-scatters "
                    "hide (prefetching; Zhao et al., 'PyTorch FSDP', VLDB'23 report near-full overlap "
                    "on fast links). Only the rest is exposed.")
    # ---- generation --------------------------------------------------------------------------
    decode_step_overhead: PositiveFloat = Field(
        1.0e-3,
        description="fixed seconds per decode step beyond weight/KV traffic and collectives: scheduling, "
                    "sampling, kernel launches (vLLM with CUDA graphs; fitted together with hbm_efficiency "
                    "to the batch-1 measurement above).")
    generation_host_overlap: bool = Field(
        True,
        description="whether the generation engine overlaps its per-sequence host work (scheduling, block tables, "
                    "the sampler's and detokenizer's per-sequence Python) with the GPU's decode step: vLLM >= 0.6 "
                    "does (multi-step scheduling, asynchronous output processing), as do the C++ runtimes; vLLM "
                    "before 0.6 ran it between steps, the GPU idle (EngineOverheads.host_sequence_seconds prices "
                    "it; engine_params says which engine does which).")
    sampler_history_seconds: float = Field(
        0.0, ge=0,
        description="host seconds per token of a sequence's history (its prompt and the tokens generated so far), per "
                    "sequence per generation pass, for an engine whose sampler rebuilds every sequence's whole token "
                    "history into padded tensors each step, the GPU idle meanwhile: vLLM 0.3 and 0.4 "
                    "(SamplingTensors.from_lists, whatever the penalties; engine_params sets it). 0: none.")
    max_decode_batch: PositiveInt = Field(
        256, description="most sequences decoded at once per replica: vLLM's default max_num_seqs for the "
                         "LLM class (256 on A100 and devices under 70 GB; 1024 on H100/H200, see for_hardware).")
    prefill_chunk_tokens: PositiveInt = Field(
        8192, description="tokens per prefill batch (vLLM's chunked-prefill max_num_batched_tokens for the LLM "
                          "class: 8192 on A100, 16384 on H100/H200); chunks pipeline across stages.")
    # ---- the single controller (CPU) ----------------------------------------------------------
    driver_seconds_per_token: float = Field(
        5e-9, ge=0,
        description="driver-side seconds per response token for advantage estimation (vectorized "
                    "torch/numpy over the batch: a few ns per element).")
    rule_reward_seconds_per_sequence: float = Field(
        1e-4, ge=0,
        description="driver-side seconds per sequence for a rule-based reward or cost function, decoding "
                    "included (Python string matching, ~100 us per sample; a profile's `reward` points, the "
                    "built-in tasks' functions timed on its machine, replace it in calibration).")
    # ---- memory reservations -----------------------------------------------------------------
    usable_memory_fraction: float = Field(
        0.95, gt=0, le=1,
        description="fraction of device memory the runtime can fill; the rest is lost to allocator "
                    "fragmentation (PyTorch caching allocator; vLLM's gpu_memory_utilization is 0.9).")
    reserved_bytes: float = Field(
        1.5 * GiB, ge=0,
        description="bytes per device held outside the models: CUDA context (~0.5 GB), NCCL "
                    "communicator buffers, cuBLAS workspaces.")

    @classmethod
    def for_hardware(cls, hardware, **overrides) -> EfficiencyParams:
        """The defaults for one device kind: vLLM schedules bigger batches on >= 70 GB devices other than
        the A100 (vllm/engine/arg_utils.py, EngineArgs.get_batch_defaults)."""
        big = hardware.hbm_bytes >= 70 * GiB and "a100" not in hardware.name.lower()
        base = {"max_decode_batch": 1024, "prefill_chunk_tokens": 16384} if big else {}
        return _cached(cls, tuple(sorted({**base, **overrides}.items())))

    def usable_bytes(self, hbm_bytes: float) -> float:
        """What a device offers the models after fragmentation and the fixed reservation."""
        return hbm_bytes * self.usable_memory_fraction - self.reserved_bytes


# Host seconds per token to rebuild a sequence's token history as vLLM 0.3/0.4's sampler does each step (pad the
# prompt and output lists of Python ints, torch.tensor them, pinned): CPU time of that code on the development VM's
# Xeon, 256 sequences of 1024 + 512 tokens, about 10 ns padding and 73 ns converting per token.
HISTORY_TOKEN_SECONDS = 85e-9


def engine_params(engine: str, version: str | None) -> dict[str, bool | float]:
    """EfficiencyParams updates for a generation engine and its version: vLLM before 0.6 runs its host work
    between decode steps (vLLM's v0.6.0 release added multi-step scheduling and asynchronous output
    processing to hide it), and vLLM 0.3 and 0.4 also rebuild every sequence's token history for the sampler
    each step (sampler_history_seconds; vLLM PR #5289 skipped it for batches without penalties, June 2024);
    every other engine, and a vLLM whose version is not stated, is priced as overlapping."""
    if engine != "vllm" or not version:
        return {}
    major, minor = (int(p) for p in version.split(".")[:2])
    out: dict[str, bool | float] = {"generation_host_overlap": False} if (major, minor) < (0, 6) else {}
    if (0, 3) <= (major, minor) < (0, 5):
        out["sampler_history_seconds"] = HISTORY_TOKEN_SECONDS
    return out


DEFAULT_PARAMS = EfficiencyParams()
_CACHE: dict[tuple, EfficiencyParams] = {}


def _cached(cls, items: tuple) -> EfficiencyParams:
    hit = _CACHE.get(items)
    if hit is None:
        hit = _CACHE[items] = cls(**dict(items))
    return hit
