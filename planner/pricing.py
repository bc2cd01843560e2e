"""Op prices and memory feasibility for the search, without building Plans.

The search calls the cost model's per-op methods directly, exactly as `cost.price_op` and
`plan_memory.plan_memory` do for a Plan (tests/planner/test_agreement.py checks they agree):

- a model's states (weights, optimizer) are sharded over all n devices of its group whatever
  the config under FSDP; under Megatron (distributed optimizer) the weights are whole over dp, so
  they depend on tp·pp. A colocated set's resident bytes R depend on its members, n and each
  member's *weight class* (the weight bytes its configs hold: one for FSDP, one per tp·pp for
  Megatron), and the set is priced once per assignment of classes to its members;
- the set fits when every op's transient (activations, gather buffers, the actor's generation
  weights and KV cache) fits in what R leaves; when it does not, trained members recompute
  activations (plan_memory.plan_recompute), which changes their training seconds;
- megatron-core keeps one parallel state per process, so a set's Megatron members share one (tp, pp, ep)
  (simulator/vocabulary/execution.py): the set pricer passes that `shared` state, and a member's configs are
  then its FSDP ones and its Megatron ones at that state (`entries`);
- the actor's generation batch — and so its seconds — depends on the free memory R leaves.

So for a set on n devices, an assignment of weight classes and a recompute flag, each member's
feasible configs are independent, and only their Pareto front over op seconds matters: the schedule's makespan never decreases
when an op gets longer. The set's front is the Pareto front of the product of its members'.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from dataclasses import dataclass
from types import SimpleNamespace

import networkx as nx

from hybridflow.planner.configs import (
    generate_configs,
    searches_sp,
    standalone_generate_configs,
    train_configs,
)
from hybridflow.planner.request import SearchRequest
from hybridflow.simulator.errors import HflowError
from hybridflow.simulator.pricing.cost import price_op
from hybridflow.simulator.pricing.memory import (
    PARTS,
    MemoryBreakdown,
    decode_batch,
    forward_transient,
    generate_buffers,
    generate_transient,
    generate_weights,
    state_bytes,
    train_transient,
)
from hybridflow.simulator.schedule.dataflow import call_order
from hybridflow.simulator.vocabulary.execution import megatron_state
from hybridflow.simulator.vocabulary.parallel import ParallelConfig
from hybridflow.simulator.vocabulary.roles import ROLLOUT, TRAINED_ROLES, role_head
from hybridflow.simulator.vocabulary.timeline import GENERATE_OPS, UPDATE_OPS, WEIGHT_SYNC_OPS


@dataclass(frozen=True)
class Candidate:
    """One role's layout on its set's devices, with the seconds of each of its op nodes."""

    train: ParallelConfig
    generate: ParallelConfig | None
    seconds: tuple[float, ...]  # per op node of the role, in call order
    busy: float  # their sum: the role's share of its set's lane


@dataclass(frozen=True)
class SetCandidate:
    """One combination of the members' candidates of a colocated set."""

    choice: tuple[tuple[str, Candidate], ...]
    node_seconds: tuple[tuple[Hashable, float], ...]
    busy: float
    recompute: bool


def pareto(items: Sequence, vec) -> list:
    """Items no other item dominates (≤ everywhere); among equal vectors the first is kept."""
    out, vecs = [], []
    for it in sorted(items, key=lambda x: sum(vec(x))):
        v = vec(it)
        if any(all(a <= b for a, b in zip(w, v, strict=False)) for w in vecs):
            continue
        out.append(it)
        vecs.append(v)
    return out


def parts(b: MemoryBreakdown) -> tuple[float, ...]:
    return tuple(getattr(b, k) for k in PARTS)


def total(parts: tuple[float, ...]) -> float:
    w, g, o, a, kv, b = parts
    return w + g + o + a + kv + b  # MemoryBreakdown.total's order, so the sums agree to the last bit


