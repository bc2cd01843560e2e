"""Pipelined execution modes on the unrolled dataflow: one-step-off and async with bound k (Plan.mode).

Both run the actor's rollout on devices of its own while the trainers score and train an earlier
batch; on the unrolled graph (dataflow.unroll: nodes (j, op), batch j) that is a rewiring of the
actor's weight sync and generate of each batch. With the staleness bound k (Plan.staleness: 1 for
one-step-off, max_staleness for async):

- batch j's rollout does not wait for update j−1: the rollout workers stream batch after batch
  into the queue (on their lane, one after another) while the trainers work through it;
- the weights move every k updates, not every update: the sync before batch j = 1 + m·k (m ≥ 1)
  carries the weights after update j−2 (the newest the trainers can hand over when batch j−1 is
  still to train), and batches j … j+k−1 are generated with them, so the last of them is k
  updates behind when it trains — the bound, never more. Batches 1 … k use the initial weights
  and need no sync. Syncing less often is what a larger k buys: the sync holds both sides (a
  collective spanning them), and its seconds are paid once per k iterations;
- the trainers hand the weights over right after the update they carry, before they score the
  next batch (those ops follow the sync), as the runtime does.

With partial rollouts (the async mode's `partial_rollout_tokens`) the weights move every iteration
(sync_period) and the rollout is a round of segments (partial_rollout_workload).

The steady iteration is then sync / k + max(rollout, scoring and training): the overlapped part
counts once, the faster side idles for the rest (the queue's bubble: the rollout waits for a free
slot, or the trainers for a batch). For k = 1 this is one-step-off exactly. As in a run's Timeline
(timeline.py), batch j's rollout is iteration j's — it runs during the ones before — and the sync
before it is iteration j − 1's, whose trainers wait for it; so an iteration's seconds are from one
trained batch's end to the next. The first iteration, whose rollout nothing overlaps, is a warm-up
(Timeline meta `warmup_iterations`). Of the rollouts past the last trained batch only the next one is
scheduled (its devices work beside the last batch's trainers, as in every iteration before) and none is
reported: nothing trained waits for them.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Hashable

import networkx as nx

from hybridflow.simulator.errors import HflowError
from hybridflow.simulator.schedule.dataflow import Lanes, forget_order
from hybridflow.simulator.vocabulary.lengths import LengthDistribution
from hybridflow.simulator.vocabulary.workload import Workload


def _actor_node(graph: nx.DiGraph, op: str) -> Hashable:
    found = [n for n, a in graph.nodes(data=True) if a["op"] == op and a["role"] == "actor"
             and not a.get("baseline") and not a.get("resampled")]
    if len(found) != 1:
        raise HflowError(f"a pipelined mode needs one actor '{op}' per iteration; the dataflow has {len(found)}")
    return found[0]


def copies_needed(iterations: int, staleness: int) -> int:
    """Unrolled copies for `iterations` steady iterations: + the warm-up, + the next batch's copy, for the
    weight sync the last trained batch's trainers hand over (its only op kept)."""
    return iterations + 2


def sync_period(staleness: int, partial_rollout_tokens: int | None = None) -> int:
    """Iterations between weight syncs, the k the pipeline is built with: the plan's bound; with partial
    rollouts 1. Each iteration of the runtime then first collects the whole last round (so a paused response
    goes on once per iteration, runtime/rl/modes/streaming.py) and syncs the newest weights before the next:
    the trainers wait for a round longer than their step, and the sync holds both sides every iteration —
    one-step-off's timing, with the rollout priced as the round (partial_rollout_workload)."""
    return 1 if partial_rollout_tokens else staleness


def priced_iterations(staleness: int) -> int:
    """Steady iterations a pipelined plan is priced over (`simulate`'s default and the planner's, so
    they agree): two sync periods, each with one sync in it."""
    return 2 * staleness


def is_sync_batch(j: int, staleness: int) -> bool:
    """Whether the weights move before batch j's rollout (see the module doc)."""
    return j >= 2 and (j - 1) % staleness == 0


