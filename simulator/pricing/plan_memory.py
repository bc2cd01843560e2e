"""A Plan's memory, device group by device group: each group's models held as the runtime holds them
(states resident, one op's transient at a time), the group's peak against the device, whether a trained
role must recompute activations to fit, and what the actor's generation leaves its KV cache and rollout
engine. The bytes of one model and one op are memory.py's."""

from __future__ import annotations

import math

from pydantic import BaseModel, ConfigDict

from hybridflow.simulator.pricing.efficiency import EfficiencyParams
from hybridflow.simulator.pricing.memory import (
    InfeasibleError,
    MemoryBreakdown,
    engine_kv_cap,
    forward_transient,
    generate_transient,
    generation_shard_bytes,
    kv_bytes_per_sequence,
    memory_parts,
    state_bytes,
    train_transient,
)
from hybridflow.simulator.vocabulary.parallel import ParallelConfig
from hybridflow.simulator.vocabulary.roles import TRAINED_ROLES, role_head


class RoleMemory(BaseModel):
    model_config = ConfigDict(extra="forbid")

    role: str
    group: str
    bytes_per_device: float  # the group's peak: all colocated models as the runtime holds them
    fits: bool
    capacity: float  # bytes per device the runtime can fill (hbm × usable_memory_fraction)
    breakdown: MemoryBreakdown  # the group's parts at that peak
    own: MemoryBreakdown  # this model's states + its largest transient
    peak_op: str  # "role:op" at the group's peak
    recompute: bool = False  # trained roles: activations recomputed to fit
    decode_batch: int | None = None  # actor: sequences decoded at once per replica
    generate_bytes_per_device: float | None = None  # actor on separate generation devices: their peak


# The ops each role can run (the work whose transients a group's peak is taken over).
_OPS = {"actor": ("actor_update", "actor_logprob"), "critic": ("critic_update", "values"),
        "cost_critic": ("critic_update", "values"), "ref": ("ref_logprob",), "reward": ("reward",), "cost": ("cost",)}


def _kv_cap(plan, actor, gen: ParallelConfig) -> float:
    return engine_kv_cap(actor.model, gen, actor.rollout_memory_fraction, plan.cluster.hardware.hbm_bytes)


def _group_phases(plan, group: str, recompute: bool, p: EfficiencyParams):
    """(states by role, [(role, op, resident states, transient)]) for one device group."""
    usable = p.usable_bytes(plan.cluster.hardware.hbm_bytes)
    states = {r: state_bytes(rp.model, role_head(r), rp.train, r in TRAINED_ROLES, plan.optimizer_offload, rp.lora)
              for r, rp in plan.roles.items() if rp.group == group}
    everyone = sum(states.values(), memory_parts())
    phases = []
    for role, s in states.items():
        rp, head = plan.roles[role], role_head(role)
        resident = s if plan.offload else everyone
        for op in _OPS[role]:
            budget = getattr(rp, "micro_batch_tokens", None)  # packed micro-batches hold the plan's budget
            t = (train_transient(rp.model, head, rp.train, plan.workload, recompute, rp.lora, budget)
                 if op.endswith("_update") else forward_transient(rp.model, head, rp.train, plan.workload, budget))
            if plan.optimizer_offload and op.endswith("_update"):  # ZeRO-Offload moves the gradients out too
                t = t.model_copy(update={"gradients": 0.0})
            phases.append((role, op, resident, t))
        if role == "actor" and rp.generate_group is None:
            gen = rp.generate or rp.train
            t = generate_transient(rp.model, rp.train, gen, plan.workload, usable - resident.total, p,
                                   plan.weight_sync_mode(), s.weights, rp.lora, _kv_cap(plan, rp, gen))
            phases.append((role, "generate", resident, t))
    actor = plan.roles.get("actor")
    if actor is not None and actor.generate_group == group:  # separate inference devices
        gen = actor.generate or actor.train
        t = generate_transient(actor.model, actor.train, gen, plan.workload, usable, p, "broadcast", lora=actor.lora,
                               kv_cap=_kv_cap(plan, actor, gen))
        phases.append(("actor", "generate", memory_parts(), t))
    return states, phases


def _group_peak(plan, group: str, recompute: bool, p: EfficiencyParams):
    states, phases = _group_phases(plan, group, recompute, p)
    role, op, resident, t = max(phases, key=lambda x: x[2].total + x[3].total)
    peak = resident + t + memory_parts(buffers=p.reserved_bytes)
    limit = plan.cluster.hardware.hbm_bytes * p.usable_memory_fraction
    gen_ok = all(t.kv_cache > 0 for _, o, _, t in phases if o == "generate")
    return states, phases, peak, f"{role}:{op}", peak.total <= limit and gen_ok


