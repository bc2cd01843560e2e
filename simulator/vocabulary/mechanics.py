"""How a system runs a plan's ops, where RLHF systems differ in ways a price must see.

A Plan says where each model lives and how it is split; its `mechanics` say how the engines then work.
HybridFlow's own (the defaults) generate with a serving engine's continuous batching (vLLM: the batch is
whatever the KV cache and max_num_seqs hold) and sync weights in packed buckets. The systems the paper
compares with (§8, and each system's own docs) differ in documented ways, each priced as what it does:

- DeepSpeed-Chat's Hybrid Engine (DeepSpeed-Chat README, `--enable_hybrid_engine`): gathers the ZeRO-3
  shards into inference kernels, then generates a *static* batch per device
  (`--per_device_generation_batch_size`): every sequence of a call waits for the call's longest. Its loop
  generates, scores and trains one PPO mini-batch at a time (`generation_batches` 1, one update per
  generated batch: BenckmarkSetting.md), so an iteration of m mini-batches switches and generates m times,
  each time a 1/m share of the prompts (`generate_per_minibatch`).
  Without the Hybrid Engine (OpenRLHF's benchmark ran DS-Chat so: "not work well with ZeRO-3") HF
  `generate` runs on the actor's training layout: under ZeRO-3 every forward step all-gathers each layer's
  shards again (`gather_every_step`); under ZeRO-2 (that benchmark's `--actor_zero_stage 2`) each device
  holds the whole model. HF's generation loop (either engine) is slower than a serving engine's:
  `decode_slowdown`, priced from the loop's documented costs by simulator/pricing/baseline_mechanics.py.
- OpenRLHF v0.2 (its README; `_broadcast_to_vllm`): ZeRO-3 training on devices of its own, vLLM on others,
  and a weight sync that gathers and broadcasts the actor *one tensor at a time*, each with a Ray call to
  every engine (`weight_sync: per-tensor`). Each actor rank hands vLLM `micro_rollout_batch_size` prompts
  per call and scores them before the next (its benchmark's "Generation micro_batch_size"): a static batch,
  whose finished sequences leave vLLM's running batch while the call waits for its longest (`drain_calls`).
  Its experiences come out padded to their call's longest response and train in micro-batches drawn shuffled
  from its replay buffer, each padded to its own longest (`rows_padded_per_batch`; replay_buffer.py).
  Each rank scores its call's batch before its next call (`RemoteExperienceMaker.make_experience`: its own
  log-probs locally, the reference, reward and value by Ray calls to those groups, round-robin by rank), so
  the scoring interleaves with the generation instead of following it (`score_per_call`; the schedule's
  simulator/schedule/per_call.py).
- NeMo-Aligner v0.2 (HybridFlow §8.2): generates in its training layout (the plan's generation config
  equals its training config, pipeline stages included) with a static batch of `rollout_micro_batch_size`
  per data-parallel rank, on Megatron's own eager generation loop (its authors later replaced it with
  TensorRT-LLM, "a 6.96x speedup": NeMo-Aligner v0.3.0.trtllm, Accelerated-RLHF.md): `decode_slowdown`, the
  loop's price over a serving engine's (simulator/pricing/baseline_mechanics.py).

Optimizer offload (ZeRO-Offload; DS-Chat's `--offload`, OpenRLHF's `--adam_offload`) is a plan option of
its own (Plan.optimizer_offload), priced for any system; this runtime does not run it yet (check_runnable).
DS-Chat's `--offload` also offloads the parameters of its ZeRO-3 models (`get_train_ds_config` and
`get_eval_ds_config` set `offload_param` with `offload_optimizer`; DeepSpeed honours it at stage 3 only):
`param_offload` names those roles.
"""

from __future__ import annotations

from typing import Literal, get_args

from pydantic import BaseModel, ConfigDict, Field, PositiveInt, model_validator

SystemName = Literal["hybridflow", "deepspeed-chat", "openrlhf", "nemo-aligner"]
SYSTEMS: tuple[str, ...] = get_args(SystemName)
Batching = Literal["continuous", "static"]
WeightSync = Literal["bucketed", "per-tensor"]


class Mechanics(BaseModel):
    """The engine behaviour a plan is priced with (module docstring)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    system: SystemName = "hybridflow"  # whose engines these are; the runtime runs only hybridflow's
    batching: Batching = "continuous"
    generation_batch: PositiveInt | None = None  # static batching: sequences per replica per generate call
    gather_every_step: bool = False  # generation under ZeRO-3: every forward step gathers each layer's shards
    generate_per_minibatch: bool = False  # one generation (and weight switch) per PPO mini-batch (DS-Chat)
    weight_sync: WeightSync = "bucketed"
    decode_slowdown: float = Field(1.0, ge=1.0)  # generation time relative to a serving engine's on the same layout
    drain_calls: bool = False  # static calls on a serving engine: finished sequences leave, the call awaits its longest
    # scoring and training rows padded to their own batch's longest (calls, shuffled micro-batches), not sorted buckets
    rows_padded_per_batch: bool = False
    # roles whose ZeRO-3 parameter shards live in host memory (DeepSpeed's offload_param: DS-Chat's --offload on a
    # stage-3 model), copied to the device at every forward and backward pass
    param_offload: tuple[str, ...] = ()
    # each actor rank scores its generate call's batch before its next call (OpenRLHF's make_experience)
    score_per_call: bool = False

    @model_validator(mode="after")
    def _consistent(self):
        if self.batching == "static" and self.generation_batch is None:
            raise ValueError("static batching needs a generation_batch (sequences per replica per call)")
        if self.batching == "continuous" and self.generation_batch is not None:
            raise ValueError("generation_batch is a static batch; continuous batching fills the KV cache instead")
        return self

    @property
    def is_default(self) -> bool:
        return self == Mechanics()

    def describe(self) -> str:
        parts = [self.system]
        if self.batching == "static":
            parts.append(f"static generation batch {self.generation_batch}")
        if self.gather_every_step:
            parts.append("ZeRO-3 gather every decode step")
        if self.generate_per_minibatch:
            parts.append("one generation per mini-batch")
        if self.weight_sync == "per-tensor":
            parts.append("per-tensor weight sync")
        if self.decode_slowdown != 1.0:
            parts.append(f"generation loop {self.decode_slowdown:g}x a serving engine's time")
        if self.drain_calls:
            parts.append("finished sequences leave their call")
        if self.rows_padded_per_batch:
            parts.append("rows padded to their batch's longest")
        if self.score_per_call:
            parts.append("each call's batch scored before the rank's next call")
        if self.param_offload:
            parts.append(f"parameters in host memory ({', '.join(self.param_offload)})")
        return ", ".join(parts)
