"""Pipelined execution modes on the unrolled dataflow: one-step-off (Plan.mode).

One step off, the rollout of batch k+1 runs on the actor's separate rollout devices while the
trainers score and train batch k. On the unrolled graph (dataflow.unroll: nodes (k, op)) that is
a rewiring of the actor's weight sync and generate of iteration k+1:

- they are issued in iteration k, right after its own generate (the runtime collects batch k,
  syncs, launches batch k+1, then trains on batch k): their call order and their Timeline
  iteration become k's;
- their weights are those after update k−1, not k: the edge from update k to them moves to
  update k−1 (staleness 1). The first look-ahead rollout (k+1 = 1) has no newer weights to wait
  for and needs no sync: that node goes;
- the controller waits for the sync (both sides of a collective) before it scores and trains
  batch k: those ops follow the sync.

The steady-state iteration is then sync + max(rollout, scoring and training): the overlapped part
counts once, the longer side's remainder is the bubble of the other. The first iteration, whose
rollout nothing overlaps, is a warm-up (Timeline meta `warmup_iterations`), as in a measured run.
"""

from __future__ import annotations

from collections.abc import Hashable

import networkx as nx

from .dataflow import Lanes, forget_order
from .errors import HflowError


def _actor_node(graph: nx.DiGraph, op: str) -> Hashable:
    found = [n for n, a in graph.nodes(data=True) if a["op"] == op and a["role"] == "actor"
             and not a.get("baseline") and not a.get("resampled")]
    if len(found) != 1:
        raise HflowError(f"one-step-off needs one actor '{op}' per iteration; the dataflow has {len(found)}")
    return found[0]


def one_step_off(graph: nx.DiGraph, lane_of: dict[Hashable, Lanes], big: nx.DiGraph,
                 big_lanes: dict[Hashable, Lanes], copies: int) -> None:
    """Rewire `big` (in place; `copies` unrolled copies of `graph`) for one-step-off, then drop the
    last copy's ops except its look-ahead rollout: `copies − 1` iterations remain, each with the
    rollout of the next batch inside it."""
    sync, gen = _actor_node(graph, "weight_sync"), _actor_node(graph, "generate")
    update = _actor_node(graph, "actor_update")
    for k in range(1, copies):
        s, g = (k, sync), (k, gen)
        for n in (s, g):
            big.remove_edges_from([((k - 1, update), n)])
        prev_order = big.nodes[(k - 1, gen)]["order"]
        big.nodes[g].update(order=prev_order + 0.2, iteration=k - 1)
        if k == 1:  # the first look-ahead: still the initial weights, nothing to sync
            big.remove_node(s)
            del big_lanes[s]
        else:
            big.nodes[s].update(order=prev_order + 0.1, iteration=k - 1)
            big.add_edge((k - 2, update), s)
    after_gen = [n for n, a in graph.nodes(data=True) if a["order"] > graph.nodes[gen]["order"]]
    for k in range(1, copies - 1):  # batch k's scoring and training wait for the sync of batch k+1
        big.add_edges_from(((k + 1, sync), (k, n)) for n in after_gen)
    last = copies - 1
    for n in [n for n in big if n[0] == last and n[1] not in (sync, gen)]:
        big.remove_node(n)
        del big_lanes[n]
    forget_order(big)
