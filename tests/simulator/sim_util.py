"""A PPO plan the cost and memory tests both price."""

from hybridflow.simulator.vocabulary.plan import Plan


def make_plan(offload=False, model="llama2-7b", nodes=1, groups=None):
    """PPO, all four models colocated on one 8-GPU node (the hybrid engine: generation tp 1 < training tp 2)."""
    groups = groups or {"all": [(0, i) for i in range(8)]}
    train = {"pp": 1, "tp": 2, "dp": 4}
    roles = {r: {"model": model, "group": "all", "train": train} for r in ("actor", "critic", "ref", "reward")}
    roles["actor"]["generate"] = {"pp": 1, "tp": 1, "dp": 8}
    return Plan.model_validate({
        "algorithm": "ppo", "offload": offload,
        "cluster": {"hardware": "a100-80g", "nodes": nodes, "devices_per_node": 8},
        "workload": {"prompts": 256, "prompt_len": 512, "response_len": 512, "micro_batch_size": 4},
        "groups": [{"name": g, "devices": [{"node": n, "index": i} for n, i in devs]} for g, devs in groups.items()],
        "roles": roles,
    })
