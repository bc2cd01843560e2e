"""Algorithm 1 (HybridFlow §6): the exact best placement, allocation and parallel configs.

For every colocation partition of the models (placement), every allocation of the cluster's
devices to its sets (placement.py's rule), and every combination of the models' parallel configs,
price the dataflow with the simulator's `schedule` and keep the best and the top k. What makes it
fast without losing exactness:

- memo: a model's configs are priced once per (model, head, ops, device count) and only their
  Pareto front is kept (pricing.py); a colocated set's feasible combinations once per (set,
  device count), again as a front over its ops' seconds;
- bound: ops of one set run one after another, so an allocation takes at least the busiest
  set's least total seconds (a profiled model's controller gaps only add to it); allocations
  (and partial allocations, in a branch-and-bound over the sets) whose bound is no better than
  the k-th best plan so far are skipped;
- order: few-set placements first (one set of all devices gives a good first incumbent) and the
  actor's set sized first, where the bound bites hardest.

With `Rollout(separate=True)` (scored.py) the actor generates on a set of devices of its own (ROLLOUT,
sized like any other set: how many devices go to rollout vs training is searched too) and every
placement of the models gets that set beside it; in a pipelined mode (one-step-off, async with
bound k) a plan is priced by its steady iteration, the period of the unrolled pipeline
(simulator/schedule/pipeline.py), instead of one iteration's makespan. The bound stays valid: each lane
runs its ops one after another in every iteration of the period too.
"""

from __future__ import annotations

import heapq
import itertools
import math
import time
from collections.abc import Callable, Hashable
from dataclasses import dataclass

from hybridflow.planner.placement import (
    Placement,
    allocation_ok,
    allocations,
    assign_devices,
    set_partitions,
    size_options,
)
from hybridflow.planner.plans import scored_to_plan
from hybridflow.planner.pricing import RolePricer
from hybridflow.planner.request import SearchRequest
from hybridflow.planner.scored import Rollout, Scored
from hybridflow.planner.sets import SetPricer, offload_key
from hybridflow.simulator.agents.planning import rollout_cost_model
from hybridflow.simulator.algorithms import get_algorithm
from hybridflow.simulator.errors import HflowError
from hybridflow.simulator.schedule.dataflow import DRIVER, add_offload_ops, build_dataflow, unroll
from hybridflow.simulator.schedule.neighbours import NodeShare, node_share
from hybridflow.simulator.schedule.pipeline import copies_needed, pipeline, priced_iterations
from hybridflow.simulator.schedule.schedule import call_gaps, makespan, pipeline_period, schedule_shared
from hybridflow.simulator.vocabulary.execution import needs_old_logprob_pass
from hybridflow.simulator.vocabulary.roles import ROLLOUT
from hybridflow.simulator.vocabulary.timeline import GENERATE_OPS, OFFLOAD_OPS, WEIGHT_SYNC_OPS

INF = math.inf


@dataclass
class SearchResult:
    request: SearchRequest
    top: list[Scored]  # best first
    plans_priced: int
    configs_priced: int
    search_seconds: float

    @property
    def best(self) -> Scored | None:
        return self.top[0] if self.top else None


class _TopK:
    def __init__(self, k: int):
        self.k, self.heap, self.tick = k, [], 0  # max-heap by seconds via negation

    @property
    def threshold(self) -> float:
        return -self.heap[0][0] if len(self.heap) >= self.k else INF

    def push(self, s: Scored) -> None:
        self.tick += 1
        item = (-s.seconds, -self.tick, s)  # on ties the earlier plan stays
        if len(self.heap) < self.k:
            heapq.heappush(self.heap, item)
        elif s.seconds < -self.heap[0][0]:
            heapq.heapreplace(self.heap, item)

    def sorted(self) -> list[Scored]:
        return [x[2] for x in sorted(self.heap, key=lambda x: (-x[0], -x[1]))]


