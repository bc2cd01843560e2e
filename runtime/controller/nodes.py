"""Which Ray node is the plan's node i: the one rule by which the resource pools place a plan's devices
(resource_pool.py) and the pre-flight checks count them per machine (tools/preflight/checks.py).
Ray-free and torch-free: it reads the node records `ray.nodes()` returns.

- a node started with a custom resource `hflow_node_<i>` (`ray start --resources='{"hflow_node_0": 1000}'`)
  is plan node i (this also tells apart several nodes on one machine);
- else, with one IP per node, plan node i is the node with the i-th smallest IP among those that can
  host the plan's devices (stable across restarts of the same machines);
- else, on a single-node cluster, every plan node folds onto it (a multi-node plan runs locally).
"""

from __future__ import annotations

import ipaddress
from collections.abc import Mapping

from hybridflow.simulator.errors import HflowError

NODE_LABEL_PREFIX = "hflow_node_"
LABEL_HINT = f"--resources='{{\"{NODE_LABEL_PREFIX}<i>\": 1000}}'"  # how `ray start` labels a node


def node_label(index: int) -> str:
    """The Ray resource that labels a node as plan node `index`."""
    return f"{NODE_LABEL_PREFIX}{index}"


def labels(resources: Mapping[str, float]) -> list[int]:
    """The plan nodes a Ray node's resources label it as ([]: unlabelled)."""
    return [int(k.removeprefix(NODE_LABEL_PREFIX)) for k in resources
            if k.startswith(NODE_LABEL_PREFIX) and k.removeprefix(NODE_LABEL_PREFIX).isdigit()]


def usable(node: dict, use_gpu: bool) -> bool:
    """Whether a Ray node can host the plan's devices: GPUs for a GPU plan, CPUs for virtual devices
    (a head node started with --num-gpus=0 or --num-cpus=0 is not a plan node)."""
    return node["Resources"].get("GPU" if use_gpu else "CPU", 0) > 0


def plan_nodes(nodes: list[dict], use_gpu: bool) -> dict[int, dict]:
    """Plan node index -> its Ray node, from `nodes` (ray.nodes()); {} on a single-node cluster, where
    every plan node folds onto the one node."""
    alive = [n for n in nodes if n.get("Alive", True)]
    labelled = {i: n for n in alive for i in labels(n["Resources"])}
    if labelled:
        return labelled
    if len(alive) == 1:
        return {}
    hosts = [n for n in alive if usable(n, use_gpu)]
    ips = [n["NodeManagerAddress"] for n in hosts]
    if len(set(ips)) != len(ips):
        raise HflowError("several Ray nodes share an IP, so plan nodes cannot be told apart; start each node "
                         f"with {LABEL_HINT} naming its plan node")
    return dict(enumerate(sorted(hosts, key=lambda n: ipaddress.ip_address(n["NodeManagerAddress"]))))


def by_label(nodes: Mapping[int, dict]) -> bool:
    """Whether plan nodes were matched by their labels (else by address)."""
    return any(labels(n["Resources"]) for n in nodes.values())
