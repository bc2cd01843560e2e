"""tools/preflight/checks.py: a plan checked against a machine before anything starts. The machines are
described explicitly (cores, memory, GPUs), so every case holds on any computer."""

from __future__ import annotations

import pytest

from hybridflow.runtime.rl.plan_support import check_runnable
from hybridflow.runtime.rl.run_config import RunConfig
from hybridflow.simulator import ClusterSpec, Device, DeviceGroup, ParallelConfig, Plan, RolePlan, Workload
from hybridflow.simulator.errors import HflowError
from hybridflow.simulator.vocabulary.units import GiB
from hybridflow.tools.cli import main
from hybridflow.tools.preflight.checks import (
    MACHINE_CHECKS,
    RUN_CHECKS,
    WORKER_PROCESS_BYTES,
    Machine,
    Node,
    RunChecks,
    models_have_weights,
    preflight,
    ray_cluster,
    role_folders_readable,
    this_machine,
)

NO_KL = RunConfig(kl={"coef": 0.0})  # the plans here have no reference model
CPU_BOX = Machine("a 2-core box", (Node(cpus=2, memory=16 * GiB),))
GPU_BOX = Machine("a 1-GPU box", (Node(cpus=16, memory=128 * GiB, gpus=(141 * GiB,)),))


# These plans name a placeholder folder: the folder checks are tools/preflight/role_folders.py's (test_role_folders.py).
PLAN_CHECKS = tuple(c for c in RUN_CHECKS if c is not role_folders_readable)


def plan_preflight(checks: RunChecks) -> RunChecks:
    return preflight(checks, PLAN_CHECKS)


