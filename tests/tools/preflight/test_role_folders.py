"""Model folders through the plan, checked before anything starts: `search --actor FOLDER` records the
folder, `run --actor FOLDER` overrides it, and a folder that does not fit is one line, exit 2, with
neither torch nor Ray imported (the CLI runs in a subprocess that reports what it imported)."""

import json
import shutil
import subprocess
import sys

import pytest
from rl_util import policy_folder, tiny_plan  # noqa: E402

from hybridflow.tools.cli import main

SEARCH = ["search", "--algo", "grpo", "--gpu", "a100-80g", "--nodes", "1", "--gpus-per-node", "1", "--batch", "4",
          "--prompt-len", "16", "--response-len", "8", "--max-pp", "1", "--max-gen-pp", "1",
          "--reward-function", "hybridflow.runtime.tasks.builtin:sort_reward"]

# Runs the CLI once per argv list (a JSON list of them) in one fresh interpreter; prints, per run, its exit
# code, its stderr and the heavy modules imported so far.
CLI_WRAPPER = """
import contextlib, io, json, sys
from hybridflow.tools.cli import main
out = []
for argv in json.loads(sys.argv[1]):
    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        code = main(argv)
    out.append({"code": code, "err": err.getvalue().strip(), "imported": [m for m in ("torch", "ray") if m in sys.modules]})
print(json.dumps(out))
"""


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return policy_folder(tmp_path_factory.mktemp("models") / "policy")


def _plan_paths(plan_file) -> dict:
    """Each role's folder as a run reads the plan: written relative to the plan's folder, read against it."""
    from hybridflow.simulator.vocabulary.plan import Plan

    return {r: rp.path for r, rp in Plan.load(plan_file).roles.items()}


def test_search_records_each_folder_in_the_plan(tmp_path, folder, monkeypatch):
    monkeypatch.chdir(folder.parent)  # a folder given relative to here is recorded relative to the plan's
    assert main([*SEARCH, "--model", "policy", "--out", str(tmp_path / "a.json"), "--json"]) == 0
    assert _plan_paths(tmp_path / "a.json") == {"actor": str(folder), "ref": str(folder)}
    # A preset records no path; a role given as a folder records its own.
    assert main([*SEARCH, "--model", "tiny", "--actor", str(folder / "config.json"), "--out", str(tmp_path / "b.json"),
                 "--json"]) == 0
    assert _plan_paths(tmp_path / "b.json") == {"actor": str(folder), "ref": None}


