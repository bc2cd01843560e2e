"""A plan and its run config resolved once into the run they make — before torch or Ray load.

`resolve_run` gives the plan the run's rollout engine (the config's `sampling.rollout` over the
actor's), checks every parallel config against its model, refuses what the runtime cannot execute
as written (plan_support.check_runnable) and fills every RL setting the config leaves unset with the
algorithm's default; `data.chat_template` left unset becomes whether the actor's tokenizer has a chat
template. `hflow-plan run` resolves once and hands the result to the Trainer, which
resolves nothing again; a library caller may hand the Trainer a plan and a config instead.

    run = resolve_run(Plan.load("plan.json"), RunConfig(seed=1))
    Trainer(run).run(iterations=10)
"""

from __future__ import annotations

from dataclasses import dataclass

from hybridflow.runtime.engines.rollout.backends import check_backend
from hybridflow.runtime.rl.plan_support import check_runnable
from hybridflow.runtime.rl.run_config import RunConfig
from hybridflow.runtime.tasks.token_count import has_chat_template
from hybridflow.simulator.vocabulary.plan import Plan
from hybridflow.simulator.vocabulary.roles import TRAINED_ROLES


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


def with_lora(plan: Plan, config: RunConfig) -> Plan:
    """`plan` with the run's LoRA adapters: the config's `lora.actor` / `lora.critic` over each role's own
    (checked as a plan: a one-line error for a LoRA actor beside a 'ref' model, a Megatron role, …)."""
    given = {r: getattr(config.lora, "actor" if r == "actor" else "critic") for r in TRAINED_ROLES}
    roles = {r: rp.model_copy(update={"lora": given[r]}) if given.get(r) is not None else rp
             for r, rp in plan.roles.items()}
    if roles == plan.roles:
        return plan
    return Plan.from_json_text(plan.model_copy(update={"roles": roles}).model_dump_json(), "plan with the run's lora")


def resolve_run(plan: Plan, config: RunConfig | None = None) -> ResolvedRun:
    """The run this plan and config make, with every check that needs neither torch nor Ray."""
    config = config or RunConfig()
    plan = with_lora(with_rollout(plan, config), config).validate_parallel()
    check_runnable(plan, config)  # reads what the config sets itself, before the algorithm's defaults
    return ResolvedRun(plan, with_chat_template(plan, config).for_algorithm(
        plan.algorithm, has_ref="ref" in plan.reference_roles()))


def with_chat_template(plan: Plan, config: RunConfig) -> RunConfig:
    """`data.chat_template` left unset: plain-text prompts go through the chat template exactly when the
    actor's tokenizer has one (the character tokenizer of the built-in policy has none)."""
    if config.data.chat_template is not None:
        return config
    actor = plan.roles.get("actor")
    chat = has_chat_template(actor.path if actor else None)
    return config.model_copy(update={"data": config.data.model_copy(update={"chat_template": chat})})
