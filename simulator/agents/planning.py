"""Multi-turn rollouts in the planner and the simulator's timeline: a cost model whose `generate` is the
price of a rollout of conversations (multiturn.py's event simulation), each model turn priced by the
wrapped cost model's own `generate` over the conversations ready then, re-prefilling their contexts.

    cm = MultiTurnCostModel(default_cost_model(cluster), AgentWorkload(turns=[1, 2, 3], tool_seconds=[0.5]))

Every other op is the wrapped model's, so a plan's timeline, the planner's search and its execution modes
all see the rollout's tool waits: in `sync` they sit on the iteration's critical path, in `one-step-off`
and `async` they overlap the actor's training — which is how tool latency moves the choice of mode and of
rollout devices.
"""

from __future__ import annotations

import math

from pydantic import BaseModel, ConfigDict, Field, NonNegativeFloat, PositiveInt

from hybridflow.simulator.agents.multiturn import MultiTurnWorkload, price_rollout
from hybridflow.simulator.pricing.op_cost import OpCost, op_cost

CONTEXT_BUCKET = 16  # re-prefilled context per row rounded up to this many tokens: turn prices memoized


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
    tool_turn_tokens: list[PositiveInt] = [16]
    tool_workers: PositiveInt = 4
    overlap: bool = True
    prefix_cache: bool = False
    draws: PositiveInt = 8  # event simulations averaged per price

    def rollout(self, conversations: int, prompt_tokens: int, response_len: int) -> MultiTurnWorkload:
        """multiturn.py's workload for one rollout of `conversations`."""
        per_turn = self.turn_tokens or [max(1, response_len // max(self.turns))]
        return MultiTurnWorkload(conversations=conversations, prompt_tokens=prompt_tokens, turns=self.turns,
                                 turn_tokens=per_turn, turn_tokens_by_turn=self.turn_tokens_by_turn,
                                 final_turn_tokens=self.final_turn_tokens,
                                 tool_turn_tokens=self.tool_turn_tokens, tool_seconds=self.tool_seconds,
                                 tool_workers=self.tool_workers, overlap=self.overlap, prefix_cache=self.prefix_cache)

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


class _TurnPrice:
    """multiturn.py's decode cost of one model turn as the wrapped cost model's `generate` of `rows`
    sequences, each re-prefilling its share of the context and decoding `steps` tokens."""

    def __init__(self, base, model, gen, workload, free, batch_cap, gather_every_step):
        self.base, self.model, self.gen, self.workload = base, model, gen, workload
        self.kw = {"free_bytes_per_device": free, "batch_cap": batch_cap, "gather_every_step": gather_every_step}
        self.memo: dict[tuple[int, int, int], float] = {}
        # each turn after the first is a call the driver makes once the last one's results (and tools) are in:
        # the single controller's dependent-call gap that a profile measures (the schedule prices the first's)
        self.gap = getattr(getattr(base, "overheads", None), "dispatch_seconds", 0.0)

    def seconds(self, rows: int, steps: int, prefill_tokens: int) -> float:
        ctx = CONTEXT_BUCKET * max(1, math.ceil(prefill_tokens / rows / CONTEXT_BUCKET))
        key = (rows, steps, ctx)
        hit = self.memo.get(key)
        if hit is None:
            w = self.workload.model_copy(update={"prompt_len": ctx, "response_len": steps, "response_lengths": None})
            hit = self.memo[key] = self.base.generate(self.model, self.gen, w, rows, **self.kw).seconds + self.gap
        return hit


class MultiTurnCostModel:
    """A cost model (any: the analytic one, a profile's) whose rollouts are conversations (`agent`)."""

    def __init__(self, base, agent: AgentWorkload):
        self.base, self.agent = base, agent
        self._prices: dict[tuple, OpCost] = {}

    def __getattr__(self, name):
        return getattr(self.base, name)

    def generate(self, model, gen, workload, sequences: int | None = None, free_bytes_per_device: float | None = None,
                 batch_cap: int | None = None, gather_every_step: bool = False) -> OpCost:
        """The rollout of `sequences` conversations: model turns (priced by the wrapped `generate`) and tool
        calls, under the runner's policy; its parts are `generate` (the model's turns) and `tool_wait`."""
        seqs = workload.sequences if sequences is None else sequences
        key = (model, gen, workload, seqs, free_bytes_per_device, batch_cap, gather_every_step)
        try:
            hit = self._prices.get(key)
        except TypeError:  # a workload holding a length distribution's lists: priced every time
            hit, key = None, None
        if hit is not None:
            return hit
        turn = _TurnPrice(self.base, model, gen, workload, free_bytes_per_device, batch_cap, gather_every_step)
        rollout = self.agent.rollout(seqs, workload.prompt_len, workload.response_len)
        total = price_rollout(rollout, turn, draws=self.agent.draws) - turn.gap
        no_tools = price_rollout(rollout.model_copy(update={"tool_seconds": [0.0]}), turn, draws=self.agent.draws) - turn.gap
        hit = op_cost(0.0, 0.0, generate=min(no_tools, total), tool_wait=max(total - no_tools, 0.0))
        if key is not None:
            self._prices[key] = hit
        return hit


def agent_cost_model(cost_model, agent: AgentWorkload | None, cluster=None):
    """`cost_model` (None: the default for `cluster`) priced for `agent`'s conversations; unchanged without one."""
    if agent is None:
        return cost_model
    if cost_model is None:
        from hybridflow.simulator.calibration.gpu_fit import default_cost_model

        cost_model = default_cost_model(cluster)
    return cost_model if isinstance(cost_model, MultiTurnCostModel) else MultiTurnCostModel(cost_model, agent)
