"""The plan carries sequence packing's token budget (RolePlan.micro_batch_tokens) and `run` uses it: the search
sets it for a workload of response lengths, a budget below the longest sequence is one line and exit 2 before
torch or Ray, the trainer hands it to every role's engine, and a packed GRPO run trains as the padded one."""

from __future__ import annotations

import json
import math
import subprocess
import sys

import pytest
from rl_util import tiny_plan

from hybridflow.simulator.errors import HflowError
from hybridflow.simulator.vocabulary.lengths import LengthDistribution
from hybridflow.simulator.vocabulary.parallel import ParallelConfig
from hybridflow.simulator.vocabulary.plan import Plan, default_micro_batch_tokens
from hybridflow.simulator.vocabulary.workload import Workload

LONG_TAIL = LengthDistribution.model_validate({"mean": 4, "max": 32})
WORKLOAD = Workload(prompts=4, samples_per_prompt=4, prompt_len=16, response_lengths=LONG_TAIL, micro_batch_size=4,
                    mini_batches=1)
PROBE = ("import sys; from hybridflow.tools.cli import main; rc = main(sys.argv[1:]); "
         "sys.exit(9 if {'torch', 'ray'} & set(sys.modules) else rc)")


def _packed_plan(budget: int | None) -> Plan:
    plan = tiny_plan("grpo", [["actor", "ref"]], devices=[2], workload=WORKLOAD)
    data = json.loads(plan.model_dump_json())
    for role in data["roles"].values():
        role["micro_batch_tokens"] = budget
    return Plan.from_json_text(json.dumps(data))


def test_default_budget_is_the_padded_micro_batch_for_a_length_distribution():
    assert default_micro_batch_tokens(WORKLOAD, ParallelConfig(dp=2)) == 4 * (16 + 32)
    fixed = Workload(prompts=4, prompt_len=16, response_len=32)
    assert default_micro_batch_tokens(fixed, ParallelConfig(dp=2)) is None  # fixed lengths: rows, as priced
    assert default_micro_batch_tokens(WORKLOAD, ParallelConfig(pp=2)) is None  # the engine packs at pp 1 only


def test_a_budget_below_the_longest_sequence_is_one_line():
    with pytest.raises(HflowError) as e:
        _packed_plan(40)
    assert "micro_batch_tokens 40 is below the longest sequence (prompt_len + response_len = 48)" in str(e.value)
    assert "\n" not in str(e.value)
    with pytest.raises(HflowError, match="runs on the fsdp backend with pp=1"):
        plan = tiny_plan("grpo", [["actor", "ref"]], devices=[2], workload=WORKLOAD,
                         train={"actor": ParallelConfig(pp=2)})
        data = json.loads(plan.model_dump_json())
        data["roles"]["actor"]["micro_batch_tokens"] = 64
        Plan.from_json_text(json.dumps(data))


def test_run_refuses_a_budget_below_the_longest_sequence_before_torch(tmp_path):
    data = json.loads(_packed_plan(48).model_dump_json())
    data["roles"]["actor"]["micro_batch_tokens"] = 47
    (tmp_path / "plan.json").write_text(json.dumps(data))
    out = subprocess.run([sys.executable, "-c", PROBE, "run", "plan.json", "--iterations", "1"], cwd=tmp_path,
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 2, out.stderr
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and "micro_batch_tokens 47 is below the longest sequence" in lines[0]


def test_the_trainer_hands_each_role_its_budget():
    from hybridflow.runtime.rl.trainer import Trainer

    trainer = Trainer(_packed_plan(96))
    assert {r: trainer.workers.role_spec(r).kwargs["micro_batch_tokens"] for r in ("actor", "ref")} == \
        {"actor": 96, "ref": 96}


@pytest.mark.ray
@pytest.mark.slow
def test_a_packed_grpo_run_trains_as_the_padded_one(ray_local, tmp_path):
    """Two dp ranks, GRPO's 16 samples of lengths up to 32: the same rollouts, and the same log-probs and update
    to fp32 rounding, whether the engines pack sequences (and the rows balance one by one) or pad rows; tokens/s
    from the batch's real tokens."""
    from hybridflow.runtime.rl.trainer import Trainer

    runs = []
    for budget in (None, 48):
        with Trainer(_packed_plan(budget)) as t:
            runs.append(t.run(2))
    for padded, packed in zip(*runs, strict=True):
        assert packed["response_lengths"] == padded["response_lengths"]  # the same rollouts
        assert packed["tokens"] == padded["tokens"]
        for m in (packed, padded):  # throughput counts the tokens really processed, not the plan's fixed lengths
            assert m["tokens_per_second"] == pytest.approx(m["tokens"] / m["seconds"])
            assert m["tokens"] < WORKLOAD.sequences * WORKLOAD.seq_len
        # (not `actor/kl`: a token mean per micro-batch, weighted by rows, so it moves with the micro-batches)
        for key in ("actor/loss", "actor/pg_loss", "actor/kl_loss", "actor/grad_norm"):
            assert math.isclose(packed[key], padded[key], rel_tol=1e-5, abs_tol=1e-7), (key, packed[key], padded[key])
    assert runs[1][1]["actor/kl_loss"] > 0  # the second iteration's policy has moved off the reference


def _with_actor(plan: Plan, **fields) -> Plan:
    data = json.loads(plan.model_dump_json())
    data["roles"]["actor"].update(fields)
    return Plan.from_json_text(json.dumps(data))


def test_the_vllm_rollout_takes_the_plans_memory_fraction_and_concurrency():
    from hybridflow.runtime.engines.rollout.vllm_rollout import engine_knobs
    from hybridflow.runtime.rl.trainer import Trainer

    trainer = Trainer(_packed_plan(48))
    assert engine_knobs(trainer.workers.rollout_settings(on_trainer=True)) == {}  # vLLM's defaults
    # (the plan swapped in after the start-up checks, which want vLLM installed to run it)
    trainer.workers.plan = _with_actor(_packed_plan(48), rollout="vllm", rollout_memory_fraction=0.6,
                               max_concurrent_sequences=64)
    for on_trainer in (True, False):
        settings = trainer.workers.rollout_settings(on_trainer=on_trainer)
        assert engine_knobs(settings) == {"gpu_memory_utilization": 0.6, "max_num_seqs": 64}


def test_engine_knobs_are_checked_and_carried_for_a_run_that_picks_vllm():
    _with_actor(_packed_plan(48), max_concurrent_sequences=64)  # the native engine ignores them
    with pytest.raises(HflowError, match="greater than 0"):
        _with_actor(_packed_plan(48), rollout="vllm", rollout_memory_fraction=0.0)
