"""How the runtime reads a Plan before anything starts (torch-free): what of it the runtime does not
run, and where each role's weights come from. The trainer uses both, and so does `hflow-plan run`
before it imports torch or starts Ray (tools/preflight/checks.py)."""

from __future__ import annotations

import importlib.util

from hybridflow.runtime.agents.checks import check_agent_plan
from hybridflow.runtime.rl.run_config import RunConfig
from hybridflow.simulator.algorithms import get_algorithm
from hybridflow.simulator.algorithms.recording import record_dataflow
from hybridflow.simulator.errors import HflowError
from hybridflow.simulator.vocabulary.execution import (
    check_partial_budget,
    colocation_problem,
    context_parallel_problem,
    moe_tp_problem,
)
from hybridflow.simulator.vocabulary.parallel import ParallelConfig
from hybridflow.simulator.vocabulary.plan import Plan
from hybridflow.simulator.vocabulary.roles import TRAINED_ROLES


def check_runnable(plan: Plan, config: RunConfig) -> None:
    """One-line HflowError for a plan (with these RL settings) the runtime cannot execute as written."""
    if config.kl.coef > 0 and "coef" in config.kl.model_fields_set and "ref" not in plan.reference_roles():
        raise HflowError(f"kl coef {config.kl.coef} needs a 'ref' model in the plan; add one or set kl.coef to 0")
    if config.agent.enabled:  # conversations (docs/agents.md): tools import, schemas parse, the template shows tools
        check_agent_plan(config.agent, plan, config.sampling.stop)
    check_partial_rollouts(plan, config)
    if not plan.mechanics.is_default:
        raise HflowError(f"this plan is priced with another system's engines ({plan.mechanics.describe()}): "
                         "`compare` writes such plans to show a baseline; run a plan from `hflow-plan search`")
    priced_only = [r for r, rp in plan.roles.items() if rp.train.backend == "deepspeed"]
    if priced_only:
        raise HflowError(f"role '{priced_only[0]}' trains on backend 'deepspeed', which the simulator prices for the "
                         "systems it is compared with but this runtime does not run: use fsdp or megatron")
    for role, rp in plan.roles.items():
        if (bad := context_parallel_problem(rp.train)) is not None:
            raise HflowError(f"role '{role}': {bad}")
    split = [r for r, rp in plan.roles.items() if rp.train.sp > 1 and rp.train.pp > 1]
    if split:  # the FSDP engine runs Ulysses (engines/train/fsdp/ulysses.py), not inside its pipeline schedule
        raise HflowError(f"role '{split[0]}' trains with sequence parallelism sp={plan.roles[split[0]].train.sp} and "
                         f"pp={plan.roles[split[0]].train.pp}; this runtime splits sequences with pp=1 only: plan with "
                         "--max-sp 1 or --max-pp 1")
    if plan.optimizer_offload:
        raise HflowError("optimizer_offload is priced by the simulator but this runtime does not run it yet (its "
                         "engines keep Adam's states on the device): set optimizer_offload false, or plan with more "
                         "devices")
    if plan.offload:
        raise HflowError("the plan offloads idle models (offload: true), which the simulator prices and the planner "
                         "chooses when nothing fits resident, but this runtime does not move models' states yet: "
                         "set offload false, or plan with more devices (hflow-plan search --offload never)")
    actor = plan.roles.get("actor")
    separate = actor is not None and actor.generate_group is not None
    if plan.mode != "sync" and separate and _greedy_baseline(plan):
        raise HflowError(f"{plan.algorithm}'s greedy baseline is generated for the prompts the iteration is handed, "
                         f"and mode '{plan.mode}' trains on prompts launched earlier; use --mode sync")
    sampling = config.sampling
    if (separate and actor.rollout == "vllm" and plan.mode != "sync"
            and (sampling.top_k or sampling.top_p < 1)):  # the behaviour log-probs would not be the loss's
        raise HflowError(f"mode '{plan.mode}' corrects with the behaviour log-probs, which vLLM renormalises over "
                         f"top-k/top-p (top_k {sampling.top_k}, top_p {sampling.top_p}) and the actor does not; "
                         "set sampling.top_k 0 and sampling.top_p 1, use --rollout native or --mode sync")
    if actor is not None and actor.generate is not None and actor.generate.pp != 1:  # both engines refuse it
        raise HflowError(f"the actor generates with pp={actor.generate.pp}; generation is not pipelined on this "
                         "runtime (training may use any pp): plan with `hflow-plan search --max-gen-pp 1` or give "
                         "the generate layout pp=1")
    lora_roles = [r for r, rp in plan.roles.items() if rp.lora is not None]
    if lora_roles and importlib.util.find_spec("peft") is None:  # torch-free: the spec, not the import
        raise HflowError(f"role '{lora_roles[0]}' trains LoRA adapters, which need peft: pip install -e "
                         "'.[runtime]' (peft comes with it), or drop lora")
    if separate and actor.lora is not None:
        raise HflowError("a LoRA actor generates on its training devices on this runtime (the native engine merges "
                         "the adapters there, vLLM takes them through its LoRA API); drop the actor's generate_group "
                         "(rollout devices of its own are priced but not run yet with LoRA)")
    if separate and actor.generate_group == actor.group:
        raise HflowError(f"the actor's generate_group '{actor.generate_group}' is its training group; drop "
                         "generate_group to generate on the training devices (hybrid engine)")
    if plan.reshard == "broadcast" and not separate:
        raise HflowError("reshard 'broadcast' is for generation on separate devices (the actor's generate_group); "
                         "use hybridflow, hybridflow-v or ds-chat")
    if separate and plan.roles_in(actor.generate_group):
        raise HflowError(f"group '{actor.generate_group}' holds the rollout and role(s) "
                         f"{', '.join(plan.roles_in(actor.generate_group))}; rollout devices hold only the rollout")
    _check_megatron(plan)


