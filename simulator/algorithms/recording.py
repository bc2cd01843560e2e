"""The simulator's dataflow: run an algorithm's loop against a recorder that writes down each op it calls.

Where the runtime's Dataflow calls a worker group, the recorder adds a node to a graph: the op
(timeline.OPS), the role that runs it (or "driver"), whether the single controller runs it itself
(`driver`: advantages, rule-based scores) and its call order (`order`). What a loop holds in place
of a batch or a pending call is a `Recorded`: the nodes its data comes from, so an op's inputs
become its graph edges. The recorder follows the runtime's rules for which calls happen (a role
the plan lacks is not called, the old-log-prob pass only when needed) and in which order (score
models are called before rule-based scores run on the driver), so the graph is what a run does.

Node names are the op's name (`generate`, `advantage`, …); a second node of one op takes a suffix:
`_baseline` for ReMax's greedy pass and its reward, `@role` for another role (`values@cost_critic`).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import networkx as nx

from hybridflow.simulator.algorithms.registry import Algorithm
from hybridflow.simulator.vocabulary.roles import CRITIC_OF

DRIVER = "driver"  # the lane and role of controller-side work


@dataclass(frozen=True)
class Recorded:
    """A batch or a pending call in a recorded loop: the graph nodes its data comes from."""

    nodes: frozenset[str] = frozenset()
    baseline: bool = False  # from ReMax's greedy pass (one response per prompt)


class RecordingDataflow:
    def __init__(self, algo: Algorithm, roles: Iterable[str], *, reward_model: bool, cost_model: bool,
                 hybrid_engine: bool, old_logprob_pass: bool, ref_from_actor: bool = False):
        self.algo, self.roles = algo, set(roles)
        self.ref_from_actor = ref_from_actor  # a LoRA actor: its base (adapters off) is the reference
        self.models = {"reward": reward_model, "cost": cost_model}
        self.old_logprob_pass = old_logprob_pass
        self.graph = nx.DiGraph(algorithm=algo.name)
        # Weight sync before generation: the 3D-HybridEngine reshard, or a broadcast to separate devices.
        self.sync = self._add("reshard" if hybrid_engine else "broadcast", "reshard" if hybrid_engine else "weight_sync",
                              "actor", broadcast=not hybrid_engine)

    def _add(self, name: str, op: str, role: str, after: Iterable[str] = (), driver: bool = False, **attrs) -> str:
        g = self.graph
        if name in g:
            name = f"{name}@{role}"
        g.add_node(name, op=op, role=role, driver=driver, order=float(len(g)), **attrs)
        g.add_edges_from((src, name) for src in after)
        return name

    # ---- the ops of registry.py -----------------------------------------------------------------
    def generate(self, batch: Recorded, greedy: bool = False) -> Recorded:
        op = "generate_baseline" if greedy else "generate"
        node = self._add(op, op, "actor", after=[self.sync, *batch.nodes], baseline=greedy)
        return Recorded(frozenset({node}), baseline=greedy)

    def score(self, batch: Recorded) -> Recorded:
        # The runtime issues score-model calls first, then runs rule-based scores on the driver.
        streams = sorted(self.algo.scores, key=lambda s: not self.models[s])
        suffix = "_baseline" if batch.baseline else ""
        nodes = {self._add(s + suffix, s, s, after=batch.nodes, driver=not self.models[s], baseline=batch.baseline)
                 for s in streams}
        return Recorded(frozenset(nodes), baseline=batch.baseline)

    def fill_batch(self, batch: Recorded) -> Recorded:
        """Dynamic sampling: the rollouts and scores repeat for the groups dropped; priced as the
        expected extra rollouts (Workload.filter_rate), marked on the nodes."""
        marked = set(batch.nodes) | {p for n in batch.nodes for p in self.graph.predecessors(n)}
        for n in marked:
            if self.graph.nodes[n]["op"] in ("generate", *self.algo.scores):
                self.graph.nodes[n]["resampled"] = True
        return batch

    def _forward(self, op: str, role: str, batch: Recorded) -> Recorded:
        return Recorded(frozenset({self._add(op, op, role, after=batch.nodes)}))

    def ref_logprob(self, batch: Recorded) -> Recorded | None:
        if self.ref_from_actor:
            return self._forward("ref_logprob", "actor", batch)
        return self._forward("ref_logprob", "ref", batch) if "ref" in self.roles else None

    def actor_logprob(self, batch: Recorded) -> Recorded | None:
        return self._forward("actor_logprob", "actor", batch) if self.old_logprob_pass else None

    def values(self, batch: Recorded, critic: str = "critic") -> Recorded | None:
        return self._forward("values", critic, batch) if critic in self.roles else None

    def gather(self, batch: Recorded, *pending: Recorded | None) -> Recorded:
        nodes = set(batch.nodes).union(*(p.nodes for p in pending if p is not None))
        return Recorded(frozenset(nodes))

    def advantage(self, batch: Recorded, baseline: Recorded | None = None) -> Recorded:
        after = set(batch.nodes) | (set(baseline.nodes) if baseline is not None else set())
        return Recorded(frozenset({self._add("advantage", "advantage", DRIVER, after=after, driver=True)}))

    def update(self, batch: Recorded) -> dict:
        for s in self.algo.scores:  # each score stream's critic, then the actor (the runtime's call order)
            if CRITIC_OF[s] in self.roles:
                self._add("critic_update", "critic_update", CRITIC_OF[s], after=batch.nodes)
        self._add("actor_update", "actor_update", "actor", after=batch.nodes)
        return {}


def record_dataflow(algo: Algorithm, roles: Iterable[str], *, reward_model: bool, cost_model: bool,
                    hybrid_engine: bool, old_logprob_pass: bool, ref_from_actor: bool = False) -> nx.DiGraph:
    """One iteration of `algo` as the graph of the ops its loop calls. ref_from_actor: the reference
    log-probs are the actor's with its LoRA adapters off (node `ref_logprob`, role `actor`)."""
    df = RecordingDataflow(algo, roles, reward_model=reward_model, cost_model=cost_model,
                           hybrid_engine=hybrid_engine, old_logprob_pass=old_logprob_pass,
                           ref_from_actor=ref_from_actor and "ref" in algo.roles)
    algo.loop(df, Recorded())
    return df.graph
