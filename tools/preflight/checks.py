"""Can this plan run here? Checks before anything starts — no torch, no Ray, milliseconds.

    checks = RunChecks(plan, this_machine(), RunConfig(data={"task": "sort"}))
    preflight(checks)                       # HflowError (one line, exit 2) at the first failing check
    checks.facts, checks.warnings           # what to tell the user

RUN_CHECKS runs in order; each check takes the RunChecks and raises a HflowError or adds a fact or
a warning. A check that needs the machine skips while it is unknown (a Ray cluster to join):
after joining, `preflight(checks.on(ray_cluster(ray.nodes(), address)), MACHINE_CHECKS)`.

On GPUs a device is a GPU. On a machine without, every device of the plan is one CPU process (a
virtual device): they share the cores and the host memory, which the checks count.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field, replace

from hybridflow.runtime.controller import host
from hybridflow.runtime.controller.nodes import by_label, node_label, plan_nodes
from hybridflow.runtime.rl.plan_support import check_runnable, role_weights
from hybridflow.runtime.rl.run_config import RunConfig
from hybridflow.runtime.tasks.builtin import get_task
from hybridflow.runtime.tasks.policy_cache import (
    MEMORY_SHARE,
    TIME_LIMIT_S,
    cached_policy,
    check_warmup_shape,
    warmup_cost,
)
from hybridflow.simulator.errors import HflowError
from hybridflow.simulator.pricing.efficiency import EfficiencyParams
from hybridflow.simulator.pricing.memory import OPTIMIZER_BYTES, MemoryBreakdown
from hybridflow.simulator.pricing.plan_memory import check_plan_memory
from hybridflow.simulator.vocabulary.plan import Plan
from hybridflow.simulator.vocabulary.units import BF16, FP32, GiB
from hybridflow.tools.preflight.role_folders import check_role_folders

# A worker process with torch, Ray and the engines imported, before it holds any model.
WORKER_PROCESS_BYTES = 0.5 * GiB
FP32_PER_BF16 = FP32 // BF16  # CPU engines run fp32: weights, gradients, activations and KV take twice the bf16 bytes
ADAM_FP32_PER_MIXED = 2 * FP32 / OPTIMIZER_BYTES  # fp32 Adam m + v, against the memory model's fp32 master + m + v


@dataclass(frozen=True)
class Node:
    """One machine: its cores, the host memory a run may use, and its GPUs' memory (0: unknown)."""

    cpus: float
    memory: float
    gpus: tuple[float, ...] = ()
    plan_node: int | None = None  # the plan node it is (runtime/controller/nodes.py); None: none, or a lone node


@dataclass(frozen=True)
class Machine:
    where: str  # "this machine", "the Ray cluster at auto" (for messages)
    nodes: tuple[Node, ...]
    by_label: bool = False  # the plan nodes matched by their hflow_node_<i> labels (else by address)

    @property
    def gpus(self) -> int:
        return sum(len(n.gpus) for n in self.nodes)

    @property
    def cpus(self) -> float:
        return sum(n.cpus for n in self.nodes)


def this_machine() -> Machine:
    return Machine("this machine", (Node(cpus=host.cpu_count(), memory=host.memory_available(),
                                         gpus=tuple(host.gpu_memory())),))


def ray_cluster(nodes: list[dict], where: str) -> Machine:
    """A Machine from `ray.nodes()`: each live node's CPUs, GPUs (memory unknown to Ray), the memory Ray
    lets its tasks use, and the plan node it is, as the resource pools will place them."""
    alive = [n for n in nodes if n.get("Alive", True)]
    matched = plan_nodes(alive, use_gpu=any(n["Resources"].get("GPU", 0) > 0 for n in alive))
    out = []
    for n in alive:
        res = n["Resources"]
        out.append(Node(cpus=res.get("CPU", 0.0), memory=res.get("memory", 0.0), gpus=(0.0,) * int(res.get("GPU", 0)),
                        plan_node=next((i for i, m in matched.items() if m is n), None)))
    return Machine(f"the Ray cluster at {where}", tuple(out), by_label(matched))


