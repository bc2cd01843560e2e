"""The Pareto front of a colocated set on n devices: its members' configs combined.

Under FSDP a member's resident states do not depend on its config, so the set's resident bytes R are
fixed and each member's front is taken beside them (pricing.RolePricer.front). Megatron keeps its
weights whole over dp, so a member's states depend on its weight class (tp·pp), and R on which class
each member takes. Two exact ways to combine them:

- per assignment: every assignment of classes to the members gives one R; the members' fronts
  beside it are combined as under FSDP. Exact always, but a product of classes (up to 8 per member
  on 128 devices: 8^4 assignments for PPO's four models on one set);
- merged: when R changes no member's seconds over the range the assignments span, R matters only
  for fitting, and a config with fewer states, less transient and no slower ops can replace another
  in every combination. Each member's configs (all classes) are cut to their Pareto front over
  (op seconds, states, peak transient) and the members are combined one by one, keeping the front
  over (op seconds, summed states, largest transient). Non-actor members' seconds never depend on
  R; the actor's generation does through its decode batch (the free memory), which is monotone in
  R: equal at both ends of the range means equal throughout (`_actor_steady`).

The merged way is used when it is exact, the per-assignment way otherwise.

megatron-core keeps one parallel state per process, so the set's Megatron members must share one
(tp, pp, ep) (simulator/vocabulary/execution.py). When two or more members may train on Megatron, the set is
priced once per state they could share, each member taking its FSDP configs and its Megatron ones at
that state (RolePricer.entries); the union of those fronts is the front of the runnable combinations
(combinations of FSDP members alone appear under every state: the front keeps one).

With offload of idle models (Plan.offload) a member runs beside its own states only, so the members'
fronts are independent: each member's options over its weight classes, each carrying the seconds of
one move of its states to host and back (`offload_key`: the dataflow's onload/offload nodes depend on
the placement, so the search maps them onto this per-role price), and the set's front is their product.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Hashable

import numpy as np

from hybridflow.planner.pricing import Candidate, RolePricer, SetCandidate, pareto, total
from hybridflow.simulator.pricing.memory import MemoryBreakdown
from hybridflow.simulator.vocabulary.execution import megatron_state
from hybridflow.simulator.vocabulary.roles import ROLLOUT, TRAINED_ROLES
from hybridflow.simulator.vocabulary.timeline import WEIGHT_SYNC_OPS

# Most combinations of the members' options the merged way enumerates; beyond it the fronts over
# seconds, states and transient keep most of them and the assignments of classes are fewer.
MERGE_LIMIT = 20_000


def offload_key(role: str) -> tuple[str, str]:
    """The pseudo node under which a SetCandidate carries one onload/offload of `role`'s states."""
    return ("offload", role)


def _front_of(items: list, vecs: list[tuple[float, ...]]) -> list:
    """pricing.pareto over many items in many dimensions (the merged way's partial combinations): the same
    items, each tested against the kept ones at once with numpy."""
    if not items:
        return []
    v = np.asarray(vecs, dtype=float)
    order = np.argsort(v.sum(axis=1), kind="stable")
    kept = np.empty_like(v)
    out, k = [], 0
    for i in order:
        if k and np.any(np.all(kept[:k] <= v[i], axis=1)):
            continue
        kept[k] = v[i]
        k += 1
        out.append(items[i])
    return out


