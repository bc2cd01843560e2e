"""The agent workload a plan is priced with: the conversations of an agent run as distributions of observed
values (turns, tokens per turn, tool seconds) and the runner's settings. A plan carries it (`Plan.agent`,
written by `search --agent-workload`), so `simulate` and `run` price that plan's rollout as multi-turn
(planning.py) as the search did. Kept apart from planning.py so that the plan's vocabulary can name it
without importing the pricing."""

from __future__ import annotations

import math

from pydantic import BaseModel, ConfigDict, Field, NonNegativeFloat, PositiveInt

from hybridflow.simulator.agents.multiturn import MultiTurnWorkload


class AgentWorkload(BaseModel):
    """The conversations of an agent run, as distributions of observed values (drawn uniformly): model turns
    per conversation, tokens the model generates per turn (None: the workload's response_len split over the
    turns), tokens a tool turn appends, tool seconds per call; and the runner's settings (the run config's
    `agent` section: tool_workers, overlap)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    turns: list[PositiveInt] = Field(min_length=1)
    tool_seconds: list[NonNegativeFloat] = Field(min_length=1)
    turn_tokens: list[PositiveInt] | None = None
    turn_tokens_by_turn: list[list[PositiveInt]] | None = None
    final_turn_tokens: list[PositiveInt] | None = None  # the answer turn's, when it differs from a call's
    turn_shares: list[dict[PositiveInt, NonNegativeFloat]] | None = None  # per observed rollout (multiturn.py)
    tool_turn_tokens: list[PositiveInt] = [16]
    tool_workers: PositiveInt = 4
    overlap: bool = True
    prefix_cache: bool = False
    driver_seconds_per_row: NonNegativeFloat = 0.0  # the runner's work between calls per conversation (multiturn.py)
    # a conversation's prompt as the chat template renders it with the tools' schemas, padded to the batch's
    # longest (what the engine prefills and the trainers train on; the plan's prompt_len counts the task's
    # prompt only); None: the plan's prompt_len
    prompt_tokens: PositiveInt | None = None
    draws: PositiveInt = 8  # event simulations averaged per price

    def rollout(self, conversations: int, prompt_tokens: int, response_len: int, runners: int = 1) -> MultiTurnWorkload:
        """multiturn.py's workload for one rollout of `conversations`, run by `runners` runners at once."""
        per_turn = self.turn_tokens or [max(1, response_len // max(self.turns))]
        return MultiTurnWorkload(conversations=conversations, prompt_tokens=prompt_tokens, turns=self.turns,
                                 turn_tokens=per_turn, turn_tokens_by_turn=self.turn_tokens_by_turn,
                                 final_turn_tokens=self.final_turn_tokens, turn_shares=self.turn_shares,
                                 tool_turn_tokens=self.tool_turn_tokens, tool_seconds=self.tool_seconds,
                                 tool_workers=self.tool_workers, overlap=self.overlap, prefix_cache=self.prefix_cache,
                                 driver_seconds_per_row=self.driver_seconds_per_row, runners=runners)

    @classmethod
    def from_means(cls, turns: float, generated_per_turn: float, tool_turn_tokens: float, tool_seconds_per_call: float,
                   final_turn_tokens: float | None = None, multi_turn_share: float | None = None,
                   tool_turn_call_share: float = 1.0, **settings) -> AgentWorkload:
        """A workload from a run's mean figures (its `agent/*` metrics), as 20-value distributions: one turn
        for 1 − `multi_turn_share` of the conversations (None: as few as the mean allows), the others the
        two integers around their mean, mixed to give it; a tool turn waits `tool_seconds_per_call` in
        `tool_turn_call_share` of them (the others called nothing: a malformed call), else nothing; the
        token counts as their means (`generated_per_turn` a calling turn's when `final_turn_tokens` gives
        the answer's). In lockstep a rollout waits for its longest conversation and slowest tool: the tails
        matter, not only the means."""
        n = 20
        multi = min(max(turns - 1.0, 0.0), 1.0) if multi_turn_share is None else min(max(multi_turn_share, 0.0), 1.0)
        singles = round(n * (1.0 - multi)) if turns > 1.0 else n
        rest = n - singles
        mix = [1] * singles
        if rest:
            cond = max(2.0, 1.0 + (turns - 1.0) * n / rest)  # the mean turns of the multi-turn conversations
            lo = math.floor(cond)
            k = round(rest * (cond - lo))
            mix += [lo] * (rest - k) + [lo + 1] * k
        calls = round(n * min(max(tool_turn_call_share, 0.0), 1.0))
        waits = [max(0.0, tool_seconds_per_call)] * calls + [0.0] * (n - calls) if calls else [0.0]
        final = None if final_turn_tokens is None else [max(1, round(final_turn_tokens))]
        return cls(turns=mix, turn_tokens=[max(1, round(generated_per_turn))], final_turn_tokens=final,
                   tool_turn_tokens=[max(1, round(tool_turn_tokens))], tool_seconds=waits, **settings)