@dataclass
class RunChecks:
    """What the checks look at, and what they found."""

    plan: Plan
    machine: Machine | None  # None: not known yet (a cluster to join)
    config: RunConfig = RunConfig()  # the run's settings (its task and seed shape the built-in policy)
    facts: list[str] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)

    def on(self, machine: Machine) -> RunChecks:
        return replace(self, machine=machine, facts=[], warnings=[])

    def per_machine_node(self, groups: set[str] | None = None) -> Counter:
        """Devices of the plan (of `groups`, default all) on each machine node, by its index in
        `machine.nodes` — placed as the resource pools place them (runtime/controller/nodes.py): every
        plan node on a single-node machine, else on the node that is that plan node."""
        nodes = self.machine.nodes
        of_plan_node = {n.plan_node: k for k, n in enumerate(nodes) if n.plan_node is not None}
        out: Counter = Counter()
        for g in self.plan.groups:
            for d in g.devices if groups is None or g.name in groups else ():
                k = 0 if len(nodes) == 1 else of_plan_node.get(d.node)
                if k is None:
                    missing = (f"no node labelled {node_label(d.node)}" if self.machine.by_label
                               else f"{len(of_plan_node)} node(s) for the plan's devices")
                    raise HflowError(f"the plan uses node {d.node} but {self.machine.where} has {missing}; add the "
                                     "node or plan for the cluster you have")
                out[k] += 1
        return out


Check = Callable[[RunChecks], None]


# ---- the checks ------------------------------------------------------------------------------
def runtime_runs_it(c: RunChecks) -> None:
    """Nothing in the plan (and settings) that the runtime does not execute: generation on separate
    devices, a KL penalty without a reference model."""
    check_runnable(c.plan, c.config)


def devices_exist(c: RunChecks) -> None:
    """GPUs: the plan's devices on each node exist. CPU: a warning when virtual devices outnumber cores."""
    if c.machine is None:
        return
    placed = c.per_machine_node()
    devices = sum(placed.values())
    if c.machine.gpus:
        for k, n in placed.items():
            have = len(c.machine.nodes[k].gpus)
            if n > have:
                raise HflowError(f"the plan needs {n} GPUs on one node but {c.machine.where} has {have} there; plan "
                                 f"for the GPUs you have (hflow-plan search --nodes N --gpus-per-node {have})")
        c.facts.append(f"{devices} GPU(s) of {c.machine.gpus}")
        return
    cores = c.machine.cpus
    c.facts.append(f"{devices} CPU process(es) as devices on {cores:g} cores")
    if devices > cores:
        c.warnings.append(f"the plan's {devices} devices run as {devices} CPU processes on {cores:g} cores: they take "
                          "turns on the cores, so iterations run slower than predicted (the simulator prices each "
                          "device as running alone)")
    if not c.plan.cluster.hardware.name.lower().startswith("cpu"):
        c.warnings.append(f"the plan is priced for {c.plan.cluster.hardware.name} devices; here each runs as a CPU "
                          "process, so its predicted seconds do not apply (price it with --profile for this machine)")


def memory_fits_devices(c: RunChecks) -> None:
    """Each device group's peak (the simulator's memory model) fits the plan's devices — and the real
    GPUs, when they are smaller."""
    mem = check_plan_memory(c.plan)
    peak = max(mem.values(), key=lambda m: m.bytes_per_device)
    c.facts.append(f"peak {peak.bytes_per_device / GiB:.1f} of {peak.capacity / GiB:.1f} GiB per "
                   f"{c.plan.cluster.hardware.name} device")
    gpus = [g for n in (c.machine.nodes if c.machine else ()) for g in n.gpus if g > 0]
    if gpus and peak.bytes_per_device > min(gpus):
        raise HflowError(f"group '{peak.group}' needs {peak.bytes_per_device / GiB:.1f} GiB per device "
                         f"({peak.breakdown.describe()}) but the GPUs of {c.machine.where} have {min(gpus) / GiB:.1f} "
                         "GiB; use more devices (larger tp·pp·dp) or offload")


