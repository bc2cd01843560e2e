"""The schedule simulation: when each op of a dataflow runs, given how long each takes.

The single controller issues ops in call order; ops on one device group (a lane) run one after
another in that order, ops on disjoint groups run concurrently, and no op starts before every
op it reads from has ended. That is list scheduling in program order — one pass over the call
order, O(ops + edges) — so the planner can call `schedule` for every candidate it prices.
`simulate` does the whole thing for a Plan: dataflow, lanes, prices, schedule → Timeline.

With a profiled cost model, `simulate` also leaves the single controller's gaps between calls
(simulator/calibration/profiled_cost.py: after an input the call waited for, after the previous call on the
same group), as a measured run's worker-timed ops show them; the planner's search and brute force
leave the same gaps (call_gaps), so a plan ranks at the seconds `simulate` gives it. Likewise they
price a device that runs while the rest of its node idles (schedule_shared, simulator/schedule/neighbours.py).
"""

from __future__ import annotations

from collections.abc import Hashable, Mapping

import networkx as nx

from hybridflow.simulator.algorithms import get_algorithm
from hybridflow.simulator.errors import HflowError
from hybridflow.simulator.schedule.dataflow import (
    DRIVER,
    Lanes,
    add_offload_ops,
    build_dataflow,
    call_order,
    lanes_tuple,
    unroll,
)
from hybridflow.simulator.schedule.neighbours import NodeShare, node_share, reprice
from hybridflow.simulator.schedule.per_call import interleave_scoring, lane_group, merge_rounds
from hybridflow.simulator.schedule.pipeline import (
    copies_needed,
    partial_rollout_workload,
    pipeline,
    priced_iterations,
    sync_period,
)
from hybridflow.simulator.vocabulary.execution import (
    check_partial_budget,
    needs_old_logprob_pass,
    partial_budgets,
)
from hybridflow.simulator.vocabulary.plan import Plan
from hybridflow.simulator.vocabulary.timeline import GENERATE_OPS, Event, Timeline


def schedule(graph: nx.DiGraph, lane_of: Mapping[Hashable, Lanes], seconds: Mapping[Hashable, float],
             gaps: Mapping[Hashable, tuple[float, float]] | None = None) -> dict[Hashable, tuple[float, float]]:
    """(start, end) of every op. Pure: reads the graph, the lane(s) each op occupies and its
    duration. An op that occupies several lanes (a weight broadcast between two groups) waits for
    all of them and holds all of them. `gaps` (optional, per op): the controller's (gap after an
    input it waited for, gap after the op before it on its lane) — the op starts no earlier than
    either."""
    free: dict[str, float] = {}
    times: dict[Hashable, tuple[float, float]] = {}
    ends: dict[Hashable, float] = {}
    for n, preds in _compiled(graph):  # the planner's hot path: plain dicts and tuples only
        lanes = lane_of[n]
        dur = seconds[n]
        if dur < 0:
            raise HflowError(f"op {n!r} has negative duration {dur}")
        after_input, after_lane = gaps[n] if gaps is not None and n in gaps else (0.0, 0.0)
        start = 0.0
        for p in preds:
            if ends[p] + after_input > start:
                start = ends[p] + after_input
        if isinstance(lanes, str):
            if lanes in free:
                start = max(start, free[lanes] + after_lane)
            free[lanes] = end = start + dur
        else:
            for lane in lanes:
                if lane in free:
                    start = max(start, free[lane] + after_lane)
            end = start + dur
            for lane in lanes:
                free[lane] = end
        ends[n] = end
        times[n] = (start, end)
    return times


SHARE_PASSES = 8  # schedule → reprice rounds at most; a fixed point comes within a few


