"""The systems HybridFlow is compared with, as Plans priced by the same simulator on their own mechanics
(paper §8; each system's docs; simulator/vocabulary/mechanics.py says what each mechanic does and prices).

- ds-chat: DeepSpeed-Chat. Every model on every device, ZeRO-3 (pp=tp=1, dp=N). With its Hybrid Engine
  (the default) the actor gathers the whole model into inference kernels (reshard "ds-chat"; tensor-parallel
  over `inference_tp` devices) and generates each PPO mini-batch's prompts on its own, switching once per
  mini-batch. Without it (`hybrid_engine: false`, as OpenRLHF's benchmark ran it) HF generate runs on the
  actor's training layout, `generation_batch` sequences per device at a time: under ZeRO-3 gathering every layer
  at every decode step, under ZeRO-2 (`actor_zero_stage: 2`, that benchmark's) on a whole local replica. Its
  `--offload` (`optimizer_offload`) also keeps its ZeRO-3 models' parameters in host memory (`param_offload`). Either
  generation loop (over the Hybrid Engine's containers, or HF's eager one) is priced with its CPU's time per
  layer (simulator/pricing/baseline_mechanics.py).
- openrlhf: OpenRLHF v0.2 on Ray. Every model on devices of its own (ZeRO-3, activation checkpointing) and
  vLLM engines on others, handed `generation_batch` prompts per call (micro_rollout_batch_size) by each
  actor rank, a call's finished sequences leaving vLLM's batch while it waits for its longest, and each call's
  batch scored (by the rank and the reference, reward and critic groups) before the rank's next call; the actor's
  weights are gathered and broadcast one tensor at a time. Its experiences, and the shuffled micro-batches it
  trains on, are padded to their own batch's longest response. Without vLLM
  (`vllm: false`) the actor generates with HF generate (eager, FlashAttention-2) on its own devices, under
  `actor_zero_stage`. OpenRLHF leaves the split to the user: `split` where a source states it, else devices in
  proportion to each group's work.
- openrlhf-colocated: OpenRLHF's DeepSpeed trainer without Ray: every model on every device and HF generate
  (FlashAttention-2) under `actor_zero_stage` — DS-Chat's layout without its Hybrid Engine.
- nemo-aligner: actor and reference on one half of the cluster, critic and reward (and cost) on the other,
  Megatron 3D parallel; generation in the training layout (no resharding), `generation_batch`
  (rollout_micro_batch_size) sequences per data-parallel rank at a time, in Megatron's eager loop. Its configs
  come from the same search restricted to that placement, re-priced on these mechanics.
- hybridflow-v: our best placement and allocation with the vanilla reshard grouping (Table 2): the whole
  model gathered per t·p replica; its configs searched again under that reshard.

A baseline that cannot fit reports why instead of a number.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from pydantic import BaseModel, ConfigDict, PositiveInt

from hybridflow.planner.configs import train_configs
from hybridflow.planner.placement import allocations, assign_devices, size_options
from hybridflow.planner.plans import group_name, plan_summary, scored_to_plan
from hybridflow.planner.request import SearchRequest
from hybridflow.simulator.errors import HflowError
from hybridflow.simulator.vocabulary.mechanics import Mechanics
from hybridflow.simulator.vocabulary.parallel import ParallelConfig
from hybridflow.simulator.vocabulary.plan import DeviceGroup, Plan, RolePlan
from hybridflow.simulator.vocabulary.roles import TRAINED_ROLES, role_head
from hybridflow.simulator.vocabulary.units import GiB

BASELINES = ("ds-chat", "openrlhf", "nemo-aligner", "hybridflow-v")


class SystemSettings(BaseModel):
    """What a baseline's user sets, where a run states it; the defaults are each system's own (module docstring)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    hybrid_engine: bool = True  # ds-chat: --enable_hybrid_engine
    inference_tp: PositiveInt | None = None  # ds-chat: --inference_tp_size (None: the smallest that fits)
    vllm: bool = True  # openrlhf: vLLM engines (else HF generate on the actor's devices)
    vllm_tp: PositiveInt | None = None  # openrlhf: --vllm_tensor_parallel_size (None: the fastest)
    split: dict[str, PositiveInt] | None = None  # openrlhf: devices per role (and "rollout" for vLLM)
    generation_batch: PositiveInt | None = None  # sequences per replica per generate call (None: the system's default)
    optimizer_offload: bool = False  # ZeRO-Offload of the trained models' Adam states
    # ds-chat --actor_zero_stage / openrlhf --zero_stage: at 2 the actor's weights stay whole on every device, so
    # HF generate runs on a local replica (no gather); at 3 it gathers every layer at every decode step
    actor_zero_stage: Literal[2, 3] = 3