def run_cli(*argvs) -> list[dict]:
    """[{code, err, imported}] of `hflow-plan argv` for each argv, in a fresh interpreter."""
    p = subprocess.run([sys.executable, "-c", CLI_WRAPPER, json.dumps([[str(a) for a in argv] for argv in argvs])],
                       capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr
    return json.loads(p.stdout.strip().splitlines()[-1])


def assert_refused_before_torch_and_ray(cases: list[tuple[list, str]]) -> None:
    for (argv, msg), got in zip(cases, run_cli(*(argv for argv, _ in cases)), strict=True):
        assert got["code"] == 2 and len(got["err"].splitlines()) == 1 and msg in got["err"], (argv, got["err"])
        assert got["imported"] == [], f"{argv}: imported {got['imported']} before refusing"


def test_run_role_folder_errors_are_one_line_before_torch_or_ray(tmp_path, folder):
    import torch

    from hybridflow.runtime.models.decoder import CausalLM
    from hybridflow.runtime.models.hf_format import save_pretrained
    from hybridflow.runtime.tasks.tokenizer import CharTokenizer

    shallow = tmp_path / "shallow"
    torch.manual_seed(0)
    save_pretrained(CausalLM(tiny_plan().roles["actor"].model.decoder_config(num_hidden_layers=2)),
                    shallow)
    CharTokenizer().save(shallow)
    plan_file = tmp_path / "plan.json"
    plan_file.write_text(tiny_plan("grpo", [["actor", "ref"]], paths={"ref": str(tmp_path / "gone")}).model_dump_json())
    run = ["run", plan_file]
    assert_refused_before_torch_and_ray([
        ([*run, "--critic", folder], "the plan has no 'critic' model"),
        ([*run, "--actor", tmp_path / "nowhere", "--ref", folder], f"--actor {tmp_path / 'nowhere'}: no such folder"),
        (run, "the plan's ref path"),
        ([*run, "--actor", shallow, "--ref", folder], "has layers = 2 but the plan's actor has 4"),
    ])


def _copy(folder, dest):
    shutil.copytree(folder, dest)
    return dest


def test_bad_folders_at_run_are_one_line_before_torch_or_ray(tmp_path, folder):
    import torch
    from safetensors.torch import load_file, save_file

    from hybridflow.runtime.models.decoder import CausalLM
    from hybridflow.runtime.models.hf_format import save_pretrained
    from hybridflow.runtime.tasks.tokenizer import CharTokenizer

    config_only = tmp_path / "config_only"  # plannable (search prices it), not runnable
    config_only.mkdir()
    shutil.copy(folder / "config.json", config_only)
    no_config = _copy(folder, tmp_path / "no_config")
    (no_config / "config.json").unlink()
    gpt2 = _copy(folder, tmp_path / "gpt2")
    (gpt2 / "config.json").write_text(json.dumps({**json.loads((folder / "config.json").read_text()),
                                                  "model_type": "gpt2", "architectures": ["GPT2LMHeadModel"]}))
    truncated = _copy(folder, tmp_path / "truncated")
    weights = truncated / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:-100])
    # Two shards and an index, the second shard missing.
    sharded = _copy(folder, tmp_path / "sharded")
    state = load_file(sharded / "model.safetensors")
    (sharded / "model.safetensors").unlink()
    names = sorted(state)
    shards = {"model-00001-of-00002.safetensors": names[:5], "model-00002-of-00002.safetensors": names[5:]}
    save_file({n: state[n] for n in shards["model-00001-of-00002.safetensors"]},
              sharded / "model-00001-of-00002.safetensors")
    (sharded / "model.safetensors.index.json").write_text(json.dumps(
        {"metadata": {}, "weight_map": {n: f for f, ns in shards.items() for n in ns}}))
    # The character tokenizer has 64 ids; this embedding has 48.
    small_vocab = tmp_path / "small_vocab"
    torch.manual_seed(0)
    save_pretrained(CausalLM(tiny_plan().roles["actor"].model.decoder_config(vocab_size=48)),
                    small_vocab)
    CharTokenizer().save(small_vocab)

    plan_file = tmp_path / "plan.json"
    plan_file.write_text(tiny_plan("grpo", [["actor", "ref"]], paths={"ref": str(folder)}).model_dump_json())
    run = ["run", plan_file, "--actor"]
    assert_refused_before_torch_and_ray([
        ([*run, config_only], "no weights here"),
        ([*run, no_config], "no config.json"),
        ([*run, gpt2], "gpt2"),
        ([*run, truncated], "truncated"),
        ([*run, sharded], "names shard model-00002-of-00002.safetensors, which is not in the folder"),
        ([*run, small_vocab], "largest token id 63 does not fit the model's embedding (vocab_size 48)"),
        ([*SEARCH, "--model", truncated], "truncated"),  # search refuses weights that cannot run, before searching
    ])
    assert main([*SEARCH, "--model", str(config_only), "--out", str(tmp_path / "plan2.json"), "--json"]) == 0
    assert _plan_paths(tmp_path / "plan2.json") == {"actor": str(config_only), "ref": str(config_only)}


