"""Multi-turn rollouts priced with a cost model (simulator/agents/planning.py): each model turn is the
wrapped model's own `generate` over the conversations ready then, tool waits in between, every other
op the wrapped model's."""

from __future__ import annotations

import statistics

import pytest

from hybridflow.simulator.agents.planning import CONTEXT_BUCKET, AgentWorkload, MultiTurnCostModel
from hybridflow.simulator.calibration.gpu_fit import default_cost_model
from hybridflow.simulator.vocabulary.hardware import ClusterSpec, hardware_preset
from hybridflow.simulator.vocabulary.model import resolve_model
from hybridflow.simulator.vocabulary.parallel import ParallelConfig
from hybridflow.simulator.vocabulary.workload import Workload

CLUSTER = ClusterSpec(hardware=hardware_preset("a100-80g"), nodes=1, devices_per_node=8)
MODEL = resolve_model("llama2-7b")
GEN = ParallelConfig(pp=1, tp=2, dp=4)
W = Workload(prompts=16, prompt_len=96, response_len=256, samples_per_prompt=2)


def turn(base, rows: int, context: int, steps: int) -> float:
    ctx = CONTEXT_BUCKET * -(-context // CONTEXT_BUCKET)
    w = W.model_copy(update={"prompt_len": ctx, "response_len": steps})
    return base.generate(MODEL, GEN, w, rows).seconds


def test_single_turn_is_one_generate_call():
    base = default_cost_model(CLUSTER)
    cm = MultiTurnCostModel(base, AgentWorkload(turns=[1], tool_seconds=[3.0], turn_tokens=[40]))
    cost = cm.generate(MODEL, GEN, W)
    assert cost.seconds == pytest.approx(turn(base, W.sequences, 96, 40))
    assert "tool_wait" not in cost.breakdown


def test_two_turns_in_lockstep_by_hand():
    base = default_cost_model(CLUSTER)
    agent = AgentWorkload(turns=[2], tool_seconds=[3.0], turn_tokens=[40], final_turn_tokens=[8],
                          tool_turn_tokens=[24], tool_workers=W.sequences, overlap=False)
    cost = MultiTurnCostModel(base, agent).generate(MODEL, GEN, W)
    # turn 1 over the prompt, every tool at once (a worker each), turn 2 re-prefilling prompt + turn + tool turn
    by_hand = turn(base, W.sequences, 96, 40) + 3.0 + turn(base, W.sequences, 96 + 40 + 24, 8)
    assert cost.seconds == pytest.approx(by_hand)
    assert cost.breakdown["tool_wait"] == pytest.approx(3.0)


def test_tool_workers_queue_the_calls():
    base = default_cost_model(CLUSTER)
    kw = dict(turns=[2], tool_seconds=[3.0], turn_tokens=[40], overlap=False)
    wide = MultiTurnCostModel(base, AgentWorkload(tool_workers=W.sequences, **kw)).generate(MODEL, GEN, W)
    narrow = MultiTurnCostModel(base, AgentWorkload(tool_workers=W.sequences // 4, **kw)).generate(MODEL, GEN, W)
    assert narrow.breakdown["tool_wait"] == pytest.approx(4 * wide.breakdown["tool_wait"])


def test_other_ops_are_the_wrapped_models():
    base = default_cost_model(CLUSTER)
    cm = MultiTurnCostModel(base, AgentWorkload(turns=[3], tool_seconds=[1.0]))
    train = ParallelConfig(pp=1, tp=2, dp=4)
    assert cm.forward(MODEL, "lm", train, W).seconds == base.forward(MODEL, "lm", train, W).seconds
    assert cm.params is base.params


def test_from_means_keeps_the_means_and_the_tail():
    a = AgentWorkload.from_means(1.6, 20, 30, 0.5, final_turn_tokens=4, multi_turn_share=0.55,
                                 tool_turn_call_share=0.8)
    assert statistics.mean(a.turns) == pytest.approx(1.6)
    assert a.turns.count(1) == 9 and max(a.turns) == 3  # 45 % single-turn; the multi-turn ones average 2.1
    assert statistics.mean(a.tool_seconds) == pytest.approx(0.4)
    assert a.final_turn_tokens == [4] and a.turn_tokens == [20]
    assert AgentWorkload.from_means(1.0, 20, 30, 0.5).turns == [1] * 20


def test_async_mode_runs_its_chunks_at_once_by_hand():
    base = default_cost_model(CLUSTER)
    agent = AgentWorkload(turns=[2], tool_seconds=[3.0], turn_tokens=[40], final_turn_tokens=[8], tool_turn_tokens=[24],
                          tool_workers=8, overlap=False)
    cm = MultiTurnCostModel(base, agent)
    assert cm.in_mode("sync", 0) is cm and cm.in_mode("one-step-off", 1) is cm
    t1, t2 = turn(base, 16, 96, 40), turn(base, 16, 96 + 40 + 24, 8)
    # sync: one runner, 32 conversations, 8 tool workers: four waves of tools between the two turns
    sync = turn(base, 32, 96, 40) + 4 * 3.0 + turn(base, 32, 96 + 40 + 24, 8)
    assert cm.generate(MODEL, GEN, W).seconds == pytest.approx(sync)
    # async: 16 prompts in two chunks of 8 (16 conversations), each chunk a runner with its own 8 workers (two
    # waves); the chunks' calls take the engine in turn: chunk 0 [0, t1], chunk 1 [t1, 2·t1], chunk 0's second
    # turn once its tools are done (t1 + 6), chunk 1's at 2·t1 + 6 or once the engine is free
    second = max(2 * t1 + 6.0, t1 + 6.0 + t2)
    assert cm.in_mode("async", 1).generate(MODEL, GEN, W).seconds == pytest.approx(second + t2)


def test_prompts_as_the_template_renders_them():
    # the chat template adds the tools' schemas: 128 tokens per prompt where the plan counts the task's 96, in
    # the rollout's prefill and in every training op's rows
    base = default_cost_model(CLUSTER)
    cm = MultiTurnCostModel(base, AgentWorkload(turns=[1], tool_seconds=[0.0], turn_tokens=[40], prompt_tokens=128))
    rendered = W.model_copy(update={"prompt_len": 128})
    assert cm.generate(MODEL, GEN, W).seconds == pytest.approx(turn(base, W.sequences, 128, 40))
    assert cm.train(MODEL, "lm", GEN, W).seconds == pytest.approx(base.train(MODEL, "lm", GEN, rendered).seconds)
    assert cm.forward(MODEL, "lm", GEN, W, 8).seconds == pytest.approx(base.forward(MODEL, "lm", GEN, rendered, 8).seconds)
    assert cm.train(MODEL, "lm", GEN, W).seconds > base.train(MODEL, "lm", GEN, W).seconds