def plan_recompute(plan, params: EfficiencyParams | None = None) -> dict[str, bool]:
    """Per trained role: whether its group needs activation recomputation to fit."""
    p = params or EfficiencyParams.for_hardware(plan.cluster.hardware)
    out = {}
    for g in {rp.group for rp in plan.roles.values()}:
        *_, ok = _group_peak(plan, g, False, p)
        for r, rp in plan.roles.items():
            if rp.group == g:
                out[r] = not ok
    return out


def plan_memory(plan, params: EfficiencyParams | None = None) -> dict[str, RoleMemory]:
    """Memory per device of every role's group, the colocated models summed as the runtime holds them."""
    p = params or EfficiencyParams.for_hardware(plan.cluster.hardware)
    limit = plan.cluster.hardware.hbm_bytes * p.usable_memory_fraction
    recompute = plan_recompute(plan, p)
    out: dict[str, RoleMemory] = {}
    for role, rp in plan.roles.items():
        states, phases, peak, peak_op, ok = _group_peak(plan, rp.group, recompute[role], p)
        mine = [t for r, _, _, t in phases if r == role]
        own = states[role] + max(mine, key=lambda m: m.total) + memory_parts(buffers=p.reserved_bytes)
        gen_t = [t for r, o, _, t in phases if o == "generate"]
        rm = RoleMemory(role=role, group=rp.group, bytes_per_device=peak.total, fits=ok, capacity=limit,
                        breakdown=peak, own=own, peak_op=peak_op,
                        recompute=recompute[role] and role in TRAINED_ROLES)
        if role == "actor":
            if rp.generate_group:
                _, gphases, gpeak, _, gok = _group_peak(plan, rp.generate_group, False, p)
                gen_t = [t for _, o, _, t in gphases if o == "generate"]
                rm.generate_bytes_per_device, rm.fits = gpeak.total, ok and gok
            gen = rp.generate or rp.train
            kv_seq = kv_bytes_per_sequence(rp.model, gen, plan.workload.kv_seq_len)
            rm.decode_batch = int(round(gen_t[0].kv_cache / kv_seq)) if gen_t else None
        out[role] = rm
    return out


def check_plan_memory(plan, params: EfficiencyParams | None = None) -> dict[str, RoleMemory]:
    """plan_memory, raising InfeasibleError (with the breakdown) for the first group that does not fit."""
    mem = plan_memory(plan, params)
    for m in mem.values():
        if not m.fits:
            where = f"group '{m.group}' ({', '.join(plan.roles_in(m.group))}) at {m.peak_op}"
            m.breakdown.require_fits(plan.cluster.hardware, where, params)
            raise InfeasibleError(f"{where}: no room for even one sequence's KV cache ({m.breakdown.describe()} "
                                  f"held per device); use a larger generation tp·pp, more devices or offload")
    return mem


def _generation_room(plan, p: EfficiencyParams) -> tuple[float, float]:
    """(bytes per device left beside everything resident and the generation weights, the logits' bytes) while
    the actor generates."""
    actor = plan.roles["actor"]
    group = actor.generate_group or actor.group
    _, phases = _group_phases(plan, group, plan_recompute(plan, p).get("actor", False), p)
    for _, op, resident, t in phases:
        if op == "generate":
            return p.usable_bytes(plan.cluster.hardware.hbm_bytes) - resident.total - t.weights, t.buffers
    return 0.0, 0.0


def kv_free_bytes(plan, params: EfficiencyParams | None = None) -> float:
    """Bytes per device left for the actor's KV cache while it generates (everything else resident), at most
    what the plan's rollout_memory_fraction gives the engine (engine_kv_cap)."""
    p = params or EfficiencyParams.for_hardware(plan.cluster.hardware)
    actor = plan.roles["actor"]
    room, logits = _generation_room(plan, p)
    return min(room, _kv_cap(plan, actor, actor.generate or actor.train)) - logits


def engine_memory_fraction(plan, params: EfficiencyParams | None = None) -> float:
    """The share of each device the rollout engine's weights and the room the plan leaves it take (vLLM's
    gpu_memory_utilization), rounded up to 1e-4 so that the cap it sets (engine_kv_cap) leaves the room whole."""
    p = params or EfficiencyParams.for_hardware(plan.cluster.hardware)
    actor = plan.roles["actor"]
    room, _ = _generation_room(plan, p)
    share = (room + generation_shard_bytes(actor.model, actor.generate or actor.train)) / plan.cluster.hardware.hbm_bytes
    return math.ceil(share * 1e4) / 1e4
