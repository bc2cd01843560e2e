"""ValueWorker: one implementation for every scalar-head role.

- `critic` / `cost_critic`: per-token values of the response (trained with the clipped value loss
  on the returns of the reward / the cost);
- `reward` / `cost`: a reward or cost model scoring each whole sequence at its last real token.

A critic built from a policy folder takes the policy's backbone and a zero-initialised value head;
reward and cost models load their own HF folders (their family's *ForSequenceClassification).
"""

from __future__ import annotations

import torch

from hybridflow.runtime.algorithms.losses import value_loss
from hybridflow.runtime.controller.batch import Batch
from hybridflow.runtime.controller.protocols import register
from hybridflow.runtime.controller.timing import timed, with_timing
from hybridflow.runtime.controller.worker import Worker
from hybridflow.runtime.engines.train.base import build_train_engine
from hybridflow.runtime.models.decoder import last_token_values
from hybridflow.runtime.workers.common import (
    EngineState,
    PhaseTiming,
    UpdateSettings,
    load_score_model,
    run_updates,
)
from hybridflow.simulator.algorithms.settings import ValueLossSettings
from hybridflow.simulator.vocabulary.lora import LoraConfig


class ValueWorker(EngineState, PhaseTiming, Worker):
    def __init__(self, model_path: str, *, seed: int = 0, micro_batch_size: int | None = None,
                 update: UpdateSettings | None = None, value_loss: ValueLossSettings | None = None,
                 lora: LoraConfig | None = None, micro_batch_tokens: int | None = None):
        """update: how a critic steps (None: a reward or cost model, never trained); value_loss: the
        critic's objective; micro_batch_tokens: sequence packing's token budget (the plan's)."""
        super().__init__()
        torch.manual_seed(seed)
        self.model_path = model_path
        self.engine = build_train_engine(load_score_model(model_path), self.parallel,
                                         optim=update.optim if update else None, micro_batch_size=micro_batch_size,
                                         lora=lora, lora_seed=seed, micro_batch_tokens=micro_batch_tokens)
        self.micro_batch_size = micro_batch_size
        self.update_settings, self.value_loss = update, value_loss or ValueLossSettings()

    def _values(self, batch: Batch):
        return self.engine.compute_values(batch.select("input_ids", "attention_mask", "position_ids").tensors,
                                          self.micro_batch_size)["values"]

    @register("DP_COMPUTE")
    def compute_values(self, batch: Batch) -> Batch:
        """V(s_t) for each response token t: the value at the position just before it."""
        timing: dict = {}
        with timed(timing, "values"):
            width = batch["responses"].shape[1]
            values = self._values(batch)[:, -width - 1:-1]
        return with_timing(Batch({"values": values}), timing)

    @register("DP_COMPUTE")
    def compute_scores(self, batch: Batch) -> Batch:
        """One score per sequence (reward or cost model): `{role}_scores` [B]."""
        timing: dict = {}
        with timed(timing, self.role):
            scores = last_token_values(self._values(batch), batch["attention_mask"])
        return with_timing(Batch({f"{self.role}_scores": scores}), timing)

    def _loss_fn(self, outputs: dict, micro):
        width = micro["responses"].shape[1]
        return value_loss(outputs["values"][:, -width - 1:-1], micro["values"], micro["returns"],
                          micro["response_mask"], self.value_loss.clip)

    @register("DP_COMPUTE")
    def update(self, batch: Batch) -> list[dict]:
        timing: dict = {}
        keys = ["input_ids", "attention_mask", "position_ids", "responses", "response_mask", "values", "returns"]
        with timed(timing, "critic_update"):
            metrics = run_updates(self.engine, batch.select(*keys), self._loss_fn, self.update_settings,
                                  self.micro_batch_size)
        return [with_timing(metrics, timing)]

