"""Multi-turn tool rollouts through the Ray trainer (`hflow-plan run` with an `agent` section): GRPO on
the calculator word problems with the tiny tool model (runtime/agents/tiny_tool_model.py, warmed up so
that it sometimes calls the calculator), on the native engine — synchronously on the actor's own devices
(hybrid engine), and one step off or asynchronously on a rollout device of its own. The batches the actor trains on hold
conversations of more than one model turn whose tool turns are out of `response_mask` (and of the
behaviour log-probs), the metrics count turns and tool calls. From a longer warm-up (a policy that
sometimes copies the calculator's result into its answer) a short synchronous run raises the reward and the
share of conversations that call the tool."""

from __future__ import annotations

import json
import statistics

import pytest
import torch
from rl_util import tiny_plan, trained_batches

from hybridflow.simulator import Device, DeviceGroup, Plan, Workload

WORKLOAD = Workload(prompts=4, prompt_len=64, response_len=64, samples_per_prompt=4, micro_batch_size=16,
                    mini_batches=1)
AGENT = {"tools": ["calculator"], "max_turns": 3, "max_tokens": 64, "turn_tokens": 24}


@pytest.fixture(scope="module")
def calculator_run(tmp_path_factory, call_format_tool_model):
    """(the tool model's folder, warmed up to call the calculator; a prompts file of word problems with their
    answers)."""
    import shutil

    from hybridflow.runtime.agents.word_problems import word_problems

    root = tmp_path_factory.mktemp("agent-trainer")
    folder = shutil.copytree(call_format_tool_model, root / "model")  # the call format (tests/conftest.py)
    torch.set_num_threads(1)
    prompts = root / "problems.jsonl"
    prompts.write_text("".join(json.dumps({k: r[k] for k in ("prompt", "answer")}) + "\n"
                               for r in word_problems(256, seed=7)))
    return folder, prompts


def calculator_plan(folder, mode: str = "sync", workload: Workload = WORKLOAD) -> Plan:
    """GRPO on the actor's device; in a pipelined mode, with a rollout device of its own."""
    from hybridflow.simulator.vocabulary.model import ModelSpec

    plan = tiny_plan("grpo", placement=[["actor"]], workload=workload, model=ModelSpec.from_hf_config(folder),
                     paths={"actor": str(folder)}, reward_function="hybridflow.runtime.agents.word_problems:answer_reward")
    if mode == "sync":
        return plan
    doc = plan.model_dump()
    doc["groups"].append(DeviceGroup(name="gen", devices=[Device(node=0, index=1)]).model_dump())
    doc["roles"]["actor"].update(generate_group="gen")
    return Plan.model_validate({**doc, "mode": mode}).validate_parallel()


def check_conversations(batch, hf) -> None:
    """Conversations of several turns: their tool turns (the calculator's `<tool_response>`) sit in the
    attended response but outside `response_mask`; the model's own `<tool_call>` inside it."""
    width = batch["responses"].shape[1]
    real = batch["attention_mask"][:, -width:].bool()
    generated = batch["response_mask"].bool()
    assert not (generated & ~real).any()
    multi = (batch["agent_turns"] > 1).nonzero().flatten().tolist()
    assert multi, "no conversation called the tool and went on"
    response_tag, call_tag = hf.convert_tokens_to_ids("<tool_response>"), hf.convert_tokens_to_ids("<tool_call>")
    for i in multi:
        tokens = batch["responses"][i]
        observed = tokens[real[i] & ~generated[i]].tolist()
        assert response_tag in observed and call_tag not in observed
        assert call_tag in tokens[generated[i]].tolist()
        start = int(batch["agent_answer_start"][i])  # the answer turn follows the tool turn, generated again
        assert generated[i, start] and not generated[i, start - 1]
    if "behaviour_log_probs" in batch:  # the sampler's, on generated tokens only
        lp = batch["behaviour_log_probs"]
        assert (lp[~generated] == 0).all() and (lp[generated] < 0).all()


@pytest.mark.ray
@pytest.mark.slow
def test_sync_grpo_on_calculator_conversations(ray_local, calculator_run):
    from transformers import AutoTokenizer

    from hybridflow.runtime.rl.run_config import RunConfig
    from hybridflow.runtime.rl.trainer import Trainer

    folder, prompts = calculator_run
    hf = AutoTokenizer.from_pretrained(str(folder), local_files_only=True)
    cfg = RunConfig(seed=0, data={"prompts_file": str(prompts)}, agent=AGENT,
                    optimizer={"actor": {"lr": 2e-3}})
    with Trainer(calculator_plan(folder), cfg) as t:
        batches = trained_batches(t)
        out = [t.step() for _ in range(3)]
    for b in batches:
        check_conversations(b, hf)
    for m, b in zip(out, batches, strict=True):
        assert m["agent/turns_mean"] == b["agent_turns"].float().mean().item() > 1
        assert m["agent/tool_calls_mean"] > 0 and m["agent/multi_turn_share"] > 0
        assert m["response_length"] < batch_real_length(b)  # generated tokens only
        assert 0 < m["agent/generated_share"] < 1


