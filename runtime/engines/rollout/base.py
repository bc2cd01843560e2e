"""The rollout interface: how the actor's worker generates, whichever engine does it.

A rollout engine is built on the actor's TrainingEngine (and so on its devices and process
group) in the plan's generation layout (tp_g, dp_g = world / tp_g):

    rollout.update_weights()                      # before the first generate and after every actor update
    out = rollout.generate(prompt_ids, mask, SamplingParams(...), generator)   # -> Rollout
    replica, tp_rank = rollout.generation_ranks(rank)   # which prompt shard this rank generates

Backends (the plan's `RolePlan.rollout`, or the run config's `rollout`):
- `native`: HybridEngine (hybrid.py) — the 3D-HybridEngine reshard into our own generation
  model, then the KV-cache engine of generation.py;
- `vllm`: VllmRollout (vllm_rollout.py) — vLLM in this process, the weights pushed through its
  weight-reload API.

Both return the same `Rollout`; the PolicyWorker hands its rows to the batch protocol the same
way. The old log-probs never come from a rollout: the actor's training engine recomputes them
(`compute_log_prob`) or its update takes its own, so both backends train on the same quantity.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import ClassVar

import torch

from hybridflow.runtime.engines.rollout.generation import Rollout, SamplingParams
from hybridflow.simulator.vocabulary.plan import RolloutBackend


class RolloutEngine(ABC):
    backend: ClassVar[RolloutBackend]

    @abstractmethod
    def update_weights(self) -> int:
        """Bring the generation weights up to the training engine's current ones (collective over the
        actor's group: every rank calls it). Returns the bytes this rank received."""

    @abstractmethod
    def generate(self, prompt_ids: torch.Tensor, attention_mask: torch.Tensor | None = None,
                 params: SamplingParams | None = None, generator: torch.Generator | None = None) -> Rollout:
        """Responses to left-padded prompts. The ranks of one generation replica pass the same prompts
        and an identically seeded generator, and all return the same rollout."""

    @abstractmethod
    def generation_ranks(self, rank: int) -> tuple[int, int]:
        """(generation data-parallel replica, generation tensor rank) of a rank of the actor's group."""
