"""The price of a multi-turn rollout: conversations of several model turns with tool calls between them.

What it costs (runtime/agents/conversation.py is what runs): each model turn is a `generate` call over
the batch of conversations ready at that moment, re-prefilling each one's whole context (the native
engine keeps no cache between calls; an engine with prefix caching re-prefills only the new turn:
`prefix_cache`), then decoding the turn's tokens; each tool call takes its latency on one of
`tool_workers` threads. In lockstep (`overlap` False) every turn waits for all of the previous turn's
tools; with overlap the engine decodes whichever conversations are ready while the others wait on tools.

The inputs are distributions, as measured: turns per conversation, generated tokens per turn (overall
or per turn index), tokens a
tool turn appends, tool latency (a probe on the user's tools: runtime/measure/agent_probe.py) and the cost of
one `generate` call as a linear model of its work (`DecodeCost`, fitted to timed calls), and the runner's own
work between calls per conversation (`driver_seconds_per_row`). The iteration's
rollout seconds are the mean of an event simulation of that policy over `draws` random draws.
"""

from __future__ import annotations

import heapq
import random
from dataclasses import dataclass, field

from pydantic import BaseModel, ConfigDict, Field, NonNegativeFloat, PositiveInt


class DecodeCost(BaseModel):
    """Seconds of one generate call over `rows` conversations: fixed + per_step·steps +
    per_row_step·rows·steps + per_prefill_token·(tokens re-prefilled)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    fixed: NonNegativeFloat = 0.0
    per_step: NonNegativeFloat = 0.0
    per_row_step: NonNegativeFloat = 0.0
    per_prefill_token: NonNegativeFloat = 0.0

    def seconds(self, rows: int, steps: int, prefill_tokens: int) -> float:
        return self.fixed + self.per_step * steps + self.per_row_step * rows * steps + \
            self.per_prefill_token * prefill_tokens


class MultiTurnWorkload(BaseModel):
    """Distributions as lists of observed values (drawn uniformly): turns per conversation, tokens per
    model turn, tokens per tool turn, tool seconds per call."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    conversations: PositiveInt
    prompt_tokens: PositiveInt
    turns: list[PositiveInt] = Field(min_length=1)
    turn_tokens: list[PositiveInt] = Field(min_length=1)
    tool_turn_tokens: list[PositiveInt] = Field(min_length=1)
    tool_seconds: list[NonNegativeFloat] = Field(min_length=1)
    # per turn index (the k-th list for the k-th model turn, the last for later ones): a model's first
    # turn (a tool call) and its last (an answer) differ in length; None: `turn_tokens` for every turn
    turn_tokens_by_turn: list[list[PositiveInt]] | None = None
    # a conversation's last turn (its answer, no call), when it differs from the turns that call a tool
    final_turn_tokens: list[PositiveInt] | None = None
    # per observed rollout, its shares of conversations by turn count; each draw takes one rollout's shares
    # (None: every conversation draws from `turns`): how many tool calls a rollout makes varies from rollout to
    # rollout more than independent draws say, and with a pool of tool workers smaller than a wave that
    # decides whether a second wave of tools comes
    turn_shares: list[dict[PositiveInt, NonNegativeFloat]] | None = None
    tool_workers: PositiveInt = 4
    overlap: bool = True
    prefix_cache: bool = False
    # the runner's own work between two calls (decoding and parsing the last call's turns, rendering the tool
    # turns through the chat template) per conversation of either call: measured by the runner; paid too for
    # every conversation before the first call (its prompt rendered) and for the last call's after it
    driver_seconds_per_row: NonNegativeFloat = 0.0
    # conversation runners in flight at once, the conversations split between them, each with its own pool of
    # `tool_workers` and its own calls, the calls of all of them one at a time on the engine (the async mode
    # launches a batch as chunks, each a runner on a driver thread: runtime/rl/rollout.py)
    runners: PositiveInt = 1


@dataclass
class _Conv:
    turns: int
    context: int
    done_turns: int = 0
    new_context: int = 0  # tokens since the last prefill (what a prefix cache would re-prefill)


def _turn_lengths(w: MultiTurnWorkload, turn: int, last: bool = False) -> list[int]:
    if last and w.final_turn_tokens:
        return w.final_turn_tokens
    if not w.turn_tokens_by_turn:
        return w.turn_tokens
    return w.turn_tokens_by_turn[min(turn, len(w.turn_tokens_by_turn) - 1)]


