"""What every role worker shares: loading models from HF folders, the sampling seed, the batch fields of
a rollout, the update loop, and a trained role's checkpoint, export and step-breakdown methods.

Workers time their own ops (controller/timing.py): `timed` around the op, `with_timing` on its output.
"""

from __future__ import annotations

from pathlib import Path

import torch
from pydantic import BaseModel, ConfigDict, PositiveInt

from hybridflow.runtime.controller.batch import Batch
from hybridflow.runtime.controller.protocols import register
from hybridflow.runtime.engines.train.base import TrainEngine
from hybridflow.runtime.engines.train.optim import OptimConfig
from hybridflow.runtime.models.decoder import CausalLM, ScoreModel
from hybridflow.runtime.models.hf_format import load_pretrained


class UpdateSettings(BaseModel):
    """How a trained role steps (passed whole): its optimizer, and the PPO epochs × mini-batches of
    optimizer steps each update takes over its shard of the batch."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    optim: OptimConfig = OptimConfig()
    epochs: PositiveInt = 1
    mini_batches: PositiveInt = 1


def generation_seed(seed: int, iteration: int, replica: int, sample_round: int = 0) -> int:
    """The sampling seed of one generation replica: the tp ranks of a replica draw the same tokens, a
    resumed run draws what a straight one would, dynamic sampling's later rounds draw afresh."""
    return seed * 1_000_003 + iteration * 1009 + replica + sample_round * 7_919_993


def rollout_fields(out) -> dict[str, torch.Tensor]:
    """A Rollout (engines/rollout/generation.py) as the batch fields the dataflow reads, on the CPU."""
    return {"input_ids": out.tokens.cpu(), "attention_mask": out.attention_mask.cpu(),
            "position_ids": out.position_ids.cpu(), "responses": out.response.cpu(),
            "response_mask": out.response_mask.cpu()}


def load_causal_lm(path: str | Path) -> CausalLM:
    return load_pretrained(path, head="lm")


def load_score_model(path: str | Path) -> ScoreModel:
    """A scalar-head model from a score-model folder, or from a policy folder: the policy's backbone with
    a zero-initialised head (values start at 0; the usual critic initialisation from the policy)."""
    return load_pretrained(path, head="scalar")


def response_slice(per_token: torch.Tensor, width: int) -> torch.Tensor:
    """The response columns of a [B, P+R] per-token tensor (aligned with input_ids)."""
    return per_token[:, -width:]


def run_updates(engine: TrainEngine, batch: Batch, loss_fn, update: UpdateSettings, micro_batch_size: int | None,
                entropy: bool = True, token_weights: str | None = "response_mask",
                score_width: int | None = None) -> dict[str, float]:
    """`update.epochs` passes over the local batch in `update.mini_batches` optimizer steps each (fixed order, so a
    resumed run repeats it exactly); returns the metrics averaged over the steps taken, and
    `skipped_steps`, the steps the engine skipped for a non-finite gradient. `token_weights`: the
    mask of a token-mean loss (micro-batches count by their share of its tokens); None for a loss
    that is a mean over sequences (they count by rows). `score_width`: the loss reads only the last
    columns of the LM outputs (FsdpEngine.train_step)."""
    td = batch.tensors
    parts = max(1, min(update.mini_batches, len(batch)))
    sums: dict[str, float] = {}
    steps = skipped = 0
    for _ in range(update.epochs):
        for mb in td.chunk(parts):
            m = engine.train_step(mb, loss_fn, micro_batch_size, token_weights=token_weights, entropy=entropy,
                                  score_width=score_width)
            if m.pop("skipped"):
                skipped += 1
                continue
            for k, v in m.items():
                sums[k] = sums.get(k, 0.0) + float(v)
            steps += 1
    return {**{k: v / steps for k, v in sums.items()}, "skipped_steps": float(skipped)}


class PhaseTiming:
    """The step breakdown's view into a worker's engine (tools/bench/step_breakdown.py): turn its phase
    clock (engines/phase_clock.py) on, then take the seconds and work per phase since the last take."""

    @register("ONE_TO_ALL")
    def time_phases(self, on: bool = True) -> None:
        self.engine.clock.enabled = on
        self.engine.clock.take()

    @register("ONE_TO_ALL")
    def take_phases(self) -> dict[str, float]:
        return self.engine.clock.take()


class EngineState:
    """Checkpoint, HF export and fingerprint of a worker's `self.engine` (a TrainEngine), under
    path/role. Mixed into the trained workers (actor, critic), which set `self.model_path` (the folder
    their weights came from), so they share one implementation."""

    @register("ONE_TO_ALL")
    def save(self, path: str) -> None:
        """Save under path/role; `path` is a local folder or a URL (runtime/controller/locations.py)."""
        from hybridflow.runtime.controller.locations import Location

        self.engine.save(f"{path}/{self.role}")
        if getattr(self.engine, "lora", None) is not None:  # LoRA: the adapters in peft's format too
            from hybridflow.runtime.models.hf_export import lora_targets
            from hybridflow.runtime.models.lora_files import ADAPTER_FOLDER, write_peft_adapter

            adapters = self.engine.adapter_tensors()  # a collective: every rank
            if self.rank == 0:
                write_peft_adapter(f"{path}/{self.role}/{ADAPTER_FOLDER}", adapters, self.engine.lora,
                                   lora_targets(self.engine), self.model_path)
        for folder in (f"{path}/{self.role}/dcp", f"{path}/{self.role}", path):  # the shards' names durable too
            Location(folder).sync()
        if self.rank == 0:  # the checkpoint carries its model's config and tokenizer (hf_export.py)
            from hybridflow.runtime.models.hf_export import copy_model_files

            copy_model_files(self.model_path, f"{path}/{self.role}")

    @register("ONE_TO_ALL")
    def export_hf(self, path: str) -> None:
        """Write the current weights as an HF folder at `path` (gathering is collective; rank 0 writes),
        with the config and tokenizer files of the folder the weights came from."""
        from hybridflow.runtime.models.hf_export import export_engine

        export_engine(self.engine, self.role, path, source=self.model_path, rank=self.rank)

    @register("ONE_TO_ALL")
    def load(self, path: str) -> None:
        self.engine.load(f"{path}/{self.role}")

    @register("ONE_TO_ALL")
    def fingerprint(self) -> str:
        return self.engine.fingerprint()
