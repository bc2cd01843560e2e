"""The systems HybridFlow is compared with, as Plans priced by the same simulator (paper §8).

- ds-chat: DeepSpeed-Chat. Every model on every device, ZeRO-3 (pp=tp=1, dp=N); the actor
  generates in its training layout after an all-gather of the whole model (reshard "ds-chat").
- openrlhf: every model on devices of its own, ZeRO-3 training, and generation on separate
  vLLM devices (pp=1, the fastest tp) that receive the actor's weights by a broadcast every
  iteration. OpenRLHF leaves the split to the user; we give each group devices in proportion to
  its work (its op seconds on the whole cluster), rounded to the allocation rule.
- nemo-aligner: actor and reference on one half of the cluster, critic and reward (and cost) on
  the other, 3D parallel; generation uses the training partitions (no resharding). The best
  configs for that placement come from the same search (planner restricted to it).
- hybridflow-v: our best placement and allocation with the vanilla reshard grouping (Table 2):
  the whole model gathered per t·p replica; its configs searched again under that reshard.

A baseline that cannot fit reports why instead of a number.
"""

from __future__ import annotations

from dataclasses import dataclass

from hybridflow.planner.configs import train_configs
from hybridflow.planner.placement import allocations, assign_devices, size_options
from hybridflow.planner.plans import group_name, plan_summary, scored_to_plan
from hybridflow.planner.request import SearchRequest
from hybridflow.simulator.errors import HflowError
from hybridflow.simulator.vocabulary.parallel import ParallelConfig
from hybridflow.simulator.vocabulary.plan import DeviceGroup, Plan, RolePlan
from hybridflow.simulator.vocabulary.roles import TRAINED_ROLES, role_head
from hybridflow.simulator.vocabulary.units import GiB

BASELINES = ("ds-chat", "openrlhf", "nemo-aligner", "hybridflow-v")


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
    from hybridflow.simulator.pricing.memory import plan_memory
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


def _plan(req: SearchRequest, groups, roles, reshard: str, notes: str) -> Plan:
    return Plan(algorithm=req.algorithm, cluster=req.cluster, workload=req.workload, groups=groups, roles=roles,
                reshard=reshard, reward_function=req.reward_function, cost_function=req.cost_function, notes=notes)


# ---- DeepSpeed-Chat -------------------------------------------------------------------------------
def ds_chat(req: SearchRequest, cost_model) -> Baseline:
    n = req.cluster.num_devices
    zero3 = ParallelConfig(dp=n)
    group = DeviceGroup(name="all", devices=assign_devices((n,), req.cluster)[0])
    roles = _role_plans(req, {r: "all" for r in req.roles}, {r: zero3 for r in req.roles}, gen=zero3)
    plan = _plan(req, [group], roles, "ds-chat", "baseline: DeepSpeed-Chat (all colocated, ZeRO-3, full all-gather)")
    return price_plan("ds-chat", plan, cost_model)


# ---- OpenRLHF -------------------------------------------------------------------------------------
def _zero3_fits(req: SearchRequest, role: str, n: int, cost_model) -> bool:
    from hybridflow.simulator.pricing.memory import role_memory

    usable = cost_model.params.usable_bytes(req.cluster.hardware.hbm_bytes)
    m = role_memory(req.models[role], role_head(role), ParallelConfig(dp=n), req.workload, role in TRAINED_ROLES,
                    req.cluster.hardware, recompute=True)  # OpenRLHF checkpoints activations
    return m.total <= usable


def _rollout_configs(req: SearchRequest, n: int) -> tuple[ParallelConfig, ...]:
    return tuple(c for c in train_configs(req.models["actor"], n, req.cluster.devices_per_node) if c.pp == 1)


def _rollout_seconds(req, n, cost_model) -> tuple[float, ParallelConfig | None]:
    best = (float("inf"), None)
    for g in _rollout_configs(req, n):
        try:
            s = cost_model.generate(req.models["actor"], g, req.workload).seconds
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


def openrlhf(req: SearchRequest, cost_model) -> Baseline:
    n_all = req.cluster.num_devices
    names = list(req.roles) + ["rollout"]
    whole = ParallelConfig(dp=n_all)
    work = []
    for r in req.roles:
        m, head = req.models[r], role_head(r)
        w = cost_model.forward(m, head, whole, req.workload).seconds
        if r in TRAINED_ROLES:
            w += cost_model.train(m, head, whole, req.workload).seconds
        work.append(w)
    work.append(_rollout_seconds(req, n_all, cost_model)[0])
    opts = size_options(req.cluster)
    mins = []
    for r in req.roles:
        mins.append(next((o for o in opts if _zero3_fits(req, r, o, cost_model)), None))
    mins.append(next((o for o in opts if _rollout_configs(req, o)), None))
    if len(names) > n_all:
        return Baseline("openrlhf", reason=f"{len(names)} groups ({', '.join(names)}) need at least {len(names)} "
                                           f"devices; the cluster has {n_all}")
    if any(m is None for m in mins):
        why = next(names[i] for i, m in enumerate(mins) if m is None)
        return Baseline("openrlhf", reason=f"{why} does not fit even on all {n_all} devices by itself (ZeRO-3 "
                                           f"with activation checkpointing)")
    sizes = _split(work, mins, req)
    if sizes is None:
        return Baseline("openrlhf", reason=f"no split of {n_all} devices gives each of {', '.join(names)} its "
                                           f"minimum ({', '.join(f'{a} {b}' for a, b in zip(names, mins, strict=False))})")
    devs = assign_devices(sizes, req.cluster)
    groups = [DeviceGroup(name=nm if nm == "rollout" else group_name((nm,)), devices=d) for nm, d in zip(names, devs, strict=False)]
    gen = _rollout_seconds(req, sizes[-1], cost_model)[1]
    if gen is None:
        return Baseline("openrlhf", reason=f"no vLLM layout of the actor fits {sizes[-1]} devices")
    train = {r: ParallelConfig(dp=s) for r, s in zip(req.roles, sizes, strict=False)}
    roles = _role_plans(req, {r: r for r in req.roles}, train, gen=gen, gen_group="rollout")
    plan = _plan(req, groups, roles, "broadcast", "baseline: OpenRLHF (separate devices per model, vLLM rollout)")
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


def nemo_aligner(req: SearchRequest, cost_model) -> Baseline:
    from hybridflow.planner.search import Planner

    split = nemo_halves(req)
    if split is None:
        return Baseline("nemo-aligner", reason="the cluster cannot be cut in two halves")
    placement, counts = split
    planner = Planner(req, cost_model, generate_rule="same")
    best = planner.best_for(placement, counts)
    if best is None:
        return Baseline("nemo-aligner", reason=f"{' | '.join('+'.join(s) for s in placement)} on "
                                               f"{' | '.join(map(str, counts))} devices: no parallel configs fit "
                                               f"the memory with generation in the training partitions")
    plan = scored_to_plan(req, best, notes="baseline: NeMo-Aligner (actor+ref | critic+reward, no resharding)")
    return price_plan("nemo-aligner", plan, cost_model)


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
