"""PolicyWorker: the actor's hybrid engine (training + rollout) and, as role `ref`, the reference policy.

One implementation for both roles: the actor trains, generates and computes the old log-probs
(or, with one epoch of one mini-batch, takes its update's own log-probs detached as the old ones);
the reference loads the same initial weights and only computes log-probs (it never steps, so its
optimizer never allocates state). When a plan colocates them they share one process per device.

Rollout runs in the plan's generation layout (tp_g | tp) on the actor's own devices, through the
rollout interface (engines/rollout/base.py) with the plan's backend: `native` (the 3D-HybridEngine,
engines/rollout/hybrid.py, and our KV-cache engine) or `vllm` (engines/rollout/vllm_rollout.py). Before each
rollout after a training step the weights move from the training layout into the rollout engine
(`update_weights`: the `reshard` op, bytes counted). The driver hands each rank the prompt shard
of its generation data-parallel replica (`generate` is ALL_TO_ALL; `generation_ranks` says who is
who) and reads tp_g rank 0.
Sampling is seeded by (seed, iteration, generation replica), so the tp_g ranks of a replica draw
the same tokens and a resumed run draws exactly what a straight run would.
When the plan gives the actor rollout devices of its own (`generate_group`), it builds no rollout
engine: RolloutWorkers generate there, and this worker sends them its weights (weight_source.py).
"""

from __future__ import annotations

import torch
from pydantic import BaseModel, ConfigDict, PositiveInt

from hybridflow.runtime.algorithms.losses import actor_loss
from hybridflow.runtime.controller.batch import Batch
from hybridflow.runtime.controller.protocols import register
from hybridflow.runtime.controller.timing import timed, with_timing
from hybridflow.runtime.controller.worker import Worker
from hybridflow.runtime.engines.rollout.backends import ROLLOUT_ENGINES
from hybridflow.runtime.engines.rollout.base import RolloutEngine, RolloutSettings
from hybridflow.runtime.engines.train.base import build_train_engine
from hybridflow.runtime.workers.common import (
    EngineState,
    PhaseTiming,
    UpdateSettings,
    generation_seed,
    load_causal_lm,
    response_slice,
    rollout_fields,
    run_updates,
)
from hybridflow.runtime.workers.weight_source import WeightSource
from hybridflow.simulator.algorithms.settings import KLSettings, PolicyLossSettings
from hybridflow.simulator.errors import HflowError
from hybridflow.simulator.vocabulary.lora import LoraConfig