def schedule_shared(graph: nx.DiGraph, lane_of: Mapping[Hashable, Lanes], seconds: Mapping[Hashable, float],
                    gaps: Mapping[Hashable, tuple[float, float]] | None = None, share: NodeShare | None = None
                    ) -> dict[Hashable, tuple[float, float]]:
    """`schedule`, with each op on devices re-priced by how much of its span the other devices of its
    node idle (simulator/schedule/neighbours.py; `share` None: `schedule` as is). Scheduled at the profile's
    speed, each op re-priced with the others where that schedule put them, scheduled again, until
    the spans stop moving (at most SHARE_PASSES rounds: the same figure wherever it is computed)."""
    times = schedule(graph, lane_of, seconds, gaps)
    if share is None:
        return times
    for _ in range(SHARE_PASSES):
        new = schedule(graph, lane_of, {**seconds, **reprice(times, lane_of, seconds, share)}, gaps)
        moved = max((abs(new[n][1] - times[n][1]) for n in new), default=0.0)
        times = new
        if moved <= 1e-12:
            break
    return times


def plan_share(plan: Plan, cost_model) -> NodeShare | None:
    """The plan's groups on their nodes and the cost model's alone_speedup (None: the term is off)."""
    overheads = getattr(cost_model, "overheads", None)
    speedup = overheads.alone_speedup if overheads is not None else 1.0
    return node_share(speedup, {g.name: g.devices for g in plan.groups}, plan.cluster.devices_per_node)


def _compiled(graph: nx.DiGraph) -> list[tuple[Hashable, tuple]]:
    """(op, its inputs) in call order, cached beside the call order."""
    order = call_order(graph)
    cached = graph.graph.get("_compiled")
    if cached is not None and cached[0] is order:
        return cached[1]
    pred = graph._pred
    out = [(n, tuple(pred[n])) for n in order]
    graph.graph["_compiled"] = (order, out)
    return out


def makespan(times: Mapping[Hashable, tuple[float, float]]) -> float:
    return max((e for _, e in times.values()), default=0.0) - min((s for s, _ in times.values()), default=0.0)


# ---- a Plan ---------------------------------------------------------------------------------
def plan_dataflow(plan: Plan, kl_in_reward: bool | None = None) -> tuple[nx.DiGraph, dict[Hashable, Lanes]]:
    """One iteration of the plan's dataflow and the device group(s) each op runs on. `kl_in_reward`:
    whether the run folds a KL penalty into the rewards (vocabulary/execution.py needs_old_logprob_pass); None: as
    the algorithm's default settings do."""
    actor = plan.roles["actor"]
    if kl_in_reward is None:
        kl_in_reward = get_algorithm(plan.algorithm).kl_in_reward
    graph = build_dataflow(plan.algorithm, plan.roles, reward_model="reward" in plan.roles,
                           cost_model="cost" in plan.roles, hybrid_engine=actor.generate_group is None,
                           old_logprob_pass=needs_old_logprob_pass(plan.workload, plan.reference_roles(), kl_in_reward),
                           ref_from_actor=plan.ref_from_actor)
    lane_of: dict[Hashable, Lanes] = {}
    for n, a in graph.nodes(data=True):
        if a["driver"]:
            lane_of[n] = DRIVER
        elif a.get("broadcast"):
            lane_of[n] = (actor.group, actor.generate_group)
        elif a["op"] in GENERATE_OPS and actor.generate_group:
            lane_of[n] = actor.generate_group
        else:
            lane_of[n] = plan.roles[a["role"]].group
    if plan.offload:
        add_offload_ops(graph, lane_of, set(plan.roles))
    return graph, lane_of


def price_dataflow(plan: Plan, graph: nx.DiGraph, cost_model=None, partial_rollout_tokens: int | None = None
                   ) -> dict[Hashable, object]:
    """The OpCost of every op of one iteration (cost.price_op; each distinct (op, role) once);
    `partial_rollout_tokens`: the async mode's rollout as partial rollouts' rounds (pipeline.partial_rollout_workload)."""
    from hybridflow.simulator.agents.planning import rollout_cost_model
    from hybridflow.simulator.calibration.gpu_fit import default_cost_model
    from hybridflow.simulator.pricing.cost import (
        price_op,  # the cost model prices; this module only schedules
    )

    # the rollout as the plan's mode makes it: conversations (`Plan.agent`, priced multi-turn unless the caller's
    # model already is), the async mode's calls in turn, or partial rollouts' one call per round
    partial = bool(partial_rollout_tokens) and plan.mode == "async"
    cm = rollout_cost_model(cost_model or default_cost_model(plan.cluster), plan.agent, mode=plan.mode,
                            staleness=plan.staleness, partial_rollouts=partial)
    cache: dict[tuple[str, str, bool], object] = {}
    out = {}
    for n, a in graph.nodes(data=True):
        key = (a["op"], a["role"], bool(a.get("baseline")), bool(a.get("resampled")))
        if key not in cache:
            priced = plan
            if partial and key[:2] == ("generate", "actor") and not key[2]:
                priced = plan.model_copy(update={"workload": partial_rollout_workload(plan.workload,
                                                                                      partial_rollout_tokens)})
            cache[key] = price_op(cm, priced, a["op"], a["role"], baseline=key[2], resampled=key[3])
        out[n] = cache[key]
    return out