@pytest.mark.ray
@pytest.mark.slow
def test_environment_rewards_land_on_their_turns(ray_local, calculator_run):
    from hybridflow.runtime.rl.run_config import RunConfig
    from hybridflow.runtime.rl.trainer import Trainer

    folder, prompts = calculator_run
    plan = calculator_plan(folder).model_copy(update={"reward_function": "hybridflow.runtime.agents.environments:no_reward"})
    cfg = RunConfig(seed=0, data={"prompts_file": str(prompts)},
                    agent={"environment": "guess-number", "max_turns": 4, "max_tokens": 64, "turn_tokens": 8})
    with Trainer(plan, cfg) as t:
        batches = trained_batches(t)
        out = [t.step() for _ in range(2)]
    for m, b in zip(out, batches, strict=True):
        rewards = b["token_rewards"]
        assert (rewards[~b["response_mask"].bool()] == 0).all()  # on generated tokens: each turn's last one
        torch.testing.assert_close(b["reward_scores"], rewards.sum(-1))  # the function's 0 + the environment's
        assert m["reward_mean"] == pytest.approx(rewards.sum(-1).mean().item())
        assert m["agent/turns_mean"] > 1 and m["agent/tool_calls_mean"] == 0
    assert any((b["token_rewards"] > 0).any() for b in batches)  # some guess was right


def batch_real_length(batch) -> float:
    return batch["attention_mask"][:, -batch["responses"].shape[1]:].sum(-1).float().mean().item()


@pytest.mark.ray
@pytest.mark.slow
@pytest.mark.parametrize("mode", ["one-step-off", "async"])  # async: two chunks' conversations in flight at once
def test_pipelined_conversations_on_rollout_devices(ray_local, calculator_run, mode):
    from transformers import AutoTokenizer

    from hybridflow.runtime.rl.run_config import RunConfig
    from hybridflow.runtime.rl.trainer import Trainer

    folder, prompts = calculator_run
    hf = AutoTokenizer.from_pretrained(str(folder), local_files_only=True)
    cfg = RunConfig(seed=0, data={"prompts_file": str(prompts)}, agent=AGENT)
    with Trainer(calculator_plan(folder, mode), cfg) as t:
        batches = trained_batches(t)
        out = [t.step() for _ in range(2)]
    for b in batches:
        assert "behaviour_log_probs" in b  # off-policy: the actor's loss corrects with them
        check_conversations(b, hf)
    assert out[1]["staleness/max"] == 1 and out[1]["agent/tool_calls_mean"] > 0
    generate = [e for e in t.timeline.events if e.op == "generate"]
    assert generate and all(e.group == "gen" for e in generate)
    assert torch.isfinite(torch.tensor([o["actor/pg_loss"] for o in out])).all()


@pytest.fixture(scope="module")
def example_model(tmp_path_factory):
    """The tool model warmed up in two phases: on demonstrations that all call the calculator (copying the
    result into the answer is learnt there in far fewer steps than in the example's 40 % mix, docs/agents.md),
    then on a mix in which a quarter call it. A policy that calls the tool in some of its answers and
    sometimes copies its result — something GRPO can learn from (120 steps of the call format alone cannot)."""
    from hybridflow.runtime.agents.tiny_tool_model import build_tool_model, warm_up
    from hybridflow.runtime.agents.word_problems import word_problems

    root = tmp_path_factory.mktemp("agent-learns")
    folder = build_tool_model(root / "model", seed=0)
    torch.set_num_threads(1)
    warm_up(folder, steps=500, tool_share=1.0, seed=0)
    warm_up(folder, steps=300, tool_share=0.25, seed=0)
    prompts = root / "problems.jsonl"
    prompts.write_text("".join(json.dumps({k: r[k] for k in ("prompt", "answer")}) + "\n"
                               for r in word_problems(512, seed=7)))
    return folder, prompts


@pytest.mark.ray
@pytest.mark.slow
def test_reward_and_tool_use_rise_through_the_trainer(ray_local, example_model):
    """30 synchronous GRPO iterations of 8 problems x 4 conversations through the Ray trainer, every turn in
    lockstep (the tokens drawn do not depend on how long tools take: deterministic)."""
    from hybridflow.runtime.rl.run_config import RunConfig
    from hybridflow.runtime.rl.trainer import Trainer

    folder, prompts = example_model
    workload = WORKLOAD.model_copy(update={"prompts": 8, "micro_batch_size": 32})
    cfg = RunConfig(seed=0, data={"prompts_file": str(prompts)}, agent={**AGENT, "overlap": False},
                    optimizer={"actor": {"lr": 1e-3}})
    with Trainer(calculator_plan(folder, workload=workload), cfg) as t:
        out = [t.step() for _ in range(30)]
    reward = [m["reward_mean"] for m in out]
    tool_use = [m["agent/tool_use_share"] for m in out]
    first, last = slice(0, 5), slice(-5, None)
    assert statistics.mean(reward[last]) > statistics.mean(reward[first]) + 0.15, reward
    assert statistics.mean(tool_use[last]) > statistics.mean(tool_use[first]) + 0.25, tool_use
