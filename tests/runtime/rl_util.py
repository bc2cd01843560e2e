"""Tiny hand-written Plans for the end-to-end RL tests (the planner is not a runtime dependency)."""

from __future__ import annotations

from hybridflow.simulator import ClusterSpec, Device, DeviceGroup, ParallelConfig, Plan, RolePlan, Workload
from hybridflow.simulator.algorithms import get_algorithm
from hybridflow.simulator.vocabulary.model import ModelSpec, model_preset

TINY = model_preset("tiny")
# Algorithms test_rl_e2e.py runs end to end in several placements; test_algorithms_e2e.py runs the others.
PLACEMENT_TESTED = ("ppo", "rloo", "remax", "safe-rlhf")


def tiny_plan(algorithm: str = "ppo", placement: list[list[str]] | None = None, devices: list[int] | None = None,
              train: dict[str, ParallelConfig] | None = None, generate: ParallelConfig | None = None,
              workload: Workload | None = None, paths: dict[str, str] | None = None, model: ModelSpec = TINY,
              **plan_fields) -> Plan:
    """Groups g0, g1, … holding the roles of `placement`, with `devices[i]` devices each (default 1), every
    role of shape `model` (the tiny preset: the built-in warmed-up policy where a role has no path)."""
    placement = placement or [["actor", "ref"], ["critic"]]
    devices = devices or [1] * len(placement)
    train = train or {}
    groups, roles, next_index = [], {}, 0
    for i, (members, n) in enumerate(zip(placement, devices, strict=True)):
        groups.append(DeviceGroup(name=f"g{i}", devices=[Device(node=0, index=next_index + k) for k in range(n)]))
        next_index += n
        for role in members:
            roles[role] = RolePlan(model=model, group=f"g{i}", train=train.get(role, ParallelConfig(dp=n)),
                                   generate=generate if role == "actor" else None, path=(paths or {}).get(role))
    workload = workload or Workload(prompts=8, prompt_len=16, response_len=8, samples_per_prompt=1,
                                    micro_batch_size=8, mini_batches=1)
    plan_fields.setdefault("reward_function", "hybridflow.runtime.tasks.builtin:sort_reward")
    if "cost" in get_algorithm(algorithm).scores and "cost" not in roles:
        plan_fields.setdefault("cost_function", "hybridflow.runtime.tasks.builtin:non_digit_cost")
    return Plan(algorithm=algorithm, cluster=ClusterSpec(hardware="a100-80g", nodes=1, devices_per_node=max(8, next_index)),
                workload=workload, groups=groups, roles=roles, **plan_fields)


def policy_folder(path, seed: int = 1, dtype=None):
    """A tiny random causal LM saved as an HF folder with the character tokenizer: weights that differ from
    the built-in warmed-up policy, so a run that trained them can tell."""
    import torch

    from hybridflow.runtime.models.decoder import CausalLM
    from hybridflow.runtime.models.hf_format import save_pretrained
    from hybridflow.runtime.tasks.tokenizer import CharTokenizer

    model = CausalLM(TINY.decoder_config())
    model.init_weights(torch.Generator().manual_seed(seed))
    save_pretrained(model, path, dtype=dtype)
    CharTokenizer().save(path)
    return path


def simulated_calls(plan: Plan, kl_in_reward: bool) -> list[tuple[str, str]]:
    """(op, role) of the simulator's graph of `plan` in call order, as the runtime's Dataflow logs its calls."""
    from hybridflow.simulator.schedule.dataflow import call_order
    from hybridflow.simulator.schedule.schedule import plan_dataflow

    graph, _ = plan_dataflow(plan, kl_in_reward)
    return [(graph.nodes[n]["op"], graph.nodes[n]["role"]) for n in call_order(graph)
            if graph.nodes[n]["op"] != "reshard"]


def exact_sort_reward(prompt: str, response: str, **_) -> float:
    """1 for exactly the sorted digits, else 0: a reward whose groups are often all equal (dynamic sampling)."""
    return float(response.strip() == "".join(sorted(c for c in prompt.split(" ", 1)[-1] if c.isdigit())))


def trained_batches(trainer) -> list:
    """Spy on the dataflow's update: every batch the actor trains on, appended as it goes through."""
    batches = []
    update = trainer.df.update

    def spy(batch):
        batches.append(batch)
        return update(batch)

    trainer.df.update = spy
    return batches