def pipeline(graph: nx.DiGraph, big: nx.DiGraph, big_lanes: dict[Hashable, Lanes], copies: int,
             staleness: int, handed_over: bool = False) -> None:
    """Rewire `big` (in place; `copies` unrolled copies of `graph`) for a pipeline with staleness bound
    `staleness`, then drop the last copy but for the weight sync the last trained batch waits for and its
    rollout (marked `lookahead`): `copies − 2` trained iterations remain after the warm-up. The lookahead
    rollout is what the rollout devices run while the last trained batch trains, as in every steady
    iteration before it: without it those trainers would be priced with their neighbours idle
    (simulator/schedule/neighbours.py). It is scheduled, not reported (`simulate` leaves it out).
    `handed_over` (partial rollouts): each sync is submitted with the update it carries and queues behind it
    on the trainers and behind the round on the rollout devices (runtime/rl/rollout.py hand_over), so no
    driver round trip comes between them (marked `queued`: schedule.call_gaps)."""
    if staleness < 1:
        raise HflowError(f"a pipelined mode needs a staleness bound of at least 1, got {staleness}")
    sync, gen = _actor_node(graph, "weight_sync"), _actor_node(graph, "generate")
    update = _actor_node(graph, "actor_update")
    after_gen = [n for n, a in graph.nodes(data=True) if a["order"] > graph.nodes[gen]["order"]]
    period_sync = None
    for j in range(1, copies):
        s, g = (j, sync), (j, gen)
        big.remove_edges_from([((j - 1, update), s), ((j - 1, update), g)])
        prev_order = big.nodes[(j - 1, gen)]["order"]
        big.nodes[g].update(order=prev_order + 0.2)  # issued right after the rollout before it
        if is_sync_batch(j, staleness):
            big.nodes[s].update(order=prev_order + 0.1, iteration=j - 1, queued=handed_over)
            big.add_edge((j - 2, update), s)
            # the trainers hand over before they score batch j−1 (the controller waits for both sides)
            big.add_edges_from((s, (j - 1, n)) for n in after_gen if (j - 1, n) in big)
            period_sync = s
        else:  # generated with the weights of the last sync (the initial ones before the first)
            big.remove_node(s)
            del big_lanes[s]
            if period_sync is not None:
                big.add_edge(period_sync, g)
    for n in [n for n in big if n[0] == copies - 1 and n[1] not in (sync, gen)]:
        big.remove_node(n)
        del big_lanes[n]
    big.nodes[(copies - 1, gen)]["lookahead"] = True
    forget_order(big)


def partial_rollout_workload(workload: Workload, budget: int) -> Workload:
    """What one steady round of the async mode's generation decodes with partial rollouts of `budget` tokens
    (runtime/rl/partial_rollouts.py), per trained batch. A round is one call: the paused responses and new
    prompt groups filling the queue's room (runtime/rl/modes/streaming.py `refill`); each iteration trains a
    batch, which leaves a batch's room, and collects the last round whole, so in the steady state (the open
    groups fit the room the queue keeps for them) each round starts a batch's responses and continues the
    earlier ones': it decodes one batch's segments — each response cut into segments of at most `budget`
    tokens, one per round — the batch's lengths drawn as a generate call's (`LengthDistribution.sample`: the
    tail it meets). The same tokens, but none longer than the budget. A segment's prompt is its prompt plus
    the tokens before it, and the continued segments are the long ones, still decoding when the new short
    ones have ended: the prompt is widened by the prefix a decode step's rows hold on average over the
    round's steps (each step is priced at its rows' context), and the prefill is priced on the segments' own
    prompts (`prefill_len`: the prompt plus the mean prefix over the segments, the tokens the round re-prefills:
    the new prompts' none, the continued ones' theirs)."""
    dist = workload.response_lengths or LengthDistribution.fixed(workload.response_len)
    lengths = dist.sample(workload.sequences)
    segments = [(start, min(budget, n - start)) for n in lengths for start in range(0, n, budget)]
    counts = Counter(length for _, length in segments)
    steps = max(counts)
    starts = Counter()
    for start, length in segments:
        starts[length] += start
    prefix_sum, alive, step_prefixes = 0, 0, 0.0  # step j decodes the segments longer than j tokens
    for j in range(steps - 1, -1, -1):
        prefix_sum, alive = prefix_sum + starts[j + 1], alive + counts[j + 1]
        step_prefixes += prefix_sum / alive  # the mean prefix of step j's rows
    return Workload.model_validate({
        **workload.model_dump(exclude={"response_lengths", "response_len"}),
        "prompts": math.ceil(len(segments) / workload.samples_per_prompt - 1e-9),
        "prompt_len": workload.prompt_len + round(step_prefixes / steps),
        "prefill_len": workload.prompt_len + round(sum(starts.values()) / len(segments)),
        # the segments themselves (a call of as many rows draws exactly them), not a histogram read between bins
        "response_len": steps, "response_lengths": {"observed": [length for _, length in segments]}})
