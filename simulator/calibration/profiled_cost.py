"""ProfiledCostModel: the analytic CostModel plus the engines' fixed overheads a profile measures.

The analytic model prices FLOPs, bytes and collectives. On small shapes — tiny models, CPU
devices, eager PyTorch — a large share of an op's time is fixed work per layer and per call:
dispatching a layer's dozen kernels (forward, and about twice that in the backward), the extra
DTensor dispatch of a tensor-parallel layer, setting up a call and an optimizer step. These do not
scale with FLOPs or bytes, so no efficiency term of the analytic model can absorb them. A profile
fits them; their defaults (0, and a backward of twice the forward) leave train, forward and
generate exactly as the analytic model prices them. The reshard is priced as the engines run it
(FSDP's gather over dp first, then the copy into the generation model), and the single
controller's gaps between calls (measured, not fitted) are left by the schedule (schedule.call_gaps).

The megatron-core engine (roles with `train.backend: megatron`) has its own terms, fitted to its own
points (megatron_train / megatron_forward): its modules, 1F1B schedule and distributed optimizer
spend other fixed time than FSDP2's, and on CPU the shim's TorchFunctionMode sees every torch call.
A profile without those points leaves them 0: Megatron roles are then priced by the analytic terms
on the profile's fitted hardware.

The overheads are added as one more part of each OpCost's breakdown ("overhead"), so tables still
add up. Method signatures are CostModel's: the planner and the schedule use this class unchanged.
"""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field

from hybridflow.simulator.pricing import generation
from hybridflow.simulator.pricing.comm import dp_ranks
from hybridflow.simulator.pricing.cost import CostModel
from hybridflow.simulator.pricing.efficiency import EfficiencyParams
from hybridflow.simulator.pricing.op_cost import OpCost
from hybridflow.simulator.pricing.reshard import HYBRID_ENGINE, IN_PLACE
from hybridflow.simulator.pricing.sequence_batches import DEFAULT_BUDGET, micro_batches
from hybridflow.simulator.vocabulary.hardware import ClusterSpec
from hybridflow.simulator.vocabulary.model import Head, ModelSpec
from hybridflow.simulator.vocabulary.parallel import ParallelConfig
from hybridflow.simulator.vocabulary.units import BF16
from hybridflow.simulator.vocabulary.workload import Workload


