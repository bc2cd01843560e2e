"""Scoring per generate call (`Mechanics.score_per_call`): the unrolled graph's generation and its scoring split into
the calls the actor ranks really make, so the scoring interleaves with the generation.

OpenRLHF v0.2 (`RemoteExperienceMaker.make_experience`, trainer/ppo_utils/experience_maker.py at commit dbdd43b0 and
v0.2.5) has each actor rank, for every `micro_rollout_batch_size` batch of prompts, generate the batch (on vLLM engine
`rank % engines`; without vLLM, with HF generate on its own GPU), then send it to the reference, reward
and critic models (Ray calls to their actors, round-robin: actor rank r to rank r % n of a group of n;
launcher.py `async_fit_actor_model`) while it computes its own log-probs, and wait for all of them before it
generates its next batch. Its generation timer spans that whole loop (ppo_trainer.py `fit`), the scoring included.

What the schedule sees, per iteration, for R actor ranks and C calls per rank (the batch's prompts over R ranks of
`generation_batch` each):
- a rank's call on its engine: one op on that engine's lane (a lane per engine, "<group>#<engine>"), the share
  of the generate op its sequences are of the engine's (the op's price is one engine's share of the batch in
  calls one after another); without an engine group, the ranks' k-th calls as one op on the actor's lane (HF
  generate; at ZeRO-3 its gathers keep the ranks in step, at ZeRO-2 nothing does and the overlap between ranks
  that leaves is not priced);
- a scoring group of n ranks serves the ranks' requests in waves: its forward is a ZeRO collective over its n
  ranks, so the j-th request of each of its ranks (actor ranks j·n … j·n+n−1) runs as one op, the share of the
  op's price one rank's batch is of a group rank's share of the whole batch; the actor's own log-probs are one
  wave of all its ranks;
- a rank's next call waits for every wave that holds its batch; the ops after the scoring wait for all of it.
A group's lane takes its waves in call order, so a group shared by several ranks serves one rank's batch while
another rank generates.

The Timeline shows the ranks' k-th calls on an engine group as one `generate` event (`merge_rounds`), from the
first call's start to the last's end: its part `scores_awaited` is what that span adds to the busiest engine's
calls, the seconds that engine stands idle within the round because a rank was still waiting for its last batch's
scores.
So the op's seconds, summed over its events (compare's breakdown), are the group's, and show the interleaving.
"""

from __future__ import annotations

from collections.abc import Hashable

import networkx as nx

from hybridflow.simulator.schedule.dataflow import Lanes, forget_order
from hybridflow.simulator.vocabulary.plan import Plan
from hybridflow.simulator.vocabulary.timeline import Event

SCORING_OPS = ("actor_logprob", "ref_logprob", "values", "reward", "cost")  # the forwards on a call's batch


def engine_lane(group: str, engine: int, engines: int) -> str:
    return f"{group}#{engine}" if engines > 1 else group


def lane_group(lane: str) -> str:
    """The device group a lane belongs to (an engine's lane is its group's)."""
    return lane.split("#", 1)[0]


