"""The algorithm registry: one entry per algorithm (loop, roles, defaults, hooks), settings merged over the
entry's defaults, the dynamic-sampling workload terms, and no second description of any algorithm in
the simulator, planner or runtime."""

import ast
import math
from pathlib import Path

import pytest
from pydantic import ValidationError

from hybridflow.simulator import HflowError, Workload
from hybridflow.simulator.algorithms import (
    RLSettings,
    algorithm,
    algorithm_names,
    get_algorithm,
    merge_settings,
)
from hybridflow.simulator.algorithms.safe_rlhf import LagrangeMultiplier
from hybridflow.simulator.algorithms.settings import KLSettings, LagrangeSettings

ROOT = Path(__file__).resolve().parents[2]
GRPO_FAMILY = ("grpo", "dr-grpo", "dapo", "gspo")


def test_the_registry_holds_every_algorithm_once():
    assert {"ppo", "grpo", "dr-grpo", "dapo", "gspo", "rloo", "remax", "reinforce++", "reinforce++-baseline",
            "safe-rlhf"} <= set(algorithm_names())
    with pytest.raises(HflowError, match="unknown algorithm 'dpo'; did you mean 'dapo' or 'ppo'"):
        get_algorithm("dpo")
    with pytest.raises(ValueError, match="registered twice"):
        algorithm("ppo", roles=("actor", "reward"))(lambda df, batch: ({}, batch))
    with pytest.raises(ValueError, match="must be among"):
        algorithm("judge-rl", roles=("actor", "judge"))


def test_defaults_per_family():
    ppo = get_algorithm("ppo").defaults.kl
    assert (ppo.placement, ppo.estimator) == ("reward", "k1") and ppo.coef > 0  # InstructGPT
    for name in GRPO_FAMILY:  # a KL, when used, is a k3 loss term (the GRPO paper)
        kl = get_algorithm(name).defaults.kl
        assert (kl.placement, kl.estimator) == ("loss", "k3"), name
    assert 0.001 <= get_algorithm("grpo").defaults.kl.coef <= 0.04
    assert get_algorithm("grpo").defaults.loss.aggregation == "seq-mean-token-mean"
    assert get_algorithm("dr-grpo").defaults.loss.aggregation == "seq-mean-token-sum-norm"
    assert not get_algorithm("dr-grpo").defaults.advantage.normalize_std
    dapo = get_algorithm("dapo").defaults
    assert dapo.loss.clip_ratio_high == 0.28 and dapo.loss.aggregation == "token-mean" and dapo.shaping.overlong_buffer
    assert get_algorithm("gspo").defaults.loss.kind == "gspo"
    assert get_algorithm("safe-rlhf").critics == ("critic", "cost_critic")
    assert get_algorithm("safe-rlhf").scores == ("reward", "cost")


def test_settings_merge_over_the_algorithms_defaults():
    grpo = get_algorithm("grpo").defaults
    merged = merge_settings(grpo, RLSettings(kl=KLSettings(coef=0.02)))
    assert (merged.kl.coef, merged.kl.placement, merged.kl.estimator) == (0.02, "loss", "k3")
    assert merged.advantage == grpo.advantage  # untouched sub-settings keep the algorithm's
    with pytest.raises(ValidationError, match="estimator k1 does not regularise"):
        merge_settings(grpo, RLSettings(kl=KLSettings(estimator="k1")))  # k1 as GRPO's loss term
    ppo = merge_settings(get_algorithm("ppo").defaults, RLSettings(kl=KLSettings(estimator="k1")))
    assert ppo.kl.placement == "reward"  # the same override is fine where the KL is in the reward


def test_lagrange_multiplier_steps_from_a_window_of_episode_costs():
    # window 3: costs 2, 0 → mean 1: log λ = 0 + .1·(1 − 0)·1 → e^.1; then 4, 4 push 2 out → mean (0+4+4)/3.
    lam = LagrangeMultiplier(LagrangeSettings(init=1.0, lr=0.1, threshold=0.0, window=3, max=None))
    assert lam.update([2.0, 0.0]) == pytest.approx(math.exp(0.1))
    assert lam.update([4.0, 4.0]) == pytest.approx(math.exp(0.1 + 0.1 * (8 / 3) * math.exp(0.1)))
    capped = LagrangeMultiplier(LagrangeSettings(init=1.0, lr=1.0, threshold=0.5, max=1.1))
    assert capped.update([1.5]) == 1.1  # e^1 > 1.1
    restored = LagrangeMultiplier(LagrangeSettings(window=3))
    restored.load_state_dict(lam.state_dict())
    assert restored.value == lam.value and list(restored.costs) == [0.0, 4.0, 4.0]


def test_dynamic_sampling_prices_the_expected_extra_rollouts():
    # f = .5, 3 rounds: 1 + .5 + .25 = 1.75 batches; f = 0: one batch.
    w = Workload(prompts=8, samples_per_prompt=4, filter_rate=0.5, max_sampling_rounds=3)
    assert w.expected_rollouts == pytest.approx(1.75)
    assert w.op_sequences(resampled=True) == 56 and w.op_sequences() == 32 and w.op_sequences(baseline=True) == 8
    assert Workload(filter_rate=0.0).expected_rollouts == 1.0
    with pytest.raises(ValidationError):
        Workload(filter_rate=1.0)


def test_dapo_simulates_its_over_generation():
    from hybridflow.simulator.schedule.schedule import simulate

    plan = _tiny_plan("dapo")
    base = _op(simulate(plan.model_copy(update={"workload": plan.workload.model_copy(update={"filter_rate": 0.0})})))
    more = _op(simulate(plan))
    assert more["generate"] > base["generate"] and more["ref_logprob"] == pytest.approx(base["ref_logprob"])


def _tiny_plan(algorithm):
    from hybridflow.simulator import ClusterSpec, Device, DeviceGroup, ParallelConfig, Plan, RolePlan

    roles = {r: RolePlan(model="llama2-7b", group="g", train=ParallelConfig(dp=8)) for r in ("actor", "ref")}
    return Plan(algorithm=algorithm, cluster=ClusterSpec(hardware="a100-80g", nodes=1, devices_per_node=8),
                workload=Workload(prompts=64, samples_per_prompt=8, prompt_len=256, response_len=256),
                groups=[DeviceGroup(name="g", devices=[Device(node=0, index=i) for i in range(8)])], roles=roles,
                reward_function="m:f")


def _op(timeline):
    return timeline.op_seconds()


def _names_in(path: Path, names: set[str]) -> list[str]:
    """String constants equal to an algorithm's name, except a field's default of type AlgorithmName."""
    tree = ast.parse(path.read_text())
    defaults = {id(n.value) for n in ast.walk(tree) if isinstance(n, ast.AnnAssign)
                and isinstance(n.annotation, ast.Name) and n.annotation.id == "AlgorithmName" and n.value}
    return [f"{path.relative_to(ROOT)}:{n.lineno} {n.value!r}" for n in ast.walk(tree)
            if isinstance(n, ast.Constant) and n.value in names and id(n) not in defaults]


def test_no_second_description_of_any_algorithm():
    # Names come from the registry: the simulator, planner and runtime neither list nor branch on them
    # (the runtime's estimator and loss registries name their math, which is not an algorithm).
    names = set(algorithm_names())
    files = [p for folder in ("simulator", "planner", "runtime") for p in (ROOT / folder).rglob("*.py")
             if "algorithms" not in p.relative_to(ROOT).parts]
    assert len(files) > 30
    found = [hit for p in files for hit in _names_in(p, names)]
    assert not found, found
