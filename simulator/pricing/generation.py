"""Generation pricing: a batched prefill, one decode step, the batch the KV cache holds, and a whole rollout.

A rollout is prefill (compute-bound) then one decode step per response token on each of gen.dp replicas, in
waves of the largest batch the free memory's KV cache holds (or a static engine's batch). A decode step costs
max(memory: (weights/tp + KV read)/HBM bandwidth, compute: 2·N·batch/peak) plus each layer's two tensor-parallel
all-reduces (latency-dominated) and a fixed per-step overhead; the bytes a device's cache keeps between steps
(EfficiencyParams.decode_cache_bytes: a CPU core's L3 share) read faster (DecodeTerms.step_memory); a profile's
or the GPU fit's engine overheads (calibration/profiled_cost.py) add per layer and per sequence. An engine whose
sampler rebuilds every sequence's token history each step (vLLM 0.3-0.4: EfficiencyParams.sampler_history_seconds)
pays it per token of the histories its slowest replica holds, per pass ("host": the GPU idles meanwhile, and a
replica's batch is not split by tp). A distribution of response lengths decodes in segments (decode_schedule.py),
each priced in closed form. OpCost.bytes is the HBM bytes read per device.

Every function takes the cost model it prices on (`cm`: what `Device` names); cost.CostModel.generate, the op's
entry point, calls generate() here.
"""

from __future__ import annotations

import math
from typing import NamedTuple, Protocol

from hybridflow.simulator.pricing.comm import dp_ranks, pp_ranks, tp_ranks
from hybridflow.simulator.pricing.decode_schedule import (
    ReplicaDecode,
    replica_decode,
    slowest_replica_lengths,
)
from hybridflow.simulator.pricing.efficiency import EfficiencyParams
from hybridflow.simulator.pricing.memory import (
    InfeasibleError,
    decode_batch,
    generation_shard_bytes,
    kv_bytes_per_sequence,
)
from hybridflow.simulator.pricing.op_cost import OpCost, model_shape, op_cost, seq_flops
from hybridflow.simulator.vocabulary.model import ModelSpec
from hybridflow.simulator.vocabulary.parallel import ParallelConfig
from hybridflow.simulator.vocabulary.units import BF16, GiB
from hybridflow.simulator.vocabulary.workload import Workload


class Device(Protocol):
    """What generation pricing reads of a cost model (cost.CostModel)."""

    params: EfficiencyParams
    peak: float  # FLOP/s
    hbm: float  # achieved HBM bytes/s
    usable_bytes: float  # per device

    def matmul_efficiency(self, tokens: float | None, width: float) -> float: ...
    def allreduce(self, size_bytes: float, world: int, ranks: tuple[int, ...]) -> tuple[float, float]: ...
    def allgather(self, size_bytes: float, world: int, ranks: tuple[int, ...]) -> tuple[float, float]: ...
    def p2p(self, size_bytes: float, world: int, ranks: tuple[int, ...]) -> tuple[float, float]: ...


class DecodeTerms(NamedTuple):
    """One decode step of a batch at context c: memory = a_m + b_m·c, compute = a_c + b_c·c (the step takes the
    larger), plus fixed seconds of tensor-parallel and pipeline bandwidth and of collectives' latency. `cached`:
    the memory-seconds of reads its devices' caches hold (EfficiencyParams.decode_cache_bytes); a step whose reads
    fit reads them `speedup` times faster, one whose reads outgrow it streams them all from memory (step_memory)."""

    a_m: float
    b_m: float
    a_c: float
    b_c: float
    tp_comm: float
    pp_comm: float
    latency: float
    cached: float = 0.0
    speedup: float = 1.0

    def step_memory(self, m: float) -> float:
        """Seconds of a step whose reads take `m` seconds from memory. All from the cache or none: a step reads its
        weights and KV cache in the same order every step, and a least-recently-used cache smaller than that
        cycle evicts each line before the next step comes back to it."""
        return m / self.speedup if self.cached > 0.0 and m <= self.cached else m

    def sums(self, m0: float, c0: float, n: int) -> tuple[float, float]:
        """sum_of_max over n steps whose k-th reads m0 + b_m·k memory-seconds and computes c0 + b_c·k: split where
        the reads outgrow the cache (each side linear in k), exact and O(1)."""
        if self.cached <= 0.0 or self.speedup == 1.0:
            return sum_of_max(m0, self.b_m, c0, self.b_c, n)
        if self.b_m > 0.0:  # steps 0 … k-1 read within the cache
            k = min(max(math.floor((self.cached - m0) / self.b_m) + 1, 0), n)
        else:
            k = n if m0 <= self.cached else 0
        s = self.speedup
        m1, c1 = sum_of_max(m0 / s, self.b_m / s, c0, self.b_c, k)
        m2, c2 = sum_of_max(m0 + self.b_m * k, self.b_m, c0 + self.b_c * k, self.b_c, n - k)
        return m1 + m2, c1 + c2