def lane_names(plan: Plan) -> dict[str, str]:
    """Lane name → what it is (devices), for exports and tables."""
    out = {}
    for g in plan.groups:
        # Nodes that hold the same device indices collapse into one range: "nodes 0-15:0-7".
        by_node: dict[int, str] = {}
        for k in sorted({d.node for d in g.devices}):
            by_node[k] = _ranges(sorted(d.index for d in g.devices if d.node == k))
        runs: list[tuple[list[int], str]] = []
        for k, idx in by_node.items():
            if runs and runs[-1][1] == idx and runs[-1][0][-1] == k - 1:
                runs[-1][0].append(k)
            else:
                runs.append(([k], idx))
        where = ", ".join(f"node{'s' if len(ks) > 1 else ''}{_ranges(ks)}:{idx}" for ks, idx in runs)
        out[g.name] = f"{len(g.devices)} device{'s' if len(g.devices) > 1 else ''} ({where})"
    out[DRIVER] = "single controller (CPU)"
    return out


def _ranges(xs: list[int]) -> str:
    parts, i = [], 0
    while i < len(xs):
        j = i
        while j + 1 < len(xs) and xs[j + 1] == xs[j] + 1:
            j += 1
        parts.append(f"{xs[i]}" if i == j else f"{xs[i]}-{xs[j]}")
        i = j + 1
    return ",".join(parts)


def call_gaps(graph: nx.DiGraph, overheads) -> dict[Hashable, tuple[float, float]] | None:
    """Per op the controller's gaps (after an input, after the lane's previous op), from a profiled
    cost model's overheads (None: no gaps, the analytic model). Every call on a worker group pays
    them; the driver's own ops do not, nor does the hybrid engine's `generate`, which runs in the same
    call as the reshard before it (a rollout on devices of its own, after a weight sync, is a call of its own).
    An op submitted ahead (`queued`: pipeline.py's handed-over sync) waits for its inputs on the workers, as a
    queued call: the queued gap after them too."""
    if overheads is None or (overheads.dispatch_seconds == 0.0 and overheads.queued_call_seconds == 0.0):
        return None
    queued = overheads.queued_call_seconds
    pair = (overheads.dispatch_seconds, queued)
    in_reshard_call = any(a["op"] == "reshard" for _, a in graph.nodes(data=True))
    return {n: (queued, queued) if a.get("queued") else pair for n, a in graph.nodes(data=True)
            if not a["driver"] and not (a["op"] == "generate" and in_reshard_call)}


