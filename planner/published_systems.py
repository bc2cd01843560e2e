"""The system tier of the published measurements (simulator/calibration/published.py), priced.

A `system_run` is one system's run of a workload: DeepSpeed-Chat, OpenRLHF and NeMo-Aligner as their
baselines build them (planner/baselines.py, on their mechanics), NeMo-RL as a plan of this simulator's own
(vLLM and Megatron, colocated on-policy or one step off on split devices, in the layout it states), HybridFlow
as the searched plan. Its metric is the iteration, its experience phase (generation and the scoring
forwards), its training phase (the rest), or a whole run of `iterations` iterations.

A `paper_study` is a ratio the HybridFlow paper states over its §8 grid: HybridFlow's searched plan (FSDP
and the 3D-HybridEngine: the search over Megatron layouts finds the same iteration within a few per cent,
at several times the time) against each baseline, per cell.

    value = price_system(point.setup)       # in the record's SI unit: seconds, a ratio, a fraction
"""

from __future__ import annotations

import statistics
from functools import cache

from hybridflow.planner.baselines import (
    Baseline,
    SystemSettings,
    ds_chat,
    nemo_aligner,
    openrlhf,
    openrlhf_colocated,
)
from hybridflow.planner.plans import scored_to_plan
from hybridflow.planner.request import SearchRequest
from hybridflow.planner.search import Planner
from hybridflow.simulator.calibration.gpu_fit import default_cost_model
from hybridflow.simulator.calibration.published import PaperStudySetup, SystemRunSetup
from hybridflow.simulator.errors import HflowError
from hybridflow.simulator.pricing.efficiency import engine_params
from hybridflow.simulator.pricing.memory import generation_shard_bytes
from hybridflow.simulator.pricing.plan_memory import kv_free_bytes
from hybridflow.simulator.vocabulary.hardware import ClusterSpec, hardware_preset
from hybridflow.simulator.vocabulary.model import ModelSpec, model_preset
from hybridflow.simulator.vocabulary.parallel import ParallelConfig
from hybridflow.simulator.vocabulary.plan import DeviceGroup, Plan, RolePlan
from hybridflow.simulator.vocabulary.timeline import GENERATE_OPS, UPDATE_OPS, WEIGHT_SYNC_OPS, Timeline
from hybridflow.simulator.vocabulary.workload import Workload

# The experience phase: generation and the forward passes that score it (OpenRLHF's "Generation" column).
EXPERIENCE_OPS = ("generate", "generate_baseline", "actor_logprob", "ref_logprob", "values", "reward", "cost")
RULE_REWARD = "hybridflow.runtime.tasks.math:reward"  # a rule-based reward: priced on the driver
BASELINE_FNS = {"ds-chat": ds_chat, "openrlhf": openrlhf, "nemo-aligner": nemo_aligner}
VLLM_BASELINES = ("openrlhf",)  # the baselines of the paper's grid that generate with vLLM (the others: own loops)


def _engine(vllm_version: str | None) -> dict:
    """The cost model's updates for a run that generates with vLLM `vllm_version` (None: no vLLM, or unstated)."""
    return engine_params("vllm", vllm_version)


def _model(ref) -> ModelSpec:
    return model_preset(ref) if isinstance(ref, str) else ModelSpec.model_validate(ref)


def _simulate(plan: Plan, cm) -> Timeline:
    from hybridflow.simulator.schedule.schedule import simulate

    return simulate(plan, cm)


def experience_seconds(tl: Timeline) -> float:
    """From the iteration's start to the end of its last experience op (a synchronous iteration: in a
    pipelined one the phases of two iterations overlap, and no phase has one span)."""
    if len(tl.iterations()) > 1:
        raise HflowError("phase seconds are defined for a synchronous iteration; this plan overlaps iterations")
    it = tl.iterations()[0]
    evs = [e for e in tl.events if e.iteration == it]
    start = min(e.start for e in evs)
    return max(e.end for e in evs if e.op in EXPERIENCE_OPS) - start


def transition_seconds(tl: Timeline) -> float:
    """The iteration's weight switches (reshards, weight syncs), summed."""
    it = tl.steady_iterations()[-1] if tl.steady_iterations() else 0
    return sum(e.end - e.start for e in tl.events if e.iteration == it and e.op in WEIGHT_SYNC_OPS)


