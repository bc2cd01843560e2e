"""RunConfig: nested sections each keeping the defaults a file leaves out, the algorithm's defaults under
every RL setting a run leaves unset, overrides by dotted path, bad combinations and the flat fields of
old configs refused in one line (before Ray starts, from `hflow-plan run --config`); a plan and a
config resolved once."""


import pytest
from rl_util import tiny_plan  # noqa: E402

from hybridflow.runtime.rl.resolve import resolve_run
from hybridflow.runtime.rl.run_config import RunConfig
from hybridflow.simulator.algorithms import get_algorithm
from hybridflow.simulator.errors import HflowError


def test_a_section_given_in_part_keeps_the_defaults_it_leaves_out():
    cfg = RunConfig.model_validate({"optimizer": {"actor": {"warmup_steps": 10, "weight_decay": 0.1,
                                                            "betas": [0.9, 0.99]}},
                                    "data": {"task": "ADD"}, "checkpoint": {"keep_last": 5}})
    actor = cfg.optimizer.actor
    assert (actor.lr, actor.warmup_steps, actor.weight_decay, actor.betas) == (2e-4, 10, 0.1, (0.9, 0.99))
    assert cfg.optimizer.critic == RunConfig().optimizer.critic  # the critic's own default lr, 1e-3
    assert cfg.data.task == "add" and cfg.data.dataset_size == 4096  # a task name in any case
    assert (cfg.checkpoint.keep_last, cfg.checkpoint.save_every) == (5, 1)


def test_the_flat_fields_of_old_configs_say_where_they_went():
    for old, new in (("actor_lr", "optimizer.actor.lr"), ("keep_last", "checkpoint.keep_last"),
                     ("top_p", "sampling.top_p"), ("value_clip", "value_loss.clip")):
        with pytest.raises(ValueError, match=f"'{old}' is now {new}"):
            RunConfig.model_validate({old: 1})


def test_overrides_by_dotted_path_keep_what_was_unset_unset():
    cfg = RunConfig.model_validate({"kl": {"coef": 0.02}}).with_overrides(
        {"optimizer.actor.lr": 1e-4, "seed": 3, "kl.estimator": "k3"})
    assert (cfg.optimizer.actor.lr, cfg.seed, cfg.kl.coef, cfg.kl.estimator) == (1e-4, 3, 0.02, "k3")
    assert cfg.kl.model_fields_set == {"coef", "estimator"}  # the algorithm still fills the rest
    assert cfg.for_algorithm("ppo").kl.placement == "reward"
    with pytest.raises(HflowError, match="'seed' is a value, not a section"):
        cfg.with_overrides({"seed.x": 1})
    with pytest.raises(HflowError, match="optimizer.actor.lr") as e:
        cfg.with_overrides({"optimizer.actor.lr": -1})
    assert "\n" not in str(e.value)


def test_a_run_is_resolved_once():
    plan = tiny_plan("grpo", [["actor", "ref"]])
    run = resolve_run(plan, RunConfig.model_validate({"kl": {"coef": 0.02}}))
    assert run.config.kl.estimator == get_algorithm("grpo").defaults.kl.estimator and run.config.kl.coef == 0.02
    assert run.config.for_algorithm("grpo") == run.config and run.plan.roles["actor"].rollout == "native"


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