def plan(model="tiny", devices=2, nodes=1, hardware="a100-80g", path="/weights", **fields) -> Plan:
    per = -(-devices // nodes)
    group = DeviceGroup(name="g", devices=[Device(node=i // per, index=i % per) for i in range(devices)])
    roles = {"actor": RolePlan(model=model, group="g", train=ParallelConfig(dp=devices), path=path)}
    return Plan(algorithm="grpo", cluster=ClusterSpec(hardware=hardware, nodes=nodes, devices_per_node=per),
                workload=Workload(prompts=16, prompt_len=16, response_len=8, micro_batch_size=4), groups=[group],
                roles=roles, reward_function="hybridflow.runtime.tasks.builtin:sort_reward", **fields)


def test_more_gpus_than_the_node_has_is_refused():
    with pytest.raises(HflowError, match="needs 8 GPUs on one node but a 1-GPU box has 1"):
        plan_preflight(RunChecks(plan(devices=8), GPU_BOX, NO_KL))
    ok = plan_preflight(RunChecks(plan(devices=1), GPU_BOX, NO_KL))
    assert ok.warnings == [] and "1 GPU(s) of 1" in ok.facts


def test_virtual_devices_beyond_the_cores_are_a_warning_not_an_error():
    c = plan_preflight(RunChecks(plan(devices=8, hardware="a100-80g"), CPU_BOX, NO_KL))
    assert any("8 CPU processes on 2 cores" in w and "slower than predicted" in w for w in c.warnings)
    assert any("priced for a100-80g" in w for w in c.warnings)  # a GPU plan on CPU processes


def test_host_memory_counts_every_virtual_device():
    small = Machine("a small box", (Node(cpus=2, memory=4 * GiB),))
    plan_preflight(RunChecks(plan(devices=2), small, NO_KL))  # 2 tiny workers fit
    with pytest.raises(HflowError, match=r"the plan's 16 worker processes need about .* but a small box has 4.0 GiB"):
        plan_preflight(RunChecks(plan(devices=16), small, NO_KL))
    assert 16 * WORKER_PROCESS_BYTES > 4 * GiB


def test_a_model_larger_than_its_device_is_refused_with_the_breakdown():
    with pytest.raises(HflowError, match=r"needs .* GiB per device \(weights .*optimizer.*\) but one a100-80g offers"):
        plan_preflight(RunChecks(plan(model="llama2-13b", devices=1), GPU_BOX, NO_KL))
    # the plan fits its A100s, but not the smaller GPUs it is about to run on
    small_gpus = Machine("a box of 16 GiB GPUs", (Node(cpus=16, memory=128 * GiB, gpus=(16 * GiB,) * 8),))
    with pytest.raises(HflowError, match="the GPUs of a box of 16 GiB GPUs have 16.0 GiB"):
        plan_preflight(RunChecks(plan(model="llama2-7b", devices=8), small_gpus, NO_KL))


def test_a_preset_without_a_path_is_refused_unless_it_can_be_warmed_up_here():
    with pytest.raises(HflowError, match=r"role 'actor' has no path, and its model 'llama2-7b' \(6.7 B parameters\) "
                                         r"is too large to warm up.*give the role a path .* such as 'tiny'"):
        models_have_weights(RunChecks(plan(model="llama2-7b", devices=8, path=None), None, NO_KL))
    c = RunChecks(plan(devices=2, path=None), None, RunConfig(seed=12345, kl={"coef": 0.0}, data={"task": "add"}))
    models_have_weights(c)  # the tiny one can (its warm-up is estimated, not refused)
    assert any("'tiny' policy is warmed up first (up to" in f for f in c.facts)


def test_a_reward_role_without_a_path_names_the_rule_to_use_instead():
    p = plan(devices=1).model_dump()
    p["roles"]["reward"] = {"model": "tiny", "group": "g", "train": {"dp": 1}}
    with pytest.raises(HflowError, match="role 'reward' has no path.*hybridflow.runtime.tasks.builtin:add_reward"):
        plan_preflight(RunChecks(Plan.model_validate(p), CPU_BOX, RunConfig(kl={"coef": 0.0}, data={"task": "add"})))


def test_generation_on_separate_devices_passes_and_its_limits_are_refused_before_anything_starts():
    p = plan(devices=2).model_dump()
    p["groups"] = [{"name": "g", "devices": [{"node": 0, "index": 0}]}, {"name": "gen", "devices": [{"node": 0, "index": 1}]}]
    p["roles"]["actor"].update(train={"dp": 1}, generate={"dp": 1}, generate_group="gen")
    plan_preflight(RunChecks(Plan.model_validate({**p, "mode": "one-step-off"}), CPU_BOX, NO_KL))
    p["roles"]["actor"]["rollout"] = "vllm"  # vLLM on the rollout devices runs; off-policy, not with top-p
    plan_preflight(RunChecks(Plan.model_validate({**p, "mode": "one-step-off"}), CPU_BOX, NO_KL))
    with pytest.raises(HflowError, match="mode 'one-step-off' corrects with the behaviour log-probs.*top_p 0.9"):
        plan_preflight(RunChecks(Plan.model_validate({**p, "mode": "one-step-off"}), CPU_BOX,
                                 NO_KL.with_overrides({"sampling.top_p": 0.9})))


TOY_MOE = dict(name="toy-moe", layers=2, hidden=128, heads=4, kv_heads=4, ffn=256, vocab=64, family="mixtral", experts=4)


def actor_and_ref(actor: dict, ref: dict, model="tiny") -> Plan:
    """GRPO's actor and reference on one group of 4 devices (one worker process per device, shared)."""
    p = plan(model=model, devices=4, path=None).model_dump()  # no folder: the CLI reads folders first
    p["roles"]["actor"]["train"] = actor
    p["roles"]["ref"] = {**p["roles"]["actor"], "train": ref}
    return Plan.model_validate(p)


def megatron(**layout) -> dict:
    return {"backend": "megatron", **layout}


def test_megatron_layouts_the_engine_cannot_run_are_refused_in_one_line_exit_2(tmp_path, capsys):
    refused = {"colocated megatron roles, different tp": (actor_and_ref(megatron(tp=2, dp=2), megatron(dp=4)),
                                                          "group 'g' holds Megatron roles with different tp/pp/ep "
                                                          "(actor 1-2-2, ref 1-1-4); megatron-core keeps one"),
               "a trained MoE model at tp 2": (actor_and_ref(megatron(tp=2, dp=2), {"dp": 4}, TOY_MOE),
                                               "role 'actor': it trains MoE model toy-moe on Megatron at tp=2 (1-2-2)")}
    for name, (p, expect) in refused.items():
        path = tmp_path / f"{name}.json"
        path.write_text(p.model_dump_json())
        assert main(["run", str(path)]) == 2, name
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and expect in err[0], (name, err)
    for ok in (actor_and_ref(megatron(tp=2, dp=2), megatron(tp=2, dp=2)),  # one parallel state, shared
               actor_and_ref(megatron(tp=2, dp=2), {"dp": 4}),  # FSDP leaves it to the Megatron role
               actor_and_ref(megatron(dp=4, ep=2), megatron(dp=4, ep=2), TOY_MOE),
               actor_and_ref({"dp": 4}, megatron(tp=2, dp=2), TOY_MOE)):  # the ref only runs forward passes
        check_runnable(ok, NO_KL)


def test_a_kl_penalty_without_a_reference_model_is_refused():
    with pytest.raises(HflowError, match="kl coef 0.01 needs a 'ref' model"):
        plan_preflight(RunChecks(plan(devices=1), CPU_BOX, RunConfig(kl={"coef": 0.01})))
    plan_preflight(RunChecks(plan(devices=1), CPU_BOX, RunConfig(kl={"coef": 0.0})))


def test_a_ray_cluster_is_read_from_ray_nodes():
    nodes = [  # the shape of ray.nodes()
        {"Alive": True, "Resources": {"CPU": 16.0, "GPU": 8.0, "memory": 100 * GiB, "hflow_node_1": 1000.0}},
        {"Alive": True, "Resources": {"CPU": 16.0, "GPU": 4.0, "memory": 100 * GiB, "hflow_node_0": 1000.0}},
        {"Alive": False, "Resources": {"CPU": 16.0, "GPU": 8.0, "hflow_node_2": 1000.0}},
    ]
    cluster = ray_cluster(nodes, "auto")
    assert cluster.gpus == 12 and [n.plan_node for n in cluster.nodes] == [1, 0]
    two_by_8 = plan(model="llama2-7b", devices=16, nodes=2)
    # plan node 0 is the labelled 4-GPU node: its 8 devices do not fit there
    with pytest.raises(HflowError, match="needs 8 GPUs on one node but the Ray cluster at auto has 4 there"):
        preflight(RunChecks(two_by_8, None, NO_KL).on(cluster), MACHINE_CHECKS)
    three = plan(model="llama2-7b", devices=12, nodes=3)
    with pytest.raises(HflowError, match="the plan uses node 2 but the Ray cluster at auto has no node labelled"):
        preflight(RunChecks(three, None, NO_KL).on(cluster), MACHINE_CHECKS)


def test_an_unknown_machine_skips_the_machine_checks_and_this_machine_is_read():
    c = plan_preflight(RunChecks(plan(devices=4096, hardware="a100-80g"), None, NO_KL))  # to be checked once a cluster is joined
    assert c.warnings == []
    here = this_machine()
    assert here.cpus >= 1 and here.nodes[0].memory > 0
    assert RUN_CHECKS[0].__name__ == "runtime_runs_it" and set(MACHINE_CHECKS) <= set(RUN_CHECKS)
