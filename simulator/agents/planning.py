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

from hybridflow.simulator.agents.multiturn import price_rollout
from hybridflow.simulator.agents.workload import AgentWorkload
from hybridflow.simulator.pricing.op_cost import OpCost, op_cost

CONTEXT_BUCKET = 16  # re-prefilled context per row rounded up to this many tokens: turn prices memoized


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