def _rollout_turns(w: MultiTurnWorkload, rng: random.Random) -> list[int]:
    """Turns of each conversation of one draw: one observed rollout's shares (`turn_shares`), else independent
    draws from `turns`."""
    if not w.turn_shares:
        return [rng.choice(w.turns) for _ in range(w.conversations)]
    shares = rng.choice(w.turn_shares)
    turns = [k for k, share in sorted(shares.items()) for _ in range(round(share * w.conversations))]
    while len(turns) < w.conversations:  # rounding: the rest drawn by the shares
        turns.append(rng.choices(list(shares), weights=list(shares.values()))[0])
    turns = turns[:w.conversations]
    rng.shuffle(turns)
    return turns


@dataclass
class _Runner:
    """One conversation runner: its conversations' state, its tool pool and its own clock (its thread)."""

    ready: set[int]
    workers_free: int
    clock: float = 0.0
    last_rows: int = 0  # conversations in its previous call (0: none yet)
    tools: list[tuple[float, int]] = field(default_factory=list)  # (finish time, conversation): running tool calls
    queue: list[int] = field(default_factory=list)  # waiting for a tool worker

    def busy(self) -> bool:
        return bool(self.ready or self.tools or self.queue)

    def calls_next(self, overlap: bool) -> bool:
        return bool(self.ready) and (overlap or not (self.tools or self.queue))

    def next_event(self, overlap: bool) -> float:
        return self.clock if self.calls_next(overlap) else max(self.clock, self.tools[0][0])


def simulate_rollout(w: MultiTurnWorkload, cost: DecodeCost, seed: int = 0) -> float:
    """Seconds of one multi-turn rollout under the runner's policy, for one random draw. `cost`: anything
    with DecodeCost's `seconds(rows, steps, prefill_tokens)` (planning.py prices a turn with a cost model).
    With several `runners` each acts on its own clock in the order of their next events; a call waits for
    the engine (the runtime's lock) when another runner's call holds it."""
    rng = random.Random(seed)
    convs = [_Conv(t, w.prompt_tokens, new_context=w.prompt_tokens) for t in _rollout_turns(w, rng)]
    n = len(convs)
    share = [n * k // w.runners for k in range(w.runners + 1)]  # contiguous chunks, as the runtime launches them
    # before its first call a runner renders each of its conversations' prompts through the chat template and
    # tokenises it: the runner's work per conversation, as between calls
    runners = [_Runner(set(range(share[k], share[k + 1])), w.tool_workers,
                       clock=w.driver_seconds_per_row * (share[k + 1] - share[k])) for k in range(w.runners)]
    engine_free = 0.0

    def start_tools(r: _Runner, t: float):
        while r.queue and r.workers_free:
            r.workers_free -= 1
            heapq.heappush(r.tools, (t + rng.choice(w.tool_seconds), r.queue.pop(0)))

    while any(r.busy() for r in runners):
        r = min((r for r in runners if r.busy()), key=lambda r: r.next_event(w.overlap))
        if r.calls_next(w.overlap):
            batch = sorted(r.ready)
            r.ready.clear()
            gen = {i: rng.choice(_turn_lengths(w, convs[i].done_turns, convs[i].done_turns + 1 == convs[i].turns))
                   for i in batch}
            prefill = sum(convs[i].new_context if w.prefix_cache else convs[i].context for i in batch)
            if r.last_rows:
                r.clock += w.driver_seconds_per_row * (r.last_rows + len(batch))
            r.last_rows = len(batch)
            r.clock = engine_free = max(r.clock, engine_free) + cost.seconds(len(batch), max(gen.values()), prefill)
            for i in batch:
                c = convs[i]
                c.context += gen[i]
                c.new_context = gen[i]
                c.done_turns += 1
                if c.done_turns < c.turns:
                    r.queue.append(i)
            start_tools(r, r.clock)
            continue
        # the runner wakes on the first tool done: with the engine idle (overlap) that one conversation alone
        # is decoded next (the others of its wave land a moment later, during that call); tools done while
        # the engine was busy are all ready together
        idle = w.overlap and r.tools[0][0] > r.clock
        r.clock = max(r.clock, r.tools[0][0])
        while r.tools and r.tools[0][0] <= r.clock:
            _, i = heapq.heappop(r.tools)
            r.workers_free += 1
            extra = rng.choice(w.tool_turn_tokens)
            convs[i].context += extra
            convs[i].new_context += extra
            r.ready.add(i)
            if idle:
                break
        start_tools(r, r.clock)
    # after its last call a runner decodes and parses that call's turns (and builds the batch)
    return max(r.clock + w.driver_seconds_per_row * r.last_rows for r in runners)


def price_rollout(w: MultiTurnWorkload, cost: DecodeCost, draws: int = 20, seed: int = 0) -> float:
    """Mean seconds of a multi-turn rollout over `draws` draws of its distributions."""
    return sum(simulate_rollout(w, cost, seed + k) for k in range(draws)) / draws