def models_have_weights(c: RunChecks) -> None:
    """A role without a path gets the built-in policy, warmed up in this process: refused for a
    reward/cost model (no built-in one) and for a model too large to warm up here."""
    built_in: dict[str, list[str]] = {}
    warmup = c.config.warmup_config()
    for role, rp in c.plan.roles.items():
        if role_weights(c.plan, role, get_task(c.config.data.task).reward_function) is not None:
            continue
        built_in.setdefault(rp.model.name, []).append(role)
        if len(built_in[rp.model.name]) > 1:
            continue
        if cached_policy(rp.model, warmup) is not None:
            continue
        cost, available = warmup_cost(rp.model, warmup), host.memory_available()
        why = ""
        if cost.bytes > MEMORY_SHARE * available:
            why = f"it needs about {cost.bytes / GiB:,.0f} GiB of memory here and {available / GiB:.1f} GiB is available"
        elif cost.seconds > TIME_LIMIT_S:
            why = f"its supervised warm-up would take {cost.describe()} here"
        if why:
            raise HflowError(f"role '{role}' has no path, and its model '{rp.model.name}' ({cost.params / 1e9:.2g} B "
                             f"parameters) is too large to warm up as a built-in policy: {why}; give the role a path "
                             "(the HF folder of its weights) or use a smaller model such as 'tiny'")
        check_warmup_shape(rp.model)
        c.facts.append(f"the built-in '{rp.model.name}' policy is warmed up first ({cost.describe()})")
    for name, roles in built_in.items():
        c.facts.append(f"{', '.join(roles)}: the built-in '{name}' policy")


def cpu_bytes(part: MemoryBreakdown, reserved: float) -> float:
    """A device's bytes as a CPU process holds them: fp32 throughout, no CUDA context."""
    return (FP32_PER_BF16 * (part.weights + part.gradients + part.activations + part.kv_cache
                             + max(part.buffers - reserved, 0.0)) + ADAM_FP32_PER_MIXED * part.optimizer)


def host_memory_fits(c: RunChecks) -> None:
    """CPU: every virtual device is a process in its node's memory; their peaks together must fit."""
    if c.machine is None or c.machine.gpus:
        return
    reserved = EfficiencyParams.for_hardware(c.plan.cluster.hardware).reserved_bytes
    mem = check_plan_memory(c.plan)
    per_group = {m.group: cpu_bytes(m.breakdown, reserved) + WORKER_PROCESS_BYTES for m in mem.values()}
    need: Counter = Counter()
    for name, per_device in per_group.items():
        for k, n in c.per_machine_node({name}).items():
            need[k] += n * per_device
    procs = c.per_machine_node(set(per_group))
    where = c.machine.where if len(c.machine.nodes) == 1 else f"one node of {c.machine.where}"
    for k, want in need.items():
        node = c.machine.nodes[k]
        if want > node.memory:
            raise HflowError(f"the plan's {procs[k]} worker processes need about {want / GiB:,.1f} GiB of host memory (on "
                             f"CPU each device is a process with fp32 weights and optimizer states) but "
                             f"{where} has {node.memory / GiB:.1f} GiB available; use fewer devices or a "
                             "smaller model, or run on GPUs (--address)")
        c.facts.append(f"about {want / GiB:.1f} of {node.memory / GiB:.1f} GiB host memory")


# Run in this order; a check of each role's model folder (config, weights, tokenizer) belongs here too.
def role_folders_readable(c: RunChecks) -> None:
    """Each role's model folder: config, family, weights, tokenizer, and the actor's token ids readable by
    the other roles (tools/preflight/role_folders.py)."""
    check_role_folders(c.plan)


RUN_CHECKS: tuple[Check, ...] = (runtime_runs_it, devices_exist, memory_fits_devices, role_folders_readable,
                                 models_have_weights, host_memory_fits)
MACHINE_CHECKS: tuple[Check, ...] = (devices_exist, host_memory_fits)  # again, once a cluster is joined


def preflight(c: RunChecks, checks: tuple[Check, ...] = RUN_CHECKS) -> RunChecks:
    for check in checks:
        check(c)
    return c
