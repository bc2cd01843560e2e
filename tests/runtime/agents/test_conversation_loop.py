"""Multi-turn rollouts on the native engine (runtime/agents/conversation.py) with a tiny tool-calling model
built here (tokenizer trained with `tokenizers`, a chat template with tool support, transformers' config
class, a short supervised warm-up on calculator demonstrations): tool calls parsed and run, their results
appended as the template's tool turn and masked; the sampler's log-probs equal one forward pass over the
whole conversation; a tool that hangs gives its conversation an error observation while the others go
on; with overlap the engine decodes while tools wait, in lockstep it never does; the token budget holds.
vLLM's path is not run here (not installed)."""

from __future__ import annotations

import pytest
import torch
from vllm_util import needs_vllm

from hybridflow.runtime.agents.chat_format import ChatFormat
from hybridflow.runtime.agents.conversation import ConversationRunner, conversation_batch
from hybridflow.runtime.agents.environments import GuessNumber
from hybridflow.runtime.agents.loading import load_tools
from hybridflow.runtime.agents.settings import AgentSettings
from hybridflow.runtime.agents.tiny_tool_model import build_tool_model
from hybridflow.runtime.agents.tool_calls import parse_tool_calls
from hybridflow.runtime.agents.train import response_log_probs
from hybridflow.runtime.agents.word_problems import word_problems
from hybridflow.runtime.engines.rollout.generation import GenerationEngine, SamplingParams
from hybridflow.runtime.models.hf_format import load_pretrained
from hybridflow.runtime.sandbox import SandboxLimits
from hybridflow.runtime.tasks.model_tokenizer import generation_ids

pytestmark = pytest.mark.slow

@pytest.fixture(scope="module")
def tool_model(tmp_path_factory, call_format_tool_model):
    import shutil

    # it has learnt the call format (tests/conftest.py)
    folder = shutil.copytree(call_format_tool_model, tmp_path_factory.mktemp("agents") / "tool-model")
    from transformers import AutoTokenizer

    hf = AutoTokenizer.from_pretrained(str(folder), local_files_only=True)
    return folder, hf, generation_ids(folder)[0], load_pretrained(folder)


def runner_for(tool_model, settings: AgentSettings, env=None):
    folder, hf, eos, model = tool_model
    tools = load_tools(settings.tools)
    chat = ChatFormat(hf, [t.schema for t in tools.values()], eos)
    engine = GenerationEngine(model)
    sampling = SamplingParams(temperature=1.0, eos_token_id=eos, pad_token_id=hf.pad_token_id)
    return ConversationRunner(engine.generate, chat, settings, tools, env, pad_id=hf.pad_token_id), sampling, chat


def test_tool_turns_parsed_run_appended_and_masked(tool_model):
    settings = AgentSettings(tools=("calculator",), max_turns=3, max_tokens=96, turn_tokens=40, overlap=False)
    runner, sampling, chat = runner_for(tool_model, settings)
    rows = word_problems(8, seed=3)
    convs = runner.run(rows, sampling.model_copy(update={"greedy": True}))
    called = [c for c in convs if c.tool_calls and not c.tool_errors]
    assert len(called) >= 4, [c.messages[1:] for c in convs]
    batch = conversation_batch(convs, tool_model[1].pad_token_id)
    for c in called:
        call = parse_tool_calls(c.messages[1]["content"])[0]
        tool_msg = c.messages[2]
        assert tool_msg["role"] == "tool" and tool_msg["content"] == runner.tools["calculator"].run(
            call.arguments, settings.sandbox)
        first_end = c.turn_ends[0]
        context = chat.next_turn_ids([tool_msg], c.tokens[first_end])
        assert c.tokens[first_end + 1:first_end + 1 + len(context)] == context
        assert c.generated[first_end + 1:first_end + 1 + len(context)] == [0] * len(context)
        assert c.generated[:first_end + 1] == [1] * (first_end + 1)
        assert c.stop in ("answer", "turns", "budget") and c.turns >= 2
    i = convs.index(called[0])
    n = len(convs[i].tokens)
    assert batch["response_mask"][i, :n].tolist() == convs[i].generated
    assert batch["attention_mask"][i, -batch["responses"].shape[1]:][:n].tolist() == [1] * n


def test_behaviour_logprobs_equal_one_forward_over_the_conversation(tool_model):
    settings = AgentSettings(environment="guess-number", max_turns=3, max_tokens=120, turn_tokens=12, overlap=False)
    runner, sampling, _ = runner_for(tool_model, settings, GuessNumber)
    convs = runner.run([{"secret": s} for s in (3, 9, 14, 7)], sampling, torch.Generator().manual_seed(5))
    assert all(c.turns == 3 or c.stop == "done" for c in convs)
    assert any(c.turns >= 2 for c in convs)
    batch = conversation_batch(convs, tool_model[1].pad_token_id)
    with torch.no_grad():
        lp = response_log_probs(tool_model[3], batch, temperature=1.0)
    gen = batch["response_mask"].bool()
    assert (batch["response_mask"] != (batch["attention_mask"][:, -gen.shape[1]:])).any()  # observations masked
    torch.testing.assert_close(lp[gen], batch["rollout_log_probs"][gen], atol=2e-4, rtol=1e-4)


