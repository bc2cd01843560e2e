"""What one RLHF iteration processes."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, PositiveInt


class Workload(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    prompts: PositiveInt = 1024  # prompts per iteration (the paper's global batch)
    prompt_len: PositiveInt = 1024
    response_len: PositiveInt = 1024
    samples_per_prompt: PositiveInt = 1  # GRPO / RLOO draw several
    ppo_epochs: PositiveInt = 1
    mini_batches: PositiveInt = 1  # optimizer steps per epoch
    micro_batch_size: PositiveInt = 8  # sequences per device per forward/backward

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
