"""The analytic cost model: seconds per op, with a breakdown that says why.

Training and forward passes are compute-bound: FLOPs (2·N·tokens forward, ×3 with the backward,
×4 with full recomputation, plus attention) over devices × peak × matmul efficiency, where the
efficiency saturates with the rows (tokens per device per matmul) and the shard width
(hidden / tp). Tensor parallelism adds 2 all-reduces of b·s·h per layer forward and 2 backward;
pipeline parallelism a bubble of (p-1)/m of the ideal time; FSDP/ZeRO-3 data parallelism
all-gathers the weights forward and backward and reduce-scatters the gradients every micro-batch,
mostly hidden under compute; Megatron's distributed optimizer (`backend: megatron`) keeps the weights
whole over dp and moves the gradients and weights once per optimizer step instead. A MoE model under
expert parallelism (Megatron, ep > 1) adds each MoE layer's token dispatch and combine all-to-alls
over the ep ranks (expert_parallel.py). The Adam step is memory-bound.

Generation is prefill (compute-bound) then one decode step per response token, each
max(memory: (weights/tp + KV read)/HBM bandwidth, compute: 2·N·batch/peak) plus each layer's TP
all-reduces (latency-dominated) and a fixed per-step overhead; the batch is what the free memory's
KV cache holds. Every tunable term is in EfficiencyParams (efficiency.py); docs/cost-model.md
gives the sources. OpCost.breakdown values are seconds that add up to OpCost.seconds; OpCost.bytes
is network bytes per device for train/forward/reshard and HBM bytes read per device for generate.
"""

from __future__ import annotations

import math
from functools import lru_cache

from pydantic import BaseModel, Field

from hybridflow.simulator.errors import HflowError
from hybridflow.simulator.pricing.comm import Collectives, dp_ranks, pp_ranks, sp_ranks, tp_ranks
from hybridflow.simulator.pricing.decode_schedule import (
    ReplicaDecode,
    replica_decode,
    slowest_replica_lengths,
)
from hybridflow.simulator.pricing.efficiency import EfficiencyParams
from hybridflow.simulator.pricing.expert_parallel import expert_dispatch, expert_gather, megatron_expert_dp
from hybridflow.simulator.pricing.memory import (
    InfeasibleError,
    decode_batch,
    kv_bytes_per_sequence,
    kv_free_bytes,
    plan_recompute,
    state_bytes,
)
from hybridflow.simulator.pricing.reshard import IN_PLACE, reshard_spec, weight_sync_buckets
from hybridflow.simulator.vocabulary.execution import shares_prompts
from hybridflow.simulator.vocabulary.hardware import ClusterSpec
from hybridflow.simulator.vocabulary.lora import LoraConfig, adapter_bytes, adapter_params
from hybridflow.simulator.vocabulary.model import Head, ModelSpec
from hybridflow.simulator.vocabulary.parallel import ParallelConfig
from hybridflow.simulator.vocabulary.roles import TRAINED_ROLES, role_head
from hybridflow.simulator.vocabulary.timeline import GENERATE_OPS, OFFLOAD_OPS, UPDATE_OPS, WEIGHT_SYNC_OPS
from hybridflow.simulator.vocabulary.units import BF16, GiB
from hybridflow.simulator.vocabulary.workload import Workload


class OpCost(BaseModel):
    """An op's price. breakdown: seconds by part (they sum to `seconds`)."""

    seconds: float
    flops: float = 0.0
    bytes: float = 0.0
    breakdown: dict[str, float] = Field(default_factory=dict)


def _cost(flops: float, nbytes: float, **parts: float) -> OpCost:
    parts = {k: float(v) for k, v in parts.items() if v > 0.0}
    return OpCost.model_construct(seconds=sum(parts.values()), flops=float(flops), bytes=float(nbytes),
                                  breakdown=parts)


def _times(cost: OpCost, n: float) -> OpCost:
    """`cost` paid `n` times over."""
    if n == 1:
        return cost
    return OpCost.model_construct(seconds=cost.seconds * n, flops=cost.flops * n, bytes=cost.bytes * n,
                                  breakdown={k: v * n for k, v in cost.breakdown.items()})


