"""`hflow-plan run`: input errors are one line (the run itself is tested in tests/runtime/rl/test_rl_e2e.py,
where the Ray fixture lives)."""


from rl_util import tiny_plan  # noqa: E402

from hybridflow.tools.cli import main


def test_run_input_errors_are_one_line(tmp_path, capsys):
    plan_file = tmp_path / "plan.json"
    plan_file.write_text(tiny_plan("grpo", [["actor", "ref"]]).model_dump_json())
    for argv, msg in [
        (["run", str(plan_file), "--resume"], "--resume needs --checkpoint-dir"),
        (["run", str(plan_file), "--keep-last", "2"], "--keep-last needs --checkpoint-dir"),
        (["run", str(plan_file), "--checkpoint-dir", str(plan_file)], "is a file; give a folder"),
        (["run", str(plan_file), "--metrics", str(tmp_path)], "is a folder"),
        (["run", str(plan_file), "--prompts", str(plan_file)], "give a .jsonl or .parquet file"),
        (["run", str(plan_file), "--keep-last", "0", "--checkpoint-dir", "c"], "expected a positive whole number"),
        (["run", str(plan_file), "--timeline", "x.svg"], "ending in .png"),
        (["run", str(plan_file), "--task", "chess"], "unknown task 'chess'"),
        (["run", str(tmp_path / "none.json")], "no such file"),
        (["run", str(plan_file), "--max-staleness", "2"], "--max-staleness 2 bounds mode 'async', and the plan runs "
                                                          "'sync'; add --mode async"),
        (["run", str(plan_file), "--mode", "async"], "mode 'async' overlaps rollout with training"),
        (["run", str(plan_file), "--set", "optimizer.actor.lr"], "--set optimizer.actor.lr: give KEY=VALUE"),
        (["run", str(plan_file), "--set", "optimizer.actor.lr=-1"], "optimizer.actor.lr"),
        (["run", str(plan_file), "--set", "optimizer.actor.betas=[0.9"], "the value is not valid YAML"),
        (["run", str(plan_file), "--set", "actor_lr=1e-4"], "'actor_lr' is now optimizer.actor.lr"),
        (["run", str(plan_file), "--set", "seed.x=1"], "'seed' is a value, not a section"),
    ]:
        assert main(argv) == 2
        err = capsys.readouterr().err.strip()
        assert msg in err and len(err.splitlines()) == 1, err


def test_bad_tokenizer_data_and_logger_inputs_are_one_line_before_ray_starts(tmp_path, capsys):
    import json

    import ray
    from hf_util import build_hf_folder

    from hybridflow.simulator.vocabulary.model import ModelSpec, model_preset

    small = build_hf_folder(tmp_path / "small", vocab_size=64)  # a 320-token tokenizer, a 64-row embedding
    plans = {"tiny": tiny_plan("grpo", [["actor", "ref"]]),
             "wide": tiny_plan("grpo", [["actor", "ref"]], model=model_preset("tiny").model_copy(
                 update={"name": "tiny-wide-vocab", "vocab": 32000})),
             "small": tiny_plan("grpo", [["actor", "ref"]], model=ModelSpec.from_hf_config(small),
                                paths={"actor": str(small)})}
    for name, plan in plans.items():
        (tmp_path / f"{name}.json").write_text(plan.model_dump_json())
    (tmp_path / "chat.jsonl").write_text(json.dumps({"prompt": [{"role": "user", "content": "hi"}]}) + "\n")
    capsys.readouterr()
    ray_was_up = ray.is_initialized()  # a suite's earlier Ray tests may have started it
    for argv, msg in [
        (["tiny.json", "--logger", "tensorboard,neptune"], "unknown logger 'neptune'; choose from tensorboard, wandb"),
        (["tiny.json", "--prompts", "nowhere"], "nowhere: no such prompt file or folder"),
        (["tiny.json", "--prompts", "chat.jsonl"], "the built-in character tokenizer has no chat template"),
        (["wide.json"], "model 'tiny-wide-vocab' has a vocabulary of 32000: the built-in warm-up only builds"),
        (["small.json"], "the tokenizer's largest token id 319 does not fit the model's embedding (vocab_size 64)"),
    ]:
        argv = ["run", str(tmp_path / argv[0]), *(str(tmp_path / a) if a.endswith((".jsonl", "nowhere")) else a
                                                  for a in argv[1:])]
        assert main(argv) == 2
        err = capsys.readouterr().err.strip()
        assert msg in err and len(err.splitlines()) == 1, err
    assert ray.is_initialized() == ray_was_up  # every error came before Ray would start


def test_rollout_flag_errors_are_one_line(tmp_path, capsys):
    import importlib.util

    plan_file = tmp_path / "plan.json"
    plan_file.write_text(tiny_plan("grpo", [["actor", "ref"]]).model_dump_json())
    cases = [(["--rollout", "sglang"], "unknown rollout backend 'sglang'; backends: native, vllm")]
    if importlib.util.find_spec("vllm") is None:  # else it runs: tests/runtime/engines/rollout/test_vllm_rollout.py
        cases.append((["--rollout", "vllm"], "the vllm rollout needs vLLM, which is not installed here"))
    for extra, msg in cases:
        assert main(["run", str(plan_file), *extra]) == 2
        err = capsys.readouterr().err.strip()
        assert msg in err and len(err.splitlines()) == 1, err


def test_set_reaches_the_run_config_over_the_file_and_the_flags(tmp_path):
    from hybridflow.tools.cli import build_parser
    from hybridflow.tools.commands.run import run_config

    (tmp_path / "run.yaml").write_text("optimizer: {actor: {lr: 3.0e-4, warmup_steps: 5}}\nseed: 7\n")
    args = build_parser().parse_args(["run", "p.json", "--config", str(tmp_path / "run.yaml"), "--seed", "8",
                                      "--set", "optimizer.actor.lr=1e-4", "--set", "optimizer.actor.betas=[0.9, 0.99]",
                                      "--set", "kl.coef=0.02", "--set", "seed=9"])
    cfg = run_config(args)
    actor = cfg.optimizer.actor
    assert (actor.lr, actor.warmup_steps, actor.betas, cfg.seed, cfg.kl.coef) == (1e-4, 5, (0.9, 0.99), 9, 0.02)
    assert cfg.kl.model_fields_set == {"coef"}  # the algorithm's defaults still fill the rest of kl
