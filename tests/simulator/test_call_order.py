"""The simulator's dataflow issues ops in the order the runtime's driver loops call them
(runtime/algorithms/loops.py), so ops sharing a device group queue in the same order."""

import pytest

from hybridflow.simulator.dataflow import build_dataflow, call_order


class CallRecorder:
    """Stands in for the runtime's Dataflow only to write down which op each loop line issues."""

    def __init__(self, roles, safe=False):
        self.roles, self.safe, self.calls = set(roles), safe, []

    def generate(self, batch, greedy=False):
        self.calls.append("generate")
        return {}

    def ref_logprob(self, batch):
        if "ref" in self.roles:
            self.calls.append("ref_logprob")

    def actor_logprob(self, batch):
        self.calls.append("actor_logprob")

    def values(self, batch):
        if "critic" in self.roles:
            self.calls.append("values")

    def score(self, batch):
        self.calls += ["reward", "cost"] if self.safe else ["reward"]
        return {}

    def gather(self, batch, *pending):
        return batch

    def advantage(self, batch, estimator, baseline=None):
        self.calls.append("advantage")
        return {}

    def update(self, batch):
        self.calls += ["critic_update", "actor_update"] if "critic" in self.roles else ["actor_update"]
        return {}

    def update_lagrange(self, batch):
        pass


@pytest.mark.parametrize("algorithm,roles", [
    ("ppo", ["actor", "critic", "ref", "reward"]), ("grpo", ["actor", "ref", "reward"]),
    ("rloo", ["actor", "ref", "reward"]), ("safe-rlhf", ["actor", "critic", "ref", "reward", "cost"])])
def test_dataflow_call_order_is_the_runtime_loops_order(algorithm, roles):
    from hybridflow.runtime.algorithms.loops import ALGORITHMS

    rec = CallRecorder(roles, safe=algorithm == "safe-rlhf")
    ALGORITHMS[algorithm](rec, {})
    g = build_dataflow(algorithm, roles, reward_model=True, cost_model=algorithm == "safe-rlhf", hybrid_engine=True)
    simulated = [g.nodes[n]["op"] for n in call_order(g) if g.nodes[n]["op"] != "reshard"]
    assert simulated == rec.calls