def micro_batches(workload: Workload, sequences: int, steps: int, dp: int) -> tuple[int, int, float]:
    """(sequences per rank per step, micro-batches per step, tokens per micro-batch) of one data-parallel
    rank. Fixed lengths: micro_batch_size sequences per micro-batch. A length distribution: sequences
    packed into micro-batches of at most micro_batch_size · seq_len tokens (the padded micro-batch's
    budget, so activation memory stays the longest sequence's), about equal tokens each."""
    per_rank = max(1, -(-sequences // (steps * dp)))
    b = min(workload.micro_batch_size, per_rank)
    budget = b * workload.seq_len
    if workload.response_lengths is None:
        return per_rank, -(-per_rank // b), float(budget)
    rank_tokens = per_rank * (workload.prompt_len + workload.mean_response_len)
    m = max(1, math.ceil(rank_tokens / budget - 1e-9))
    return per_rank, m, rank_tokens / m


def _mean_seq_flops(pm: float, attn: float, workload: Workload, attention_efficiency: float = 1.0) -> float:
    """E[_seq_flops(P + L)] over the workload's response lengths L (exact from the first two moments)."""
    d, P = workload.response_lengths, workload.prompt_len
    mean_x = P + d.mean
    mean_x2 = P * P + 2 * P * d.mean + d.mean_square
    return 2.0 * pm * mean_x + attn * (mean_x2 + mean_x) / 2.0 / attention_efficiency


@lru_cache(maxsize=256)
def _shape(model: ModelSpec, head: Head) -> tuple[float, float, float, float]:
    """(parameters, matmul parameters, attention FLOPs per token per context token, KV bytes per token)."""
    attn = 4.0 * model.layers * model.heads * model.dim_head
    return float(model.num_params(head)), float(model.matmul_params(head)), attn, float(model.kv_bytes_per_token())


def _seq_flops(pm: float, attn: float, seq_len: float, attention_efficiency: float = 1.0) -> float:
    """Forward FLOPs of one causal sequence (each token attends to (s+1)/2 tokens on average); with
    `attention_efficiency` < 1 the attention's share is weighted up by it (its kernels' slower FLOPs),
    which makes this the matmul-equivalent work a compute time is priced from."""
    return seq_len * (2.0 * pm + attn * (seq_len + 1) / 2.0 / attention_efficiency)


def _sum_of_max(a1: float, b1: float, a2: float, b2: float, n: int) -> tuple[float, float]:
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


class CostModel(Collectives):
    """Prices ops on one cluster. Cheap per call (plain floats inside): the planner calls it a lot."""

    def __init__(self, cluster: ClusterSpec, params: EfficiencyParams | None = None):
        super().__init__(cluster, params or EfficiencyParams.for_hardware(cluster.hardware))
        hw = cluster.hardware
        self.peak = hw.peak_flops
        self.hbm = hw.hbm_bandwidth * self.params.hbm_efficiency
        self.usable_bytes = self.params.usable_bytes(hw.hbm_bytes)

    # ---- building blocks (and the collectives of comm.Collectives) ------------------------------
    def matmul_efficiency(self, tokens: float | None, width: float) -> float:
        """Saturating efficiency: e_max · tokens/(tokens + t½) · width/(width + w½); tokens=None for
        decode steps, whose few-row bound is priced as memory traffic instead."""
        p = self.params
        e = p.matmul_efficiency * width / (width + p.width_half)
        return e if tokens is None else e * tokens / (tokens + p.tokens_half)

    # ---- forward / train ------------------------------------------------------------------------
    def _passes(self, model: ModelSpec, head: Head, par: ParallelConfig, workload: Workload, sequences: int,
                steps: int, mult: float, tp_collectives: int, fsdp_passes: int):
        """Shared by forward() and train(): `mult` passes' worth of FLOPs (1 forward, 3 fwd+bwd, 4 with
        recompute) over `sequences` split evenly into `steps` optimizer steps."""
        n_params, pm, attn, _ = _shape(model, head)
        tp, pp, dp, world = par.tp, par.pp, par.dp, par.world_size
        s, sp = workload.seq_len, par.sp
        # per_rank, m, rows: per group of sp ranks that shares its sequences (each device holds rows/sp tokens)
        per_rank, m, rows = micro_batches(workload, sequences, steps, dp // sp)
        rows /= sp
        ae = self.params.attention_efficiency
        seq_flops, seq_work = _seq_flops(pm, attn, s), _seq_flops(pm, attn, s, ae)
        if workload.response_lengths is not None:  # packed: attention per sequence, E over the lengths
            seq_flops, seq_work = _mean_seq_flops(pm, attn, workload), _mean_seq_flops(pm, attn, workload, ae)
        if workload.samples_per_prompt > 1 and shares_prompts(head, par, model.attention_window, s):  # each sample's share of its prompt
            share = 1.0 - 1.0 / workload.samples_per_prompt
            seq_flops -= share * _seq_flops(pm, attn, workload.prompt_len)
            seq_work -= share * _seq_flops(pm, attn, workload.prompt_len, ae)
        engine = self.params.deepspeed_efficiency if par.backend == "deepspeed" else 1.0
        compute = mult * seq_work * per_rank * steps / (tp * pp * sp) / (
            self.peak * self.matmul_efficiency(rows, model.hidden / tp) * engine)
        act_bytes = BF16 * rows * model.hidden
        micro = steps * m
        tp_bw, tp_lat = self.allreduce(act_bytes, world, tp_ranks(par))
        layers = model.layers / pp
        tp_comm, tp_latency = tp_collectives * layers * micro * tp_bw, tp_collectives * layers * micro * tp_lat
        # Megatron's scatter-gather p2p: each tensor rank sends 1/tp of the activations, then all-gathers
        pp_bw, pp_lat = self.p2p(act_bytes / tp, world, pp_ranks(par))
        sends = (2 if mult > 1 else 1) * micro
        pp_comm, pp_latency = sends * pp_bw, sends * pp_lat
        ep_bw, ep_lat, ep_bytes = expert_dispatch(self, model, par, rows, tp_collectives)
        ep_comm, ep_latency = micro * ep_bw, micro * ep_lat
        sp_comm, sp_latency, sp_bytes = 0.0, 0.0, 0.0
        if sp > 1:  # Ulysses: per layer and pass, q·k·v to whole heads on a sequence's ranks, the output back
            per_a2a = BF16 * rows * (model.hidden + model.kv_heads * model.dim_head) / tp  # mean of the two
            a2a_bw, a2a_lat = self.alltoall(per_a2a, world, sp_ranks(par))
            n_a2a = tp_collectives * layers * micro
            sp_comm, sp_latency, sp_bytes = n_a2a * a2a_bw, n_a2a * a2a_lat, n_a2a * (sp - 1) / sp * per_a2a
        stage = (compute + tp_comm + tp_latency + pp_comm + pp_latency + ep_comm + ep_latency + sp_comm
                 + sp_latency)
        bubble = stage * (pp - 1) / m
        shard = BF16 * n_params / (tp * pp)
        ag_bw, ag_lat = self.allgather(shard, world, dp_ranks(par))
        if par.backend == "megatron":
            # Megatron's distributed optimizer (ZeRO-1): the weights stay whole on every dp rank; once per
            # optimizer step the fp32 gradients are reduce-scattered and the updated bf16 weights
            # all-gathered, after the last backward (not hidden under compute). Forward passes move nothing.
            dp_steps = steps if fsdp_passes > 1 else 0
            dp_total = dp_steps * (3 * ag_bw + 2 * ag_lat)  # fp32 gradients: twice the bf16 bytes
            dp_exposed, dp_bytes = dp_total, dp_steps * 3 * (dp - 1) / dp * shard
            if par.ep > 1:
                bw, lat, nbytes = megatron_expert_dp(self, model, par, n_params)
                dp_exposed, dp_bytes = dp_steps * (bw + lat), dp_steps * nbytes
        else:
            # FSDP/ZeRO-3: gather the weights (each pass), reduce-scatter the gradients (training)
            dp_total = micro * fsdp_passes * (ag_bw + layers * ag_lat)
            dp_exposed = max(0.0, dp_total - self.params.fsdp_overlap * compute)
            dp_bytes = micro * fsdp_passes * (dp - 1) / dp * shard
        pp_bytes = sends * act_bytes / tp if pp > 1 else 0.0  # `sends` counts every micro-batch already
        net = (micro * (tp_collectives * layers * 2.0 * (tp - 1) / tp * act_bytes + ep_bytes) + pp_bytes + dp_bytes
               + sp_bytes)
        flops = mult * seq_flops * sequences
        return flops, net, dict(compute=compute, tp_comm=tp_comm, pp_comm=pp_comm, ep_comm=ep_comm, sp_comm=sp_comm,
                                latency=tp_latency + pp_latency + ep_latency + sp_latency, pp_bubble=bubble,
                                dp_comm=dp_exposed)

    def forward(self, model: ModelSpec, head: Head, parallel: ParallelConfig, workload: Workload,
                sequences: int | None = None) -> OpCost:
        """A forward-only pass over `sequences` full sequences (log-probs, values, rewards, costs)."""
        seqs = workload.sequences if sequences is None else sequences
        flops, net, parts = self._passes(model, head, parallel, workload, seqs, 1, 1.0, 2, 1)
        return _cost(flops, net, **parts)

    def train(self, model: ModelSpec, head: Head, parallel: ParallelConfig, workload: Workload,
              recompute: bool = False, optimizer_offload: bool = False, lora: LoraConfig | None = None) -> OpCost:
        """All PPO epochs × mini-batches of forward + backward (+ recomputation) and Adam steps.
        optimizer_offload: each step sends the gradients to host memory, runs Adam on the node's CPU (its
        devices' shards one after another through the host's DRAM) and copies the new weights back.
        lora: the backward still computes activation gradients through every frozen layer (a forward's
        FLOPs) but weight gradients only for the adapters: 2 passes (3 with recompute) plus the adapters'
        own 6 FLOPs per parameter and token; FSDP gathers the frozen base for the forward and the backward
        and reduce-scatters only the adapters' gradients; Adam steps the adapters."""
        steps = workload.ppo_epochs * workload.mini_batches
        if lora is not None:
            adapters = adapter_params(model, lora)
            mult = (3.0 if recompute else 2.0) + 3.0 * adapters / _shape(model, head)[1]
            flops, net, parts = self._passes(model, head, parallel, workload, workload.sequences * workload.ppo_epochs,
                                             steps, mult, 6 if recompute else 4, 2)
            local = adapters / parallel.world_size
        else:
            flops, net, parts = self._passes(model, head, parallel, workload, workload.sequences * workload.ppo_epochs,
                                             steps, 4.0 if recompute else 3.0, 6 if recompute else 4, 3)
            local = _shape(model, head)[0] / parallel.world_size
        p = self.params
        if optimizer_offload:
            per_node = local * min(parallel.world_size, self.cluster.devices_per_node)
            host_link = self.cluster.hardware.host_bandwidth * p.host_link_efficiency
            parts["host_optimizer"] = steps * per_node * p.adam_bytes_per_param / p.host_adam_bandwidth
            parts["host_copy"] = steps * 2 * BF16 * local / host_link  # gradients out, weights back
        else:
            parts["optimizer"] = steps * local * p.adam_bytes_per_param / self.hbm
        return _cost(flops, net, **parts)

    # ---- generation -----------------------------------------------------------------------------
    def prefill(self, model: ModelSpec, gen: ParallelConfig, batch: int, prompt_len: int) -> dict[str, float]:
        """Seconds by part of one batched prefill on one generation replica. The batch's tokens go in
        chunks of prefill_chunk_tokens (fractional: smooth in the batch), which pipeline across stages:
        the stages' time stretches by 1 + (pp-1)/chunks."""
        _, pm, attn, _ = _shape(model, "lm")
        tp, pp, world = gen.tp, gen.pp, gen.world_size
        tokens = batch * prompt_len
        chunk = min(tokens, self.params.prefill_chunk_tokens)
        chunks = tokens / chunk
        fill = 1.0 + (pp - 1) / chunks
        eff = self.matmul_efficiency(chunk, model.hidden / tp)
        work = batch * _seq_flops(pm, attn, prompt_len, self.params.attention_efficiency)
        compute = work / (tp * pp * self.peak * eff) * fill
        memory = chunks * BF16 * pm / (tp * pp) / self.hbm * fill  # every weight read once per chunk
        layers = model.layers / pp
        bw, lat = self.allreduce(BF16 * chunk * model.hidden, world, tp_ranks(gen))
        pbw, plat = self.p2p(BF16 * chunk * model.hidden / tp, world, pp_ranks(gen))
        return {"compute": compute if compute >= memory else 0.0,
                "memory": memory if memory > compute else 0.0,
                "tp_comm": 2 * layers * chunks * bw * fill, "pp_comm": (pp - 1) * pbw,
                "latency": 2 * layers * math.ceil(chunks) * lat * fill + (pp - 1) * plat,
                "overhead": self.params.decode_step_overhead}

    def _decode_terms(self, model: ModelSpec, gen: ParallelConfig, batch: int):
        """Per decode step at context c: memory = a_m + b_m·c, compute = a_c + b_c·c, plus fixed
        collective bandwidth/latency. Pipeline: min(pp, batch) micro-batches cycle through pp stages."""
        _, pm, attn, kv_tok = _shape(model, "lm")
        tp, pp, world = gen.tp, gen.pp, gen.world_size
        mbs = min(pp, batch)
        x = batch / mbs  # sequences per micro-batch
        kv_share = max(model.kv_heads / tp, 1.0) / model.kv_heads
        w_stage = BF16 * pm / (tp * pp)
        kv_stage = kv_tok * kv_share / pp
        a_m, b_m = pp * w_stage / self.hbm, pp * x * kv_stage / (self.hbm * self.params.kv_read_efficiency)
        eff = self.matmul_efficiency(None, model.hidden / tp)
        a_c, b_c = x * 2 * pm / (tp * self.peak * eff), x * attn / (tp * self.peak * eff)
        bw, lat = self.allreduce(BF16 * x * model.hidden, world, tp_ranks(gen))
        pbw, plat = self.p2p(BF16 * x * model.hidden / tp, world, pp_ranks(gen))
        latency = 2 * model.layers * lat + (pp * plat if pp > 1 else 0.0)
        return a_m, b_m, a_c, b_c, 2 * model.layers * bw, pp * pbw if pp > 1 else 0.0, latency

    def decode_step(self, model: ModelSpec, gen: ParallelConfig, batch: int, context: int) -> dict[str, float]:
        """Seconds by part of one decode step of `batch` sequences at `context` tokens. "memory" and
        "compute" are both reported; the step takes the larger (see step_seconds)."""
        a_m, b_m, a_c, b_c, tp_comm, pp_comm, latency = self._decode_terms(model, gen, batch)
        memory, compute = a_m + b_m * context, a_c + b_c * context
        fixed = tp_comm + pp_comm + latency + self.params.decode_step_overhead
        return {"memory": memory, "compute": compute, "tp_comm": tp_comm, "pp_comm": pp_comm, "latency": latency,
                "overhead": self.params.decode_step_overhead, "step_seconds": max(memory, compute) + fixed}

    def decode_slots(self, model: ModelSpec, gen: ParallelConfig, workload: Workload, sequences: int,
                     free_bytes_per_device: float | None, batch_cap: int | None = None) -> tuple[int, int]:
        """(sequences per replica, sequences decoded at once): the largest batch the KV cache holds, at most
        `batch_cap` (a static engine's batch per call). Default free memory: usable minus the generation weights."""
        if free_bytes_per_device is None:
            free_bytes_per_device = self.usable_bytes - BF16 * model.num_params("lm") / (gen.tp * gen.pp)
        batch = decode_batch(model, gen, workload, free_bytes_per_device, self.params, sequences)
        if batch < 1:
            need = kv_bytes_per_sequence(model, gen, workload.seq_len)
            raise InfeasibleError(
                f"generation of {model.name} with {gen}: one sequence's KV cache needs {need / GiB:.2f} GiB per "
                f"device but only {max(free_bytes_per_device, 0) / GiB:.2f} GiB is free; raise tp·pp or free memory")
        return -(-sequences // gen.dp), min(batch, batch_cap or batch)

    def decode_waves(self, model: ModelSpec, gen: ParallelConfig, workload: Workload, sequences: int,
                     free_bytes_per_device: float | None, batch_cap: int | None = None) -> tuple[int, int, int]:
        """(sequences per replica, waves, balanced batch): decode_slots' batch, in as few waves as it allows."""
        per_replica, batch = self.decode_slots(model, gen, workload, sequences, free_bytes_per_device, batch_cap)
        waves = -(-per_replica // batch)
        return per_replica, waves, -(-per_replica // waves)  # balance the waves

    def generate(self, model: ModelSpec, gen: ParallelConfig, workload: Workload, sequences: int | None = None,
                 free_bytes_per_device: float | None = None, batch_cap: int | None = None,
                 gather_every_step: bool = False) -> OpCost:
        """Prefill + decode of `sequences` responses on gen.dp replicas in waves of the largest batch
        the KV cache holds. free_bytes_per_device: bytes left for the KV cache (everything else already
        resident); default: usable memory minus the generation weights. batch_cap: a static engine's batch
        per call (vocabulary/mechanics.py). gather_every_step: the weights stay ZeRO-3 shards over gen.dp and
        every pass (the prefill and each decode step) all-gathers them layer by layer (HF generate under ZeRO-3)."""
        seqs = workload.sequences if sequences is None else sequences
        if workload.response_lengths is not None:
            return self._generate_lengths(model, gen, workload, seqs, free_bytes_per_device, batch_cap,
                                          gather_every_step)
        _, pm, attn, kv_tok = _shape(model, "lm")
        per_replica, waves, batch = self.decode_waves(model, gen, workload, seqs, free_bytes_per_device, batch_cap)
        P, R = workload.prompt_len, workload.response_len
        pre = self.prefill(model, gen, batch, P)
        a_m, b_m, a_c, b_c, tp_comm, pp_comm, latency = self._decode_terms(model, gen, batch)
        steps = R - 1  # the prefill yields the first token; step k attends to P + k tokens
        memory, compute = _sum_of_max(a_m + b_m * (P + 1), b_m, a_c + b_c * (P + 1), b_c, steps)
        parts = {
            "compute": waves * (pre["compute"] + compute),
            "memory": waves * (pre["memory"] + memory),
            "tp_comm": waves * (pre["tp_comm"] + steps * tp_comm),
            "pp_comm": waves * (pre["pp_comm"] + steps * pp_comm),
            "latency": waves * (pre["latency"] + steps * latency),
            "overhead": waves * (1 + steps) * self.params.decode_step_overhead,
        }
        if gather_every_step and gen.dp > 1:  # each pass gathers the whole model, one collective per layer
            ag_bw, ag_lat = self.allgather(BF16 * model.num_params("lm") / (gen.tp * gen.pp), gen.world_size,
                                           dp_ranks(gen))
            parts["dp_gather"] = waves * (1 + steps) * ag_bw
            parts["latency"] += waves * (1 + steps) * (model.layers / gen.pp) * ag_lat
        flops = seqs * (_seq_flops(pm, attn, P) + steps * (2 * pm + attn * (P + 1 + (steps - 1) / 2)))
        kv_share = max(model.kv_heads / gen.tp, 1.0) / model.kv_heads
        weights_read = BF16 * pm / (gen.tp * gen.pp) * min(gen.pp, batch)  # once per micro-batch per step
        hbm_bytes = waves * steps * (weights_read + batch * kv_tok * kv_share / gen.pp * (P + 1 + (steps - 1) / 2))
        return _cost(flops, hbm_bytes, **parts)

    def replica_decode(self, model: ModelSpec, gen: ParallelConfig, workload: Workload, sequences: int,
                       free_bytes_per_device: float | None, batch_cap: int | None = None) -> ReplicaDecode:
        """The slowest replica's decode of a workload with response_lengths (pricing/decode_schedule.py):
        continuous batching over as many slots as the KV cache holds at the mean context, or a static
        engine's batches of `batch_cap`, each until its longest response ends."""
        per_replica, slots = self.decode_slots(model, gen, workload, sequences, free_bytes_per_device, batch_cap)
        lengths = slowest_replica_lengths(workload.response_lengths, sequences, gen.dp)
        return replica_decode(lengths, min(slots, per_replica), batch_cap is None)

    def decode_counts(self, model: ModelSpec, gen: ParallelConfig, workload: Workload, sequences: int,
                      free_bytes_per_device: float | None, batch_cap: int | None = None) -> tuple[int, int]:
        """(forward passes, response tokens) of the slowest replica: its prefills and decode steps, and the
        tokens it generates (what per-step and per-sequence engine overheads scale with)."""
        if workload.response_lengths is None:
            per_replica, waves, _ = self.decode_waves(model, gen, workload, sequences, free_bytes_per_device,
                                                      batch_cap)
            return waves * workload.response_len, per_replica * workload.response_len
        d = self.replica_decode(model, gen, workload, sequences, free_bytes_per_device, batch_cap)
        return d.admissions + sum(s.steps for s in d.segments), d.tokens

    def _generate_lengths(self, model: ModelSpec, gen: ParallelConfig, workload: Workload, seqs: int,
                          free_bytes_per_device: float | None, batch_cap: int | None,
                          gather_every_step: bool) -> OpCost:
        """generate() for a distribution of response lengths: the slowest replica's prefills and its decode
        segments, each priced in closed form (the step's price is linear in the context its batch holds)."""
        _, pm, attn, kv_tok = _shape(model, "lm")
        P = workload.prompt_len
        d = self.replica_decode(model, gen, workload, seqs, free_bytes_per_device, batch_cap)
        per_prefill = -(-d.sequences // d.admissions)
        pre = self.prefill(model, gen, per_prefill, P)
        parts = {k: d.admissions * v for k, v in pre.items()}
        terms: dict[int, tuple] = {}
        steps_total, hbm_bytes = 0, 0.0
        kv_share = max(model.kv_heads / gen.tp, 1.0) / model.kv_heads
        for seg in d.segments:
            t = terms.get(seg.batch)
            if t is None:
                t = terms[seg.batch] = self._decode_terms(model, gen, seg.batch)
            a_m, b_m, a_c, b_c, tp_comm, pp_comm, latency = t
            # per step j: memory a_m + (b_m / b)·C_j with C_j = b·P + generated + b·j the batch's context
            per_ctx_m, per_ctx_c = b_m / seg.batch, b_c / seg.batch
            c0 = seg.batch * P + seg.generated
            memory, compute = _sum_of_max(a_m + per_ctx_m * c0, b_m, a_c + per_ctx_c * c0, b_c, seg.steps)
            parts["memory"] += memory
            parts["compute"] += compute
            parts["tp_comm"] += seg.steps * tp_comm
            parts["pp_comm"] += seg.steps * pp_comm
            parts["latency"] += seg.steps * latency
            steps_total += seg.steps
            weights_read = BF16 * pm / (gen.tp * gen.pp) * min(gen.pp, seg.batch)
            hbm_bytes += seg.steps * (weights_read + kv_tok * kv_share / gen.pp * (c0 + seg.batch * (seg.steps - 1) / 2))
        parts["overhead"] = (d.admissions + steps_total) * self.params.decode_step_overhead
        if gather_every_step and gen.dp > 1:
            ag_bw, ag_lat = self.allgather(BF16 * model.num_params("lm") / (gen.tp * gen.pp), gen.world_size,
                                           dp_ranks(gen))
            parts["dp_gather"] = (d.admissions + steps_total) * ag_bw
            parts["latency"] += (d.admissions + steps_total) * (model.layers / gen.pp) * ag_lat
        dist = workload.response_lengths
        # every sequence's FLOPs: its prompt, then a decode step per further token at contexts P+1 … P+L-1
        mean_steps = dist.mean - 1.0
        mean_ctx_sum = P * mean_steps + (dist.mean_square - dist.mean) / 2.0  # E[Σ_{k=1}^{L-1} (P + k)]
        flops = seqs * (_seq_flops(pm, attn, P) + 2 * pm * mean_steps + attn * mean_ctx_sum)
        return _cost(flops, hbm_bytes, **parts)

    # ---- weights moving -------------------------------------------------------------------------
    def reshard(self, model: ModelSpec, train: ParallelConfig, gen: ParallelConfig, mode: str,
                per_tensor: bool = False, lora: LoraConfig | None = None) -> OpCost:
        """Switch the actor's weights from its training to its generation layout (paper Table 2).
        per_tensor: a broadcast that gathers and sends one tensor at a time (OpenRLHF v0.2's weight sync),
        paying a gather's and a broadcast's latency per tensor instead of per layer and per bucket.
        lora: only the adapters move (vocabulary/lora.py); on the actor's own devices its generation
        engine's base copy comes back from host memory, where it waits while the actor trains."""
        m_bytes = BF16 * model.num_params("lm")
        if mode == IN_PLACE:
            return _cost(0.0, 0.0)
        world = train.world_size
        collectives = model.layers + 1  # gathered layer by layer (plus embeddings/head)
        if lora is not None:
            a_bytes = float(adapter_bytes(model, lora))
            if mode != "broadcast":  # every device gathers the whole adapters, merges its generation slice
                link = self.cluster.hardware.host_bandwidth * self.params.host_link_efficiency
                ag, lat = self.allgather(a_bytes, world, tuple(range(world)))
                return _cost(0.0, a_bytes, reshard_comm=ag, host_copy=m_bytes / (gen.tp * gen.pp) / link,
                             latency=collectives * lat if world > 1 else 0.0)
            m_bytes = a_bytes  # the broadcast below moves the adapters
        spec = reshard_spec(m_bytes, train, gen, mode)
        if mode == "broadcast":  # gather the ZeRO-3 shards, then send the full model to the other devices
            ag, lat = self.allgather(m_bytes, world, tuple(range(world)))
            across = world + gen.world_size > self.cluster.devices_per_node
            hw = self.cluster.hardware
            # one sender: across nodes its bytes leave through its own NIC (of the node's nics_per_node)
            bw = (hw.inter_node_bandwidth / hw.nics_per_node * self.params.inter_link_efficiency
                  if across else hw.intra_node_bandwidth * self.params.intra_link_efficiency)
            send_lat = hw.inter_node_latency if across else hw.intra_node_latency
            # the gather, layer by layer when the training weights are sharded; then one broadcast per bucket
            gathers, sends = (model.num_tensors(), model.num_tensors()) if per_tensor else (
                collectives, weight_sync_buckets(m_bytes))
            return _cost(0.0, spec.volume, reshard_comm=ag + m_bytes / bw,
                         latency=(gathers * lat if world > 1 else 0.0) + sends * send_lat)
        bw_s, lat = self.allgather(spec.gathered_bytes, world, spec.ranks)
        eg_bw, eg_lat, eg_bytes = expert_gather(self, model, train)  # generation holds every expert
        return _cost(0.0, spec.volume + eg_bytes, reshard_comm=bw_s, ep_gather=eg_bw,
                     latency=(collectives * lat if bw_s else 0.0) + eg_lat)

    def offload(self, bytes_per_device: float) -> OpCost:
        """Copy a model's states to host memory (or back: onload) over the device-host link."""
        bw = self.cluster.hardware.host_bandwidth * self.params.host_link_efficiency
        return _cost(0.0, bytes_per_device, host_copy=bytes_per_device / bw)

    def onload(self, bytes_per_device: float) -> OpCost:
        return self.offload(bytes_per_device)


# ---- a plan's ops ---------------------------------------------------------------------------------
FORWARD_OPS = ("actor_logprob", "ref_logprob", "values", "reward", "cost")


def price_op(cm: CostModel, plan, op: str, role: str, *, baseline: bool = False, resampled: bool = False) -> OpCost:
    """The OpCost of one op of `plan` run by `role` ("driver" or a rule-based reward/cost: the single
    controller's CPU). baseline: the ReMax greedy pass (one sequence per prompt, not per sample);
    resampled: a dynamically sampled rollout or score (the expected extra rounds, Workload.op_sequences)."""
    w, p = plan.workload, cm.params
    seqs = w.op_sequences(baseline=baseline or op == "generate_baseline", resampled=resampled)
    if op == "advantage" or role not in plan.roles:
        if op in ("reward", "cost"):  # a rule-based function on the driver
            return _cost(0.0, 0.0, driver=seqs * p.rule_reward_seconds_per_sequence)
        if op == "advantage":
            return _cost(0.0, 0.0, driver=w.sequences * w.mean_response_len * p.driver_seconds_per_token)
        raise HflowError(f"op '{op}' names role '{role}', which the plan does not have (roles: {', '.join(plan.roles)})")
    rp, head = plan.roles[role], role_head(role)
    mech = getattr(plan, "mechanics", None)  # the planner's view of a request has none: HybridFlow's own
    calls = w.mini_batches if mech and mech.generate_per_minibatch else 1  # DS-Chat: per mini-batch
    if op in GENERATE_OPS:
        # Both rollout backends (native, vllm) are priced alike: the decode model above is the engine-
        # agnostic roofline and no profile measures vLLM apart yet. Their weight syncs differ (reshard).
        # A baseline's static batch or ZeRO-3 generation is its mechanics' (vocabulary/mechanics.py).
        one = cm.generate(rp.model, plan.generation_config(), w, -(-seqs // calls), kv_free_bytes(plan, p),
                          batch_cap=mech.generation_batch if mech else None,
                          gather_every_step=bool(mech and mech.gather_every_step))
        return _times(_times(one, calls), mech.decode_slowdown if mech else 1.0)
    if op in FORWARD_OPS:
        return cm.forward(rp.model, head, rp.train, w, seqs)
    lora = getattr(rp, "lora", None)
    if op in UPDATE_OPS:
        return cm.train(rp.model, head, rp.train, w, recompute=plan_recompute(plan, p).get(role, False),
                        optimizer_offload=bool(getattr(plan, "optimizer_offload", False)), lora=lora)
    if op in WEIGHT_SYNC_OPS:
        return _times(cm.reshard(rp.model, rp.train, plan.generation_config(), plan.weight_sync_mode(),
                                 per_tensor=bool(mech and mech.weight_sync == "per-tensor"), lora=lora), calls)
    if op in OFFLOAD_OPS:
        states = state_bytes(rp.model, head, rp.train, role in TRAINED_ROLES,
                             optimizer_offload=bool(getattr(plan, "optimizer_offload", False)), lora=lora)
        return cm.offload(states.total)
    raise HflowError(f"unknown op '{op}'; known ops: generate, generate_baseline, {', '.join(FORWARD_OPS)}, "
                     "advantage, actor_update, critic_update, reshard, offload, onload")
