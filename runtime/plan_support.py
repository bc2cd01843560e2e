"""How the runtime reads a Plan before anything starts (torch-free): what of it the runtime does not
run, and where each role's weights come from. The trainer uses both, and so does `hflow-plan run`
before it imports torch or starts Ray (tools/preflight.py)."""

from __future__ import annotations

from hybridflow.simulator.errors import HflowError
from hybridflow.simulator.plan import Plan

from .run_config import RunConfig


def check_runnable(plan: Plan, config: RunConfig) -> None:
    """One-line HflowError for a plan (with these RL settings) the runtime cannot execute as written."""
    if config.kl.coef > 0 and "coef" in config.kl.model_fields_set and "ref" not in plan.roles:
        raise HflowError(f"kl coef {config.kl.coef} needs a 'ref' model in the plan; add one or set kl.coef to 0")
    if any(rp.generate_group for rp in plan.roles.values()):
        raise HflowError("the plan puts generation on separate devices (generate_group); the runtime runs the "
                         "actor's rollout on its own devices through the hybrid engine: drop generate_group")
    if plan.reshard == "broadcast":
        raise HflowError("reshard 'broadcast' is for generation on separate devices, which the runtime does not "
                         "run; use hybridflow, hybridflow-v or ds-chat")


def role_weights(plan: Plan, role: str, example_reward: str = "hybridflow.runtime.tasks.builtin:sort_reward") -> str | None:
    """The folder a role loads its weights from: its `path`, else the actor's when it is the same model
    (critic, cost critic, ref), else None — the built-in policy, warmed up on the run's task. A reward or cost role
    has no built-in model: without a path it is a one-line error (naming `example_reward`)."""
    rp = plan.roles[role]
    if rp.path:
        return rp.path
    if role in ("reward", "cost"):
        raise HflowError(f"role '{role}' has no path: give the HF folder of a {role} model, or drop the role and name "
                         f"a {role}_function ('module:function', e.g. {example_reward})")
    if role in ("critic", "cost_critic", "ref") and plan.roles["actor"].model == rp.model:
        return role_weights(plan, "actor")
    return None