def calls_per_rank(plan: Plan) -> tuple[int, int]:
    """(actor ranks, generate calls per rank in one iteration)."""
    ranks = plan.roles["actor"].train.dp
    batch = plan.mechanics.generation_batch or 1
    return ranks, max(1, -(-plan.workload.sequences // (ranks * batch)))


def interleave_scoring(plan: Plan, big: nx.DiGraph, lanes: dict[Hashable, Lanes]) -> None:
    """Rewrite the unrolled graph `big` (in place; `lanes` too) into per-call ops (module docstring). Each new node
    keeps its op's attributes and adds `base` (the iteration's node it is a share of) and `share` (its fraction
    of that node's price); an engine's calls add `round` (the call)."""
    gens = [n for n, a in big.nodes(data=True) if a["op"] == "generate" and a["role"] == "actor"
            and not a.get("baseline") and "share" not in a]
    for g in gens:
        _split_iteration(plan, big, lanes, g)
    forget_order(big)


def _split_iteration(plan: Plan, big: nx.DiGraph, lanes: dict[Hashable, Lanes], g: Hashable) -> None:
    """One iteration's generate node `g` and the scoring forwards on its output, split into calls and waves."""
    actor = plan.roles["actor"]
    ranks, calls = calls_per_rank(plan)
    batch = plan.mechanics.generation_batch or 1
    seqs = plan.workload.sequences
    engines = 0  # without an engine group the ranks generate in step on the actor's devices
    if actor.generate_group:
        gen = plan.generation_config()
        engines = max(1, len(plan.group(actor.generate_group).devices) // (gen.tp * gen.pp))
    it = g[0]
    scorers = [s for s in big.successors(g) if big.nodes[s]["op"] in SCORING_OPS and s[0] == it
               and not big.nodes[s]["driver"]]
    order = big.nodes[g]["order"]
    slot = 1.0 / (calls * (1 + len(scorers)) + 1)  # sub-ops' call order, between generate's and the next op's
    preds = {n: [p for p in big.predecessors(n) if p != g] for n in (g, *scorers)}
    succs = {n: [s for s in big.successors(n) if s not in scorers] for n in (g, *scorers)}

    def add(base: Hashable, key: tuple, lane: Lanes, share: float, at: float) -> Hashable:
        node = (it, (base[1], *key))
        big.add_node(node, **{**big.nodes[base], "order": order + at * slot, "base": base[1], "share": share})
        lanes[node] = lane
        big.add_edges_from((p, node) for p in preds[base])
        big.add_edges_from((node, s) for s in succs[base])
        return node

    holding: list[list[Hashable]] = [[] for _ in range(ranks)]  # per rank: the waves that hold its last batch
    for k in range(calls):
        step = k * (1 + len(scorers)) + 1
        called_seqs = min(batch, seqs / ranks - k * batch)  # each rank's k-th call (the last may be short)
        if engines:
            called = {r: add(g, ("call", k, r), engine_lane(actor.generate_group, r % engines, engines),
                             called_seqs * engines / seqs, step) for r in range(ranks)}
            for node in called.values():
                big.nodes[node]["round"] = k
        else:
            one = add(g, ("call", k), lanes[g], called_seqs * ranks / seqs, step)
            called = dict.fromkeys(range(ranks), one)
        for r in range(ranks):
            big.add_edges_from((w, called[r]) for w in holding[r])
            holding[r] = []
        for i, s in enumerate(scorers):
            n = plan.roles[big.nodes[s]["role"]].train.dp
            waves = -(-ranks // n)
            for j in range(waves):
                members = range(j * n, min(ranks, (j + 1) * n))
                wave = add(s, ("call", k, "wave", j), lanes[s], called_seqs * n / seqs, step + i + 1 + j / (waves + 1))
                big.add_edges_from({(called[r], wave) for r in members})
                for r in members:
                    holding[r].append(wave)
    big.remove_nodes_from([g, *scorers])
    for n in (g, *scorers):
        lanes.pop(n, None)


SCORES_AWAITED = "scores_awaited"  # a round's span beyond one call's price (module docstring)


def merge_rounds(events: list[Event], rounds: list[tuple | None]) -> list[Event]:
    """`events` with each round made one event at its first member's place. `rounds`, per event: None, or (key,
    lane): the round (iteration, base node, call) and the engine's lane. The event spans the round's calls and sums
    their bytes and FLOPs; its parts are the busiest engine's calls' parts and `SCORES_AWAITED`, the rest of the
    span."""
    members: dict[tuple, list[int]] = {}
    for i, r in enumerate(rounds):
        if r is not None:
            members.setdefault(r[0], []).append(i)
    out = []
    for i, (e, r) in enumerate(zip(events, rounds, strict=True)):
        if r is None:
            out.append(e)
            continue
        idx = members[r[0]]
        if idx[0] != i:
            continue
        busy: dict[str, list[int]] = {}
        for j in idx:
            busy.setdefault(rounds[j][1], []).append(j)
        busiest = max(busy.values(), key=lambda js: sum(events[j].seconds for j in js))
        parts: dict[str, float] = {}
        for j in busiest:
            for p, v in events[j].breakdown.items():
                parts[p] = parts.get(p, 0.0) + v
        start, end = min(events[j].start for j in idx), max(events[j].end for j in idx)
        waited = max(0.0, (end - start) - sum(events[j].seconds for j in busiest))
        out.append(e.model_copy(update={"start": start, "end": end, "bytes": sum(events[j].bytes for j in idx),
                                        "flops": sum(events[j].flops for j in idx),
                                        "breakdown": {**parts, SCORES_AWAITED: waited}}))
    return out