# ---- one system's run -----------------------------------------------------------------------------
def _request(s: SystemRunSetup) -> SearchRequest:
    models = {r: _model(m) for r, m in s.models.items()}
    fn = RULE_REWARD if "reward" not in models else None
    return SearchRequest(algorithm=s.algorithm, models=models, cluster=s.cluster(), workload=Workload(**s.workload),
                         reward_function=fn, top_k=1)


def nemo_rl_plan(req: SearchRequest, settings: dict) -> Plan:
    """NeMo-RL's GRPO as it runs: vLLM and Megatron colocated on-policy (training states offloaded while vLLM
    generates), or one step off policy with generation on half the devices."""
    n, train = req.cluster.num_devices, settings["train"]
    colocated = settings["placement"] == "colocated"
    n_train = n if colocated else n // 2
    tr = ParallelConfig(tp=train["tp"], pp=train["pp"], dp=n_train // (train["tp"] * train["pp"]),
                        backend=train.get("backend", "megatron"))
    gtp = settings["generation_tp"]
    gen = ParallelConfig(tp=gtp, dp=(n if colocated else n - n_train) // gtp)
    devices = [DeviceGroup(name=name, devices=[d for d in _devices(req.cluster)[lo:hi]])
               for name, lo, hi in (("train", 0, n_train), ("rollout", n_train, n)) if hi > lo]
    # rollout "native": priced as vLLM is (cost.price_op), its weights switched by the 3D-HybridEngine's
    # gather of each tensor-parallel shard, as NeMo-RL's refit hands vLLM its shards (not our vLLM backend's
    # whole-model gather)
    # NeMo-RL packs sequences on Megatron (sequence_packing: train_mb_tokens = max_total_sequence_length x
    # train_micro_batch_size): the budget is set past RolePlan's validation, which refuses packing on the
    # megatron backend because our runtime does not pack there; this plan is priced, never run
    budget = req.workload.micro_batch_size * req.workload.seq_len if req.workload.response_lengths else None
    roles = {r: RolePlan(model=m, group="train", train=tr, generate=gen if r == "actor" else None,
                         generate_group=None if colocated or r != "actor" else "rollout")
             for r, m in req.models.items()}
    plan = Plan(algorithm=req.algorithm, cluster=req.cluster, workload=req.workload, groups=devices, roles=roles,
                reshard="broadcast" if not colocated else "hybridflow", reward_function=req.reward_function,
                offload=colocated, mode=settings.get("mode", "sync"),
                notes="NeMo-RL (vLLM + Megatron)")
    packed = {r: rp.model_copy(update={"micro_batch_tokens": budget}) for r, rp in plan.roles.items()}
    return plan.model_copy(update={"roles": packed})


def _devices(cluster: ClusterSpec):
    from hybridflow.simulator.vocabulary.plan import Device

    return [Device(node=k, index=i) for k in range(cluster.nodes) for i in range(cluster.devices_per_node)]


def _largest_batch(s: SystemRunSetup, fn, settings: SystemSettings) -> Baseline:
    """The system's plan at the largest per-device batch (generation batch = training micro-batch, one update per
    batch) that fits, at most the workload's prompts: halving from there until the memory model says it fits."""
    req = _request(s)
    n = req.cluster.num_devices
    per_device = max(1, req.workload.prompts // n)
    while True:
        w = req.workload.model_copy(update={"prompts": per_device * n, "micro_batch_size": per_device})
        b = fn(req.model_copy(update={"workload": w}), default_cost_model(req.cluster, **_engine(s.vllm_version)),
               settings)
        if b.fits or per_device == 1:
            return b
        per_device //= 2


def run_plan(s: SystemRunSetup) -> tuple[Plan, object]:
    """The plan `s` describes, and the cost model pricing it (the fitted defaults of its hardware)."""
    req = _request(s)
    cm = default_cost_model(req.cluster, **_engine(s.vllm_version))
    if s.system == "nemo-rl":
        return nemo_rl_plan(req, s.settings), cm
    if s.system == "hybridflow":
        best = Planner(req, cm).run().best
        if best is None:
            raise HflowError(f"{s.system}: no plan fits")
        return scored_to_plan(req, best), cm
    knobs = dict(s.settings)
    largest = knobs.pop("largest_batch", False)
    settings = SystemSettings(**knobs)
    fn = {"deepspeed-chat": ds_chat, "openrlhf": openrlhf, "openrlhf-colocated": openrlhf_colocated,
          "nemo-aligner": nemo_aligner}[s.system]
    b = _largest_batch(s, fn, settings) if largest else fn(req, cm, settings)
    if not b.fits:
        raise HflowError(f"{s.system}: {b.reason}")
    return b.plan, cm


def deepspeed_chat_timers(tl: Timeline) -> tuple[float, float]:
    """(generation, training) as DS-Chat step 3's main.py times them: its generate calls, its training loop
    (the optimizer steps); the scoring forwards between them are timed by neither (SystemRunSetup.timer)."""
    ops = tl.op_seconds()
    return (sum(ops.get(op, 0.0) for op in GENERATE_OPS), sum(ops.get(op, 0.0) for op in UPDATE_OPS))


def price_run(s: SystemRunSetup) -> float:
    plan, cm = run_plan(s)
    tl = _simulate(plan, cm)
    if s.timer == "deepspeed-chat":
        gen, train = deepspeed_chat_timers(tl)
        it = gen + train
    else:
        it = tl.iteration_seconds()
        gen = experience_seconds(tl) if s.metric in ("generation_seconds", "training_seconds") else 0.0
        train = it - gen
    if s.metric == "iteration_seconds":
        return it
    if s.metric == "run_seconds":
        return it * (s.samples / plan.workload.prompts if s.samples else s.iterations)
    return gen if s.metric == "generation_seconds" else train


# ---- the paper's grid -----------------------------------------------------------------------------
@cache
def _cell_request(hardware: str, model: str, n: int, algorithm: str, workload: Workload,
                  critic: str | None = None) -> SearchRequest:
    cluster = ClusterSpec(hardware=hardware_preset(hardware), nodes=max(1, n // 8), devices_per_node=min(8, n))
    from hybridflow.simulator.algorithms import get_algorithm

    roles = get_algorithm(algorithm).roles
    over = {r: model_preset(critic) for r in ("critic", "reward", "cost") if r in roles} if critic else None
    return SearchRequest.for_algorithm(algorithm, model_preset(model), cluster, workload, overrides=over, top_k=1)


@cache
def _hybridflow(hardware: str, model: str, n: int, algorithm: str, workload: Workload,
                vllm_version: str | None = None) -> Timeline | None:
    req = _cell_request(hardware, model, n, algorithm, workload)
    cm = default_cost_model(req.cluster, **_engine(vllm_version))
    best = Planner(req, cm).run().best
    return _simulate(scored_to_plan(req, best), cm) if best else None


@cache
def _baseline(name: str, hardware: str, model: str, n: int, algorithm: str, workload: Workload,
              vllm_version: str | None = None) -> tuple[Baseline, Timeline | None]:
    req = _cell_request(hardware, model, n, algorithm, workload)
    cm = default_cost_model(req.cluster, **_engine(vllm_version if name in VLLM_BASELINES else None))
    if name == "nemo-aligner" and "critic" not in req.models:  # v0.2 trains PPO's actor-critic only (§8.1: no ReMax)
        return Baseline(name, reason="NeMo-Aligner v0.2 runs actor-critic PPO only"), None
    b = BASELINE_FNS[name](req, cm)
    return b, (_simulate(b.plan, cm) if b.fits else None)


def _cells(s: PaperStudySetup):
    w = Workload(**s.workload)
    for algorithm in s.algorithms:
        for model, counts in s.grid.items():
            for n in counts:
                yield algorithm, model, n, w


def _stat(values: list[float], statistic: str, what: str) -> float:
    if not values:
        raise HflowError(f"{what}: no cell of the grid fits both systems")
    return {"mean": statistics.mean, "max": max, "min": min, "one": lambda v: v[0]}[statistic](values)


def _generation_tp(s: PaperStudySetup) -> float:
    """1 - generation(t_g) / generation(t_g'): every model colocated in the `train` layout, the actor generating
    with tp t_g, pp 1 and micro-dp 8/t_g (Fig. 15)."""
    from hybridflow.simulator.schedule.schedule import plan_dataflow, price_dataflow

    (model, (n,)), = s.grid.items()
    req = _cell_request(s.hardware, model, n, s.algorithms[0], Workload(**s.workload))
    cm = default_cost_model(req.cluster, **_engine(s.vllm_version))
    group = DeviceGroup(name="all", devices=_devices(req.cluster)[:n])
    train = s.train.model_copy(update={"dp": n // (s.train.tp * s.train.pp)})

    def gen_seconds(tg: int) -> float:
        roles = {r: RolePlan(model=m, group="all", train=train,
                             generate=ParallelConfig(tp=tg, dp=n // tg) if r == "actor" else None)
                 for r, m in req.models.items()}
        plan = Plan(algorithm=req.algorithm, cluster=req.cluster, workload=req.workload, groups=[group], roles=roles)
        if s.kv_share_of_free_memory is not None:  # as the plan's knob: the engine's weights and KV in the device
            actor = plan.roles["actor"]
            kv = s.kv_share_of_free_memory * kv_free_bytes(plan, cm.params)
            share = (generation_shard_bytes(actor.model, actor.generate) + kv) / req.cluster.hardware.hbm_bytes
            actor = actor.model_copy(update={"rollout_memory_fraction": min(share, 1.0)})
            plan = plan.model_copy(update={"roles": {**plan.roles, "actor": actor}})
        graph, _ = plan_dataflow(plan)
        costs = price_dataflow(plan, graph, cm)
        return sum(c.seconds for node, c in costs.items() if graph.nodes[node]["op"] == "generate")

    a, b = s.generation_tp
    return 1.0 - gen_seconds(a) / gen_seconds(b)


def _colocate_gain(s: PaperStudySetup) -> float:
    """Colocate's throughput over the best other placement's (standalone, split), minus one, per GPU count."""
    gains = []
    for algorithm, model, n, w in _cells(s):
        req = _cell_request(s.hardware, model, n, algorithm, w, s.critic_model)
        planner = Planner(req, default_cost_model(req.cluster, **_engine(s.vllm_version)))
        roles = req.roles
        colocate = planner.best_placement((roles,))
        others = [planner.best_placement(tuple((r,) for r in roles)),
                  planner.best_placement((("actor", "ref"), tuple(r for r in roles if r not in ("actor", "ref"))))]
        others = [o.seconds for o in others if o is not None]
        if colocate is not None and others:
            gains.append(min(others) / colocate.seconds - 1.0)
    return _stat(gains, s.statistic, "colocate_gain")


def _strong_scaling(s: PaperStudySetup) -> float:
    """(throughput at the largest count / at the smallest) / (largest / smallest), per algorithm and size, averaged."""
    effs = []
    for algorithm in s.algorithms:
        for model, counts in s.grid.items():
            w = Workload(**s.workload)
            fits = [(n, tl) for n in counts
                    if (tl := _hybridflow(s.hardware, model, n, algorithm, w, s.vllm_version)) is not None]
            if len(fits) >= 2:
                (n0, t0), (n1, t1) = fits[0], fits[-1]
                effs.append((t0.iteration_seconds() / t1.iteration_seconds()) / (n1 / n0))
    return _stat(effs, "mean", "strong_scaling")


def price_study(s: PaperStudySetup) -> float:
    if s.study == "generation_tp_reduction":
        return _generation_tp(s)
    if s.study == "colocate_gain":
        return _colocate_gain(s)
    if s.study == "strong_scaling":
        return _strong_scaling(s)
    values = []
    for algorithm, model, n, w in _cells(s):
        ours = _hybridflow(s.hardware, model, n, algorithm, w, s.vllm_version)
        for name in s.baselines:
            b, tl = _baseline(name, s.hardware, model, n, algorithm, w, s.vllm_version)
            if ours is None or tl is None:
                continue
            if s.study == "speedup":
                values.append(tl.iteration_seconds() / ours.iteration_seconds())
            elif s.study == "generation_share":
                values.append(experience_seconds(tl) / tl.iteration_seconds())
            elif s.study == "transition_reduction":
                theirs = transition_seconds(tl)
                if theirs > 0:
                    values.append(1.0 - transition_seconds(ours) / theirs)
    return _stat(values, s.statistic, s.study)


def price_system(setup) -> float:
    """A system-tier setup's figure in its record's SI unit (module docstring)."""
    if isinstance(setup, SystemRunSetup):
        return price_run(setup)
    if isinstance(setup, PaperStudySetup):
        return price_study(setup)
    raise HflowError(f"no system-tier pricing for setup {type(setup).__name__}")