class EngineOverheads(BaseModel):
    """Fixed seconds the engines spend beyond FLOPs, bytes and collectives (fitted to a profile).

    Each op kind has its own terms: on eager CPU PyTorch a training pass, a no-grad forward and a
    KV-cache decode step dispatch different kernels, and a tensor-parallel decode step (two
    latency-bound all-reduces per layer for a handful of tokens) costs far more per layer than a
    tensor-parallel training pass over a whole micro-batch — one shared term fits neither."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    layer_seconds: float = Field(0.0, ge=0, description="per decoder layer per forward pass of one micro-batch "
                                 "(forward ops and the forward half of a training step): eager kernel dispatch")
    backward_layer_seconds: float = Field(0.0, ge=0, description="per decoder layer per backward pass of one "
                                          "micro-batch: autograd's dispatch and gradient hooks")
    decode_layer_seconds: float = Field(0.0, ge=0, description="per decoder layer per generation pass (the "
                                        "prefill or one decode step): dispatch, KV-cache append")
    decode_sequence_seconds: float = Field(0.0, ge=0, description="per sequence per generation pass: the serving "
                                           "engine's scheduling, sampling and bookkeeping of each sequence in "
                                           "the batch")
    host_sequence_seconds: float = Field(0.0, ge=0, description="per sequence per generation pass of an engine "
                                         "that does not overlap its host work with the GPU step (vLLM before 0.6: "
                                         "EfficiencyParams.generation_host_overlap False): its scheduler, block "
                                         "manager, sampler and detokenizer walk every sequence in Python between "
                                         "steps while the GPU idles")
    tp_layer_seconds: float = Field(0.0, ge=0, description="extra per layer per forward pass when tp > 1 (forward "
                                    "ops and a training step's forward half): DTensor dispatch and the "
                                    "synchronisation of the layer's two all-reduces")
    tp_backward_layer_seconds: float = Field(0.0, ge=0, description="extra per layer per backward pass when tp > 1: "
                                             "autograd through DTensor and the backward's own all-reduces "
                                             "(a shared forward/backward term over-prices tp forwards by 20–40 %)")
    tp_decode_layer_seconds: float = Field(0.0, ge=0, description="extra per layer per generation pass when "
                                           "tp > 1: the same, paid per decode step for a few tokens")
    dp_layer_seconds: float = Field(0.0, ge=0, description="extra per layer per FSDP collective when dp > 1 (one "
                                    "per forward pass, two per backward): the hooks and the synchronisation of "
                                    "the layer's weight all-gather / gradient reduce-scatter")
    reshard_layer_seconds: float = Field(0.0, ge=0, description="per layer of a reshard's gather between "
                                         "layouts: one gather per parameter tensor, each with its own setup")
    dp_gather_layer_seconds: float = Field(0.0, ge=0, description="per layer of the FSDP gather over dp before "
                                           "a reshard: the layer's unshard and reading its tensors out")
    call_seconds: float = Field(0.0, ge=0, description="per op call on a device: batching, gathering results")
    weight_tensor_seconds: float = Field(0.0, ge=0, description="per weight tensor of a sync into the generation "
                                         "engine: the tensor's own gather call on the trainer and the engine "
                                         "loader's call for it (ModelSpec.num_tensors per sync)")
    step_seconds: float = Field(0.0, ge=0, description="per optimizer step: zeroing, clipping, the step's launch")
    dispatch_seconds: float = Field(0.0, ge=0, description="the single controller's gap between a call's "
                                    "input ending on its workers and the call starting there: the result back "
                                    "through Ray, the next batch sharded and sent (runtime/measure/dispatch_probe.py; "
                                    "measured, not fitted; the schedule leaves it, schedule.call_gaps)")
    queued_call_seconds: float = Field(0.0, ge=0, description="the gap between two calls queued on one worker "
                                       "group: the second was sent while the first ran (measured likewise)")
    alone_speedup: float = Field(1.0, ge=1, description="how many times faster a device runs while the other "
                                 "devices of its node idle than while they all work, as the profile times its "
                                 "points (runtime/measure/alone_probe.py; measured, not fitted; 1: no difference, as on "
                                 "a GPU node; the schedule prices it, simulator/schedule/neighbours.py)")
    backward_ratio: float = Field(2.0, gt=0, description="the backward pass's compute relative to the forward's "
                                  "(2 in FLOPs, the analytic model's figure; eager CPU kernels reach another)")
    # The megatron-core engine's own terms (roles with train.backend: megatron; its megatron_train /
    # megatron_forward points): other modules, its schedule and distributed optimizer, and on CPU the
    # shim's TorchFunctionMode on every torch call. 0 (a profile without those points): the analytic
    # model's price on the profile's fitted hardware.
    megatron_layer_seconds: float = Field(0.0, ge=0, description="megatron: per decoder layer per forward pass "
                                          "of one micro-batch")
    megatron_backward_layer_seconds: float = Field(0.0, ge=0, description="megatron: per decoder layer per "
                                                   "backward pass of one micro-batch")
    megatron_tp_layer_seconds: float = Field(0.0, ge=0, description="megatron: extra per layer per forward pass "
                                             "when tp > 1 (the parallel linears' all-reduces and their setup)")
    megatron_tp_backward_layer_seconds: float = Field(0.0, ge=0, description="megatron: extra per layer per "
                                                      "backward pass when tp > 1")
    megatron_pp_seconds: float = Field(0.0, ge=0, description="megatron: per micro-batch pass (forward or "
                                       "backward) when pp > 1: the 1F1B schedule's p2p exchange")
    megatron_call_seconds: float = Field(0.0, ge=0, description="megatron: per op call (the schedule's set-up, "
                                         "packing, gathering results from the last stage)")
    megatron_step_seconds: float = Field(0.0, ge=0, description="megatron: per optimizer step (the distributed "
                                         "optimizer's grad buffers, norm, step and weight all-gather)")
    megatron_backward_ratio: float = Field(2.0, gt=0, description="megatron: the backward's compute relative to "
                                           "the forward's (as backward_ratio)")

    @property
    def megatron_fitted(self) -> bool:
        """Whether a profile's Megatron points set the megatron terms (else Megatron roles price analytically)."""
        return any(getattr(self, f) > 0 for f in MEGATRON_OVERHEADS if f.endswith("_seconds"))


