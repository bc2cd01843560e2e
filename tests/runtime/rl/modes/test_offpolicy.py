"""Off-policy pieces without Ray: the truncated importance weights against hand-computed values, the
actor loss they weight, the weight sync's bucketing (bytes = the model's), the execution modes a plan
accepts and the plans the runtime refuses, each with one line."""

import pytest
import torch
from rl_util import tiny_plan

from hybridflow.runtime.algorithms.losses import actor_loss, behaviour_weights
from hybridflow.runtime.engines.rollout.weight_sync import buckets, tensor_specs
from hybridflow.runtime.rl.plan_support import check_runnable, rollout_parallel
from hybridflow.runtime.rl.run_config import RunConfig
from hybridflow.simulator import Device, DeviceGroup, ParallelConfig, Plan
from hybridflow.simulator.algorithms.settings import PolicyLossSettings
from hybridflow.simulator.errors import HflowError

T = torch.tensor
PPO = PolicyLossSettings()  # ε = 0.2, C = 2


def test_behaviour_weights_by_hand():
    # π_old/μ = 0.5, 1, 1.5, 3 → capped at C = 2: 0.5, 1, 1.5, 2
    old = torch.log(T([[0.2, 0.4, 0.3, 0.6]]))
    behaviour = torch.log(T([[0.4, 0.4, 0.2, 0.2]]))
    w = behaviour_weights(old, behaviour, cap=2.0)
    assert torch.allclose(w, T([[0.5, 1.0, 1.5, 2.0]]), atol=1e-6)
    assert not w.requires_grad


def test_weighted_ppo_loss_by_hand():
    # r = π_θ/π_old = 1.5, 0.5, 1.0; A = 1, −1, 2; w = π_old/μ = 0.5, 3 → 2 (capped), 1.
    #   w·max(−r·A, −clip(r)·A) per token: 0.5·max(−1.5, −1.2) = −0.6; 2·max(0.5, 0.8) = 1.6; 1·(−2) = −2.
    old = torch.log(T([[0.2, 0.6, 0.5]]))
    logp = (old + torch.log(T([[1.5, 0.5, 1.0]])))
    behaviour = torch.log(T([[0.4, 0.2, 0.5]]))
    loss, stats = actor_loss(logp, old, T([[1.0, -1.0, 2.0]]), torch.ones(1, 3), PPO, behaviour_logprobs=behaviour)
    assert loss.item() == pytest.approx((-0.6 + 1.6 - 2.0) / 3, abs=1e-6)
    assert stats["is_weight_mean"] == pytest.approx((0.5 + 2.0 + 1.0) / 3, abs=1e-6)
    assert stats["is_weight_capped"] == pytest.approx(1 / 3)
    assert stats["clipfrac"] == pytest.approx(2 / 3)  # the PPO clip is the same as without the weights
    on_policy, _ = actor_loss(logp, old, T([[1.0, -1.0, 2.0]]), torch.ones(1, 3), PPO, behaviour_logprobs=old)
    plain, _ = actor_loss(logp, old, T([[1.0, -1.0, 2.0]]), torch.ones(1, 3), PPO)
    assert on_policy.item() == pytest.approx(plain.item())  # μ = π_old: weights 1, the plain loss


def test_buckets_carry_exactly_the_model_bytes():
    named = {"a": torch.zeros(3, 4), "b": torch.zeros(10), "c": torch.zeros(2, dtype=torch.bfloat16),
             "d": torch.zeros(100), "e": torch.zeros(5)}
    specs = tensor_specs(named)
    got = buckets(specs, bucket_bytes=64)
    assert [[s.name for s in b] for b in got] == [["a"], ["b"], ["c"], ["d"], ["e"]]  # 48 + 40 > 64; dtype; size
    got = buckets(specs, bucket_bytes=100)
    assert [[s.name for s in b] for b in got] == [["a", "b"], ["c"], ["d"], ["e"]]
    total = sum(t.numel() * t.element_size() for t in named.values())
    assert sum(s.nbytes for b in got for s in b) == total == 12 * 4 + 40 + 4 + 400 + 20


def _disaggregated(mode: str = "sync", generate: ParallelConfig | None = None, **actor) -> Plan:
    plan = tiny_plan("grpo", placement=[["actor", "ref"]])
    groups = [*plan.groups, DeviceGroup(name="gen", devices=[Device(node=0, index=1), Device(node=0, index=2)])]
    a = plan.roles["actor"].model_copy(update={"generate_group": "gen", "generate": generate, **actor})
    return Plan.model_validate({**plan.model_dump(), "groups": [g.model_dump() for g in groups],
                                "roles": {**{r: rp.model_dump() for r, rp in plan.roles.items()}, "actor": a.model_dump()},
                                "mode": mode})


