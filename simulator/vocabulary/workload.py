"""What one RLHF iteration processes."""

from __future__ import annotations

import math

from pydantic import BaseModel, ConfigDict, Field, PositiveInt, model_validator

from hybridflow.simulator.vocabulary.lengths import LengthDistribution


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
    # Response lengths as a distribution (vocabulary/lengths.py); None: every response is response_len
    # long. With one, response_len is the longest response allowed (memory is sized for it) and
    # defaults to the distribution's longest.
    response_lengths: LengthDistribution | None = None
    # A partial-rollout round's (simulator/schedule/pipeline.py partial_rollout_workload): the mean tokens a
    # sequence prefills — its prompt plus the tokens it continues from — where prompt_len is the mean context its
    # decode steps hold. None: prompt_len (every other workload).
    prefill_len: PositiveInt | None = None

    @model_validator(mode="before")
    @classmethod
    def _budget_from_lengths(cls, data):
        if isinstance(data, dict) and data.get("response_lengths") is not None and "response_len" not in data:
            dist = data["response_lengths"]
            dist = dist if isinstance(dist, LengthDistribution) else LengthDistribution.model_validate(dist)
            data = {**data, "response_lengths": dist, "response_len": dist.longest}
        return data

    @model_validator(mode="after")
    def _lengths_within_budget(self):
        if self.response_lengths is not None and self.response_lengths.longest > self.response_len:
            raise ValueError(f"response_lengths reach {self.response_lengths.longest} tokens, beyond response_len "
                             f"{self.response_len}: raise response_len or cap the distribution")
        return self

    @property
    def sequences(self) -> int:
        return self.prompts * self.samples_per_prompt

    @property
    def seq_len(self) -> int:
        return self.prompt_len + self.response_len

    @property
    def mean_response_len(self) -> float:
        """Tokens an average response really has: response_len without a distribution."""
        return float(self.response_len) if self.response_lengths is None else self.response_lengths.mean

    @property
    def kv_seq_len(self) -> int:
        """The context a generation slot is sized for: the whole sequence for fixed lengths; for a
        distribution the prompt plus the mean response (continuous batching frees a finished
        sequence's cache for the next one, so the cache holds sequences of mean length on average)."""
        if self.response_lengths is None:
            return self.seq_len
        return self.prompt_len + max(1, math.ceil(self.response_lengths.mean - 1e-9))

    def padded_per_batch(self, rows: int) -> Workload:
        """This workload as a system that pads each batch of `rows` rows, drawn in no order, to its own longest
        response sees it: every response the expected longest of `rows` (fixed lengths: unchanged)."""
        if self.response_lengths is None:
            return self
        width = max(1, round(self.response_lengths.expected_longest(rows)))
        return self.model_copy(update={"response_lengths": None, "response_len": width})

    def drawn_batch(self) -> Workload:
        """This workload with its responses as one iteration's batch holds them: the lengths its rollout is priced
        on (LengthDistribution.sample of its sequences, the longest among them), so the trainers are priced on the
        tokens the rollout made — a small batch's mean lies above the distribution's (its longest weighs 1/n).
        Fixed lengths: itself."""
        d = self.response_lengths
        if d is None:
            return self
        return self.model_copy(update={"response_lengths": _drawn(d, self.sequences)})

    @property
    def tokens_per_iteration(self) -> int:
        """The throughput numerator: the tokens really processed, prompts × samples × (prompt + mean response
        length). With fixed lengths, the paper's (prompt + response length)."""
        if self.response_lengths is None:
            return self.sequences * self.seq_len
        return round(self.sequences * (self.prompt_len + self.response_lengths.mean))

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


_DRAWN: dict[tuple, LengthDistribution] = {}


def _drawn(dist: LengthDistribution, n: int) -> LengthDistribution:
    """`dist.sample(n)` as observed lengths, cached (the planner prices the same batch for many layouts)."""
    key = (tuple(sorted(dist.quantiles.items())), n)
    if key not in _DRAWN:
        if len(_DRAWN) > 256:
            _DRAWN.clear()
        _DRAWN[key] = LengthDistribution(observed=dist.sample(n))
    return _DRAWN[key]