def sum_of_max(a1: float, b1: float, a2: float, b2: float, n: int) -> tuple[float, float]:
    """For k = 0..n-1: (Σ of f1 where f1 ≥ f2, Σ of f2 where f2 > f1), f_i = a_i + b_i·k. Exact and O(1)."""
    if n <= 0:
        return 0.0, 0.0

    def series(a, b, lo, hi):  # Σ_{k=lo}^{hi-1} (a + b·k)
        cnt = hi - lo
        return a * cnt + b * (lo + hi - 1) * cnt / 2.0 if cnt > 0 else 0.0

    if b1 == b2:
        return (series(a1, b1, 0, n), 0.0) if a1 >= a2 else (0.0, series(a2, b2, 0, n))
    cross = (a2 - a1) / (b1 - b2)  # f1 - f2 changes sign at k = cross
    k = min(max(math.ceil(cross), 0), n)
    if b1 > b2:  # f1 wins from `cross` on
        return series(a1, b1, k, n), series(a2, b2, 0, k)
    k = min(max(math.floor(cross) + 1, 0), n)  # f1 wins up to `cross`
    return series(a1, b1, 0, k), series(a2, b2, k, n)


def prefill(cm: Device, model: ModelSpec, gen: ParallelConfig, batch: int, prompt_len: int) -> dict[str, float]:
    """Seconds by part of one batched prefill on one generation replica. The batch's tokens go in chunks of
    prefill_chunk_tokens (fractional: smooth in the batch), which pipeline across stages: the stages' time
    stretches by 1 + (pp-1)/chunks."""
    _, pm, attn, _ = model_shape(model, "lm")
    tp, pp, world = gen.tp, gen.pp, gen.world_size
    tokens = batch * prompt_len
    chunk = min(tokens, cm.params.prefill_chunk_tokens)
    chunks = tokens / chunk
    fill = 1.0 + (pp - 1) / chunks
    eff = cm.matmul_efficiency(chunk, model.hidden / tp)
    ae = cm.params.prefill_attention_efficiency or cm.params.attention_efficiency
    work = batch * seq_flops(pm, attn, prompt_len, ae)
    compute = work / (tp * pp * cm.peak * eff) * fill
    memory = chunks * BF16 * pm / (tp * pp) / cm.hbm * fill  # every weight read once per chunk
    layers = model.layers / pp
    bw, lat = cm.allreduce(BF16 * chunk * model.hidden, world, tp_ranks(gen))
    pbw, plat = cm.p2p(BF16 * chunk * model.hidden / tp, world, pp_ranks(gen))
    return {"compute": compute if compute >= memory else 0.0,
            "memory": memory if memory > compute else 0.0,
            "tp_comm": 2 * layers * chunks * bw * fill, "pp_comm": (pp - 1) * pbw,
            "latency": 2 * layers * math.ceil(chunks) * lat * fill + (pp - 1) * plat,
            "overhead": cm.params.decode_step_overhead}