def test_score_models_must_read_the_actors_token_ids(tmp_path, folder):
    import torch
    from tokenizers import Tokenizer, models

    from hybridflow.runtime.models.decoder import ScoreModel
    from hybridflow.runtime.models.hf_format import save_pretrained
    from hybridflow.simulator.errors import HflowError
    from hybridflow.tools.preflight.role_folders import check_role_folders, resolve_role_paths

    tiny = tiny_plan().roles["actor"].model
    torch.manual_seed(0)
    save_pretrained(ScoreModel(tiny.decoder_config()), tmp_path / "reward")
    save_pretrained(ScoreModel(tiny.decoder_config(vocab_size=48)), tmp_path / "small")

    def plan_with(reward, vocab=64):
        plan = tiny_plan("grpo", [["actor", "ref", "reward"]], paths={"actor": str(folder), "reward": str(reward)},
                         reward_function=None)
        rp = plan.roles["reward"]
        plan.roles["reward"] = rp.model_copy(update={"model": rp.model.model_copy(update={"vocab": vocab})})
        return resolve_role_paths(plan)

    check_role_folders(plan_with(tmp_path / "reward"))  # no tokenizer of its own: reads the actor's ids
    with pytest.raises(HflowError, match=r"embedding \(vocab_size 48\) cannot read the actor's token ids"):
        check_role_folders(plan_with(tmp_path / "small", vocab=48))
    # A tokenizer of its own that is not the actor's: its token ids mean other words.
    Tokenizer(models.WordLevel({c: i for i, c in enumerate("<unk> a b c".split())}, unk_token="<unk>")).save(
        str(tmp_path / "reward" / "tokenizer.json"))
    with pytest.raises(HflowError, match="tokenizer is not the actor's"):
        check_role_folders(plan_with(tmp_path / "reward"))


def test_a_safe_rlhf_plan_with_a_folder_per_role_passes_the_run_checks(tmp_path, folder):
    """Safe-RLHF with every role its own folder, the cost critic's included (a causal LM, which a critic may
    start from): `run`'s pre-flight checks pass; a cost-critic folder of another shape is one line naming
    the cost critic, before torch or Ray."""
    import torch

    from hybridflow.runtime.models.decoder import CausalLM, ScoreModel
    from hybridflow.runtime.models.hf_format import save_pretrained
    from hybridflow.runtime.tasks.tokenizer import CharTokenizer
    from hybridflow.simulator.vocabulary.roles import ROLES
    from hybridflow.simulator.vocabulary.units import GiB
    from hybridflow.tools.preflight.checks import Machine, Node, RunChecks, preflight
    from hybridflow.tools.preflight.role_folders import resolve_role_paths

    tiny = tiny_plan().roles["actor"].model
    torch.manual_seed(0)
    paths = {"actor": folder, "ref": _copy(folder, tmp_path / "ref"),
             "cost_critic": _copy(folder, tmp_path / "cost_critic")}
    for role in ("critic", "reward", "cost"):
        save_pretrained(ScoreModel(tiny.decoder_config()), tmp_path / role)
        paths[role] = tmp_path / role
    plan = tiny_plan("safe-rlhf", [["actor", "ref"], ["critic", "cost_critic"], ["reward", "cost"]],
                     paths={r: str(p) for r, p in paths.items()}, reward_function=None)
    assert set(plan.roles) == set(ROLES) and len(set(paths.values())) == len(ROLES)

    box = Machine("a 4-core box", (Node(cpus=4, memory=64 * GiB),))
    checks = preflight(RunChecks(resolve_role_paths(plan), box))
    assert checks.facts and not any("built-in" in f for f in checks.facts)  # every role reads its own folder

    shallow = tmp_path / "shallow"
    save_pretrained(CausalLM(tiny.decoder_config(num_hidden_layers=2)), shallow)
    CharTokenizer().save(shallow)
    plan_file = tmp_path / "plan.json"
    plan_file.write_text(plan.model_dump_json())
    assert_refused_before_torch_and_ray([
        (["run", plan_file, "--cost-critic", shallow],
         f"has layers = 2 but the plan's cost_critic has 4; re-plan with `hflow-plan search --cost-critic {shallow}`"),
    ])


def test_a_folder_whose_context_the_workload_passes_is_one_line(tmp_path, folder):
    """The folder's own max_position_embeddings bounds the run (`run --actor` may name another model than the
    plan's): prompt_len 16 + response_len 8 against a context of 16 is one line, exit 2, before torch or Ray."""
    short = _copy(folder, tmp_path / "short")
    config = json.loads((short / "config.json").read_text())
    (short / "config.json").write_text(json.dumps({**config, "max_position_embeddings": 16}))
    plan_file = tmp_path / "plan.json"
    plan_file.write_text(tiny_plan("grpo", [["actor", "ref"]]).model_dump_json())
    assert_refused_before_torch_and_ray([
        (["run", plan_file, "--actor", short], "= 24 tokens is beyond short's context of 16"),
    ])
