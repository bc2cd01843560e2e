"""Brute force: every placement × allocation × parallel config, priced one by one.

The reference the search is checked against (tests/planner/test_exactness.py): no fronts, no
bounds, no memo of best configs — just the cost model's prices of each op and the memory rule
of `plan_memory.plan_memory` applied to every full combination. Only for small clusters.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator

from hybridflow.planner.configs import generate_configs
from hybridflow.planner.placement import allocations, set_partitions
from hybridflow.planner.pricing import Candidate, RolePricer
from hybridflow.planner.request import SearchRequest
from hybridflow.planner.scored import Rollout, Scored
from hybridflow.planner.search import Planner
from hybridflow.planner.sets import offload_key
from hybridflow.simulator.pricing.memory import MemoryBreakdown
from hybridflow.simulator.vocabulary.execution import colocation_problem
from hybridflow.simulator.vocabulary.roles import ROLLOUT, TRAINED_ROLES
from hybridflow.simulator.vocabulary.timeline import GENERATE_OPS, WEIGHT_SYNC_OPS


def _set_layouts(rp: RolePricer, members, n):
    """Every combination of the members' (train, generate) layouts on n devices the runtime runs: their
    Megatron members share one megatron-core state (vocabulary/execution.py colocation_problem)."""
    per_role = []
    for r in members:
        opts = []
        for entry in rp.static(r, n):
            cfg = entry[0]
            gens = generate_configs(cfg, rp.req.max_gen_pp) if r == "actor" and not rp.separate_rollout else (None,)
            opts += [(entry, g) for g in gens]
        per_role.append(opts)
    return (lay for lay in itertools.product(*per_role)
            if colocation_problem("set", {r: entry[0] for r, (entry, _) in zip(members, lay, strict=True)}) is None)


def price_set(rp: RolePricer, members, n, layout, offload: bool = False) -> tuple[dict, tuple[Candidate, ...]] | None:
    """Node seconds and candidates of one full combination of a set; None if it does not fit. With
    offload each member runs beside its own states only, and each move of its states is priced."""
    everyone = sum((entry[1] for entry, _ in layout), MemoryBreakdown())  # each config's own states
    trained = any(r in TRAINED_ROLES for r in members)
    for recompute in ((False, True) if trained else (False,)):
        ok, gens = True, {}
        for r, ((cfg, own, fwd, trans, _), g) in zip(members, layout, strict=False):
            resident = own if offload else everyone
            ok = ok and rp._fits(resident, max(trans[recompute], fwd, key=sum))
            if r == "actor" and not rp.separate_rollout:
                gens[r] = rp.generation(cfg, g, resident.total, own.weights, n)
                ok = ok and gens[r] is not None and rp._fits(resident, gens[r][0])
        if ok:
            break
    if not ok:
        return None
    secs, cands = {}, []
    for r, ((cfg, own, _, _, s), g) in zip(members, layout, strict=False):
        if offload and len(members) > 1:
            secs[offload_key(r)] = rp.offload_seconds(own)
        mine = []
        for x in rp.role_nodes.get(r, []):
            op = rp.node_attrs[x]["op"]
            if op in GENERATE_OPS:
                v = gens[r][1][x]
            elif op in WEIGHT_SYNC_OPS:
                v = gens[r][2]
            else:
                v = s[recompute][x]
            secs[x] = v
            mine.append(v)
        cands.append(Candidate(cfg, g, tuple(mine), sum(mine)))
    return secs, tuple(cands)


def all_plans(req: SearchRequest, cost_model, rollout: Rollout = Rollout(), offload: bool = False) -> Iterator[Scored]:
    """Every feasible plan of the request, priced (seconds of one iteration, or a pipeline's steady one).
    The schedule's primitives (the dataflow, lanes, `simulate`'s pricing) come from a Planner; its
    search (fronts, bounds) is not used."""
    ref = Planner(req, cost_model, rollout=rollout, offload=offload)
    rp = ref.pricer
    driver = rp.driver_seconds()
    extra = ((ROLLOUT,),) if rollout.separate else ()
    roles = req.roles + ((ROLLOUT,) if rollout.separate else ())
    for placement in (p + extra for p in set_partitions(req.roles)):
        graph, lane_of, gaps, moves = ref.placement_graph(placement, ref.lanes(placement))
        big_lanes = ref.pipeline_lanes(lane_of)
        for counts in allocations([1] * len(placement), req.cluster):
            share = ref.node_share(counts)
            per_set = []
            for members, n in zip(placement, counts, strict=False):
                if members == (ROLLOUT,):
                    nodes = rp.role_nodes.get(ROLLOUT, [])
                    per_set.append([(dict(zip(nodes, c.seconds, strict=True)), (c,)) for c in rp.rollout_layouts(n)])
                    continue
                priced = [price_set(rp, members, n, lay, offload) for lay in _set_layouts(rp, members, n)]
                per_set.append([p for p in priced if p is not None])
            size = {m: n for members, n in zip(placement, counts, strict=True) for m in members}
            for pick in itertools.product(*per_set):
                seconds = dict(driver)
                if rollout.separate:
                    seconds.update(dict.fromkeys(rp.sync_nodes, rp.weight_sync_seconds(size["actor"], size[ROLLOUT])))
                choice = {}
                for members, (secs, cands) in zip(placement, pick, strict=False):
                    seconds.update(secs)
                    choice.update(zip(members, cands, strict=False))
                for x, role in moves:
                    seconds[x] = seconds[offload_key(role)]
                t = ref.price(lane_of, big_lanes, seconds, share, graph, gaps)
                yield Scored(t, placement, counts, tuple((r, choice[r]) for r in roles), rollout, offload)


def brute_force(req: SearchRequest, cost_model=None, rollout: Rollout = Rollout(), offload: bool = False
                ) -> Scored | None:
    from hybridflow.simulator.calibration.gpu_fit import default_cost_model

    cm = cost_model or default_cost_model(req.cluster)
    return min(all_plans(req, cm, rollout, offload), key=lambda s: s.seconds, default=None)