def test_modes_and_rollout_devices_in_the_plan():
    plan = _disaggregated("one-step-off")
    check_runnable(plan, RunConfig())
    check_runnable(_disaggregated("async"), RunConfig())  # executed (runtime/rl/async_rollout.py)
    remax = Plan.model_validate({**_disaggregated("async").model_dump(), "algorithm": "remax"})
    check_runnable(remax.with_mode("sync"), RunConfig())
    for mode in ("one-step-off", "async"):  # the baseline would be another batch's prompts'
        with pytest.raises(HflowError, match=f"remax's greedy baseline .* mode '{mode}' trains on prompts launched"):
            check_runnable(remax.with_mode(mode), RunConfig())
    assert rollout_parallel(plan) == ParallelConfig(dp=2)  # every rollout device a replica by default
    assert rollout_parallel(_disaggregated(generate=ParallelConfig(tp=2))) == ParallelConfig(tp=2)
    assert plan.with_mode("sync").mode == "sync"
    with pytest.raises(HflowError, match="mode 'one-step-off' overlaps rollout with training.*generate_group"):
        tiny_plan("grpo", placement=[["actor", "ref"]]).with_mode("one-step-off")
    check_runnable(_disaggregated(rollout="vllm"), RunConfig(sampling={"top_k": 5}))  # vLLM on rollout devices; on-policy
    check_runnable(_disaggregated("one-step-off", rollout="vllm"), RunConfig())
    with pytest.raises(HflowError, match="mode 'one-step-off' corrects with the behaviour log-probs, which vLLM "
                                         "renormalises over top-k/top-p"):
        check_runnable(_disaggregated("one-step-off", rollout="vllm"), RunConfig(sampling={"top_p": 0.9}))


def test_cli_mode_flag_is_checked_before_anything_starts(tmp_path, capsys):
    from hybridflow.tools.cli import main

    path = tmp_path / "plan.json"
    path.write_text(tiny_plan("grpo", placement=[["actor", "ref"]]).model_dump_json())
    assert main(["run", str(path), "--mode", "one-step-off"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "generate_group" in err[0]
    assert main(["run", str(path), "--mode", "one-step"]) == 2
    assert "did you mean 'one-step-off'" in capsys.readouterr().err


def test_sampler_rewinds_prompts_in_flight_across_an_epoch():
    from hybridflow.runtime.tasks.data import PromptSampler

    s = PromptSampler(size=10, batch_size=4, seed=3)
    s.next_indices()
    s.next_indices()  # 8 drawn
    in_flight = s.next_indices()  # 4 more: crosses into epoch 1
    resumed = PromptSampler(size=10, batch_size=4, seed=3)
    resumed.load_state_dict(s.state_dict(rewind=len(in_flight)))
    assert resumed.next_indices() == in_flight and resumed.next_indices() == s.next_indices()
    with pytest.raises(ValueError, match="cannot rewind"):
        s.state_dict(rewind=100)


def test_sampler_jumps_over_prompts_trained_after_those_in_flight():
    """One step off with dynamic sampling: the look-ahead's prompts in flight, then an extra round's drawn and
    trained; the resumed sampler draws the look-ahead's again, then carries on after the extra round's, as
    the straight one does — across an epoch, and in batches that straddle the jump."""
    from hybridflow.runtime.tasks.data import PromptSampler

    s = PromptSampler(size=10, batch_size=4, seed=3)
    s.next_indices(5)
    in_flight, extra = s.next_indices(), s.next_indices(3)  # 5 + 4 + 3: the extra round in epoch 1
    resumed = PromptSampler(size=10, batch_size=4, seed=3)
    resumed.load_state_dict(s.state_dict(rewind=len(in_flight) + len(extra), skip=len(extra)))
    assert resumed.next_indices(3) == in_flight[:3]
    assert resumed.next_indices(6) == in_flight[3:] + s.next_indices(5)  # the rest, then past the extra round
    assert resumed.next_indices() == s.next_indices()
    assert s.state_dict(rewind=4)["skip"] == 0


def test_pipelined_generation_is_refused_before_anything_starts():
    # the search prices pp_g > 1 unless --max-gen-pp 1; neither the rollout workers nor the hybrid engine run it
    hybrid = tiny_plan("grpo", placement=[["actor", "ref"]], devices=[2], train={"actor": ParallelConfig(pp=2)},
                       generate=ParallelConfig(pp=2))
    for plan in (_disaggregated(generate=ParallelConfig(pp=2)), hybrid):
        with pytest.raises(HflowError, match=r"generates with pp=2; .*--max-gen-pp 1"):
            check_runnable(plan, RunConfig())
    check_runnable(_disaggregated(generate=ParallelConfig(tp=2)), RunConfig())