class Planner:
    """One search: the dataflow graph is built once, prices are memoized across placements."""

    def __init__(self, req: SearchRequest, cost_model=None, generate_rule: str = "3d", reshard: str = "hybridflow",
                 rollout: Rollout = Rollout(), offload: bool = False):
        from hybridflow.simulator.calibration.gpu_fit import default_cost_model

        if offload and rollout.staleness:
            raise HflowError(f"offload of idle models is planned for sync mode only, not '{rollout.mode}'")
        self.req, self.rollout, self.offload = req, rollout, offload
        # rollouts priced as the mode makes them: conversations, the async mode's calls in turn
        self.cm = rollout_cost_model(cost_model or default_cost_model(req.cluster), req.agent, req.cluster,
                                     mode=rollout.mode, staleness=rollout.staleness)
        self.graph = build_dataflow(req.algorithm, req.roles, reward_model="reward" in req.models,
                                    cost_model="cost" in req.models, hybrid_engine=not rollout.separate,
                                    ref_from_actor=req.lora is not None,
                                    old_logprob_pass=needs_old_logprob_pass(req.workload, req.reference_roles,
                                                                             get_algorithm(req.algorithm).kl_in_reward))
        self.roles = req.roles
        self.pricer = RolePricer(req, self.graph, self.cm, generate_rule, reshard, separate_rollout=rollout.separate)
        self.sets = SetPricer(self.pricer, offload)
        self.driver_seconds = self.pricer.driver_seconds()
        overheads = getattr(self.cm, "overheads", None)
        # A profiled cost model's controller gaps, as `simulate` leaves them: ranking and simulate agree.
        self.gaps = call_gaps(self.graph, overheads)
        # A device whose neighbours idle runs faster (simulator/schedule/neighbours.py): priced as `simulate` does,
        # and the busy-speed bounds divided by it stay lower bounds.
        self.alone_speedup = overheads.alone_speedup if overheads is not None else 1.0
        self.big = None
        if rollout.staleness:  # the unrolled pipeline `simulate` prices, built once
            k, n = rollout.staleness, priced_iterations(rollout.staleness)
            self.big, _ = unroll(self.graph, dict.fromkeys(self.graph, DRIVER), copies_needed(n, k))
            pipeline(self.graph, self.big, dict.fromkeys(self.big, DRIVER), copies_needed(n, k), k)
            self.big_gaps = call_gaps(self.big, overheads)
        self.opts = size_options(req.cluster)
        self.plans_priced = 0
        self._offload_graphs: dict[Placement, tuple] = {}

    # ---- bounds -----------------------------------------------------------------------------------
    def set_bound(self, members: tuple[str, ...], n: int) -> float:
        """Least busy seconds of a set on n devices (each member's fastest config, memory ignored
        across members): a lower bound on the iteration, since a set's ops run one after another."""
        return self.sets.bound(members, n) / self.alone_speedup

    # ---- one allocation ---------------------------------------------------------------------------
    def price_allocation(self, placement: Placement, counts: tuple[int, ...], lane_of: dict, top: _TopK) -> None:
        graph, lane_of, gaps, moves = self.placement_graph(placement, lane_of)
        fronts = []
        for members, n in zip(placement, counts, strict=False):
            f = self.sets.front(members, n)
            if not f:
                return
            fronts.append(f)
        seconds = dict(self.driver_seconds)
        if self.rollout.separate:
            size = {m: n for members, n in zip(placement, counts, strict=True) for m in members}
            seconds.update(dict.fromkeys(self.pricer.sync_nodes, self.pricer.weight_sync_seconds(size["actor"],
                                                                                                 size[ROLLOUT])))
        big_lanes = self.pipeline_lanes(lane_of)
        share = self.node_share(counts)
        best, best_combo = INF, None
        for combo in itertools.product(*fronts):
            if max(c.busy for c in combo) / self.alone_speedup >= min(best, top.threshold):
                continue
            for sc in combo:
                seconds.update(sc.node_seconds)
            for x, role in moves:  # every onload/offload of a role: one move of its states
                seconds[x] = seconds[offload_key(role)]
            self.plans_priced += 1
            t = self.price(lane_of, big_lanes, seconds, share, graph, gaps)
            if t < best:
                best, best_combo = t, combo
        if best_combo is not None and best < top.threshold:  # the top k lists distinct allocations
            choice = dict(kv for sc in best_combo for kv in sc.choice)
            roles = self.roles + ((ROLLOUT,) if self.rollout.separate else ())
            top.push(Scored(best, placement, counts, tuple((r, choice[r]) for r in roles), self.rollout,
                            self.offload))

    def placement_graph(self, placement: Placement, lane_of: dict) -> tuple:
        """(graph, lanes, controller gaps, [(onload/offload node, role)]) one placement is priced on, its
        lanes `lane_of`: the search's graph, or with offload a copy with the moves of its colocated models
        (which depend on the placement's lanes) and those lanes extended to them."""
        if not self.offload:
            return self.graph, lane_of, self.gaps, []
        hit = self._offload_graphs.get(placement)
        if hit is None:
            graph, lanes = self.graph.copy(), dict(lane_of)
            add_offload_ops(graph, lanes, set(self.roles))
            moves = [(x, a["role"]) for x, a in graph.nodes(data=True) if a["op"] in OFFLOAD_OPS]
            overheads = getattr(self.cm, "overheads", None)
            hit = self._offload_graphs[placement] = (graph, lanes, call_gaps(graph, overheads), moves)
        return hit

    def pipeline_lanes(self, lane_of: dict) -> dict | None:
        """The unrolled pipeline's lanes for one placement's `lanes` (None in sync mode)."""
        return {n: lane_of[n[1]] for n in self.big} if self.big is not None else None

    def node_share(self, counts: tuple[int, ...]) -> NodeShare | None:
        """The sets' devices on their nodes (set i is lane g{i}, placed as plans.py places it) for the
        alone speed (None: the cost model has none)."""
        if self.alone_speedup <= 1.0:
            return None
        devices = assign_devices(counts, self.req.cluster)
        return node_share(self.alone_speedup, {f"g{i}": d for i, d in enumerate(devices)},
                          self.req.cluster.devices_per_node)

    def price(self, lane_of: dict, big_lanes: dict | None, seconds: dict, share: NodeShare | None = None,
              graph=None, gaps=None) -> float:
        """One iteration's makespan (sync) or the pipeline's steady iteration, as `simulate` gives it,
        from each op node's seconds (the single iteration's nodes); `share`: node_share(counts); `graph`
        and `gaps`: placement_graph's (the search's own by default)."""
        if big_lanes is None:
            if graph is None:
                graph, gaps = self.graph, self.gaps
            return makespan(schedule_shared(graph, lane_of, seconds, gaps, share))
        times = schedule_shared(self.big, big_lanes, {n: seconds[n[1]] for n in self.big}, self.big_gaps, share)
        k = self.rollout.staleness
        return pipeline_period(self.big, times, priced_iterations(k), k)

    # ---- the search -------------------------------------------------------------------------------
    def lanes(self, placement: Placement) -> dict[Hashable, str | tuple[str, str]]:
        set_of = {r: f"g{i}" for i, s in enumerate(placement) for r in s}
        out: dict[Hashable, str | tuple[str, str]] = {}
        for n, a in self.graph.nodes(data=True):
            if a["driver"]:
                out[n] = DRIVER
            elif self.rollout.separate and a["op"] in GENERATE_OPS:
                out[n] = set_of[ROLLOUT]
            elif self.rollout.separate and a["op"] in WEIGHT_SYNC_OPS:  # a broadcast holds both sides
                out[n] = (set_of["actor"], set_of[ROLLOUT])
            else:
                out[n] = set_of[a["role"]]
        return out

    def min_devices(self, members: tuple[str, ...]) -> int | None:
        """Smallest allowed size on which the set has a feasible combination of configs (None when
        not even the whole cluster holds it: checked first, so hopeless sets cost one front)."""
        if not self.sets.feasible(members, self.opts[-1]):
            return None
        for n in self.opts:
            if self.sets.feasible(members, n):
                return n
        return None

    def search_placement(self, placement: Placement, top: _TopK) -> None:
        mins = [self.min_devices(s) for s in placement]
        if any(m is None for m in mins):
            return
        lane_of = self.lanes(placement)
        # Size the set that generates first (generation dominates), the rest in order.
        gen_set = ROLLOUT if self.rollout.separate else "actor"
        order = sorted(range(len(placement)), key=lambda i: gen_set not in placement[i])
        if len(placement) == 1:
            for counts in allocations(mins, self.req.cluster):
                self.price_allocation(placement, counts, lane_of, top)
            return
        self._branch(placement, order, mins, lane_of, top)

    def _branch(self, placement, order, mins, lane_of, top: _TopK) -> None:
        """Branch and bound over the sets' sizes: a partial allocation whose sized sets already
        bound the iteration at or above the k-th best is dropped with everything below it."""
        k, total = len(placement), self.req.cluster.num_devices
        floors = [next(o for o in self.opts if o >= mins[i]) for i in order]
        tail = [0] * (k + 1)
        for j in range(k - 1, -1, -1):
            tail[j] = tail[j + 1] + floors[j]
        counts = [0] * k
        opt_set = set(self.opts)

        def rec(j: int, left: int, bound: float) -> None:
            i = order[j]
            if j == k - 1:
                if left < mins[i] or left not in opt_set:
                    return
                counts[i] = left
                if max(bound, self.set_bound(placement[i], left)) >= top.threshold:
                    return
                c = tuple(counts)
                if allocation_ok(c, self.req.cluster):
                    self.price_allocation(placement, c, lane_of, top)
                return
            for o in self.opts:
                if o < mins[i]:
                    continue
                if o + tail[j + 1] > left:
                    break
                b = max(bound, self.set_bound(placement[i], o))
                if b >= top.threshold:
                    continue
                counts[i] = o
                rec(j + 1, left - o, b)

        rec(0, total, 0.0)

    def best_placement(self, placement: Placement) -> Scored | None:
        """The best allocation and configs for one fixed placement (the paper's placement studies)."""
        top = _TopK(1)
        self.search_placement(placement, top)
        return top.sorted()[0] if top.heap else None

    def best_for(self, placement: Placement, counts: tuple[int, ...]) -> Scored | None:
        """The best configs for one fixed placement and allocation (used by baselines)."""
        top = self.top_for(placement, counts, 1)
        return top[0] if top else None

    def top_for(self, placement: Placement, counts: tuple[int, ...], k: int) -> list[Scored]:
        """The k best configs for one fixed placement and allocation, fastest first."""
        top = _TopK(k)
        self.price_allocation(placement, counts, self.lanes(placement), top)
        return top.sorted()

    def run(self, progress: Callable[[int, int], None] | None = None) -> SearchResult:
        t0 = time.perf_counter()
        top = _TopK(self.req.top_k)
        placements = sorted(set_partitions(self.roles), key=len)
        if self.rollout.separate:
            placements = [p + ((ROLLOUT,),) for p in placements]
        for i, p in enumerate(placements):
            self.search_placement(p, top)
            if progress:
                progress(i + 1, len(placements))
        return SearchResult(self.req, self._verified(top.sorted()), self.plans_priced, self.pricer.configs_priced,
                            time.perf_counter() - t0)

    def _verified(self, top: list[Scored]) -> list[Scored]:
        """Insurance for "never return a plan the memory model calls infeasible": the winners are
        checked against plan_memory.plan_memory on real Plans (the search's own test agrees with it by
        construction; tests/planner/test_agreement.py checks that it does)."""
        from hybridflow.simulator.pricing.plan_memory import plan_memory

        ok = []
        for s in top:
            if all(m.fits for m in plan_memory(scored_to_plan(self.req, s, self.pricer.reshard)).values()):
                ok.append(s)
        return ok


def search(req: SearchRequest, cost_model=None, progress: Callable[[int, int], None] | None = None,
           rollout: Rollout = Rollout(), offload: bool = False) -> SearchResult:
    return Planner(req, cost_model, rollout=rollout, offload=offload).run(progress)


def search_as_asked(req: SearchRequest, cost_model=None, progress: Callable[[int, int], None] | None = None
                    ) -> tuple[Planner, SearchResult]:
    """The synchronous search under the request's offload policy (SearchRequest.offload): with "auto" the
    plans that keep every model resident, and only when none fits, those that offload idle models (moving
    states costs time, so where both fit the resident plans win or tie in practice)."""
    planner = Planner(req, cost_model, offload=req.offload == "always")
    result = planner.run(progress)
    if result.best is None and req.offload == "auto":
        planner = Planner(req, planner.cm, offload=True)
        result = planner.run(progress)
    return planner, result