def _check_megatron(plan: Plan) -> None:
    """What our Megatron engine cannot run (simulator/vocabulary/execution.py): a trained MoE role at tp > 1,
    and colocated Megatron roles (one worker process each device) with different tp, pp or ep."""
    for role, rp in plan.roles.items():
        bad = moe_tp_problem(rp.model, rp.train) if role in TRAINED_ROLES else None
        if bad:
            raise HflowError(f"role '{role}': {bad}")
    for g in plan.groups:
        bad = colocation_problem(g.name, {r: plan.roles[r].train for r in plan.roles_in(g.name)})
        if bad:
            raise HflowError(bad)


def _greedy_baseline(plan: Plan) -> bool:
    """Whether the algorithm's loop generates a greedy baseline (ReMax): its ops, recorded (no schedule)."""
    graph = record_dataflow(get_algorithm(plan.algorithm), plan.roles, reward_model="reward" in plan.roles,
                            cost_model="cost" in plan.roles, hybrid_engine=True, old_logprob_pass=True)
    return any(a["op"] == "generate_baseline" for _, a in graph.nodes(data=True))


def rollout_parallel(plan: Plan) -> ParallelConfig:
    """The generation layout of the actor's separate rollout devices: the plan's generation config, else
    every rollout device a data-parallel replica."""
    actor = plan.roles["actor"]
    return actor.generate or ParallelConfig(dp=len(plan.group(actor.generate_group).devices))


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


def check_partial_rollouts(plan: Plan, config: RunConfig) -> None:
    """async_mode.partial_rollout_tokens (rl/partial_rollouts.py): the async mode, the native engine, one-call
    rollouts (no agent), a budget below the response length."""
    budget = config.async_mode.partial_rollout_tokens
    if budget is None:
        return
    if budget == "auto":
        raise HflowError("async_mode.partial_rollout_tokens: auto is priced by the simulator before a run starts, as "
                         "`hflow-plan run` does; from Python, pass the config through hybridflow.tools.preflight."
                         "partial_budget.with_partial_budget first, or give a number")
    check_partial_budget(plan, budget)
    if config.agent.enabled:
        raise HflowError("async_mode.partial_rollout_tokens pauses single-call responses; an agent run's turns are "
                         "calls of their own: drop partial_rollout_tokens for an agent run")
    if plan.roles["actor"].rollout != "native":
        raise HflowError(f"partial rollouts continue a response from its prefix on the native engine (the actor's "
                         f"rollout is '{plan.roles['actor'].rollout}'): use --rollout native or drop "
                         "async_mode.partial_rollout_tokens")