class RolePricer:
    """Memoized prices per role, device count, resident bytes and recompute flag."""

    def __init__(self, req: SearchRequest, graph: nx.DiGraph, cost_model, generate_rule: str = "3d",
                 reshard: str = "hybridflow", separate_rollout: bool = False):
        self.req, self.cm, self.p = req, cost_model, cost_model.params
        # separate_rollout: the actor generates on a set of its own (ROLLOUT); the weight sync between
        # them is priced per allocation (weight_sync_seconds), the generation per rollout layout
        self.separate_rollout = separate_rollout
        self.per_node = req.cluster.devices_per_node
        self.usable = self.p.usable_bytes(req.cluster.hardware.hbm_bytes)
        self.limit = req.cluster.hardware.hbm_bytes * self.p.usable_memory_fraction
        self.generate_rule = generate_rule  # "3d": tp_g | tp, pp_g | pp; "same": the training layout
        self.reshard = reshard  # the plan's reshard mode: "hybridflow" (ours) or "hybridflow-v" (vanilla)
        self.role_nodes: dict[str, list[Hashable]] = {}
        self.node_attrs: dict[Hashable, dict] = {}
        self.driver_nodes: list[Hashable] = []
        self.sync_nodes: list[Hashable] = []
        for n in call_order(graph):
            a = graph.nodes[n]
            self.node_attrs[n] = a
            if a["driver"]:
                self.driver_nodes.append(n)
            elif separate_rollout and a["op"] in WEIGHT_SYNC_OPS:
                self.sync_nodes.append(n)
            elif separate_rollout and a["op"] in GENERATE_OPS:
                self.role_nodes.setdefault(ROLLOUT, []).append(n)
            else:
                self.role_nodes.setdefault(a["role"], []).append(n)
        self._states: dict[tuple, MemoryBreakdown] = {}
        self._static: dict[tuple, list] = {}
        self._gen: dict[tuple, tuple | None] = {}
        self._gen_weights: dict[tuple, float] = {}
        self._gen_by_batch: dict[tuple, tuple | None] = {}
        self._gen_nodes = [x for x in self.role_nodes.get("actor", ()) if self.node_attrs[x]["op"] in GENERATE_OPS]
        self._reshard: dict[tuple, float] = {}
        self._fronts: dict[tuple, list[Candidate]] = {}
        self._bounds: dict[tuple, float] = {}
        self._classes: dict[tuple, dict[float, list]] = {}
        self._entries: dict[tuple, list] = {}
        self.configs_priced = 0

    def _key(self, role: str) -> tuple:
        return (self.req.models[role], role_head(role), role, tuple(self.node_attrs[x]["op"] for x in
                                                                     self.role_nodes.get(role, ())))

    def driver_seconds(self) -> dict[Hashable, float]:
        """Controller-side ops (advantage, rule-based rewards): their price does not depend on the plan."""
        view = SimpleNamespace(workload=self.req.workload, roles=self.req.models)
        return {n: price_op(self.cm, view, self.node_attrs[n]["op"], self.node_attrs[n]["role"],
                            baseline=bool(self.node_attrs[n].get("baseline")),
                            resampled=bool(self.node_attrs[n].get("resampled"))).seconds
                for n in self.driver_nodes}

    def states(self, role: str, cfg: ParallelConfig) -> MemoryBreakdown:
        """The role's resident states in training layout `cfg` (memory.state_bytes; Megatron's depend on tp·pp, ep)."""
        key = (self._key(role), cfg.world_size, (cfg.model_parallel_size, cfg.ep) if cfg.backend == "megatron" else 0)
        hit = self._states.get(key)
        if hit is None:
            hit = state_bytes(self.req.models[role], role_head(role), cfg, role in TRAINED_ROLES,
                              lora=self.req.lora_of(role))
            self._states[key] = hit
        return hit

    def weight_classes(self, role: str, n: int, shared: tuple | None = None) -> tuple[MemoryBreakdown, ...]:
        """The distinct resident states the role's configs on n devices hold, fewest bytes first."""
        out = {st.total: st for _, st, *_ in self.entries(role, n, shared)}
        return tuple(out[k] for k in sorted(out))

    def _seqs(self, node) -> int:
        # cost.price_op: the ReMax greedy pass and its reward score one response per prompt
        a = self.node_attrs[node]
        return self.req.workload.op_sequences(baseline=a["op"] == "generate_baseline" or bool(a.get("baseline")),
                                              resampled=bool(a.get("resampled")))

    # ---- per training config: what does not depend on the set ------------------------------------
    def static(self, role: str, n: int) -> list:
        """Per training config: (config, its resident states, forward transient, train transient by
        recompute flag, seconds of the non-generation op nodes by recompute flag). Memoized per (model,
        role, n)."""
        key = (self._key(role), n)
        hit = self._static.get(key)
        if hit is not None:
            return hit
        model, head, w, cm = self.req.models[role], role_head(role), self.req.workload, self.cm
        trained, lora = role in TRAINED_ROLES, self.req.lora_of(role)
        # LoRA trains on FSDP with pp=1 (vocabulary/plan.py lora_problem)
        backends, max_pp = (("fsdp",), 1) if lora is not None else (self.req.backends, self.req.max_pp)
        out = []
        for cfg in train_configs(model, n, self.per_node, max_pp, backends=backends, trained=trained,
                                 sequence_parallel=searches_sp(w.seq_len) and lora is None):
            if self.req.max_sp is not None and cfg.sp > self.req.max_sp:
                continue
            fwd = parts(forward_transient(model, head, cfg, w))
            trans = {f: parts(train_transient(model, head, cfg, w, f, lora)) if trained else fwd for f in (False, True)}
            secs = {False: {}, True: {}}
            for node in self.role_nodes.get(role, ()):
                op = self.node_attrs[node]["op"]
                if op in UPDATE_OPS:
                    for f in (False, True):
                        secs[f][node] = cm.train(model, head, cfg, w, recompute=f, lora=lora).seconds
                elif op not in GENERATE_OPS and op not in WEIGHT_SYNC_OPS:
                    s = cm.forward(model, head, cfg, w, self._seqs(node)).seconds
                    secs[False][node] = secs[True][node] = s
            out.append((cfg, self.states(role, cfg), fwd, trans, secs))
        self._static[key] = out
        return out

    def entries(self, role: str, n: int, shared: tuple | None = None) -> list:
        """static(role, n)'s entries in a set whose Megatron members share megatron-core state `shared`
        (tp, pp, ep): the FSDP ones and the Megatron ones at `shared`; all of them for None."""
        if shared is None:
            return self.static(role, n)
        key = (self._key(role), n, shared)
        hit = self._entries.get(key)
        if hit is None:
            hit = self._entries[key] = [e for e in self.static(role, n) if megatron_state(e[0]) in (None, shared)]
        return hit

    def generation(self, train: ParallelConfig, gen: ParallelConfig, resident: float, own_weights: float,
                   n: int) -> tuple | None:
        """(transient parts, {gen node: seconds}, reshard seconds) of the actor generating with `resident`
        bytes of states on its devices; None when not one sequence's KV cache fits."""
        phase = self._gen_phase(train, gen, resident, own_weights)
        if phase is None:
            return None
        key = (train, gen)
        r = self._reshard.get(key)
        if r is None:
            r = self._reshard[key] = self.cm.reshard(self.req.models["actor"], train, gen, self.reshard,
                                                     lora=self.req.lora_of("actor")).seconds
        return phase[0], phase[1], r

    def gen_batches(self, train: ParallelConfig, gen: ParallelConfig, resident: float,
                    own_weights: float) -> tuple[int, ...]:
        """The decode batches the actor's generation runs with beside `resident` bytes: the KV cache's
        (the transient) and each generation node's (cost.generate, with the transient's logits held).
        Its transient and seconds depend on `resident` only through them."""
        model, w = self.req.models["actor"], self.req.workload
        key = (train, gen, own_weights)
        wg = self._gen_weights.get(key)
        if wg is None:
            wg = self._gen_weights[key] = generate_weights(model, train, gen, self.reshard, own_weights,
                                                           self.req.lora_of("actor"))
        kv_free = self.usable - resident
        b = decode_batch(model, gen, w, kv_free - wg, self.p)
        free = kv_free - wg - generate_buffers(model, gen, b)
        return (b,) + tuple(decode_batch(model, gen, w, free, self.p, self._seqs(x)) for x in self._gen_nodes)

    def _gen_phase(self, train: ParallelConfig, gen: ParallelConfig, resident: float, own_weights: float):
        # With our reshard the generation weights are its peak M/(tp_g·pp_g) less the training shard:
        # they do not depend on which training layout `gen` came from, so the key leaves `train` out.
        key = (gen, resident, own_weights) if self.reshard == "hybridflow" else (train, gen, resident, own_weights)
        if key in self._gen:
            return self._gen[key]
        batches = self.gen_batches(train, gen, resident, own_weights)
        out = self._gen_by_batch.get((key[:-2], own_weights, batches), False)
        if out is False:  # the same batches give the same transient and seconds (memory.generate_transient, cost.generate)
            model, w = self.req.models["actor"], self.req.workload
            t = generate_transient(model, train, gen, w, self.usable - resident, self.p, self.reshard, own_weights,
                                   self.req.lora_of("actor"))
            out = None
            if t.kv_cache > 0:
                free = self.usable - resident - t.weights - t.buffers
                try:
                    secs = {node: self.cm.generate(model, gen, w, self._seqs(node), free).seconds
                            for node in self._gen_nodes}
                    out = (parts(t), secs)
                except HflowError:
                    out = None
            self._gen_by_batch[(key[:-2], own_weights, batches)] = out
        self._gen[key] = out
        return out

    # ---- a role's Pareto front in a given set context ------------------------------------------------
    def front(self, role: str, n: int, resident: MemoryBreakdown, recompute: bool,
              own: MemoryBreakdown, shared: tuple | None = None) -> list[Candidate]:
        """Feasible configs of `role` on n devices holding states `own` (a weight class), beside
        `resident` states (its own included), priced with the set's recompute flag, among those a set
        sharing Megatron state `shared` allows (`entries`); only the Pareto front over its op seconds."""
        key = (self._key(role), n, resident.total, recompute, own.total, shared)
        hit = self._fronts.get(key)
        if hit is not None:
            return hit
        # What `resident` changes: which configs fit and the actor's decode batches. Priced once per those.
        fitting = [e for e, peak in self._class_entries(role, n, own.total, recompute, shared)
                   if self._fits(resident, peak)]
        sig = (key[:2], recompute, own.total, tuple(id(e) for e in fitting))
        if role == "actor":
            sig += tuple(self._gen_fits(e[0], g, resident, own) for e in fitting for g in self.gens(e[0]))
        hit = self._fronts.get(sig)
        if hit is None:
            hit = self._fronts[sig] = self._front(role, n, fitting, resident, recompute, own)
        self._fronts[key] = hit
        return hit

    def _class_entries(self, role: str, n: int, own_total: float, recompute: bool, shared: tuple | None) -> list:
        """entries(role, n, shared) of one weight class, in order, each with its peak transient parts:
        grouped once (a Megatron MoE model has a class per tp·pp and ep, and `front` runs per assignment)."""
        key = (self._key(role), n, recompute, shared)
        by_class = self._classes.get(key)
        if by_class is None:
            by_class = self._classes[key] = {}
            for e in self.entries(role, n, shared):
                by_class.setdefault(e[1].total, []).append((e, max(e[3][recompute], e[2], key=total)))
        return by_class.get(own_total, [])

    def _gen_fits(self, cfg: ParallelConfig, g: ParallelConfig, resident: MemoryBreakdown,
                  own: MemoryBreakdown) -> tuple:
        gen = self.generation(cfg, g, resident.total, own.weights, 0)
        fits = gen is not None and self._fits(resident, gen[0])
        return (fits, self.gen_batches(cfg, g, resident.total, own.weights) if fits else None)

    def gens(self, cfg: ParallelConfig) -> tuple[ParallelConfig, ...]:
        """The actor's generation layouts reachable from training layout `cfg` under the search's rule."""
        return (cfg.generation_layout(),) if self.generate_rule == "same" else generate_configs(cfg, self.req.max_gen_pp)

    def _front(self, role: str, n: int, fitting: list, resident: MemoryBreakdown, recompute: bool,
               own: MemoryBreakdown) -> list[Candidate]:
        nodes = self.role_nodes.get(role, [])
        out = []
        for cfg, _st, _fwd, _trans, secs in fitting:
            if role != "actor" or self.separate_rollout:
                s = tuple(secs[recompute][x] for x in nodes)
                out.append(Candidate(cfg, None, s, sum(s)))
                continue
            for g in self.gens(cfg):
                gen = self.generation(cfg, g, resident.total, own.weights, n)
                if gen is None or not self._fits(resident, gen[0]):
                    continue
                t, gsecs, rsecs = gen
                s = tuple(gsecs[x] if x in gsecs else rsecs if self.node_attrs[x]["op"] in WEIGHT_SYNC_OPS
                          else secs[recompute][x] for x in nodes)
                out.append(Candidate(cfg, g, s, sum(s)))
        self.configs_priced += len(out)
        return pareto(out, lambda c: c.seconds)

    def rollout_front(self, n: int) -> list[Candidate]:
        """The Pareto front of rollout_layouts(n)."""
        key = (ROLLOUT, n)
        hit = self._fronts.get(key)
        if hit is None:
            hit = self._fronts[key] = pareto(self.rollout_layouts(n), lambda c: c.seconds)
        return hit

    def rollout_layouts(self, n: int) -> list[Candidate]:
        """The generation layouts that fit on n rollout devices of their own (memory.py's `broadcast`
        generation phase: the full weights per t_g·p_g shard, the KV cache in the rest, nothing else
        resident), as Candidates whose train and generate config are the layout."""
        model, w, out = self.req.models["actor"], self.req.workload, []
        for gen in standalone_generate_configs(model, n, self.per_node, self.req.max_gen_pp):
            t = generate_transient(model, gen, gen, w, self.usable, self.p, "broadcast", lora=self.req.lora_of("actor"))
            if t.kv_cache <= 0 or not self._fits(MemoryBreakdown(), parts(t)):
                continue
            free = self.usable - t.weights - t.buffers  # plan_memory.kv_free_bytes of such a plan
            try:
                s = tuple(self.cm.generate(model, gen, w, self._seqs(x), free).seconds
                          for x in self.role_nodes.get(ROLLOUT, []))
            except HflowError:
                continue
            out.append(Candidate(gen, gen, s, sum(s)))
        self.configs_priced += len(out)
        return out

    def offload_seconds(self, own: MemoryBreakdown) -> float:
        """One move of a model's states `own` between device and host (cost.price_op's onload/offload)."""
        return self.cm.offload(own.total).seconds

    def weight_sync_seconds(self, train_devices: int, rollout_devices: int) -> float:
        """The broadcast from the actor's training set to its rollout set: it depends on the two sizes only
        (cost.reshard's `broadcast`), so it is one price per allocation."""
        key = (train_devices, rollout_devices)
        hit = self._reshard.get(key)
        if hit is None:
            hit = self._reshard[key] = self.cm.reshard(self.req.models["actor"], ParallelConfig(dp=train_devices),
                                                       ParallelConfig(dp=rollout_devices), "broadcast",
                                                       lora=self.req.lora_of("actor")).seconds
        return hit

    def _fits(self, resident: MemoryBreakdown, transient: tuple[float, ...]) -> bool:
        """plan_memory._group_peak's test: resident + transient + the fixed reservation within hbm × usable
        fraction, summed part by part in the same order (plain floats: this is the hot path)."""
        w, g, o, a, kv, b = transient
        peak = ((resident.weights + w) + (resident.gradients + g) + (resident.optimizer + o)
                + (resident.activations + a) + (resident.kv_cache + kv) + (resident.buffers + b + self.p.reserved_bytes))
        return peak <= self.limit

    def bound(self, role: str, n: int) -> float:
        """A lower bound on the role's busy seconds on n devices in any set: its own states only (the
        most free memory, the fastest generation), no recomputation, memory otherwise ignored."""
        key = (self._key(role), n)
        hit = self._bounds.get(key)
        if hit is not None:
            return hit
        nodes = self.role_nodes.get(role, [])
        best = float("inf")
        for cfg, own, _fwd, _trans, secs in self.static(role, n):
            rest = sum(secs[False][x] for x in nodes if x in secs[False])
            if role != "actor" or self.separate_rollout:
                best = min(best, rest)
                continue
            for g in self.gens(cfg):
                gen = self.generation(cfg, g, own.total, own.weights, n)
                if gen is not None:
                    best = min(best, rest + sum(gen[1].values()) + gen[2])
        self._bounds[key] = best
        return best
