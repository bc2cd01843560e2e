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
from hybridflow.simulator.pricing.rollout_calls import StreamedRollout
from hybridflow.simulator.vocabulary.plan import stream_chunk_prompts

CONTEXT_BUCKET = 16  # re-prefilled context per row rounded up to this many tokens: turn prices memoized


class _TurnPrice:
    """multiturn.py's decode cost of one model turn as the wrapped cost model's `generate` of `rows`
    sequences, each re-prefilling its share of the context and decoding `steps` tokens."""

    def __init__(self, base, model, gen, workload, free, batch_cap, gather_every_step, drain_calls=False):
        self.base, self.model, self.gen, self.workload = base, model, gen, workload
        self.kw = {"free_bytes_per_device": free, "batch_cap": batch_cap, "gather_every_step": gather_every_step,
                   "drain_calls": drain_calls}
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


def async_chunks(prompts: int, staleness: int) -> int:
    """Conversation runners in flight at once in the async mode: the rollout devices refill only when idle,
    with `staleness` batches' prompt groups in chunks (runtime/rl/modes/streaming.py), each chunk a runner on
    a driver thread with its own tool pool (runtime/rl/rollout.py)."""
    return -(-staleness * prompts // stream_chunk_prompts(prompts))


class MultiTurnCostModel:
    """A cost model (any: the analytic one, a profile's) whose rollouts are conversations (`agent`).
    `staleness` > 0: the async mode's rollout, `staleness` batches at once by async_chunks runners, each
    batch's price their rollout's seconds / `staleness` (in_mode)."""

    def __init__(self, base, agent: AgentWorkload, staleness: int = 0):
        self.base, self.agent, self.staleness = base, agent, staleness
        self._prices: dict[tuple, OpCost] = {}
        self._modes: dict[int, MultiTurnCostModel] = {}

    def in_mode(self, mode: str, staleness: int) -> MultiTurnCostModel:
        """This model for a plan of `mode` (its rollouts run as that mode runs them: one runner, or the async
        mode's chunks)."""
        k = staleness if mode == "async" else 0
        if k == self.staleness:
            return self
        if k not in self._modes:
            self._modes[k] = MultiTurnCostModel(self.base, self.agent, k)
        return self._modes[k]

    def __getattr__(self, name):
        return getattr(self.base, name)

    def _rendered(self, workload):
        """`workload` with its prompts as the chat template renders them (AgentWorkload.prompt_tokens)."""
        n = self.agent.prompt_tokens
        return workload if n is None or n == workload.prompt_len else workload.model_copy(update={"prompt_len": n})

    def forward(self, model, head, parallel, workload, *args, **kwargs) -> OpCost:
        """The wrapped model's forward over the conversations' rows (their prompts as rendered)."""
        return self.base.forward(model, head, parallel, self._rendered(workload), *args, **kwargs)

    def train(self, model, head, parallel, workload, *args, **kwargs) -> OpCost:
        """The wrapped model's update over the conversations' rows (their prompts as rendered)."""
        return self.base.train(model, head, parallel, self._rendered(workload), *args, **kwargs)

    def generate(self, model, gen, workload, sequences: int | None = None, free_bytes_per_device: float | None = None,
                 batch_cap: int | None = None, gather_every_step: bool = False, drain_calls: bool = False) -> OpCost:
        """The rollout of `sequences` conversations: model turns (priced by the wrapped `generate`) and tool
        calls, under the runner's policy; its parts are `generate` (the model's turns) and `tool_wait`."""
        seqs = workload.sequences if sequences is None else sequences
        key = (model, gen, workload, seqs, free_bytes_per_device, batch_cap, gather_every_step, drain_calls)
        try:
            hit = self._prices.get(key)
        except TypeError:  # a workload holding a length distribution's lists: priced every time
            hit, key = None, None
        if hit is not None:
            return hit
        turn = _TurnPrice(self.base, model, gen, workload, free_bytes_per_device, batch_cap, gather_every_step,
                          drain_calls)
        k = max(self.staleness, 1)
        runners = async_chunks(workload.prompts, self.staleness) if self.staleness else 1
        rollout = self.agent.rollout(k * seqs, self._rendered(workload).prompt_len, workload.response_len, runners)
        total = (price_rollout(rollout, turn, draws=self.agent.draws) - turn.gap) / k
        no_tools = (price_rollout(rollout.model_copy(update={"tool_seconds": [0.0]}), turn, draws=self.agent.draws)
                    - turn.gap) / k
        hit = op_cost(0.0, 0.0, generate=min(no_tools, total), tool_wait=max(total - no_tools, 0.0))
        if key is not None:
            self._prices[key] = hit
        return hit


def agent_cost_model(cost_model, agent: AgentWorkload | None, cluster=None, mode: str = "sync", staleness: int = 1):
    """`cost_model` (None: the default for `cluster`) priced for `agent`'s conversations as a plan of `mode`
    and `staleness` runs them; unchanged without one."""
    if agent is None and not isinstance(cost_model, MultiTurnCostModel):
        return cost_model
    if cost_model is None:
        from hybridflow.simulator.calibration.gpu_fit import default_cost_model

        cost_model = default_cost_model(cluster)
    if not isinstance(cost_model, MultiTurnCostModel):
        cost_model = MultiTurnCostModel(cost_model, agent)
    return cost_model.in_mode(mode, staleness)


def rollout_cost_model(cost_model, agent: AgentWorkload | None, cluster=None, mode: str = "sync", staleness: int = 1,
                       partial_rollouts: bool = False):
    """`cost_model` with its rollout priced as a plan of `mode` makes it: conversations (`agent`: agent_cost_model),
    the `async` mode's calls one after another (pricing/rollout_calls.py; not with partial rollouts, whose round is
    one call), else unchanged (`cluster`: agent_cost_model's, for a None model). Both the planner and the simulator's
    schedule price a plan's rollout through it."""
    if agent is not None or isinstance(cost_model, MultiTurnCostModel):
        return agent_cost_model(cost_model, agent, cluster, mode, staleness)
    if isinstance(cost_model, StreamedRollout):  # the caller's choice, but for partial rollouts' one call per round
        return cost_model.base if partial_rollouts else cost_model
    return StreamedRollout(cost_model) if mode == "async" and not partial_rollouts else cost_model