class PolicyObjective(BaseModel):
    """The actor's loss (passed whole): the policy loss, the KL to the reference, and the response
    budget a length-normalised aggregation divides by."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    loss: PolicyLossSettings = PolicyLossSettings()
    kl: KLSettings = KLSettings()
    norm_length: PositiveInt | None = None


class PolicyWorker(EngineState, PhaseTiming, WeightSource, Worker):
    def __init__(self, model_path: str, *, seed: int = 0, micro_batch_size: int | None = None,
                 temperature: float = 1.0, update: UpdateSettings | None = None,
                 objective: PolicyObjective | None = None, rollout: RolloutSettings | None = None,
                 lora: LoraConfig | None = None, micro_batch_tokens: int | None = None):
        """update: how the actor steps (None: the reference, never trained); objective: its loss;
        rollout: how it generates on its own devices (None: on separate rollout devices,
        workers/rollout.py, or not at all). temperature: the sampling temperature; every log-prob
        (old, reference, training) is taken from logits / temperature, the distribution the
        responses were drawn from (greedy, 0: at 1). lora: train adapters on the frozen model (seeded by
        `seed`); its base, adapters off, is then the reference (`compute_ref_log_prob`). micro_batch_tokens:
        sequence packing's token budget (the plan's, RolePlan.micro_batch_tokens)."""
        super().__init__()
        torch.manual_seed(seed)
        if update is not None and objective is None:
            raise HflowError("the actor needs its loss settings (PolicyObjective)")
        self.seed, self.model_path = seed, model_path
        self.update_settings, self.objective = update, objective
        self.engine = build_train_engine(load_causal_lm(model_path), self.parallel,
                                         optim=update.optim if update else None, micro_batch_size=micro_batch_size,
                                         temperature=temperature or 1.0, lora=lora, lora_seed=seed,
                                         micro_batch_tokens=micro_batch_tokens)
        self.micro_batch_size = micro_batch_size
        self.sampling = rollout.sampling if rollout else None
        self.rollout: RolloutEngine | None = None
        if rollout is not None:
            self.rollout = ROLLOUT_ENGINES.get(rollout.backend).on_trainer(self.engine, model_path, rollout,
                                                                           seed=seed)
        self._gen_version = -1  # engine step the generation weights were taken at

    # ---- rollout ------------------------------------------------------------------------------
    @register("ONE_TO_ALL")
    def generation_ranks(self) -> tuple[int, int]:
        """(generation data-parallel replica, generation tensor rank) of this rank."""
        return self.rollout.generation_ranks(self.rank)

    @register("ALL_TO_ALL")
    def generate(self, shard: Batch, iteration: int, greedy: bool = False, sample_round: int = 0) -> Batch:
        """Sample responses to this rank's prompt shard (`prompt_ids`/`prompt_mask`, left-padded);
        `sample_round`: dynamic sampling's later rounds of the same iteration draw fresh randomness."""
        timing: dict = {}
        if self._gen_version != self.engine.step:  # weights changed since the last switch
            with timed(timing, "reshard") as span:
                span[2] = float(self.rollout.update_weights())
            self._gen_version = self.engine.step
        replica, _ = self.generation_ranks()
        g = torch.Generator(device=self.device).manual_seed(generation_seed(self.seed, iteration, replica,
                                                                            sample_round))
        params = self.sampling.model_copy(update={"greedy": True}) if greedy else self.sampling
        with timed(timing, "generate_baseline" if greedy else "generate"):
            out = self.rollout.generate(shard["prompt_ids"].to(self.device), shard["prompt_mask"].to(self.device),
                                        params, g)
        return with_timing(Batch(rollout_fields(out)), timing)

    # ---- log-probs ----------------------------------------------------------------------------
    @register("DP_COMPUTE")
    def compute_log_prob(self, batch: Batch) -> Batch:
        """Log-probs of the response tokens under this policy: `old_log_probs` (actor) or `ref_log_probs`."""
        timing: dict = {}
        op = "actor_logprob" if self.role == "actor" else "ref_logprob"
        with timed(timing, op):
            width = batch["responses"].shape[1]  # only the responses' log-probs are read
            lp = self.engine.compute_log_probs(batch.select("input_ids", "attention_mask", "position_ids").tensors,
                                               self.micro_batch_size, score_width=width)["log_probs"]
        key = "old_log_probs" if self.role == "actor" else "ref_log_probs"
        return with_timing(Batch({key: response_slice(lp, width)}), timing)

    @register("DP_COMPUTE")
    def compute_ref_log_prob(self, batch: Batch) -> Batch:
        """`ref_log_probs` from this LoRA actor's base model (its adapters off): the reference of a LoRA plan."""
        if getattr(self.engine, "lora", None) is None:
            raise HflowError(f"role '{self.role}' has no LoRA adapters: its reference is a 'ref' model of its own")
        timing: dict = {}
        with timed(timing, "ref_logprob"), self.engine.base_policy():
            width = batch["responses"].shape[1]
            lp = self.engine.compute_log_probs(batch.select("input_ids", "attention_mask", "position_ids").tensors,
                                               self.micro_batch_size, score_width=width)["log_probs"]
        return with_timing(Batch({"ref_log_probs": response_slice(lp, width)}), timing)

    # ---- training -----------------------------------------------------------------------------
    def _loss_fn(self, outputs: dict, micro) -> tuple[torch.Tensor, dict]:
        width = micro["responses"].shape[1]
        logprobs = response_slice(outputs["log_probs"], width)
        # One epoch of one mini-batch: this forward's policy is the one that sampled, so its own
        # log-probs, detached, are the old ones (ratio 1, gradient of the plain policy gradient).
        old = micro["old_log_probs"] if "old_log_probs" in micro.keys() else logprobs.detach()
        entropy = outputs.get("entropy")
        obj = self.objective
        return actor_loss(logprobs, old, micro["advantages"], micro["response_mask"], obj.loss,
                          norm_length=obj.norm_length,
                          entropy=None if entropy is None else response_slice(entropy, width),
                          ref_logprobs=micro.get("ref_log_probs", None), kl=obj.kl,
                          behaviour_logprobs=micro.get("behaviour_log_probs", None))

    @register("DP_COMPUTE")
    def update(self, batch: Batch) -> list[dict]:
        """PPO epochs × mini-batches of optimizer steps on this rank's shard; [metrics] per dp rank.
        Without `old_log_probs` (one epoch of one mini-batch only) the update's own serve as the old ones."""
        up = self.update_settings
        if up is None:
            raise RuntimeError(f"role '{self.role}' is not trainable")
        if "old_log_probs" not in batch and (up.epochs > 1 or up.mini_batches > 1):
            raise HflowError(f"the actor update needs old_log_probs with {up.epochs} epochs × {up.mini_batches} "
                             "mini-batches (the policy moves between steps); run compute_log_prob first")
        timing: dict = {}
        keys = ["input_ids", "attention_mask", "position_ids", "responses", "response_mask", "advantages"]
        keys += [k for k in ("old_log_probs", "ref_log_probs", "behaviour_log_probs") if k in batch]
        # A token-mean loss weighs micro-batches by their response tokens; a mean over sequences by rows.
        loss = self.objective.loss
        weights = "response_mask" if loss.aggregation == "token-mean" else None
        with timed(timing, "actor_update"):
            metrics = run_updates(self.engine, batch.select(*keys), self._loss_fn, up, self.micro_batch_size,
                                  entropy=bool(loss.entropy_coef), token_weights=weights,
                                  score_width=batch["responses"].shape[1])
        return [with_timing(metrics, timing)]

    # ---- state --------------------------------------------------------------------------------
    @register("ONE_TO_ALL")
    def load(self, path: str) -> None:
        super().load(path)
        self._gen_version = -1  # reshard again before the next rollout
