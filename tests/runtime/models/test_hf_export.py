"""Weights through a run: the plan's folders are what trains (`run --actor` overrides one), `run --export-hf`
writes HF folders that transformers loads with our logits, and `hflow-plan export CHECKPOINT` turns the
sharded checkpoint into the same folders in one process."""

import json

import pytest
import torch
from rl_util import policy_folder, tiny_plan
from safetensors.torch import load_file

from hybridflow.simulator import ParallelConfig, Workload

pytestmark = [pytest.mark.ray, pytest.mark.slow]
transformers = pytest.importorskip("transformers")

# One Adam step moves each weight by at most about the learning rate (its first step is lr·sign(g)).
ACTOR_LR = 2e-4


def _weights(folder) -> dict[str, torch.Tensor]:
    from hybridflow.runtime.models.hf_format import load_pretrained

    return load_pretrained(folder).state_dict()


def _max_diff(a: dict, b: dict, skip: str = "") -> float:
    return max((a[k] - b[k]).abs().max().item() for k in a if k in b and not (skip and k.startswith(skip)))


def test_run_trains_the_plans_folders_exports_hf_and_export_matches(ray_local, tmp_path, capsys):
    from hybridflow.runtime.models.hf_format import load_pretrained
    from hybridflow.tools.cli import main

    planned, given = policy_folder(tmp_path / "planned", seed=1), policy_folder(tmp_path / "given", seed=2)
    # Sharded training (actor tp=2, critic in two pipeline stages), so the checkpoint is sharded; the plan
    # records `planned` for every role and `run --actor` replaces the actor's.
    w = Workload(prompts=4, samples_per_prompt=1, prompt_len=16, response_len=8, micro_batch_size=2, mini_batches=1)
    plan = tiny_plan("ppo", [["actor", "ref", "critic"]], [2], workload=w,
                     train={"actor": ParallelConfig(tp=2), "ref": ParallelConfig(dp=2), "critic": ParallelConfig(pp=2)},
                     paths={r: str(planned) for r in ("actor", "ref", "critic")},
                     reward_function="hybridflow.runtime.tasks.builtin:non_digit_cost")
    plan_file = tmp_path / "plan.json"
    plan_file.write_text(plan.model_dump_json())
    ckpt, hf, out = tmp_path / "ckpt", tmp_path / "hf", tmp_path / "export"
    assert main(["run", str(plan_file), "--iterations", "1", "--actor", str(given), "--checkpoint-dir", str(ckpt),
                 "--export-hf", str(hf), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["exported"] == [str(hf / "actor"), str(hf / "critic")]

    # The actor trained `given` (one step away from it), the critic started from the plan's `planned`.
    actor, critic = _weights(hf / "actor"), _weights(hf / "critic")
    assert 0 < _max_diff(actor, _weights(given)) <= 1.05 * ACTOR_LR
    assert _max_diff(actor, _weights(planned)) > 0.01
    assert _max_diff(critic, _weights(planned), skip="score") <= 1.05 * 1e-3  # the critic's lr
    assert json.loads((hf / "critic" / "config.json").read_text())["architectures"] == ["LlamaForSequenceClassification"]
    assert (hf / "actor" / "hflow_tokenizer.json").is_file()  # the source folder's tokenizer travels along

    # transformers loads the exports and computes our logits.
    ids = torch.tensor([[1, 5, 9, 14, 20, 33, 2], [1, 7, 7, 30, 41, 12, 2]])
    with torch.no_grad():
        ours = load_pretrained(hf / "actor").eval()(ids)
        theirs = transformers.AutoModelForCausalLM.from_pretrained(hf / "actor", dtype=torch.float32).eval()(ids).logits
        assert (ours - theirs).abs().max() <= 1e-5
        ours_v = load_pretrained(hf / "critic").eval()
        hf_v = transformers.AutoModelForSequenceClassification.from_pretrained(hf / "critic", dtype=torch.float32).eval()
        # HF's score has no bias (ours does): compare the last-token score without it.
        got = torch.cat([hf_v(row[None]).logits.squeeze(-1) for row in ids]) + ours_v.score.bias
        assert (got - ours_v(ids)[:, -1]).abs().max() <= 1e-5

    # The checkpoint (sharded over two ranks: tensor-parallel, pipeline stages) exported in this process equals the run's own export, which
    # equals the export written with the checkpoint.
    assert main(["export", str(ckpt), "--out", str(out)]) == 0
    for role in ("actor", "critic"):
        exported, final, with_ckpt = (load_file(f / role / "model.safetensors")
                                      for f in (out, hf, hf / "iter_000001"))
        assert exported.keys() == final.keys() == with_ckpt.keys()
        assert all(torch.equal(exported[k], final[k]) and torch.equal(final[k], with_ckpt[k]) for k in final)
        assert (out / role / "config.json").is_file() and (out / role / "hflow_tokenizer.json").is_file()