# Each system's own generation batch where it has one: OpenRLHF's benchmark's micro_rollout_batch_size (16,
# benchmark/README.md), NeMo-Aligner v0.2.0's rollout_micro_batch_size (8, gpt_ppo_actor.yaml), DS-Chat's
# per-device generation batch when generating under ZeRO-3 (8, OpenRLHF's benchmark of it).
DEFAULT_GENERATION_BATCH = {"openrlhf": 16, "nemo-aligner": 8, "ds-chat": 8}
NEMO_LAYOUTS = 16  # the search's leading layouts re-priced on NeMo-Aligner's mechanics


@dataclass
class Baseline:
    name: str
    plan: Plan | None = None
    seconds: float | None = None
    reason: str | None = None

    @property
    def fits(self) -> bool:
        return self.plan is not None and self.reason is None

    def json(self) -> dict:
        if not self.fits:
            return {"fits": False, "reason": self.reason or "no plan"}
        return plan_summary(self.plan, self.seconds)

    @property
    def tokens_per_second(self) -> float | None:
        return self.plan.workload.tokens_per_iteration / self.seconds if self.fits and self.seconds else None


def price_plan(name: str, plan: Plan, cost_model) -> Baseline:
    """Simulate `plan`; a plan whose memory model says it does not fit gets a reason, no number."""
    from hybridflow.simulator.pricing.plan_memory import plan_memory
    from hybridflow.simulator.schedule.schedule import simulate

    try:
        memory = plan_memory(plan)
    except HflowError as e:
        return Baseline(name, plan, reason=str(e))
    bad = [(r, m) for r, m in memory.items() if not m.fits]
    if bad:
        role, m = bad[0]
        usable = cost_model.params.usable_bytes(plan.cluster.hardware.hbm_bytes)
        what = m.breakdown.describe() if hasattr(m.breakdown, "describe") else str(m.breakdown)
        return Baseline(name, plan, reason=f"{role} needs {m.bytes_per_device / GiB:.1f} GiB per device "
                                           f"({what}) in group '{plan.roles[role].group}' but a device offers "
                                           f"{usable / GiB:.1f} GiB")
    try:
        timeline = simulate(plan, cost_model)
    except HflowError as e:
        return Baseline(name, plan, reason=str(e))
    return Baseline(name, plan, seconds=timeline.iteration_seconds())


def _role_plans(req: SearchRequest, group_of: dict[str, str], train: dict[str, ParallelConfig],
                gen: ParallelConfig | None = None, gen_group: str | None = None) -> dict[str, RolePlan]:
    return {r: RolePlan(model=req.models[r], group=group_of[r], train=train[r],
                        generate=gen if r == "actor" else None, generate_group=gen_group if r == "actor" else None,
                        path=req.paths.get(r))
            for r in req.roles}


def _plan(req: SearchRequest, groups, roles, reshard: str, notes: str, mechanics: Mechanics,
          settings: SystemSettings) -> Plan:
    return Plan(algorithm=req.algorithm, cluster=req.cluster, workload=req.workload, groups=groups, roles=roles,
                reshard=reshard, reward_function=req.reward_function, cost_function=req.cost_function, notes=notes,
                mechanics=mechanics, optimizer_offload=settings.optimizer_offload)


def _hf_generate(system: str, settings: SystemSettings) -> Mechanics:
    """HF generate on the actor's training devices: a static batch per device; under ZeRO-3 every layer gathered
    at every step, under ZeRO-2 a whole local replica. Its eager loop's price is set once the plan exists
    (`_eager_loop`)."""
    batch = settings.generation_batch or DEFAULT_GENERATION_BATCH["ds-chat"]
    return Mechanics(system=system, batching="static", generation_batch=batch,
                     gather_every_step=settings.actor_zero_stage == 3, rows_padded_per_batch=system == "openrlhf")


def _eager_loop_or_plan(plan: Plan, cost_model, loop: str = "hf-eager") -> Plan:
    """_eager_loop, or `plan` as it is where it cannot be priced (price_plan then says why)."""
    try:
        return _eager_loop(plan, cost_model, loop)
    except HflowError:
        return plan


