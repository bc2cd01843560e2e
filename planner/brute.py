"""Brute force: every placement × allocation × parallel config, priced one by one.

The reference the search is checked against (tests/planner/test_exactness.py): no fronts, no
bounds, no memo of best configs — just the cost model's prices of each op and the memory rule
of `memory.plan_memory` applied to every full combination. Only for small clusters.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator

from hybridflow.simulator.algorithms import TRAINED_ROLES, get_algorithm
from hybridflow.simulator.dataflow import DRIVER, build_dataflow, needs_old_logprob_pass
from hybridflow.simulator.memory import MemoryBreakdown
from hybridflow.simulator.schedule import call_gaps, makespan, schedule
from hybridflow.simulator.timeline import WEIGHT_SYNC_OPS

from .configs import generate_configs
from .placement import allocations, set_partitions
from .pricing import GEN_OPS, Candidate, RolePricer
from .request import SearchRequest
from .search import Scored


def _set_layouts(rp: RolePricer, members, n):
    """Every combination of the members' (train, generate) layouts on n devices."""
    per_role = []
    for r in members:
        opts = []
        for entry in rp.static(r, n):
            cfg = entry[0]
            gens = generate_configs(cfg, rp.req.max_gen_pp) if r == "actor" else (None,)
            opts += [(entry, g) for g in gens]
        per_role.append(opts)
    return itertools.product(*per_role)


def price_set(rp: RolePricer, members, n, layout) -> tuple[dict, tuple[Candidate, ...]] | None:
    """Node seconds and candidates of one full combination of a set; None if it does not fit."""
    resident = sum((entry[1] for entry, _ in layout), MemoryBreakdown())  # each config's own states
    trained = any(r in TRAINED_ROLES for r in members)
    for recompute in ((False, True) if trained else (False,)):
        ok, gens = True, {}
        for r, ((cfg, own, fwd, trans, _), g) in zip(members, layout, strict=False):
            ok = ok and rp._fits(resident, max(trans[recompute], fwd, key=sum))
            if r == "actor":
                gens[r] = rp.generation(cfg, g, resident.total, own.weights, n)
                ok = ok and gens[r] is not None and rp._fits(resident, gens[r][0])
        if ok:
            break
    if not ok:
        return None
    secs, cands = {}, []
    for r, ((cfg, _, _, _, s), g) in zip(members, layout, strict=False):
        mine = []
        for x in rp.role_nodes.get(r, []):
            op = rp.node_attrs[x]["op"]
            if op in GEN_OPS:
                v = gens[r][1][x]
            elif op in WEIGHT_SYNC_OPS:
                v = gens[r][2]
            else:
                v = s[recompute][x]
            secs[x] = v
            mine.append(v)
        cands.append(Candidate(cfg, g, tuple(mine), sum(mine)))
    return secs, tuple(cands)


def all_plans(req: SearchRequest, cost_model) -> Iterator[Scored]:
    """Every feasible plan of the request, priced (seconds of one iteration)."""
    graph = build_dataflow(req.algorithm, req.roles, reward_model="reward" in req.models,
                           cost_model="cost" in req.models, hybrid_engine=True,
                           old_logprob_pass=needs_old_logprob_pass(req.workload, req.roles,
                                                                  get_algorithm(req.algorithm).kl_in_reward))
    rp = RolePricer(req, graph, cost_model)
    driver = rp.driver_seconds()
    gaps = call_gaps(graph, getattr(cost_model, "overheads", None))  # as the search and simulate
    for placement in set_partitions(req.roles):
        set_of = {r: i for i, s in enumerate(placement) for r in s}
        lane_of = {x: DRIVER if a["driver"] else f"g{set_of[a['role']]}" for x, a in graph.nodes(data=True)}
        for counts in allocations([1] * len(placement), req.cluster):
            per_set = []
            for members, n in zip(placement, counts, strict=False):
                priced = [price_set(rp, members, n, lay) for lay in _set_layouts(rp, members, n)]
                per_set.append([p for p in priced if p is not None])
            for pick in itertools.product(*per_set):
                seconds = dict(driver)
                choice = {}
                for members, (secs, cands) in zip(placement, pick, strict=False):
                    seconds.update(secs)
                    choice.update(zip(members, cands, strict=False))
                t = makespan(schedule(graph, lane_of, seconds, gaps))
                yield Scored(t, placement, counts, tuple((r, choice[r]) for r in req.roles))


def brute_force(req: SearchRequest, cost_model=None) -> Scored | None:
    from hybridflow.simulator.cost import CostModel

    cm = cost_model or CostModel(req.cluster)
    return min(all_plans(req, cm), key=lambda s: s.seconds, default=None)
