"""Turning search results into Plans (only for the winners) and Plans into JSON summaries."""

from __future__ import annotations

from hybridflow.planner.placement import assign_devices
from hybridflow.planner.request import SearchRequest
from hybridflow.planner.scored import Scored
from hybridflow.simulator.pricing.cost import rollout_knobs
from hybridflow.simulator.vocabulary.plan import DeviceGroup, Plan, RolePlan, default_micro_batch_tokens
from hybridflow.simulator.vocabulary.roles import ROLLOUT


def group_name(members: tuple[str, ...] | list[str]) -> str:
    return "-".join(members)  # "+" joins lanes in Timeline events (a broadcast spans two groups)


def scored_to_plan(req: SearchRequest, s: Scored, reshard: str = "hybridflow", notes: str = "") -> Plan:
    devs = assign_devices(s.counts, req.cluster)
    groups = [DeviceGroup(name=group_name(members), devices=d) for members, d in zip(s.placement, devs, strict=False)]
    set_of = {r: group_name(members) for members in s.placement for r in members}
    choice = dict(s.choice)
    rollout = choice.pop(ROLLOUT, None)  # separate rollout devices: the actor's generate_group
    roles = {}
    for role, cand in choice.items():
        gen = (rollout.generate if rollout else cand.generate) if role == "actor" else None
        roles[role] = RolePlan(model=req.models[role], group=set_of[role], train=cand.train, generate=gen,
                               generate_group=set_of[ROLLOUT] if rollout and role == "actor" else None,
                               path=req.paths.get(role), lora=req.lora_of(role),
                               micro_batch_tokens=default_micro_batch_tokens(req.workload, cand.train))
    mode = s.rollout
    plan = Plan(algorithm=req.algorithm, cluster=req.cluster, workload=req.workload, groups=groups, roles=roles,
                reshard=reshard, reward_function=req.reward_function, cost_function=req.cost_function,
                mode=mode.mode, max_staleness=max(mode.staleness, 1), offload=s.offload, agent=req.agent,
                notes=notes or f"hflow-plan search: {s.seconds:.3f} s per iteration (simulated)")
    # the rollout engine's memory share and batch, as priced (vLLM takes them; the native engine sizes its own)
    actor = plan.roles["actor"].model_copy(update=rollout_knobs(plan))
    return plan.model_copy(update={"roles": {**plan.roles, "actor": actor}})


def _cfg(c) -> dict:
    """pp, tp, dp, and the training engine, expert- and sequence-parallel sizes where they are not the default."""
    return {"pp": c.pp, "tp": c.tp, "dp": c.dp, **({"ep": c.ep} if c.ep > 1 else {}),
            **({"sp": c.sp} if c.sp > 1 else {}), **({"backend": c.backend} if c.backend != "fsdp" else {})}


def plan_summary(plan: Plan, iteration_seconds: float) -> dict:
    """The PLANSUMMARY of issue 3: placement, devices per role, parallel configs, seconds, tokens/s."""
    parallel = {}
    for role, rp in plan.roles.items():
        entry = {"train": _cfg(rp.train)}
        if role == "actor":
            entry["generate"] = _cfg(plan.generation_config())
        if rp.micro_batch_tokens is not None:
            entry["micro_batch_tokens"] = rp.micro_batch_tokens
        if rp.lora is not None:
            entry["lora"] = {"rank": rp.lora.rank, "alpha": rp.lora.lora_alpha,
                             "target_modules": list(rp.lora.targets(rp.model))}
            if role == "actor":
                entry["lora"]["rollout"] = plan.lora_rollout()
        parallel[role] = entry
    return {
        "placement": plan.placement(),
        "devices": {role: len(plan.group(rp.group).devices) for role, rp in plan.roles.items()},
        "parallel": parallel,
        "iteration_seconds": iteration_seconds,
        "tokens_per_second": plan.workload.tokens_per_iteration / iteration_seconds if iteration_seconds > 0 else 0.0,
    }