def _eager_loop(plan: Plan, cost_model, loop: str = "hf-eager") -> Plan:
    """`plan` with its generation priced as HF generate's loop runs it (simulator/pricing/baseline_mechanics.py)."""
    from hybridflow.simulator.pricing.baseline_mechanics import hf_generate_slowdown

    slowdown = hf_generate_slowdown(cost_model, plan, loop)
    return plan.model_copy(update={"mechanics": plan.mechanics.model_copy(update={"decode_slowdown": slowdown})})


# ---- DeepSpeed-Chat (and OpenRLHF's colocated DeepSpeed trainer) ----------------------------------
def ds_chat(req: SearchRequest, cost_model, settings: SystemSettings = SystemSettings(),
            name: str = "ds-chat") -> Baseline:
    n = req.cluster.num_devices
    zero3 = ParallelConfig(dp=n, backend="deepspeed")  # ZeRO-3 on HF model code
    group = DeviceGroup(name="all", devices=assign_devices((n,), req.cluster)[0])
    system = "openrlhf" if name == "openrlhf-colocated" else "deepspeed-chat"
    gen_layout = zero3.generation_layout()
    if settings.hybrid_engine and name == "ds-chat":
        if settings.inference_tp is None:  # DS-Chat's users raise --inference_tp_size until the actor fits
            tps = [t for t in (1, 2, 4, 8) if t <= req.cluster.devices_per_node and n % t == 0]
            tried = [ds_chat(req, cost_model, settings.model_copy(update={"inference_tp": t})) for t in tps]
            return next((b for b in tried if b.fits), tried[-1])
        tp = settings.inference_tp
        if n % tp:
            return Baseline(name, reason=f"inference_tp {tp} does not divide the {n} devices")
        gen = ParallelConfig(tp=tp, dp=n // tp)
        w = req.workload
        per_call = -(-w.sequences // (w.mini_batches * gen.dp))  # one mini-batch's share per replica
        mech = Mechanics(system=system, batching="static", generation_batch=settings.generation_batch or per_call,
                         generate_per_minibatch=True)
        reshard, what = "ds-chat", f"Hybrid Engine (inference tp {tp}), one generation per mini-batch"
    else:
        gen, mech, reshard = gen_layout, _hf_generate(system, settings), "ds-chat"
        what = f"HF generate under ZeRO-{settings.actor_zero_stage}"
    if settings.optimizer_offload and system == "deepspeed-chat":
        # --offload sets offload_param with offload_optimizer for the actor and critic and for the reward model;
        # DeepSpeed honours it on a ZeRO-3 model only (its critic and reward here; the actor at actor_zero_stage 3)
        mech = mech.model_copy(update={"param_offload": tuple(
            r for r in req.roles if r in ("critic", "reward") or (r == "actor" and settings.actor_zero_stage == 3))})
    roles = _role_plans(req, {r: "all" for r in req.roles}, {r: zero3 for r in req.roles}, gen=gen)
    plan = _plan(req, [group], roles, reshard, f"baseline: {name} (all colocated, ZeRO-3, {what})", mech, settings)
    # HF generate's loop, over the Hybrid Engine's fused containers or over the eager HF model (DS-Chat's own
    # attention; OpenRLHF's DeepSpeed trainer loads FlashAttention-2, its scripts' --flash_attn)
    loop = "hybrid-engine" if mech.generate_per_minibatch else "hf-eager-fa2" if system == "openrlhf" else "hf-eager"
    plan = _eager_loop_or_plan(plan, cost_model, loop)
    return price_plan(name, plan, cost_model)


def openrlhf_colocated(req: SearchRequest, cost_model, settings: SystemSettings = SystemSettings()) -> Baseline:
    return ds_chat(req, cost_model, settings.model_copy(update={"hybrid_engine": False}), name="openrlhf-colocated")


# ---- OpenRLHF -------------------------------------------------------------------------------------
def _zero3_fits(req: SearchRequest, role: str, n: int, cost_model, settings: SystemSettings) -> bool:
    from hybridflow.simulator.pricing.memory import role_memory

    usable = cost_model.params.usable_bytes(req.cluster.hardware.hbm_bytes)
    m = role_memory(req.models[role], role_head(role), ParallelConfig(dp=n), req.workload, role in TRAINED_ROLES,
                    req.cluster.hardware, recompute=True)  # OpenRLHF checkpoints activations
    if settings.optimizer_offload and role in TRAINED_ROLES:
        return m.total - m.optimizer <= usable
    return m.total <= usable


def _rollout_configs(req: SearchRequest, n: int, tp: int | None = None) -> tuple[ParallelConfig, ...]:
    return tuple(c for c in train_configs(req.models["actor"], n, req.cluster.devices_per_node)
                 if c.pp == 1 and (tp is None or c.tp == tp))


def _rollout_seconds(req, n, cost_model, settings: SystemSettings) -> tuple[float, ParallelConfig | None]:
    best = (float("inf"), None)
    batch = settings.generation_batch or DEFAULT_GENERATION_BATCH["openrlhf"]
    for g in _rollout_configs(req, n, settings.vllm_tp):
        try:
            s = cost_model.generate(req.models["actor"], g, req.workload, batch_cap=batch).seconds
        except HflowError:
            continue
        best = min(best, (s, g), key=lambda x: x[0])
    return best


def _split(weights: list[float], mins: list[int], req: SearchRequest) -> tuple[int, ...] | None:
    """Devices for each group, at least its minimum, legal sizes, all devices used, as balanced as
    possible (least max work / devices). With a node or more per group: water-filling, one node at
    a time to the most loaded group; on fewer nodes: every legal split is tried."""
    c = req.cluster
    d = c.devices_per_node
    if c.nodes >= len(weights):
        sizes = [max(d, -(-m // d) * d) for m in mins]
        if sum(sizes) > c.num_devices:
            return None
        while sum(sizes) < c.num_devices:
            i = max(range(len(sizes)), key=lambda i: weights[i] / sizes[i])
            sizes[i] += d
        return tuple(sizes)
    best = min(allocations(mins, c), key=lambda a: max(w / n for w, n in zip(weights, a, strict=False)), default=None)
    return best


def openrlhf(req: SearchRequest, cost_model, settings: SystemSettings = SystemSettings()) -> Baseline:
    n_all = req.cluster.num_devices
    names = list(req.roles) + (["rollout"] if settings.vllm else [])
    if len(names) > n_all:
        return Baseline("openrlhf", reason=f"{len(names)} groups ({', '.join(names)}) need at least {len(names)} "
                                           f"devices; the cluster has {n_all}")
    if settings.split is not None:
        sizes = tuple(settings.split.get(nm, 0) for nm in names)
        if set(settings.split) != set(names) or sum(sizes) != n_all:
            return Baseline("openrlhf", reason=f"split {settings.split} must give each of {', '.join(names)} "
                                               f"devices, {n_all} in all")
    else:
        whole = ParallelConfig(dp=n_all)
        work = []
        for r in req.roles:
            m, head = req.models[r], role_head(r)
            w = cost_model.forward(m, head, whole, req.workload).seconds
            if r in TRAINED_ROLES:
                w += cost_model.train(m, head, whole, req.workload).seconds
            work.append(w)
        opts = size_options(req.cluster)
        mins = [next((o for o in opts if _zero3_fits(req, r, o, cost_model, settings)), None) for r in req.roles]
        if settings.vllm:
            work.append(_rollout_seconds(req, n_all, cost_model, settings)[0])
            mins.append(next((o for o in opts if _rollout_configs(req, o, settings.vllm_tp)), None))
        if any(m is None for m in mins):
            why = next(names[i] for i, m in enumerate(mins) if m is None)
            return Baseline("openrlhf", reason=f"{why} does not fit even on all {n_all} devices by itself (ZeRO-3 "
                                               f"with activation checkpointing)")
        sizes = _split(work, mins, req)
        if sizes is None:
            return Baseline("openrlhf", reason=f"no split of {n_all} devices gives each of {', '.join(names)} its "
                                               f"minimum ({', '.join(f'{a} {b}' for a, b in zip(names, mins, strict=False))})")
    devs = assign_devices(sizes, req.cluster)
    groups = [DeviceGroup(name=nm if nm == "rollout" else group_name((nm,)), devices=d)
              for nm, d in zip(names, devs, strict=True)]
    train = {r: ParallelConfig(dp=s, backend="deepspeed") for r, s in zip(req.roles, sizes, strict=False)}
    batch = settings.generation_batch or DEFAULT_GENERATION_BATCH["openrlhf"]
    if settings.vllm:
        gen = _rollout_seconds(req, sizes[-1], cost_model, settings)[1]
        if gen is None:
            return Baseline("openrlhf", reason=f"no vLLM layout of the actor fits {sizes[-1]} devices")
        mech = Mechanics(system="openrlhf", batching="static", generation_batch=batch, weight_sync="per-tensor",
                         drain_calls=True, rows_padded_per_batch=True, score_per_call=True)
        roles = _role_plans(req, {r: r for r in req.roles}, train, gen=gen, gen_group="rollout")
        reshard, what = "broadcast", "vLLM rollout, per-tensor broadcast"
    else:
        mech = _hf_generate("openrlhf", settings.model_copy(update={"generation_batch": batch})).model_copy(
            update={"score_per_call": True})
        roles = _role_plans(req, {r: r for r in req.roles}, train, gen=train["actor"].generation_layout())
        reshard, what = "ds-chat", f"HF generate under ZeRO-{settings.actor_zero_stage}"
    plan = _plan(req, groups, roles, reshard, f"baseline: OpenRLHF (separate devices per model, {what})", mech,
                 settings)
    if not settings.vllm:  # OpenRLHF loads its models with FlashAttention-2 (its scripts' --flash_attn)
        plan = _eager_loop_or_plan(plan, cost_model, "hf-eager-fa2")
    return price_plan("openrlhf", plan, cost_model)


# ---- NeMo-Aligner ---------------------------------------------------------------------------------
def nemo_halves(req: SearchRequest) -> tuple[tuple[tuple[str, ...], ...], tuple[int, ...]] | None:
    first = tuple(r for r in req.roles if r in ("actor", "ref"))
    second = tuple(r for r in req.roles if r not in first)
    if not second:
        return (first,), (req.cluster.num_devices,)
    c = req.cluster
    if c.nodes >= 2:
        counts = ((c.nodes + 1) // 2 * c.devices_per_node, c.nodes // 2 * c.devices_per_node)
    elif c.devices_per_node % 2 == 0:
        counts = (c.devices_per_node // 2,) * 2
    else:
        return None
    return (first, second), counts


def nemo_aligner(req: SearchRequest, cost_model, settings: SystemSettings = SystemSettings()) -> Baseline:
    from hybridflow.planner.search import Planner

    split = nemo_halves(req)
    if split is None:
        return Baseline("nemo-aligner", reason="the cluster cannot be cut in two halves")
    placement, counts = split
    megatron = req.model_copy(update={"backends": ("megatron",)})  # NeMo trains on Megatron
    # the search prices generation as a serving engine would; NeMo-Aligner's users pick the layout under its
    # own generation loop, so the search's leading layouts are re-priced on NeMo-Aligner's mechanics
    top = Planner(megatron, cost_model, generate_rule="same").top_for(placement, counts, NEMO_LAYOUTS)
    if not top:
        return Baseline("nemo-aligner", reason=f"{' | '.join('+'.join(s) for s in placement)} on "
                                               f"{' | '.join(map(str, counts))} devices: no parallel configs fit "
                                               f"the memory with generation in the training partitions")
    batch = settings.generation_batch or DEFAULT_GENERATION_BATCH["nemo-aligner"]
    mech = Mechanics(system="nemo-aligner", batching="static", generation_batch=batch)
    priced = []
    for s in top:
        plan = scored_to_plan(megatron, s, notes="baseline: NeMo-Aligner (actor+ref | critic+reward, generation in "
                                                 "the training layout)")
        plan = plan.model_copy(update={"mechanics": mech, "optimizer_offload": settings.optimizer_offload})
        priced.append(price_plan("nemo-aligner", _eager_loop_or_plan(plan, cost_model, "megatron"), cost_model))
    fitting = [b for b in priced if b.fits]
    return min(fitting, key=lambda b: b.seconds) if fitting else priced[0]


# ---- HybridFlow-V ---------------------------------------------------------------------------------
def hybridflow_v(req: SearchRequest, cost_model, best) -> Baseline:
    """Our placement and allocation; the best configs under the vanilla reshard's prices and memory."""
    from hybridflow.planner.search import Planner

    if best is None:
        return Baseline("hybridflow-v", reason="the search found no plan that fits")
    found = Planner(req, cost_model, reshard="hybridflow-v").best_for(best.placement, best.counts)
    if found is None:
        where = " | ".join("+".join(s) for s in best.placement)
        return Baseline("hybridflow-v", reason=f"{where} on {' | '.join(map(str, best.counts))} devices: with the "
                                               f"vanilla reshard (whole model gathered per t·p replica) no "
                                               f"configs fit the memory")
    plan = scored_to_plan(req, found, reshard="hybridflow-v", notes="baseline: HybridFlow-V (vanilla reshard)")
    return price_plan("hybridflow-v", plan, cost_model)


def price_baselines(req: SearchRequest, planner, result) -> dict[str, Baseline]:
    cm = planner.cm
    return {
        "ds-chat": ds_chat(req, cm),
        "openrlhf": openrlhf(req, cm),
        "nemo-aligner": nemo_aligner(req, cm),
        "hybridflow-v": hybridflow_v(req, cm, result.best),
    }
