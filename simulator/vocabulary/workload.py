"""What one RLHF iteration processes."""

from __future__ import annotations

import math

from pydantic import BaseModel, ConfigDict, Field, PositiveInt


class Workload(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    prompts: PositiveInt = 1024  # prompts per iteration (the paper's global batch)
    prompt_len: PositiveInt = 1024
    response_len: PositiveInt = 1024
    samples_per_prompt: PositiveInt = 1  # GRPO / RLOO draw several
    ppo_epochs: PositiveInt = 1
    # Optimizer steps per epoch: common practice takes several per rollout batch (verl's examples:
    # mini-batches of 256 out of 1024 prompts).
    mini_batches: PositiveInt = 4
    micro_batch_size: PositiveInt = 8  # sequences per device per forward/backward
    # Dynamic sampling (DAPO): rounds of rollouts that may top up a batch whose groups were dropped,
    # and the fraction of groups the simulator expects each round to drop.
    max_sampling_rounds: PositiveInt = 3
    filter_rate: float = Field(0.5, ge=0.0, lt=1.0)

    @property
    def sequences(self) -> int:
        return self.prompts * self.samples_per_prompt

    @property
    def seq_len(self) -> int:
        return self.prompt_len + self.response_len

    @property
    def tokens_per_iteration(self) -> int:
        """The paper's throughput numerator: prompts × samples × (prompt + response length)."""
        return self.sequences * self.seq_len

    @property
    def expected_rollouts(self) -> float:
        """Rollouts per batch under dynamic sampling, in batches: each round regenerates the groups the
        last one dropped (a fraction `filter_rate` f of them), for at most R rounds: Σ_{k<R} f^k."""
        f, rounds = self.filter_rate, self.max_sampling_rounds
        return rounds if f == 1.0 else (1.0 - f**rounds) / (1.0 - f)

    def op_sequences(self, *, baseline: bool = False, resampled: bool = False) -> int:
        """Sequences an op processes: one per prompt for ReMax's greedy baseline, every sample otherwise,
        times the expected rollouts for a dynamically sampled generation (rounded up)."""
        seqs = self.prompts if baseline else self.sequences
        return math.ceil(seqs * self.expected_rollouts - 1e-9) if resampled else seqs