def test_hanging_tool_is_an_error_observation_and_the_rest_go_on(tool_model, tmp_path):
    f = tmp_path / "slow_calc.py"
    f.write_text('def calculator(expression: str):\n    """Evaluate."""\n    if "+" in expression:\n'
                 '        while True:\n            pass\n    return str(eval(expression, {}))\n')
    settings = AgentSettings(tools=(f"{f}:calculator",), max_turns=2, max_tokens=96, turn_tokens=40, overlap=True,
                             sandbox=SandboxLimits(cpu_seconds=1, wall_seconds=1.5, memory_mb=256))
    runner, sampling, _ = runner_for(tool_model, settings)
    rows = word_problems(8, seed=3)
    convs = runner.run(rows, sampling.model_copy(update={"greedy": True}))
    assert all(c.stop for c in convs)
    results = [(c.messages[1]["content"], c.messages[2]["content"]) for c in convs
               if c.tool_calls and len(c.messages) > 2]
    stopped = [r for call, r in results if "+" in call]
    ran = [r for call, r in results if "+" not in call]
    assert stopped and all(r.startswith(("error (cpu)", "error (timeout)")) for r in stopped), results
    assert ran and not any(r.startswith(("error (cpu)", "error (timeout)")) for r in ran), results


class Flaky(GuessNumber):
    def step(self, action: str):
        raise ValueError("the environment broke")


def test_environment_error_is_an_observation(tool_model):
    settings = AgentSettings(environment="guess-number", max_turns=2, max_tokens=96, turn_tokens=8, overlap=True)
    runner, sampling, _ = runner_for(tool_model, settings, Flaky)
    convs = runner.run([{"secret": 3}, {"secret": 4}], sampling, torch.Generator().manual_seed(0))
    for c in convs:
        assert c.messages[2] == {"role": "user", "content": "error (environment): ValueError: the environment broke"}
        assert c.stop == "turns" and c.turns == 2


def _overlaps(a: tuple[float, float], b: tuple[float, float]) -> bool:
    return a[0] < b[1] and b[0] < a[1]


def test_overlap_decodes_while_tools_wait_and_lockstep_does_not(tool_model, tmp_path):
    f = tmp_path / "sleepy.py"
    f.write_text('import time\ndef calculator(expression: str):\n    """Evaluate."""\n'
                 '    time.sleep(0.5 if "+" in expression else 0.0)\n    return str(eval(expression, {}))\n')
    rows = word_problems(8, seed=3)
    for overlap in (True, False):
        settings = AgentSettings(tools=(f"{f}:calculator@inprocess",), max_turns=3, max_tokens=96, turn_tokens=40,
                                 overlap=overlap)
        runner, sampling, _ = runner_for(tool_model, settings)
        convs = runner.run(rows, sampling.model_copy(update={"greedy": True}))
        assert sum(c.tool_calls > 0 for c in convs) >= 4
        during = [(i, j) for (s, e, batch) in runner.decode_spans for i, c in enumerate(convs) if i not in batch
                  for j, span in enumerate(c.tool_spans) if _overlaps((s, e), span)]
        assert bool(during) == overlap, (overlap, runner.decode_spans)
        # the runner's own work between calls (what multi-turn pricing charges per conversation handled there)
        # leaves out its waits on the 0.5 s tools (in lockstep at least 0.5 s outside the calls)
        rows_per_call = [len(b) for _, _, b in runner.decode_spans]
        assert runner.stats["driver_rows"] == sum(rows_per_call[:-1]) + sum(rows_per_call[1:])
        assert 0.0 < runner.stats["driver_s"] < 0.5
        assert overlap or runner.stats["wall_s"] - runner.stats["decode_s"] >= 0.5


def test_lockstep_is_deterministic_and_the_budget_holds(tool_model):
    settings = AgentSettings(tools=("calculator",), max_turns=4, max_tokens=40, turn_tokens=24, overlap=False)
    runner, sampling, _ = runner_for(tool_model, settings)
    rows = word_problems(6, seed=4)
    a = runner.run(rows, sampling, torch.Generator().manual_seed(1))
    b = runner.run(rows, sampling, torch.Generator().manual_seed(1))
    assert [c.tokens for c in a] == [c.tokens for c in b]
    assert all(len(c.tokens) <= 40 for c in a)
    assert any(c.stop == "budget" for c in a)


@pytest.mark.vllm
@needs_vllm
def test_conversations_on_vllm(tmp_path):
    from transformers import AutoTokenizer

    from hybridflow.runtime.engines.rollout.vllm_rollout import VllmRollout

    folder = build_tool_model(tmp_path / "m", seed=0, head_dim=32, num_attention_heads=2, num_key_value_heads=1)
    hf = AutoTokenizer.from_pretrained(str(folder), local_files_only=True)
    eos = generation_ids(folder)[0]
    settings = AgentSettings(environment="guess-number", max_turns=3, max_tokens=80, turn_tokens=8)
    chat = ChatFormat(hf, None, eos)
    engine = VllmRollout(folder)
    runner = ConversationRunner(engine.generate, chat, settings, None, GuessNumber, pad_id=hf.pad_token_id)
    sampling = SamplingParams(temperature=1.0, eos_token_id=eos, pad_token_id=hf.pad_token_id)
    convs = runner.run([{"secret": s} for s in (3, 9)], sampling, torch.Generator().manual_seed(0))
    batch = conversation_batch(convs, hf.pad_token_id)
    with torch.no_grad():
        lp = response_log_probs(load_pretrained(folder), batch)
    gen = batch["response_mask"].bool()
    torch.testing.assert_close(lp[gen], batch["rollout_log_probs"][gen], atol=2e-2, rtol=1e-2)