def decode_terms(cm: Device, model: ModelSpec, gen: ParallelConfig, batch: int) -> DecodeTerms:
    """A decode step of `batch` sequences, linear in its context. Pipeline: min(pp, batch) micro-batches cycle
    through pp stages."""
    _, pm, attn, kv_tok = model_shape(model, "lm")
    tp, pp, world = gen.tp, gen.pp, gen.world_size
    mbs = min(pp, batch)
    x = batch / mbs  # sequences per micro-batch
    kv_share = max(model.kv_heads / tp, 1.0) / model.kv_heads
    w_stage = BF16 * pm / (tp * pp)
    kv_stage = kv_tok * kv_share / pp
    a_m, b_m = pp * w_stage / cm.hbm, pp * x * kv_stage / (cm.hbm * cm.params.kv_read_efficiency)
    eff = cm.matmul_efficiency(None, model.hidden / tp)
    a_c, b_c = x * 2 * pm / (tp * cm.peak * eff), x * attn / (tp * cm.peak * eff)
    bw, lat = cm.allreduce(BF16 * x * model.hidden, world, tp_ranks(gen))
    pbw, plat = cm.p2p(BF16 * x * model.hidden / tp, world, pp_ranks(gen))
    latency = 2 * model.layers * lat + (pp * plat if pp > 1 else 0.0)
    cached = pp * cm.params.decode_cache_bytes / cm.hbm  # each stage's device its own cache
    return DecodeTerms(a_m, b_m, a_c, b_c, 2 * model.layers * bw, pp * pbw if pp > 1 else 0.0, latency, cached,
                       cm.params.cache_read_speedup)


def decode_step(cm: Device, model: ModelSpec, gen: ParallelConfig, batch: int, context: int) -> dict[str, float]:
    """Seconds by part of one decode step of `batch` sequences at `context` tokens. "memory" and "compute" are
    both reported; the step takes the larger (see step_seconds)."""
    t = decode_terms(cm, model, gen, batch)
    memory, compute = t.step_memory(t.a_m + t.b_m * context), t.a_c + t.b_c * context
    fixed = t.tp_comm + t.pp_comm + t.latency + cm.params.decode_step_overhead
    return {"memory": memory, "compute": compute, "tp_comm": t.tp_comm, "pp_comm": t.pp_comm, "latency": t.latency,
            "overhead": cm.params.decode_step_overhead, "step_seconds": max(memory, compute) + fixed}


