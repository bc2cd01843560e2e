"""Memory per device: what each model holds, part by part, and whether a colocated set fits.

Accounting (bytes per parameter, mixed-precision Adam as in the ZeRO paper, Rajbhandari et al. 2020):
bf16 weights 2, bf16 gradients 2, fp32 master weights + Adam m + v 12 — 16 in total for a trained
model, 2 for a frozen one. Training and forward-only models are fully sharded over all their
devices (tp·pp shard the model, FSDP/ZeRO-3 shards over dp), so states scale as 1/(tp·pp·dp);
under `backend: megatron` (distributed optimizer) only the optimizer states are split over dp, the
weights and an fp32 gradient buffer are whole on each dp rank. That buffer is a state: megatron-core's
DDP allocates it with the model and keeps it (through generation too) unless the model is offloaded.

A model's memory is its *states* (weights, optimizer: resident while it lives on the device) plus the
*transient* of the op it runs (training: gradients, activations, FSDP gather buffers; forward: one layer's
working set and the logits — what a token holds: activations.py; generation: the generation-layout weights
and the KV cache). Colocated models take turns: without offload every model's states stay resident and
only the running op's transient is added; with `plan.offload` idle models' states live in host memory, so
the peak is the largest single model's states + its largest transient. Each device also keeps
`reserved_bytes` (CUDA context, NCCL) once, reported under buffers.
(A Plan's groups summed so: plan_memory.py.)

LoRA (vocabulary/lora.py): the base weights stay in bf16 with no gradients and no optimizer states;
the adapters (A) carry the trained 16 bytes per parameter — weights and Adam's states resident,
gradients in the update's transient. Activations are the full model's; the FSDP gathers move the
frozen base too, but no full-size gradient is reduce-scattered.
"""

from __future__ import annotations

import math

from pydantic import BaseModel, ConfigDict

from hybridflow.simulator.errors import HflowError
from hybridflow.simulator.pricing.activations import (
    activation_bytes_per_token_layer,
    backward_working_bytes_per_token,
    layer_working_bytes_per_token,
    micro_batch_split,
    micro_batch_tokens_held,
    norm_saved_bytes,
)
from hybridflow.simulator.pricing.efficiency import EfficiencyParams
from hybridflow.simulator.pricing.reshard import reshard_spec
from hybridflow.simulator.vocabulary.hardware import HardwareSpec
from hybridflow.simulator.vocabulary.lora import LoraConfig, adapter_params
from hybridflow.simulator.vocabulary.model import Head, ModelSpec
from hybridflow.simulator.vocabulary.parallel import ParallelConfig
from hybridflow.simulator.vocabulary.roles import TRAINED_ROLES, role_head
from hybridflow.simulator.vocabulary.units import BF16, FP32, GiB
from hybridflow.simulator.vocabulary.workload import Workload

MEGATRON_GRAD_BYTES = FP32  # Megatron's fp32 main-grad buffer (grad_reduce_in_fp32)
OPTIMIZER_BYTES = 12  # fp32 master + Adam m + v
PARTS = ("weights", "gradients", "optimizer", "activations", "kv_cache", "buffers")


class InfeasibleError(HflowError):
    """A model or colocated set does not fit its devices; the message shows the breakdown."""


