"""The RLHF dataflows as graphs of ops: which model runs which op, and what waits for what.

A node is one op instance of one iteration ("generate", "ref_logprob", "reward_baseline", …)
with attributes `op` (a shared op name, timeline.OPS), `role` (the model that runs it, or
"driver"), `driver` (True when the single controller runs it itself: advantage estimation, a
rule-based reward or cost) and `order` (the driver's call order). Edges are data dependencies.
Sorting by `order` gives a topological order: the order in which the single controller issues
the calls (verl's ray_trainer loop), which is also the order ops of one colocation group run in.

The graph of an algorithm is not described here: `build_dataflow` runs the algorithm's own driver
loop (simulator/algorithms/, the one the runtime executes) against a recording dataflow
(algorithms/recording.py), so what is priced is what is run.

Old log-probs: with one PPO epoch of one mini-batch the policy that runs the update's forward is
still the one that sampled, so the update's own log-probs, detached, are the old ones (TRL and verl
do this) and the graph has no `actor_logprob` op — unless a KL penalty is folded into the rewards,
which needs them before the advantages (vocabulary/execution.py `needs_old_logprob_pass`, the runtime's rule too).

Weight sync before generation: the actor's 3D-HybridEngine `reshard` (train → generation layout
on the same devices) or, when generation runs on its own devices, a `broadcast` node (op
"weight_sync", `broadcast=True`) that occupies both the training and the generation group.
With offload, colocated models move their states to host while another model of their group
runs: `add_offload_ops` puts an `onload` before and an `offload` after each stretch of one
model's ops in a group.
"""

from __future__ import annotations

from collections.abc import Collection, Hashable, Iterable, Mapping

import networkx as nx

from hybridflow.simulator.algorithms import get_algorithm
from hybridflow.simulator.algorithms.recording import DRIVER, record_dataflow
from hybridflow.simulator.errors import HflowError
from hybridflow.simulator.vocabulary.roles import ROLES
from hybridflow.simulator.vocabulary.timeline import OFFLOAD_OPS, UPDATE_OPS

Lanes = str | tuple[str, ...]  # the device group(s) an op occupies


def build_dataflow(algorithm: str, roles: Iterable[str], *, reward_model: bool, cost_model: bool,
                   hybrid_engine: bool, offload: bool | Collection[str] = False,
                   placement: Iterable[Iterable[str]] | None = None, old_logprob_pass: bool = True,
                   ref_from_actor: bool = False) -> nx.DiGraph:
    """One iteration of `algorithm` as a DAG of op instances, recorded from its driver loop.

    roles: the models the plan has ("ref" may be missing: no KL term). reward_model/cost_model:
    False when the reward/cost is a rule-based function the driver runs. hybrid_engine: the actor
    generates on its training devices (reshard) rather than on a separate group (broadcast).
    offload: True (or a collection of roles) adds onload/offload ops around each stretch of a
    model's ops in its group; `placement` (lists of roles sharing devices) says which models
    share a group — by default all of them do. old_logprob_pass: False drops `actor_logprob` (the
    update's own log-probs serve as the old ones; see needs_old_logprob_pass). ref_from_actor: a LoRA
    actor computes the reference log-probs itself, adapters off (vocabulary/lora.py).
    """
    algo = get_algorithm(algorithm)
    roles = set(roles)
    unknown = roles - set(ROLES)
    if unknown:
        raise HflowError(f"unknown role(s) {', '.join(sorted(unknown))}; roles are {', '.join(ROLES)}")
    try:
        algo.check_roles(roles, {s: "function" for s in algo.scores})  # rule-based scores are always possible here
    except ValueError as e:
        raise HflowError(str(e)) from None
    g = record_dataflow(algo, roles, reward_model=reward_model, cost_model=cost_model, hybrid_engine=hybrid_engine,
                        old_logprob_pass=old_logprob_pass, ref_from_actor=ref_from_actor)
    if offload:
        which = set(ROLES) if offload is True else set(offload)
        groups = [list(p) for p in placement] if placement is not None else [sorted(roles)]
        lane_of = {}
        for i, members in enumerate(groups):
            for n, a in g.nodes(data=True):
                if not a["driver"] and a["role"] in members:
                    lane_of[n] = f"g{i}"
        for n in g.nodes:
            lane_of.setdefault(n, DRIVER)
        add_offload_ops(g, lane_of, which)
    return g


