"""RunConfig: the algorithm's defaults under every RL setting a run leaves unset, bad combinations refused
in one line (before Ray starts, from `hflow-plan run --config`)."""

import sys
from pathlib import Path

import pytest

from hybridflow.runtime.rl.run_config import RunConfig
from hybridflow.simulator.algorithms import get_algorithm
from hybridflow.simulator.errors import HflowError

sys.path.insert(0, str(Path(__file__).resolve().parent))
from rl_util import tiny_plan  # noqa: E402


def test_unset_settings_take_the_algorithms_defaults():
    grpo = RunConfig().for_algorithm("grpo")
    assert grpo.kl == get_algorithm("grpo").defaults.kl and not grpo.kl_in_reward
    ppo = RunConfig().for_algorithm("ppo")
    assert (ppo.kl.placement, ppo.kl.estimator) == ("reward", "k1") and ppo.kl_in_reward
    assert RunConfig().for_algorithm("gspo").loss.kind == "gspo"


def test_a_partial_override_keeps_the_rest_of_the_algorithms_setting():
    cfg = RunConfig.model_validate({"kl": {"coef": 0.02}, "loss": {"clip_ratio_high": 0.3}}).for_algorithm("dapo")
    assert (cfg.kl.coef, cfg.kl.placement, cfg.kl.estimator) == (0.02, "loss", "k3")
    assert cfg.loss.clip_ratio_high == 0.3 and cfg.loss.aggregation == "token-mean"  # DAPO's
    assert cfg.shaping.overlong_buffer == get_algorithm("dapo").defaults.shaping.overlong_buffer
    assert cfg.for_algorithm("dapo") == cfg  # resolving twice changes nothing


def test_a_kl_loss_term_with_k1_is_refused_in_one_line():
    with pytest.raises(HflowError) as e:
        RunConfig.model_validate({"kl": {"estimator": "k1"}}).for_algorithm("grpo")
    msg = str(e.value)
    assert "run config for grpo: field 'kl'" in msg and "k1 does not regularise" in msg and "\n" not in msg
    RunConfig.model_validate({"kl": {"estimator": "k1"}}).for_algorithm("ppo")  # in the reward it is fine


def test_without_a_reference_model_the_kl_is_off_unless_set():
    assert RunConfig().for_algorithm("ppo", has_ref=False).kl.coef == 0.0
    assert RunConfig.model_validate({"kl": {"coef": 0.1}}).for_algorithm("ppo", has_ref=False).kl.coef == 0.1


def test_cli_run_refuses_a_bad_config_before_starting_anything(tmp_path, capsys):
    from hybridflow.tools.cli import main

    plan_file, cfg = tmp_path / "plan.json", tmp_path / "run.yaml"
    plan_file.write_text(tiny_plan("grpo", [["actor", "ref"]]).model_dump_json())
    cfg.write_text("kl:\n  estimator: k1\n")
    assert main(["run", str(plan_file), "--config", str(cfg)]) == 2
    err = capsys.readouterr().err.strip()
    assert "k1 does not regularise" in err and len(err.splitlines()) == 1, err
    cfg.write_text("kl_coef: 0.1\n")  # the flat field of old configs
    assert main(["run", str(plan_file), "--config", str(cfg)]) == 2
    assert "kl_coef" in capsys.readouterr().err