class SetPricer:
    """The Pareto front of a colocated set on n devices (memoized per set and n)."""

    def __init__(self, roles: RolePricer, offload: bool = False):
        self.roles, self.offload = roles, offload
        self._fronts: dict[tuple, list[SetCandidate]] = {}

    def front(self, members: tuple[str, ...], n: int) -> list[SetCandidate]:
        key = (members, n)
        hit = self._fronts.get(key)
        if hit is not None:
            return hit
        rp = self.roles
        if members == (ROLLOUT,):  # separate rollout devices: generation only, its own front
            nodes = rp.role_nodes.get(ROLLOUT, [])
            hit = self._fronts[key] = [SetCandidate(((ROLLOUT, c),), tuple(zip(nodes, c.seconds, strict=True)),
                                                    c.busy, False) for c in rp.rollout_front(n)]
            return hit
        combos: list[SetCandidate] = []
        for shared in self.shared_states(members, n):
            classes = [rp.weight_classes(r, n, shared) for r in members]
            merged = any(len(c) > 1 for c in classes) and self._actor_steady(members, n, classes, shared)
            for recompute in ((False, True) if any(r in TRAINED_ROLES for r in members) else (False,)):
                if self.offload:
                    combos += self._independent(members, n, classes, recompute, shared)
                else:
                    combos += (self._merged(members, n, classes, recompute, shared) if merged
                               else self._per_assignment(members, n, classes, recompute, shared))
        # A combination priced with recomputation although it fits without is dominated by (or equal
        # to) the same combination without it, so the union's front is the true front.
        hit = _front_of(combos, [tuple(s for _, s in sc.node_seconds) for sc in combos])
        self._fronts[key] = hit
        return hit

    def feasible(self, members: tuple[str, ...], n: int) -> bool:
        """Whether the set has any feasible combination on n devices (its front is not empty), stopping
        at the first: the assignment of the fewest bytes first, which fits whenever any does in practice."""
        if (members, n) in self._fronts or members == (ROLLOUT,):
            return bool(self.front(members, n))
        rp = self.roles
        trained = any(r in TRAINED_ROLES for r in members)
        for shared in self.shared_states(members, n):
            if self.offload:  # each member beside its own states only
                if any(all(any(rp.front(r, n, own, f, own, shared) for own in rp.weight_classes(r, n, shared))
                           for r in members) for f in ((True, False) if trained else (False,))):
                    return True
                continue
            for owns in itertools.product(*(rp.weight_classes(r, n, shared) for r in members)):
                resident = sum(owns, MemoryBreakdown())
                for recompute in ((True, False) if trained else (False,)):
                    if all(rp.front(r, n, resident, recompute, own, shared)
                           for r, own in zip(members, owns, strict=True)):
                        return True
        return False

    def shared_states(self, members: tuple[str, ...], n: int) -> list[tuple | None]:
        """The megatron-core states (tp, pp, ep) the set's Megatron members may share on n devices, each
        a context to price the set in; [None] (no constraint) when fewer than two members can be on Megatron."""
        per_member = [{megatron_state(e[0]) for e in self.roles.static(r, n)} - {None} for r in members]
        if sum(1 for states in per_member if states) < 2:
            return [None]
        return sorted(set().union(*per_member))

    def bound(self, members: tuple[str, ...], n: int) -> float:
        if members == (ROLLOUT,):
            return min((c.busy for c in self.roles.rollout_front(n)), default=float("inf"))
        return sum(self.roles.bound(r, n) for r in members)

    # ---- the two ways ----------------------------------------------------------------------------
    def _candidate(self, members, pick: tuple[Candidate, ...], recompute: bool) -> SetCandidate:
        nodes = self.roles.role_nodes
        node_secs = tuple((x, s) for r, c in zip(members, pick, strict=True)
                          for x, s in zip(nodes.get(r, []), c.seconds, strict=False))
        return SetCandidate(tuple(zip(members, pick, strict=True)), node_secs, sum(c.busy for c in pick), recompute)

    def _per_assignment(self, members, n, classes, recompute: bool, shared: tuple | None) -> list[SetCandidate]:
        rp, out = self.roles, []
        for owns in itertools.product(*classes):
            resident = sum(owns, MemoryBreakdown())
            fronts = [rp.front(r, n, resident, recompute, own, shared) for r, own in zip(members, owns, strict=True)]
            if all(fronts):
                out += [self._candidate(members, pick, recompute) for pick in itertools.product(*fronts)]
        return out

    def _independent(self, members, n, classes, recompute: bool, shared: tuple | None) -> list[SetCandidate]:
        """With offload: each member's front beside its own states, per weight class, with the seconds of
        one move of those states (a lone member never moves: add_offload_ops); the set's front is the
        product of the members' (their op seconds are disjoint dimensions)."""
        rp, per = self.roles, []
        moves = len(members) > 1
        for r, cls in zip(members, classes, strict=True):
            opts = [(c, rp.offload_seconds(own) if moves else 0.0) for own in cls
                    for c in rp.front(r, n, own, recompute, own, shared)]
            opts = pareto(opts, lambda o: o[0].seconds + (o[1],))
            if not opts:
                return []
            per.append(opts)
        out = []
        for pick in itertools.product(*per):
            sc = self._candidate(members, tuple(c for c, _ in pick), recompute)
            if moves:
                sc = SetCandidate(sc.choice, sc.node_seconds + tuple((offload_key(r), m) for r, (_, m)
                                                                     in zip(members, pick, strict=True)),
                                  sc.busy, recompute)
            out.append(sc)
        return out

    def _span(self, members, classes, role: str, own: MemoryBreakdown) -> tuple[float, float]:
        """The least and most resident bytes of the set while `role` holds `own`."""
        others = [c for r, c in zip(members, classes, strict=True) if r != role]
        return (own.total + sum(c[0].total for c in others), own.total + sum(c[-1].total for c in others))

    def _actor_steady(self, members, n, classes, shared: tuple | None) -> bool:
        """Whether every actor layout decodes with the same batches at the least and the most resident
        bytes the set can hold (then at every R between: the batches are monotone in R)."""
        if "actor" not in members:
            return True
        rp = self.roles
        for cfg, own, *_ in rp.entries("actor", n, shared):
            lo, hi = self._span(members, classes, "actor", own)
            for g in rp.gens(cfg):
                if rp.gen_batches(cfg, g, lo, own.weights) != rp.gen_batches(cfg, g, hi, own.weights):
                    return False
        return True

    def _options(self, role: str, n: int, members, classes, recompute: bool, shared: tuple | None) -> list[tuple]:
        """(candidate, states, peak transient parts) of every config of `role` that fits beside the least
        resident bytes, priced there; cut to the front over (seconds, states, transient)."""
        rp, out = self.roles, []
        nodes = rp.role_nodes.get(role, [])
        for cfg, own, fwd, trans, secs in rp.entries(role, n, shared):
            base = max(trans[recompute], fwd, key=total)
            lo = self._span(members, classes, role, own)[0]
            if role != "actor":
                s = tuple(secs[recompute][x] for x in nodes)
                out.append((Candidate(cfg, None, s, sum(s)), own, base))
                continue
            for g in rp.gens(cfg):
                gen = rp.generation(cfg, g, lo, own.weights, n)
                if gen is None:
                    continue
                t, gsecs, rsecs = gen
                s = tuple(gsecs[x] if x in gsecs else rsecs if rp.node_attrs[x]["op"] in WEIGHT_SYNC_OPS
                          else secs[recompute][x] for x in nodes)
                out.append((Candidate(cfg, g, s, sum(s)), own, max(base, t, key=total)))
        return pareto(out, lambda o: o[0].seconds + (o[1].total, total(o[2])))

    def _merged(self, members, n, classes, recompute: bool, shared: tuple | None) -> list[SetCandidate]:
        options = [self._options(r, n, members, classes, recompute, shared) for r in members]
        if math.prod(len(o) for o in options) > MERGE_LIMIT:  # fronts in that many dimensions barely prune
            return self._per_assignment(members, n, classes, recompute, shared)
        partial: list[tuple[tuple, float, float, tuple]] = [((), 0.0, 0.0, ())]  # picks, states, transient, secs
        for opts in options:
            grown = [(picks + (o,), w + o[1].total, max(t, total(o[2])), secs + o[0].seconds)
                     for picks, w, t, secs in partial for o in opts]
            partial = _front_of(grown, [p[3] + (p[1], p[2]) for p in grown])
        out = []
        for picks, *_ in partial:  # price the survivors exactly beside their own resident bytes
            resident = sum((o[1] for o in picks), MemoryBreakdown())
            pick = self._exact(members, n, picks, resident)
            if pick is not None:
                out.append(self._candidate(members, pick, recompute))
        return out

    def _exact(self, members, n, picks, resident: MemoryBreakdown) -> tuple[Candidate, ...] | None:
        rp, out = self.roles, []
        for r, (cand, own, base) in zip(members, picks, strict=True):
            if not rp._fits(resident, base):
                return None
            if r == "actor":
                gen = rp.generation(cand.train, cand.generate, resident.total, own.weights, n)
                if gen is None or not rp._fits(resident, gen[0]):
                    return None
                nodes: list[Hashable] = rp.role_nodes["actor"]
                s = tuple(gen[1].get(x, v) for x, v in zip(nodes, cand.seconds, strict=True))
                cand = Candidate(cand.train, cand.generate, s, sum(s))
            out.append(cand)
        return tuple(out)