def call_order(graph: nx.DiGraph) -> list[Hashable]:
    """The driver's call order: a topological order that follows the `order` attribute (insertion
    order where it is missing). Cached on the graph (keyed by its node count: counting edges costs
    more than the schedule); after adding edges to a built graph, call `forget_order(graph)`."""
    key = len(graph)
    cached = graph.graph.get("_call_order")
    if cached is not None and cached[0] == key:
        return cached[1]
    index = {n: i for i, n in enumerate(graph.nodes)}
    try:
        order = list(nx.lexicographical_topological_sort(
            graph, key=lambda n: (graph.nodes[n].get("order", index[n]), index[n])))
    except nx.NetworkXUnfeasible:
        raise HflowError("the dataflow has a cycle; an op cannot wait for its own output") from None
    graph.graph["_call_order"] = (key, order)
    return order


def lanes_tuple(lanes: Lanes) -> tuple[str, ...]:
    return (lanes,) if isinstance(lanes, str) else tuple(lanes)


def add_offload_ops(graph: nx.DiGraph, lane_of: dict[Hashable, Lanes], roles: Collection[str]) -> None:
    """Insert onload/offload ops (in place) around each stretch of one model's ops in a lane.

    A lane's model ops are taken in call order and cut where the model changes; a model that
    is alone in its lane is never idle for someone else and is not moved. The lane's sequence
    is read cyclically (the steady state of many iterations): when the iteration ends with the
    model it starts with, that model stays on the devices across the boundary.
    """
    order = call_order(graph)
    by_lane: dict[str, list[Hashable]] = {}
    for n in order:
        a = graph.nodes[n]
        lanes = lanes_tuple(lane_of[n])
        if a["driver"] or len(lanes) != 1 or a["op"] in OFFLOAD_OPS:
            continue  # the broadcast spans two groups; the model is on both already
        by_lane.setdefault(lanes[0], []).append(n)
    for lane, seq in by_lane.items():
        stretches: list[list[Hashable]] = []
        for n in seq:
            if stretches and graph.nodes[stretches[-1][-1]]["role"] == graph.nodes[n]["role"]:
                stretches[-1].append(n)
            else:
                stretches.append([n])
        if len(stretches) < 2:
            continue
        wraps = graph.nodes[stretches[0][0]]["role"] == graph.nodes[stretches[-1][-1]]["role"]
        prev_off = None
        for i, stretch in enumerate(stretches):
            role = graph.nodes[stretch[0]]["role"]
            first, last = stretch[0], stretch[-1]
            if role not in roles:
                prev_off = None
                continue
            if not (wraps and i == 0):
                on = f"onload_{role}_{lane}_{i}"
                graph.add_node(on, op="onload", role=role, driver=False, order=graph.nodes[first]["order"] - 0.25)
                graph.add_edge(on, first)
                if prev_off is not None:
                    graph.add_edge(prev_off, on)
                lane_of[on] = lane
            prev_off = None
            if not (wraps and i == len(stretches) - 1):
                off = f"offload_{role}_{lane}_{i}"
                graph.add_node(off, op="offload", role=role, driver=False, order=graph.nodes[last]["order"] + 0.25)
                graph.add_edge(last, off)
                lane_of[off] = lane
                prev_off = off
    forget_order(graph)


def forget_order(graph: nx.DiGraph) -> None:
    """Drop the cached call order (and the schedule's compiled form) after changing a graph."""
    graph.graph.pop("_call_order", None)
    graph.graph.pop("_compiled", None)


def unroll(graph: nx.DiGraph, lane_of: Mapping[Hashable, Lanes], iterations: int
           ) -> tuple[nx.DiGraph, dict[Hashable, Lanes]]:
    """`iterations` copies of one iteration, nodes (iteration, node). A trained model's update in
    iteration k precedes all of its ops in k+1 (they need the new weights); the lanes and the
    driver's call order carry on across iterations."""
    if iterations < 1:
        raise HflowError(f"iterations must be at least 1, got {iterations}")
    order = call_order(graph)
    span = len(order)
    rank = {n: i for i, n in enumerate(order)}
    out = nx.DiGraph(**{k: v for k, v in graph.graph.items() if not k.startswith("_")})  # no stale caches
    lanes: dict[Hashable, Lanes] = {}
    updates = {a["role"]: n for n, a in graph.nodes(data=True) if a["op"] in UPDATE_OPS}
    for it in range(iterations):
        for n in order:
            out.add_node((it, n), **{**graph.nodes[n], "order": it * span + rank[n], "iteration": it})
            lanes[(it, n)] = lane_of[n]
        out.add_edges_from(((it, u), (it, v)) for u, v in graph.edges)
        if it:
            for n, a in graph.nodes(data=True):
                if a["role"] in updates:
                    out.add_edge((it - 1, updates[a["role"]]), (it, n))
    return out, lanes