def decode_slots(cm: Device, model: ModelSpec, gen: ParallelConfig, workload: Workload, sequences: int,
                 free_bytes_per_device: float | None, batch_cap: int | None = None) -> tuple[int, int]:
    """(sequences per replica, sequences decoded at once): the largest batch the KV cache holds, at most
    `batch_cap` (a static engine's batch per call). Default free memory: usable minus the generation weights."""
    if free_bytes_per_device is None:
        free_bytes_per_device = cm.usable_bytes - generation_shard_bytes(model, gen)
    batch = decode_batch(model, gen, workload, free_bytes_per_device, cm.params, sequences)
    if batch < 1:
        need = kv_bytes_per_sequence(model, gen, workload.seq_len)
        raise InfeasibleError(
            f"generation of {model.name} with {gen}: one sequence's KV cache needs {need / GiB:.2f} GiB per "
            f"device but only {max(free_bytes_per_device, 0) / GiB:.2f} GiB is free; raise tp·pp or free memory")
    return -(-sequences // gen.dp), min(batch, batch_cap or batch)


def decode_waves(cm: Device, model: ModelSpec, gen: ParallelConfig, workload: Workload, sequences: int,
                 free_bytes_per_device: float | None, batch_cap: int | None = None) -> tuple[int, int, int]:
    """(sequences per replica, waves, balanced batch): decode_slots' batch, in as few waves as it allows."""
    per_replica, batch = decode_slots(cm, model, gen, workload, sequences, free_bytes_per_device, batch_cap)
    waves = -(-per_replica // batch)
    return per_replica, waves, -(-per_replica // waves)  # balance the waves


def slowest_replica(cm: Device, model: ModelSpec, gen: ParallelConfig, workload: Workload, sequences: int,
                    free_bytes_per_device: float | None, batch_cap: int | None = None,
                    drain_calls: bool = False) -> ReplicaDecode:
    """The slowest replica's decode of a workload with response_lengths (decode_schedule.py): continuous
    batching over as many slots as the KV cache holds at the mean context, or a static engine's batches of
    `batch_cap`, each until its longest response ends (`drain_calls`: its finished sequences leaving)."""
    per_replica, slots = decode_slots(cm, model, gen, workload, sequences, free_bytes_per_device, batch_cap)
    lengths = slowest_replica_lengths(workload.response_lengths, sequences, gen.dp)
    return replica_decode(lengths, min(slots, per_replica), batch_cap is None, drain_calls)


def decode_counts(cm: Device, model: ModelSpec, gen: ParallelConfig, workload: Workload, sequences: int,
                  free_bytes_per_device: float | None, batch_cap: int | None = None,
                  drain_calls: bool = False) -> tuple[int, int]:
    """(forward passes, response tokens) of the slowest replica: its prefills and decode steps, and the tokens
    it generates (what per-step and per-sequence engine overheads scale with)."""
    if workload.response_lengths is None:
        per_replica, waves, _ = decode_waves(cm, model, gen, workload, sequences, free_bytes_per_device, batch_cap)
        return waves * workload.response_len, per_replica * workload.response_len
    d = slowest_replica(cm, model, gen, workload, sequences, free_bytes_per_device, batch_cap, drain_calls)
    return d.admissions + sum(s.steps for s in d.segments), d.tokens


def _gather_every_pass(cm: Device, model: ModelSpec, gen: ParallelConfig, passes: int,
                       parts: dict[str, float]) -> None:
    """HF generate under ZeRO-3: each pass (the prefill, each decode step) all-gathers the whole model's shards
    over gen.dp, one collective per layer."""
    ag_bw, ag_lat = cm.allgather(generation_shard_bytes(model, gen), gen.world_size, dp_ranks(gen))
    parts["dp_gather"] = passes * ag_bw
    parts["latency"] += passes * (model.layers / gen.pp) * ag_lat


def generate(cm: Device, model: ModelSpec, gen: ParallelConfig, workload: Workload, sequences: int,
             free_bytes_per_device: float | None = None, batch_cap: int | None = None,
             gather_every_step: bool = False, drain_calls: bool = False) -> OpCost:
    """Prefill + decode of `sequences` responses on gen.dp replicas in waves of the largest batch the KV cache
    holds (cost.CostModel.generate says what the arguments mean)."""
    if workload.response_lengths is not None:
        return _generate_lengths(cm, model, gen, workload, sequences, free_bytes_per_device, batch_cap,
                                 gather_every_step, drain_calls)
    _, pm, attn, kv_tok = model_shape(model, "lm")
    per_replica, waves, batch = decode_waves(cm, model, gen, workload, sequences, free_bytes_per_device, batch_cap)
    P, R = workload.prompt_len, workload.response_len
    prefilled = workload.prefill_len or P  # a partial round's: its segments' own prompts
    pre = prefill(cm, model, gen, batch, prefilled)
    t = decode_terms(cm, model, gen, batch)
    steps = R - 1  # the prefill yields the first token; step k attends to P + k tokens
    memory, compute = t.sums(t.a_m + t.b_m * (P + 1), t.a_c + t.b_c * (P + 1), steps)
    parts = {
        "compute": waves * (pre["compute"] + compute),
        "memory": waves * (pre["memory"] + memory),
        "tp_comm": waves * (pre["tp_comm"] + steps * t.tp_comm),
        "pp_comm": waves * (pre["pp_comm"] + steps * t.pp_comm),
        "latency": waves * (pre["latency"] + steps * t.latency),
        "overhead": waves * (1 + steps) * cm.params.decode_step_overhead,
        # each sequence's history at its prefill (P) and its decode steps (P + 1 … P + R - 1)
        "host": per_replica * (R * P + R * (R - 1) / 2) * cm.params.sampler_history_seconds,
    }
    if gather_every_step and gen.dp > 1:
        _gather_every_pass(cm, model, gen, waves * (1 + steps), parts)
    flops = sequences * (seq_flops(pm, attn, prefilled) + steps * (2 * pm + attn * (P + 1 + (steps - 1) / 2)))
    kv_share = max(model.kv_heads / gen.tp, 1.0) / model.kv_heads
    weights_read = BF16 * pm / (gen.tp * gen.pp) * min(gen.pp, batch)  # once per micro-batch per step
    hbm_bytes = waves * steps * (weights_read + batch * kv_tok * kv_share / gen.pp * (P + 1 + (steps - 1) / 2))
    return op_cost(flops, hbm_bytes, **parts)


def _generate_lengths(cm: Device, model: ModelSpec, gen: ParallelConfig, workload: Workload, seqs: int,
                      free_bytes_per_device: float | None, batch_cap: int | None, gather_every_step: bool,
                      drain_calls: bool = False) -> OpCost:
    """generate() for a distribution of response lengths: the slowest replica's prefills and its decode
    segments, each priced in closed form (the step's price is linear in the context its batch holds)."""
    _, pm, attn, kv_tok = model_shape(model, "lm")
    P = workload.prompt_len
    prefilled = workload.prefill_len or P  # a partial round's: its segments' own prompts
    d = slowest_replica(cm, model, gen, workload, seqs, free_bytes_per_device, batch_cap, drain_calls)
    per_prefill = -(-d.sequences // d.admissions)
    pre = prefill(cm, model, gen, per_prefill, prefilled)
    parts = {k: d.admissions * v for k, v in pre.items()}
    terms: dict[int, DecodeTerms] = {}
    steps_total, hbm_bytes = 0, 0.0
    history = d.sequences * P  # tokens the sampler rebuilds: each prompt at its prefill, then every step's batch
    kv_share = max(model.kv_heads / gen.tp, 1.0) / model.kv_heads
    for seg in d.segments:
        t = terms.get(seg.batch)
        if t is None:
            t = terms[seg.batch] = decode_terms(cm, model, gen, seg.batch)
        # per step j: memory a_m + (b_m / b)·C_j with C_j = b·P + generated + b·j the batch's context
        per_ctx_m, per_ctx_c = t.b_m / seg.batch, t.b_c / seg.batch
        c0 = seg.batch * P + seg.generated
        memory, compute = t.sums(t.a_m + per_ctx_m * c0, t.a_c + per_ctx_c * c0, seg.steps)
        parts["memory"] += memory
        parts["compute"] += compute
        parts["tp_comm"] += seg.steps * t.tp_comm
        parts["pp_comm"] += seg.steps * t.pp_comm
        parts["latency"] += seg.steps * t.latency
        steps_total += seg.steps
        history += seg.steps * (c0 + seg.batch * (seg.steps - 1) / 2)
        weights_read = BF16 * pm / (gen.tp * gen.pp) * min(gen.pp, seg.batch)
        hbm_bytes += seg.steps * (weights_read + kv_tok * kv_share / gen.pp * (c0 + seg.batch * (seg.steps - 1) / 2))
    parts["overhead"] = (d.admissions + steps_total) * cm.params.decode_step_overhead
    parts["host"] = parts.get("host", 0.0) + history * cm.params.sampler_history_seconds
    if gather_every_step and gen.dp > 1:
        _gather_every_pass(cm, model, gen, d.admissions + steps_total, parts)
    dist = workload.response_lengths
    # every sequence's FLOPs: its prompt, then a decode step per further token at contexts P+1 … P+L-1
    mean_steps = dist.mean - 1.0
    mean_ctx_sum = P * mean_steps + (dist.mean_square - dist.mean) / 2.0  # E[Σ_{k=1}^{L-1} (P + k)]
    flops = seqs * (seq_flops(pm, attn, prefilled) + 2 * pm * mean_steps + attn * mean_ctx_sum)
    return op_cost(flops, hbm_bytes, **parts)
