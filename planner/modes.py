"""Searching execution modes side by side (`hflow-plan search --modes … --max-staleness K`).

Per mode the best plan over its placements: `sync` over the colocated and split placements whose
actor generates on its own training devices (the 3D-HybridEngine, today's search) and over those
that give generation devices of their own; `one-step-off` and `async` (staleness bound k) over the
latter only, since overlapping rollout with training needs rollout devices apart. A mode's
staleness is the most updates a trained batch's policy may lag (0, 1, k); the pick is the fastest
mode within the user's limit, the less stale one on a tie.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from hybridflow.planner.scored import Rollout
from hybridflow.planner.search import Planner, SearchResult
from hybridflow.simulator.errors import HflowError
from hybridflow.simulator.vocabulary.plan import EXECUTION_MODES


def mode_rollouts(mode: str, max_staleness: int) -> list[Rollout]:
    """The rollout settings one mode is searched with; async takes the largest bound allowed (its sync
    is paid once per k updates, so a larger k never prices slower), at least 1."""
    if mode == "sync":
        return [Rollout(), Rollout(separate=True)]
    if mode == "one-step-off":
        return [Rollout("one-step-off", 1, separate=True)]
    return [Rollout("async", max(max_staleness, 1), separate=True)]


@dataclass
class ModeResult:
    mode: str
    staleness: int
    result: SearchResult  # the mode's top plans over its placements, best first
    planners: list[Planner]

    @property
    def best(self):
        return self.result.best


def check_modes(modes: Sequence[str], max_staleness: int) -> None:
    """One line when the request cannot pick anything."""
    bad = [m for m in modes if m not in EXECUTION_MODES]
    if bad:
        raise HflowError(f"unknown mode '{bad[0]}'; modes are {', '.join(EXECUTION_MODES)}")
    if max_staleness < 0:
        raise HflowError(f"--max-staleness must be 0 or more, got {max_staleness}")
    if not any(staleness_of(m, max_staleness) <= max_staleness for m in modes):
        raise HflowError(f"no mode in --modes {','.join(modes)} is within --max-staleness {max_staleness}: add sync "
                         "to --modes or raise --max-staleness")


def staleness_of(mode: str, max_staleness: int) -> int:
    return mode_rollouts(mode, max_staleness)[0].staleness


def search_modes(req, cost_model, modes: Sequence[str], max_staleness: int,
                 progress: Callable[[int, int], None] | None = None) -> dict[str, ModeResult]:
    """Each mode's search, in the order given (modes must be valid: check_modes)."""
    from hybridflow.simulator.agents.planning import agent_cost_model

    cost_model = agent_cost_model(cost_model, req.agent, req.cluster)
    out = {}
    for mode in modes:
        planners, results = [], []
        for rollout in mode_rollouts(mode, max_staleness):
            # the Planner prices rollouts as the mode makes them (planning.rollout_cost_model)
            planner = Planner(req, cost_model, rollout=rollout)
            planners.append(planner)
            results.append(planner.run(progress))
        top = sorted((s for r in results for s in r.top), key=lambda s: s.seconds)[:req.top_k]
        merged = SearchResult(req, top, sum(r.plans_priced for r in results), sum(r.configs_priced for r in results),
                              sum(r.search_seconds for r in results))
        out[mode] = ModeResult(mode, staleness_of(mode, max_staleness), merged, planners)
    return out


def pick_mode(results: dict[str, ModeResult], max_staleness: int) -> str | None:
    """The fastest mode with a plan within the staleness limit (the less stale on a tie); None: none."""
    ok = [r for r in results.values() if r.best is not None and r.staleness <= max_staleness]
    return min(ok, key=lambda r: (r.best.seconds, r.staleness)).mode if ok else None


def mode_summary(plan, iteration_seconds: float) -> dict:
    """plans.plan_summary plus the execution mode, its staleness and the devices for rollout vs training."""
    from hybridflow.planner.plans import plan_summary

    gen_group = plan.roles["actor"].generate_group
    rollout = len(plan.group(gen_group).devices) if gen_group else 0
    return {**plan_summary(plan, iteration_seconds), "mode": plan.mode, "staleness": plan.staleness,
            "rollout_devices": rollout, "training_devices": plan.cluster.num_devices - rollout}
