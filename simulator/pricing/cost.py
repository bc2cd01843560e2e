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

Generation (prefill, then one decode step per response token) is priced in generation.py;
CostModel.generate is its entry point. Every tunable term is in EfficiencyParams (efficiency.py); docs/cost-model.md
gives the sources. OpCost.breakdown values are seconds that add up to OpCost.seconds; OpCost.bytes
is network bytes per device for train/forward/reshard and HBM bytes read per device for generate.
"""

from __future__ import annotations

from hybridflow.simulator.errors import HflowError
from hybridflow.simulator.pricing import generation
from hybridflow.simulator.pricing.comm import Collectives, dp_ranks, pp_ranks, sp_ranks, tp_ranks
from hybridflow.simulator.pricing.efficiency import EfficiencyParams
from hybridflow.simulator.pricing.expert_parallel import expert_dispatch, expert_gather, megatron_expert_dp
from hybridflow.simulator.pricing.memory import state_bytes
from hybridflow.simulator.pricing.op_cost import (
    OpCost,
    mean_seq_flops,
    model_shape,
    op_cost,
    plus,
    seq_flops,
    times,
)
from hybridflow.simulator.pricing.plan_memory import engine_memory_fraction, kv_free_bytes, plan_recompute
from hybridflow.simulator.pricing.reshard import IN_PLACE, reshard_spec, weight_sync_buckets
from hybridflow.simulator.pricing.rollout_calls import sequential_generate
from hybridflow.simulator.pricing.sequence_batches import (
    DEFAULT_BUDGET,
    micro_batches,
    packed_seq_flops,
    padded_seq_flops,
)
from hybridflow.simulator.vocabulary.execution import shares_prompts
from hybridflow.simulator.vocabulary.hardware import ClusterSpec
from hybridflow.simulator.vocabulary.lora import LoraConfig, adapter_bytes, adapter_params
from hybridflow.simulator.vocabulary.model import Head, ModelSpec
from hybridflow.simulator.vocabulary.parallel import ParallelConfig
from hybridflow.simulator.vocabulary.roles import TRAINED_ROLES, role_head
from hybridflow.simulator.vocabulary.timeline import GENERATE_OPS, OFFLOAD_OPS, UPDATE_OPS, WEIGHT_SYNC_OPS
from hybridflow.simulator.vocabulary.units import BF16
from hybridflow.simulator.vocabulary.workload import Workload


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
                steps: int, mult: float, tp_collectives: int, fsdp_passes: int,
                micro_batch_tokens: int | None | str = DEFAULT_BUDGET):
        """Shared by forward() and train(): `mult` passes' worth of FLOPs (1 forward, 3 fwd+bwd, 4 with
        recompute) over `sequences` split evenly into `steps` optimizer steps; `micro_batch_tokens` as
        micro_batches takes it."""
        n_params, pm, attn, _ = model_shape(model, head)
        if workload.response_lengths is not None and micro_batch_tokens is not None:
            # packed: the tokens the rollout made, its batch's lengths (padded: padded_widths' rows are the batch's)
            workload = workload.drawn_batch()
        tp, pp, dp, world = par.tp, par.pp, par.dp, par.world_size
        s, sp = workload.seq_len, par.sp
        # per_rank, m, rows: per group of sp ranks that shares its sequences (each device holds rows/sp tokens)
        per_rank, m, rows = micro_batches(workload, sequences, steps, dp // sp, micro_batch_tokens)
        rows /= sp
        # FLOPs count the causal half; the work a compute time is priced from counts what the kernel computes
        ae, kb = self.params.attention_efficiency, self.params.attention_key_block
        one_seq, seq_work = seq_flops(pm, attn, s), seq_flops(pm, attn, s, ae, kb)
        if workload.response_lengths is not None and micro_batch_tokens is None:  # rows padded to their bucket's longest
            b = min(workload.micro_batch_size, per_rank)
            one_seq = padded_seq_flops(pm, attn, workload, per_rank, b)
            seq_work = padded_seq_flops(pm, attn, workload, per_rank, b, ae, kb)
        elif workload.response_lengths is not None:  # packed: attention per sequence, the slowest rank's
            one_seq = mean_seq_flops(pm, attn, workload)
            seq_work = packed_seq_flops(pm, attn, workload, per_rank, dp // sp, ae, kb)
        packed = micro_batch_tokens is not None and (micro_batch_tokens != DEFAULT_BUDGET
                                                     or workload.response_lengths is not None)
        if (workload.samples_per_prompt > 1 and not packed  # the engine shares prompts only without packing
                and shares_prompts(head, par, model.attention_window, s)):  # each sample's share of its prompt
            share = 1.0 - 1.0 / workload.samples_per_prompt
            one_seq -= share * seq_flops(pm, attn, workload.prompt_len)
            seq_work -= share * seq_flops(pm, attn, workload.prompt_len, ae, kb)
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
        if sp > 1 and par.backend == "megatron":
            sp_comm, sp_latency, sp_bytes = self._ring_attention(model, par, workload, rows, layers * micro, mult,
                                                                  compute, seq_work, pm)
        elif sp > 1:  # Ulysses: per layer and pass, q·k·v to whole heads on a sequence's ranks, the output back
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
        flops = mult * one_seq * sequences
        return flops, net, dict(compute=compute, tp_comm=tp_comm, pp_comm=pp_comm, ep_comm=ep_comm, sp_comm=sp_comm,
                                latency=tp_latency + pp_latency + ep_latency + sp_latency, pp_bubble=bubble,
                                dp_comm=dp_exposed)

    def _ring_attention(self, model: ModelSpec, par: ParallelConfig, workload: Workload, rows: float,
                        layer_passes: float, mult: float, compute: float, seq_work: float, pm: float):
        """Context parallelism (Megatron's ring attention): each of a sequence's sp ranks holds 1/sp of its
        tokens and passes its K,V chunk round the ring, sp − 1 sends per layer and forward; a backward sends
        K,V again and their gradients (three in all). Each send hides under the attention over the chunk
        already there, so only what the attention's share of the compute does not cover is exposed.
        Returns (exposed seconds, latency seconds, bytes)."""
        sp = par.sp
        chunk = BF16 * 2 * rows * model.kv_heads * model.dim_head / par.tp
        ring = self.link(par.world_size, sp_ranks(par))  # every rank sends at once: the slowest hop paces it
        bw, lat = chunk / ring.bandwidth, ring.latency
        sends = (sp - 1) * layer_passes * (3 if mult > 1 else 1)
        tokens = workload.prompt_len + (workload.response_lengths.mean if workload.response_lengths is not None
                                        else workload.response_len)
        attention_share = max(0.0, 1.0 - 2.0 * pm * tokens / seq_work)
        return max(0.0, sends * bw - attention_share * compute), sends * lat, sends * chunk

    def forward(self, model: ModelSpec, head: Head, parallel: ParallelConfig, workload: Workload,
                sequences: int | None = None, micro_batch_tokens: int | None | str = DEFAULT_BUDGET) -> OpCost:
        """A forward-only pass over `sequences` full sequences (log-probs, values, rewards, costs);
        `micro_batch_tokens`: the role's packing budget (None: rows padded; micro_batches)."""
        seqs = workload.sequences if sequences is None else sequences
        flops, net, parts = self._passes(model, head, parallel, workload, seqs, 1, 1.0, 2, 1, micro_batch_tokens)
        return op_cost(flops, net, **parts)

    def train(self, model: ModelSpec, head: Head, parallel: ParallelConfig, workload: Workload,
              recompute: bool = False, optimizer_offload: bool = False, lora: LoraConfig | None = None,
              micro_batch_tokens: int | None | str = DEFAULT_BUDGET) -> OpCost:
        """All PPO epochs × mini-batches of forward + backward (+ recomputation) and Adam steps.
        optimizer_offload: each step sends the gradients to host memory, runs Adam on the node's CPU (its
        devices' shards one after another through the host's DRAM) and copies the new weights back.
        lora: the backward still computes activation gradients through every frozen layer (a forward's
        FLOPs) but weight gradients only for the adapters: 2 passes (3 with recompute) plus the adapters'
        own 6 FLOPs per parameter and token; FSDP gathers the frozen base for the forward and the backward
        and reduce-scatters only the adapters' gradients; Adam steps the adapters.
        micro_batch_tokens: the role's packing budget (None: rows padded; micro_batches)."""
        steps = workload.ppo_epochs * workload.mini_batches
        if lora is not None:
            adapters = adapter_params(model, lora)
            mult = (3.0 if recompute else 2.0) + 3.0 * adapters / model_shape(model, head)[1]
            flops, net, parts = self._passes(model, head, parallel, workload, workload.sequences * workload.ppo_epochs,
                                             steps, mult, 6 if recompute else 4, 2, micro_batch_tokens)
            local = adapters / parallel.world_size
        else:
            flops, net, parts = self._passes(model, head, parallel, workload, workload.sequences * workload.ppo_epochs,
                                             steps, 4.0 if recompute else 3.0, 6 if recompute else 4, 3,
                                             micro_batch_tokens)
            local = model_shape(model, head)[0] / parallel.world_size
        p = self.params
        if optimizer_offload:
            per_node = local * min(parallel.world_size, self.cluster.devices_per_node)
            host_link = self.cluster.hardware.host_bandwidth * p.host_link_efficiency
            parts["host_optimizer"] = steps * per_node * p.adam_bytes_per_param / p.host_adam_bandwidth
            parts["host_copy"] = steps * 2 * BF16 * local / host_link  # gradients out, weights back
        else:
            parts["optimizer"] = steps * local * p.adam_bytes_per_param / self.hbm
        return op_cost(flops, net, **parts)

    def param_fetch(self, model: ModelSpec, head: Head, parallel: ParallelConfig, workload: Workload,
                    sequences: int, steps: int, passes: int,
                    micro_batch_tokens: int | None | str = DEFAULT_BUDGET) -> OpCost:
        """ZeRO-3 parameter offload (DeepSpeed's offload_param): the rank's shard of the bf16 weights lives in host
        memory and is copied to the device at each of `passes` passes of every micro-batch (1 for a forward; 2 for
        a training micro-batch, its forward and its backward, whose recomputed forward runs on the backward's
        fetch) before the all-gather the pass pays anyway. DS-Chat's config leaves DeepSpeed's pin_memory off, so
        the copies do not run ahead of the compute: exposed. `sequences` split into `steps` steps (micro_batches)."""
        _, m, _ = micro_batches(workload, sequences, steps, parallel.dp // parallel.sp, micro_batch_tokens)
        shard = BF16 * model_shape(model, head)[0] / parallel.world_size
        link = self.cluster.hardware.host_bandwidth * self.params.host_link_efficiency
        fetched = steps * m * passes * shard
        return op_cost(0.0, fetched, host_gather=fetched / link)

    # ---- generation (generation.py) ------------------------------------------------------------
    def generate(self, model: ModelSpec, gen: ParallelConfig, workload: Workload, sequences: int | None = None,
                 free_bytes_per_device: float | None = None, batch_cap: int | None = None,
                 gather_every_step: bool = False, drain_calls: bool = False) -> OpCost:
        """Prefill + decode of `sequences` responses on gen.dp replicas in waves of the largest batch
        the KV cache holds. free_bytes_per_device: bytes left for the KV cache (everything else already
        resident); default: usable memory minus the generation weights. batch_cap: a static engine's batch
        per call (vocabulary/mechanics.py). gather_every_step: the weights stay ZeRO-3 shards over gen.dp and
        every pass (the prefill and each decode step) all-gathers them layer by layer (HF generate under ZeRO-3).
        drain_calls: a static call's finished sequences leave its running batch (a serving engine's calls)."""
        seqs = workload.sequences if sequences is None else sequences
        return generation.generate(self, model, gen, workload, seqs, free_bytes_per_device, batch_cap,
                                   gather_every_step, drain_calls)

    def host_seconds_per_step(self, batch: int) -> float:
        """A decode step's seconds outside the GPU's work: its fixed overhead (a profile's engine terms add the
        per-sequence work, calibration/profiled_cost.py)."""
        return self.params.decode_step_overhead

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
            return op_cost(0.0, 0.0)
        world = train.world_size
        collectives = model.layers + 1  # gathered layer by layer (plus embeddings/head)
        if lora is not None:
            a_bytes = float(adapter_bytes(model, lora))
            if mode != "broadcast":  # every device gathers the whole adapters, merges its generation slice
                link = self.cluster.hardware.host_bandwidth * self.params.host_link_efficiency
                ag, lat = self.allgather(a_bytes, world, tuple(range(world)))
                return op_cost(0.0, a_bytes, reshard_comm=ag, host_copy=m_bytes / (gen.tp * gen.pp) / link,
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
            return op_cost(0.0, spec.volume, reshard_comm=ag + m_bytes / bw,
                         latency=(gathers * lat if world > 1 else 0.0) + sends * send_lat)
        bw_s, lat = self.allgather(spec.gathered_bytes, world, spec.ranks)
        eg_bw, eg_lat, eg_bytes = expert_gather(self, model, train)  # generation holds every expert
        return op_cost(0.0, spec.volume + eg_bytes, reshard_comm=bw_s, ep_gather=eg_bw,
                     latency=(collectives * lat if bw_s else 0.0) + eg_lat)

    def offload(self, bytes_per_device: float) -> OpCost:
        """Copy a model's states to host memory (or back: onload) over the device-host link."""
        bw = self.cluster.hardware.host_bandwidth * self.params.host_link_efficiency
        return op_cost(0.0, bytes_per_device, host_copy=bytes_per_device / bw)

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
            return op_cost(0.0, 0.0, driver=seqs * p.rule_reward_seconds_per_sequence)
        if op == "advantage":
            return op_cost(0.0, 0.0, driver=w.sequences * w.mean_response_len * p.driver_seconds_per_token)
        raise HflowError(f"op '{op}' names role '{role}', which the plan does not have (roles: {', '.join(plan.roles)})")
    rp, head = plan.roles[role], role_head(role)
    mech = getattr(plan, "mechanics", None)  # the planner's view of a request has none: HybridFlow's own
    calls = w.mini_batches if mech and mech.generate_per_minibatch else 1  # DS-Chat: per mini-batch
    if op in GENERATE_OPS:
        # Both rollout backends (native, vllm) are priced alike: the decode model above is the engine-
        # agnostic roofline and no profile measures vLLM apart yet. Their weight syncs differ (reshard).
        # A baseline's static batch or ZeRO-3 generation is its mechanics' (vocabulary/mechanics.py).
        made = sequential_generate(cm, rp.model, plan.generation_config(), w, seqs, calls,
                                   free_bytes_per_device=kv_free_bytes(plan, p),
                                   batch_cap=mech.generation_batch if mech else None,
                                   gather_every_step=bool(mech and mech.gather_every_step),
                                   drain_calls=bool(mech and mech.drain_calls))
        return times(made, mech.decode_slowdown if mech else 1.0)
    # the role's packing budget as the plan sets it (None: rows padded); a planner's view has no knob yet
    budget = getattr(rp, "micro_batch_tokens", DEFAULT_BUDGET)
    if mech and mech.rows_padded_per_batch and op in FORWARD_OPS + UPDATE_OPS:  # a call's rows; a micro-batch's
        w = w.padded_per_batch(mech.generation_batch if op in FORWARD_OPS else w.micro_batch_size)
    in_host = bool(mech and role in mech.param_offload)  # DS-Chat's --offload on a ZeRO-3 model
    if op in FORWARD_OPS:
        cost = cm.forward(rp.model, head, rp.train, w, seqs, micro_batch_tokens=budget)
        return plus(cost, cm.param_fetch(rp.model, head, rp.train, w, seqs, 1, 1, budget)) if in_host else cost
    lora = getattr(rp, "lora", None)
    if op in UPDATE_OPS:
        cost = cm.train(rp.model, head, rp.train, w, recompute=plan_recompute(plan, p).get(role, False),
                        optimizer_offload=bool(getattr(plan, "optimizer_offload", False)), lora=lora,
                        micro_batch_tokens=budget)
        if not in_host:
            return cost
        steps = w.ppo_epochs * w.mini_batches
        return plus(cost, cm.param_fetch(rp.model, head, rp.train, w, w.sequences * w.ppo_epochs, steps, 2, budget))
    if op in WEIGHT_SYNC_OPS:
        return times(cm.reshard(rp.model, rp.train, plan.generation_config(), plan.weight_sync_mode(),
                                 per_tensor=bool(mech and mech.weight_sync == "per-tensor"), lora=lora), calls)
    if op in OFFLOAD_OPS:
        states = state_bytes(rp.model, head, rp.train, role in TRAINED_ROLES,
                             optimizer_offload=bool(getattr(plan, "optimizer_offload", False)), lora=lora)
        return cm.offload(states.total)
    raise HflowError(f"unknown op '{op}'; known ops: generate, generate_baseline, {', '.join(FORWARD_OPS)}, "
                     "advantage, actor_update, critic_update, reshard, offload, onload")


def rollout_knobs(plan, params: EfficiencyParams | None = None) -> dict[str, float | int]:
    """The rollout engine's settings that make `plan`'s generation what it is priced as: the share of each
    device's memory the engine may take (its weights and the KV cache the colocated states leave,
    vLLM's gpu_memory_utilization) and the sequences decoded at once (the KV-cache batch, max_num_seqs)."""
    cm = CostModel(plan.cluster, params)
    actor, gen, w = plan.roles["actor"], plan.generation_config(), plan.workload
    _, batch = generation.decode_slots(cm, actor.model, gen, w, w.sequences, kv_free_bytes(plan, cm.params))
    fraction = engine_memory_fraction(plan, cm.params)
    return {"rollout_memory_fraction": min(max(fraction, 0.01), 1.0), "max_concurrent_sequences": batch}