def simulate(plan: Plan, cost_model=None, iterations: int | None = None, kl_in_reward: bool | None = None,
             partial_rollout_tokens: int | None = None) -> Timeline:
    """The simulated Timeline of `iterations` iterations of `plan` (source="simulated"; None: one, or a
    pipelined plan's pipeline.priced_iterations); a pipelined mode (pipeline.py) adds a warm-up iteration
    before them. `partial_rollout_tokens`: an async run's partial-rollout budget (the run config's
    async_mode.partial_rollout_tokens)."""
    graph, lane_of = plan_dataflow(plan, kl_in_reward)
    costs = price_dataflow(plan, graph, cost_model, partial_rollout_tokens)
    pipelined = plan.mode != "sync"
    partial = plan.mode == "async" and bool(partial_rollout_tokens)
    k = sync_period(plan.staleness, partial_rollout_tokens if partial else None)
    if iterations is None:
        iterations = priced_iterations(k) if pipelined else 1
    copies = copies_needed(iterations, k) if pipelined else iterations
    big, big_lanes = unroll(graph, lane_of, copies)
    if pipelined:
        pipeline(graph, big, big_lanes, copies, k, handed_over=partial)
    elif plan.mechanics.score_per_call:
        interleave_scoring(plan, big, big_lanes)  # per_call.py: each call's scoring before the rank's next call
    gaps = call_gaps(big, getattr(cost_model, "overheads", None))
    # a node split into calls (per_call.py) is a `share` of its iteration node's (`base`) price
    cost_of = {n: (costs[a.get("base", n[1])], a.get("share", 1.0)) for n, a in big.nodes(data=True)}
    times = schedule_shared(big, big_lanes, {n: c.seconds * f for n, (c, f) in cost_of.items()}, gaps,
                            plan_share(plan, cost_model))
    events, rounds = [], []
    for n in call_order(big):
        a, (c, f) = big.nodes[n], cost_of[n]
        if a.get("lookahead"):  # priced beside the last trained batch, not one of the iterations (pipeline.py)
            continue
        start, end = times[n]
        events.append(Event(op=a["op"], role=a["role"], group="+".join(lane_group(x) for x in lanes_tuple(big_lanes[n])),
                            start=start, end=end, iteration=a["iteration"], bytes=c.bytes * f, flops=c.flops * f,
                            breakdown={p: v * f for p, v in c.breakdown.items()}))
        rounds.append(((n[0], a["base"], a["round"]), big_lanes[n]) if "round" in a else None)
    events = merge_rounds(events, rounds)
    return Timeline(
        source="simulated", events=events, tokens_per_iteration=plan.workload.tokens_per_iteration,
        meta={"algorithm": plan.algorithm, "iterations": iterations, "lanes": lane_names(plan),
              "makespan": makespan({n: t for n, t in times.items() if not big.nodes[n].get("lookahead")}),
              "mode": plan.mode, "staleness": k if pipelined else plan.staleness,
              "warmup_iterations": int(pipelined)},
    )


def pipeline_period(big: nx.DiGraph, times: Mapping[Hashable, tuple[float, float]], iterations: int,
                    staleness: int) -> float:
    """A pipeline's steady iteration from its scheduled graph, without building the Timeline (the
    planner's): the same figure as the simulated Timeline's `iteration_seconds()` — the mean seconds
    from one trained batch's end to the next over the last sync period (k iterations, one sync among
    them; the first ones after the warm-up still carry the pipeline filling). Fewer than k steady
    iterations: over all of them."""
    ends: dict[int, float] = {}
    for n, a in big.nodes(data=True):
        if a["op"] not in ("generate", "weight_sync") or a["role"] != "actor":  # rollouts run ahead
            ends[n[0]] = max(ends.get(n[0], 0.0), times[n][1])
    span = min(staleness, iterations)
    return (ends[iterations] - ends[iterations - span]) / span


def fastest_partial_budget(plan: Plan, cost_model=None, budgets: list[int] | None = None,
                           iterations: int | None = None,
                           name: str = "partial rollouts auto") -> tuple[int | None, dict[int | None, float]]:
    """The async plan's simulated iteration seconds (`simulate`'s `iterations`) without partial rollouts (key
    None) and with each budget (default partial_budgets), and the fastest of them (None: partial rollouts do not
    pay; a tie keeps the fewer rounds, the first priced). A plan that cannot run them (not async, k < 2) is one
    line naming the setting `name`."""
    check_partial_budget(plan, -(-plan.workload.response_len // 2), name)  # two rounds, the fewest: any at all
    budgets = partial_budgets(plan.workload.response_len, plan.staleness) if budgets is None else budgets
    seconds: dict[int | None, float] = {}
    for budget in [None, *budgets]:
        seconds[budget] = simulate(plan, cost_model, iterations, partial_rollout_tokens=budget).iteration_seconds()
    return first_fastest(seconds), seconds


def first_fastest(seconds: Mapping) -> Hashable:
    """The first key whose seconds are the least, to a rounding (budgets that leave the same side the longer one
    price alike but for the last bits: the first priced, the fewer rounds, is kept)."""
    least = min(seconds.values())
    return next(k for k, t in seconds.items() if t <= least * (1 + 1e-9))