class MemoryBreakdown(BaseModel):
    """Bytes per device by part."""

    model_config = ConfigDict(extra="forbid")

    weights: float = 0.0
    gradients: float = 0.0
    optimizer: float = 0.0
    activations: float = 0.0
    kv_cache: float = 0.0
    buffers: float = 0.0

    @property
    def total(self) -> float:
        return self.weights + self.gradients + self.optimizer + self.activations + self.kv_cache + self.buffers

    def __add__(self, other: MemoryBreakdown) -> MemoryBreakdown:
        return MemoryBreakdown.model_construct(**{k: getattr(self, k) + getattr(other, k) for k in PARTS})

    def describe(self) -> str:
        return ", ".join(f"{k} {getattr(self, k) / GiB:.1f}" for k in PARTS if getattr(self, k) > 0) + " GiB"

    def require_fits(self, hardware: HardwareSpec, what: str, params: EfficiencyParams | None = None) -> None:
        """Raise InfeasibleError (one line, with the breakdown) when this does not fit one device."""
        p = params or EfficiencyParams.for_hardware(hardware)
        limit = hardware.hbm_bytes * p.usable_memory_fraction
        if self.total > limit:
            raise InfeasibleError(
                f"{what} needs {self.total / GiB:.1f} GiB per device ({self.describe()}) but one {hardware.name} "
                f"offers {limit / GiB:.1f} GiB; use more devices (larger tp·pp·dp), recomputation or offload")


def memory_parts(**parts: float) -> MemoryBreakdown:
    """A MemoryBreakdown of the parts named (the others 0), unchecked: the hot paths build many."""
    return MemoryBreakdown.model_construct(**{k: float(parts.get(k, 0.0)) for k in PARTS})


# ---- the parts, as plain floats --------------------------------------------------------------
def at_element_bytes(states: MemoryBreakdown, element_bytes: int) -> MemoryBreakdown:
    """`states` (state_bytes: counted in bf16) on a device that computes in `element_bytes` per element (a CPU
    profile measured in fp32: 4): weights and a gradient buffer scale with the element; Adam's m and v are fp32
    either way, and fp32 weights are their own master copy (8 bytes per trained parameter instead of 12). The
    transients take the element size themselves (an eager norm's fp32 copy does not scale)."""
    scale = element_bytes / BF16
    optimizer = (OPTIMIZER_BYTES - (FP32 if element_bytes >= FP32 else 0)) / OPTIMIZER_BYTES
    return memory_parts(weights=states.weights * scale, gradients=states.gradients * scale,
                        optimizer=states.optimizer * optimizer)


def megatron_local_params(model: ModelSpec, head: Head, parallel: ParallelConfig) -> float:
    """Parameters one Megatron rank holds whole over dp: the dense ones split by tp·pp, the experts also over ep."""
    params, experts = model.num_params(head), model.expert_params()
    return (params - experts) / parallel.model_parallel_size + experts / (parallel.model_parallel_size * parallel.ep)


def state_bytes(model: ModelSpec, head: Head, parallel: ParallelConfig, trainable: bool,
                optimizer_offload: bool = False, lora: LoraConfig | None = None) -> MemoryBreakdown:
    """Resident bytes per device: the weights and (trained, unless offloaded to host memory) Adam's states.
    lora: the frozen base in bf16 plus the adapters and their Adam states (FSDP: everything over all devices)."""
    n = parallel.world_size
    params = model.num_params(head)
    if lora is not None and trainable:
        a = adapter_params(model, lora)
        return memory_parts(weights=BF16 * (params + a) / n, optimizer=0.0 if optimizer_offload else OPTIMIZER_BYTES * a / n)
    # Megatron (distributed optimizer, ZeRO-1): weights whole over dp (experts split over ep), optimizer
    # states sharded over dp (of the experts, over dp / ep ranks holding an ep-th each: the same share), and a
    # trained model's fp32 gradient buffer whole per dp rank, resident (ZeRO-Offload's gradients live in host
    # memory, as under FSDP).
    megatron = parallel.backend == "megatron"
    weights = megatron_local_params(model, head, parallel) if megatron else params / n
    kept = trainable and not optimizer_offload
    grads = MEGATRON_GRAD_BYTES * weights if megatron and kept else 0.0
    return memory_parts(weights=BF16 * weights, gradients=grads, optimizer=OPTIMIZER_BYTES * params / n if kept else 0.0)


def _gather_unit_bytes(model: ModelSpec, tp: int, element_bytes: int = BF16) -> float:
    """The largest FSDP unit, unsharded over dp (still split over tp): a layer or the embedding."""
    return element_bytes * max(model.layer_params(), model.vocab * model.hidden) / tp