MEGATRON_OVERHEADS = tuple(f for f in EngineOverheads.model_fields if f.startswith("megatron_"))


def _micro_batches(workload: Workload, sequences: int, steps: int, dp: int,
                   micro_batch_tokens: int | None | str = DEFAULT_BUDGET) -> int:
    """Micro-batches one rank runs: as CostModel._passes splits the work (sequence_batches.micro_batches)."""
    return steps * micro_batches(workload, sequences, steps, dp, micro_batch_tokens)[1]


class ProfiledCostModel(CostModel):
    def __init__(self, cluster: ClusterSpec, params: EfficiencyParams | None = None,
                 overheads: EngineOverheads | None = None):
        super().__init__(cluster, params)
        self.overheads = overheads or EngineOverheads()

    def _layer(self, par: ParallelConfig, backward: bool = False, dp_hooks: bool = True) -> float:
        """Overhead per layer of one training/forward pass (forward or backward) in layout `par`. A
        backward pass runs FSDP's two collectives per layer (gather, reduce-scatter) to the forward's one
        (`dp_hooks` False: not counted here, see _gathered_once)."""
        o = self.overheads
        if par.backend == "megatron":
            return ((o.megatron_backward_layer_seconds if backward else o.megatron_layer_seconds)
                    + ((o.megatron_tp_backward_layer_seconds if backward else o.megatron_tp_layer_seconds)
                       if par.tp > 1 else 0.0))
        return ((o.backward_layer_seconds if backward else o.layer_seconds)
                + ((o.tp_backward_layer_seconds if backward else o.tp_layer_seconds) if par.tp > 1 else 0.0)
                + ((2.0 if backward else 1.0) * o.dp_layer_seconds if par.dp > 1 and dp_hooks else 0.0))

    @staticmethod
    def _gathered_once(par: ParallelConfig) -> bool:
        """Whether FSDP's per-layer collectives run once per call and optimizer step, not per micro-batch: the
        fsdp engine at pp = 1 keeps the weights gathered over a call's micro-batches and reduce-scatters the
        gradients after the last (FsdpEngine._infer, train_step). The pipeline runner and Megatron do not."""
        return par.backend != "megatron" and par.pp == 1 and par.dp > 1

    @staticmethod
    def _with(cost: OpCost, extra: float, part: str = "overhead") -> OpCost:
        if extra == 0.0:
            return cost
        parts = dict(cost.breakdown)
        parts[part] = parts.get(part, 0.0) + extra
        return OpCost.model_construct(seconds=cost.seconds + extra, flops=cost.flops, bytes=cost.bytes,
                                      breakdown=parts)

    def _slots(self, par: ParallelConfig, micro: int, steps: int) -> float:
        """Micro-batch passes one rank's layers wait through: Megatron's pipeline schedule fills and
        drains once per step ((pp - 1) more slots); FSDP's layers run once per micro-batch."""
        return micro + (steps * (par.pp - 1) if par.backend == "megatron" else 0)

    def _call(self, par: ParallelConfig, passes: int) -> float:
        """Per call: its set-up, and Megatron's p2p exchange per pipelined micro-batch pass."""
        o = self.overheads
        if par.backend != "megatron":
            return o.call_seconds
        return o.megatron_call_seconds + (passes * o.megatron_pp_seconds if par.pp > 1 else 0.0)

    def forward(self, model: ModelSpec, head: Head, parallel: ParallelConfig, workload: Workload,
                sequences: int | None = None, micro_batch_tokens: int | None | str = DEFAULT_BUDGET) -> OpCost:
        cost = super().forward(model, head, parallel, workload, sequences, micro_batch_tokens)
        seqs = workload.sequences if sequences is None else sequences
        micro = _micro_batches(workload, seqs, 1, parallel.dp // parallel.sp, micro_batch_tokens)
        once = self._gathered_once(parallel)
        extra = (self._slots(parallel, micro, 1) * model.layers / parallel.pp * self._layer(parallel, dp_hooks=not once)
                 + self._call(parallel, micro) + (model.layers * self.overheads.dp_layer_seconds if once else 0.0))
        return self._with(cost, extra)

    def train(self, model: ModelSpec, head: Head, parallel: ParallelConfig, workload: Workload,
              recompute: bool = False, optimizer_offload: bool = False, lora=None,
              micro_batch_tokens: int | None | str = DEFAULT_BUDGET) -> OpCost:
        cost = super().train(model, head, parallel, workload, recompute, optimizer_offload, lora=lora,
                             micro_batch_tokens=micro_batch_tokens)
        o = self.overheads
        steps = workload.ppo_epochs * workload.mini_batches
        micro = _micro_batches(workload, workload.sequences * workload.ppo_epochs, steps, parallel.dp // parallel.sp,
                               micro_batch_tokens)
        # the analytic compute counts the backward as 2 forwards (3 passes, 4 with recomputation)
        forwards = 2.0 if recompute else 1.0
        ratio = o.megatron_backward_ratio if parallel.backend == "megatron" else o.backward_ratio
        # (LoRA: its backward, one forward's worth of activation gradients, is not what the ratio measured)
        scale = 1.0 if lora is not None else (forwards + ratio) / (forwards + 2.0)
        if scale != 1.0 and cost.breakdown.get("compute", 0.0) > 0.0:
            cost = self._with(cost, (scale - 1.0) * cost.breakdown["compute"], part="compute")
        layers = self._slots(parallel, micro, steps) * model.layers / parallel.pp
        step = o.megatron_step_seconds if parallel.backend == "megatron" else o.step_seconds
        once = self._gathered_once(parallel)  # then a step's gather and two backward hooks per layer, as one micro-batch's
        extra = (layers * (forwards * self._layer(parallel, dp_hooks=not once)
                           + self._layer(parallel, backward=True, dp_hooks=not once))
                 + steps * step + self._call(parallel, 2 * micro)
                 + (steps * model.layers * 3.0 * o.dp_layer_seconds if once else 0.0))
        return self._with(cost, extra)

    def generate(self, model: ModelSpec, gen: ParallelConfig, workload: Workload, sequences: int | None = None,
                 free_bytes_per_device: float | None = None, batch_cap: int | None = None,
                 gather_every_step: bool = False, drain_calls: bool = False) -> OpCost:
        cost = super().generate(model, gen, workload, sequences, free_bytes_per_device, batch_cap, gather_every_step,
                                drain_calls)
        seqs = workload.sequences if sequences is None else sequences
        # the slowest replica's prefills and decode steps, and the response tokens it generates
        passes, tokens = generation.decode_counts(self, model, gen, workload, seqs, free_bytes_per_device, batch_cap,
                                                  drain_calls)
        # generation replicas hold whole (tp-sharded) weights: no FSDP hooks however large dp is
        o = self.overheads
        per_layer = o.decode_layer_seconds + (o.tp_decode_layer_seconds if gen.tp > 1 else 0.0)
        extra = passes * model.layers * per_layer + tokens * o.decode_sequence_seconds
        cost = self._with(cost, extra + o.call_seconds)
        if self.params.generation_host_overlap:
            return cost
        return self._with(cost, tokens * o.host_sequence_seconds, part="host")

    def host_seconds_per_step(self, batch: int) -> float:
        """The step's fixed overhead and the engine's per-sequence work in one decode step of `batch` sequences
        (the bookkeeping every engine pays, and the host work an engine that does not overlap it runs between
        steps)."""
        o = self.overheads
        host = 0.0 if self.params.generation_host_overlap else o.host_sequence_seconds
        return super().host_seconds_per_step(batch) + batch * (o.decode_sequence_seconds + host)

    def reshard(self, model: ModelSpec, train: ParallelConfig, gen: ParallelConfig, mode: str,
                per_tensor: bool = False, lora=None) -> OpCost:
        """The switch as the engines run it. The analytic price is paper Table 2, whose training
        weights are whole on every data-parallel replica (Megatron); the training engine shards them
        over dp (FSDP2), so before any mode's gather it all-gathers each tensor-parallel shard over
        the dp ranks ((d-1)/d · M/(t·p) per device, one all-gather per FSDP unit: each decoder layer
        and the root, FsdpEngine.gathered_tp_shards). Then the generation weights are written
        into the generation model (a local copy of M/(t_g·p_g)). DS-Chat's gather over every device
        is that dp gather when nothing is tensor- or pipeline-parallel (t·p = 1): the engines then
        move no more bytes, and neither does this price."""
        cost = super().reshard(model, train, gen, mode, per_tensor, lora=lora)
        if mode == IN_PLACE or lora is not None:  # nothing switches / only the adapters move (the analytic price)
            return cost
        if mode in ("ds-chat", HYBRID_ENGINE) and train.tp * train.pp == 1:
            cost = OpCost.model_construct(seconds=0.0, flops=0.0, bytes=0.0, breakdown={})
        o = self.overheads
        m_bytes = BF16 * model.num_params("lm")
        parts = dict(cost.breakdown)
        if mode == "broadcast":  # as runtime/engines/rollout/weight_sync.py runs it: no gather between tensor shards
            # the sender packs the buckets; each receiver reads every bucket it is sent (all of M) to take its
            # slice — which leaves the price a function of the two sizes alone (planner/pricing.py relies on it)
            parts["copy"] = 2 * m_bytes / self.hbm
            parts["overhead"] = (o.call_seconds + model.num_tensors() * o.weight_tensor_seconds
                                 + (model.layers * o.dp_gather_layer_seconds if train.dp > 1 else 0.0))
            parts = {k: v for k, v in parts.items() if v > 0.0}
            return OpCost.model_construct(seconds=sum(parts.values()), flops=0.0, bytes=cost.bytes, breakdown=parts)
        nbytes = cost.bytes
        overhead = model.layers * o.reshard_layer_seconds if cost.bytes > 0 else 0.0
        if train.dp > 1:
            bw, lat = self.allgather(m_bytes / (train.tp * train.pp), train.world_size, dp_ranks(train))
            parts["dp_gather"] = bw
            parts["latency"] = parts.get("latency", 0.0) + (model.layers + 1) * lat
            nbytes += (train.dp - 1) / train.dp * m_bytes / (train.tp * train.pp)
            overhead += model.layers * o.dp_gather_layer_seconds
        parts["copy"] = m_bytes / (gen.tp * gen.pp) / self.hbm
        parts["overhead"] = overhead + model.num_tensors() * o.weight_tensor_seconds
        parts = {k: v for k, v in parts.items() if v > 0.0}
        return OpCost.model_construct(seconds=sum(parts.values()), flops=0.0, bytes=nbytes, breakdown=parts)
