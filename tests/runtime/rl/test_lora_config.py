"""LoRA from the run config (runtime/rl/run_config.py `lora`, resolved in rl/resolve.py): set on the plan's
trained roles, checked as a plan (one line, before torch or Ray), the KL kept (the base is the reference)."""

from __future__ import annotations

import pytest
from rl_util import tiny_plan

from hybridflow.runtime.rl.plan_support import check_runnable
from hybridflow.runtime.rl.resolve import resolve_run
from hybridflow.runtime.rl.run_config import RunConfig
from hybridflow.simulator import ParallelConfig
from hybridflow.simulator.errors import HflowError
from hybridflow.simulator.vocabulary.lora import LoraConfig


def test_config_lora_lands_on_the_plan_and_keeps_the_kl():
    run = resolve_run(tiny_plan("grpo", [["actor"]]), RunConfig(lora={"actor": {"rank": 4, "alpha": 8}}))
    assert run.plan.roles["actor"].lora == LoraConfig(rank=4, alpha=8)
    assert run.plan.ref_from_actor and run.config.kl.coef > 0  # GRPO's KL, against the base
    ppo = resolve_run(tiny_plan("ppo", [["actor"], ["critic"]]), RunConfig(lora={"critic": {"rank": 2}}))
    assert ppo.plan.roles["critic"].lora == LoraConfig(rank=2) and ppo.plan.roles["actor"].lora is None
    plain = resolve_run(tiny_plan("grpo", [["actor", "ref"]]))
    assert not plain.plan.ref_from_actor and plain.plan.roles["actor"].lora is None


@pytest.mark.parametrize("plan,lora,msg", [
    (tiny_plan("grpo", [["actor", "ref"]]), {"rank": 4}, "drop the 'ref' role"),
    (tiny_plan("grpo", [["actor"]], train={"actor": ParallelConfig(backend="megatron")}), {"rank": 4},
     "fsdp backend only"),
    (tiny_plan("grpo", [["actor"]]), {"rank": 4, "target_modules": ["attn"]}, "not linear layers of a llama model"),
    (tiny_plan("grpo", [["actor"]]), {"rank": 0}, "lora.actor.rank"),
])
def test_bad_lora_is_one_line(plan, lora, msg):
    with pytest.raises(HflowError, match=msg) as e:
        resolve_run(plan, RunConfig().with_overrides({"lora.actor": lora}))
    assert "\n" not in str(e.value)


def test_lora_on_separate_rollout_devices_is_refused():
    from hybridflow.simulator import Device, DeviceGroup

    base = tiny_plan("grpo", [["actor"]])
    groups = [*base.groups, DeviceGroup(name="roll", devices=[Device(node=0, index=1)])]
    actor = base.roles["actor"].model_copy(update={"generate_group": "roll", "lora": LoraConfig(rank=4)})
    plan = base.model_copy(update={"groups": groups, "roles": {"actor": actor}})
    with pytest.raises(HflowError, match="drop the actor's generate_group"):
        check_runnable(plan, RunConfig())