def train_transient(model: ModelSpec, head: Head, parallel: ParallelConfig, workload: Workload,
                    recompute: bool = False, lora: LoraConfig | None = None,
                    micro_batch_tokens: int | None = None, element_bytes: int = BF16) -> MemoryBreakdown:
    """micro_batch_tokens: the role's packing budget (micro_batch_tokens_held). element_bytes: the compute
    element (bf16 on GPUs; a CPU profile's fp32)."""
    tp, pp, dp, e = parallel.tp, parallel.pp, parallel.dp, element_bytes
    _, m = micro_batch_split(workload, dp // parallel.sp, workload.mini_batches)
    # Ulysses: 1/sp of the sequences' tokens
    tokens = micro_batch_tokens_held(workload, dp // parallel.sp, workload.mini_batches, micro_batch_tokens) / parallel.sp
    per_layer = activation_bytes_per_token_layer(model, tp, parallel.backend, e) * tokens
    in_flight = min(m, pp)  # 1F1B: the first stage holds pp micro-batches
    layers = model.layers / pp
    if recompute:  # keep each layer's input, rebuild one layer at a time in the backward
        acts = in_flight * layers * e * model.hidden * tokens + per_layer
    else:
        acts = in_flight * layers * per_layer
    # the final norm's saved tensors and the backward's first gradients
    acts += (norm_saved_bytes(model, parallel.backend, e) + backward_working_bytes_per_token(model, tp, e)) * tokens
    if head == "lm":  # logits, their fp32 log-softmax, the logits' gradient
        acts += tokens * model.vocab / tp * (2 * e + FP32)
    if parallel.backend == "megatron":  # its gradient buffer is a state (state_bytes); no gathers
        return memory_parts(activations=acts)
    if lora is not None:  # gradients of the adapters only; the gathers still move the frozen base
        bufs = 2 * _gather_unit_bytes(model, tp, e) if dp > 1 else 0.0
        return memory_parts(gradients=e * adapter_params(model, lora) / parallel.world_size, activations=acts,
                            buffers=bufs)
    bufs = 3 * _gather_unit_bytes(model, tp, e) if dp > 1 else 0.0  # gather current + prefetch, grad to scatter
    return memory_parts(gradients=e * model.num_params(head) / parallel.world_size, activations=acts, buffers=bufs)


def forward_transient(model: ModelSpec, head: Head, parallel: ParallelConfig, workload: Workload,
                      micro_batch_tokens: int | None = None, element_bytes: int = BF16) -> MemoryBreakdown:
    """Without gradients a forward holds one layer's working set at a time (+ the logits and their fp32
    log-softmax)."""
    e = element_bytes
    tokens = micro_batch_tokens_held(workload, parallel.dp // parallel.sp, 1, micro_batch_tokens) / parallel.sp
    acts = layer_working_bytes_per_token(model, parallel.tp, e) * tokens
    if head == "lm":
        acts += tokens * model.vocab / parallel.tp * (e + FP32)
    gathers = parallel.dp > 1 and parallel.backend == "fsdp"
    bufs = 2 * _gather_unit_bytes(model, parallel.tp, e) if gathers else 0.0
    return memory_parts(activations=acts, buffers=bufs)


def kv_bytes_per_sequence(model: ModelSpec, gen: ParallelConfig, seq_len: int) -> float:
    """KV-cache bytes one full-length sequence takes on one device of the generation layout."""
    kv_share = max(model.kv_heads / gen.tp, 1.0) / model.kv_heads  # kv heads replicate when tp > kv_heads
    return seq_len * model.kv_bytes_per_token() * kv_share / gen.pp


def generation_shard_bytes(model: ModelSpec, gen: ParallelConfig) -> float:
    """One device's bf16 share of the LM's weights in the generation layout."""
    return BF16 * model.num_params("lm") / (gen.tp * gen.pp)


def generate_weights(model: ModelSpec, train: ParallelConfig, gen: ParallelConfig, mode: str,
                     resident_train_weights: float, lora: LoraConfig | None = None) -> float:
    """Extra weight bytes per device while generating: the reshard's peak, minus the training shard
    when it lies inside the generation shard (HybridFlow's zero redundancy). A LoRA actor's generation
    engine holds its own copy of the base in the generation layout (the adapters merged in, or beside it
    under vLLM's LoRA API): the whole generation shard, which no frozen training shard can alias."""
    if lora is not None:
        return generation_shard_bytes(model, gen)
    spec = reshard_spec(BF16 * model.num_params("lm"), train, gen, mode)
    overlap = resident_train_weights if mode == "hybridflow" else 0.0
    return max(spec.peak_memory - overlap, 0.0)


def generate_buffers(model: ModelSpec, gen: ParallelConfig, batch: int) -> float:
    return batch * model.vocab / gen.tp * 4.0  # fp32 logits of one decode step


def decode_batch(model: ModelSpec, gen: ParallelConfig, workload: Workload, kv_free_bytes: float,
                 params: EfficiencyParams, sequences: int | None = None) -> int:
    """Sequences one generation replica decodes at once: as many as the free memory holds, at most
    max_decode_batch and at most what it was given. 0 when not even one sequence fits. With a length
    distribution a slot is sized for the mean context (Workload.kv_seq_len), and the longest response
    must fit on its own."""
    seqs = sequences if sequences is not None else workload.sequences
    per_replica = -(-seqs // gen.dp)
    free = max(kv_free_bytes, 0.0)
    if free < kv_bytes_per_sequence(model, gen, workload.seq_len):
        return 0
    cap = int(free // kv_bytes_per_sequence(model, gen, workload.kv_seq_len))
    return min(cap, params.max_decode_batch, per_replica)


def engine_kv_cap(model: ModelSpec, gen: ParallelConfig, memory_fraction: float | None, hbm_bytes: float) -> float:
    """The most KV-cache bytes per device a rollout engine given `memory_fraction` of each device takes: vLLM's
    gpu_memory_utilization bounds its weights and KV cache together (inf: no fraction set, the memory left)."""
    if memory_fraction is None:
        return math.inf
    return memory_fraction * hbm_bytes - generation_shard_bytes(model, gen)


def generate_transient(model: ModelSpec, train: ParallelConfig, gen: ParallelConfig, workload: Workload,
                       kv_free_bytes: float, params: EfficiencyParams, mode: str = "hybridflow",
                       resident_train_weights: float = 0.0, lora: LoraConfig | None = None,
                       kv_cap: float = math.inf) -> MemoryBreakdown:
    """Generation weights + the KV cache of the batch that `kv_free_bytes` allows, at most `kv_cap`
    (engine_kv_cap) (+ logits)."""
    w = generate_weights(model, train, gen, mode, resident_train_weights, lora)
    batch = decode_batch(model, gen, workload, min(kv_free_bytes - w, kv_cap), params)
    return memory_parts(weights=w, kv_cache=max(batch * kv_bytes_per_sequence(model, gen, workload.kv_seq_len),
                                       kv_bytes_per_sequence(model, gen, workload.seq_len) if batch else 0.0),
               buffers=generate_buffers(model, gen, batch))


def role_memory(model: ModelSpec, head: Head, parallel: ParallelConfig, workload: Workload, trainable: bool,
                hardware: HardwareSpec, gen: ParallelConfig | None = None, *, recompute: bool = False,
                mode: str = "hybridflow", params: EfficiencyParams | None = None,
                lora: LoraConfig | None = None) -> MemoryBreakdown:
    """One model alone on its devices at its peak op (states + the largest transient + the fixed
    reservation). `gen` (the actor) adds the generation phase, its KV cache filling the free memory
    up to the decode batch it would run."""
    p = params or EfficiencyParams.for_hardware(hardware)
    states = state_bytes(model, head, parallel, trainable, lora=lora)
    phases = [train_transient(model, head, parallel, workload, recompute, lora) if trainable
              else forward_transient(model, head, parallel, workload)]
    if gen is not None:
        free = p.usable_bytes(hardware.hbm_bytes) - states.total
        phases.append(generate_transient(model, parallel, gen, workload, free, p, mode, states.weights, lora))
    peak = max(phases, key=lambda m: m.total)
    return states + peak + memory_parts(buffers=p.reserved_bytes)


# ---- colocated sets on n devices (the planner's minimum allocation) -------------------------
def _configs(model: ModelSpec, n: int, devices_per_node: int) -> list[ParallelConfig]:
    out = []
    for tp in range(1, min(n, devices_per_node) + 1):
        if n % tp or model.heads % tp or model.kv_heads % tp:
            continue
        for pp in range(1, n // tp + 1):
            if (n // tp) % pp == 0 and model.layers % pp == 0:
                out.append(ParallelConfig(pp=pp, tp=tp, dp=n // (tp * pp)))
    return out


def _least_transient(model: ModelSpec, role: str, n: int, workload: Workload, devices_per_node: int) -> float | None:
    """The smallest transient any config over n devices gives this role (None: no config exists).
    States do not depend on the config (everything is sharded over all n devices)."""
    head, best = role_head(role), None
    for cfg in _configs(model, n, devices_per_node):
        t = (train_transient(model, head, cfg, workload, recompute=True) if role in TRAINED_ROLES
             else forward_transient(model, head, cfg, workload)).total
        if role == "actor":  # generation in the same layout, at least one sequence in the KV cache
            w = generate_weights(model, cfg, cfg, "hybridflow", state_bytes(model, head, cfg, True).weights)
            t = max(t, w + kv_bytes_per_sequence(model, cfg, workload.seq_len) + generate_buffers(model, cfg, 1))
        best = t if best is None else min(best, t)
    return best


_FITS_CACHE: dict[tuple, bool] = {}


def fits_on(models: list[tuple[ModelSpec, str]], devices: int, workload: Workload, cluster,
            *, offload: bool = False, params: EfficiencyParams | None = None) -> bool:
    """Can these colocated (model, role) pairs share `devices` devices under some parallel configs?
    Roles say which are trained (actor, critic: Adam states, recomputation allowed) and which
    generate (actor). Offload: idle models' states live in host memory."""
    p = params or EfficiencyParams.for_hardware(cluster.hardware)
    key = (tuple(models), devices, workload, cluster, offload, p)
    hit = _FITS_CACHE.get(key)
    if hit is not None:
        return hit
    usable = p.usable_bytes(cluster.hardware.hbm_bytes)
    states, peaks = [], []
    ok = True
    for model, role in models:
        t = _least_transient(model, role, devices, workload, cluster.devices_per_node)
        if t is None:
            ok = False
            break
        s = ((BF16 + (OPTIMIZER_BYTES if role in TRAINED_ROLES else 0)) * model.num_params(role_head(role))
             / devices)
        states.append(s)
        peaks.append(s + t if offload else t)
    if ok:
        ok = (max(peaks, default=0.0) if offload else sum(states) + max(peaks, default=0.0)) <= usable
    if len(_FITS_CACHE) > 100_000:
        _FITS_CACHE.clear()
    _FITS_CACHE[key] = ok
    return ok


def min_devices(models: list[tuple[ModelSpec, str]], workload: Workload, cluster, *, offload: bool = False,
                params: EfficiencyParams | None = None) -> int | None:
    """The fewest devices (up to the whole cluster) on which the colocated set fits; None if none."""
    for n in range(1, cluster.num_devices + 1):
        if fits_on(models, n, workload, cluster, offload=offload, params=params):
            return n
    return None
