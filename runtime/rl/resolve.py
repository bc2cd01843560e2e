"""A plan and its run config resolved once into the run they make — before torch or Ray load.

`resolve_run` gives the plan the run's rollout engine (the config's `sampling.rollout` over the
actor's), checks every parallel config against its model, refuses what the runtime cannot execute
as written (plan_support.check_runnable) and fills every RL setting the config leaves unset with the
algorithm's default. `hflow-plan run` resolves once and hands the result to the Trainer, which
resolves nothing again; a library caller may hand the Trainer a plan and a config instead.

    run = resolve_run(Plan.load("plan.json"), RunConfig(seed=1))
    Trainer(run).run(iterations=10)
"""

from __future__ import annotations

from dataclasses import dataclass

from hybridflow.runtime.engines.rollout.backends import check_backend
from hybridflow.runtime.rl.plan_support import check_runnable
from hybridflow.runtime.rl.run_config import RunConfig
from hybridflow.simulator.vocabulary.plan import Plan


@dataclass(frozen=True)
class ResolvedRun:
    """The plan with the run's rollout engine and checked parallel configs; the config with the
    algorithm's defaults under every RL field it left unset."""

    plan: Plan
    config: RunConfig


def with_rollout(plan: Plan, config: RunConfig) -> Plan:
    """`plan` with the run's generation engine: the config's `sampling.rollout` overrides the actor's.
    An unknown backend, or vLLM where it cannot run, is one line."""
    actor = plan.roles.get("actor")
    backend = config.sampling.rollout or (actor.rollout if actor else "native")
    check_backend(backend, actor.model if actor else None)
    if actor is None or actor.rollout == backend:
        return plan
    return plan.model_copy(update={"roles": {**plan.roles, "actor": actor.model_copy(update={"rollout": backend})}})


def resolve_run(plan: Plan, config: RunConfig | None = None) -> ResolvedRun:
    """The run this plan and config make, with every check that needs neither torch nor Ray."""
    config = config or RunConfig()
    plan = with_rollout(plan, config).validate_parallel()
    check_runnable(plan, config)  # reads what the config sets itself, before the algorithm's defaults
    return ResolvedRun(plan, config.for_algorithm(plan.algorithm, has_ref="ref" in plan.roles))
