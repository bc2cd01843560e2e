"""Probes for pricing multi-turn rollouts (simulator/agents/multiturn.py): the latency of the user's
tools on sample arguments, the cost of one `generate` call fitted as `DecodeCost`, the distributions
a run of conversations showed (turns, tokens per turn, tokens per tool turn) and the runner's own work
between calls per conversation (`driver_seconds_per_row`: decoding and parsing the last call's turns,
rendering the tool turns through the chat template, tokenising them), all on the user's machine.

    latencies = tool_latency(tool, [{"expression": "2+3"}, ...], limits)
    cost = fit_decode_cost(engine.generate, vocab=500, pad_id=0)
    workload = probe_workload(folder, settings, rows)   # what `search --agent-workload FILE` reads
"""

from __future__ import annotations

import time

import torch

from hybridflow.runtime.agents.tools import Tool
from hybridflow.runtime.engines.rollout.generation import SamplingParams, left_pad
from hybridflow.runtime.sandbox import SandboxLimits
from hybridflow.simulator.agents.multiturn import DecodeCost
from hybridflow.simulator.agents.planning import AgentWorkload


def tool_latency(tool: Tool, arguments: list[dict], limits: SandboxLimits) -> list[float]:
    """Seconds of each call of `tool` on each of `arguments` (the observed distribution)."""
    out = []
    for args in arguments:
        start = time.perf_counter()
        tool.run(args, limits)
        out.append(time.perf_counter() - start)
    return out


def fit_decode_cost(generate, vocab: int, pad_id: int = 0, rows=(1, 4, 16), contexts=(48, 128),
                    steps=(8, 32), repeats: int = 2, seed: int = 0) -> DecodeCost:
    """DecodeCost fitted (non-negative least squares) to timed generate calls over a grid of batch rows,
    context lengths and decode steps (no EOS, so every call decodes exactly its steps); each point the
    minimum of `repeats` timings."""
    from scipy.optimize import nnls

    g = torch.Generator().manual_seed(seed)
    features, seconds = [], []
    for b in rows:
        for c in contexts:
            ids = torch.randint(3, vocab, (b, c), generator=g)
            ids, mask = left_pad(ids.tolist(), pad_id)
            for s in steps:
                params = SamplingParams(max_new_tokens=s, temperature=1.0, eos_token_id=None, pad_token_id=pad_id)
                best = float("inf")
                for _ in range(repeats):
                    start = time.perf_counter()
                    generate(ids, mask, params, torch.Generator().manual_seed(seed))
                    best = min(best, time.perf_counter() - start)
                features.append([1.0, s, b * s, b * c])
                seconds.append(best)
    coef, _ = nnls(torch.tensor(features, dtype=torch.float64).numpy(), torch.tensor(seconds).numpy())
    return DecodeCost(fixed=coef[0], per_step=coef[1], per_row_step=coef[2], per_prefill_token=coef[3])


def observed_distributions(convs) -> dict[str, list]:
    """Turns per conversation, generated tokens per model turn (all, and by turn index) and tokens per
    tool turn of finished conversations (runtime/agents/conversation.py)."""
    turns = [c.turns for c in convs]
    turn_tokens, tool_turn_tokens, by_turn = [], [], []
    for c in convs:
        start = 0
        for k, end in enumerate(c.turn_ends):
            gen_start = start
            while gen_start <= end and not c.generated[gen_start]:
                gen_start += 1
            turn_tokens.append(end + 1 - gen_start)
            if len(by_turn) <= k:
                by_turn.append([])
            by_turn[k].append(end + 1 - gen_start)
            if k:
                tool_turn_tokens.append(gen_start - start)
            start = end + 1
    return {"turns": turns, "turn_tokens": turn_tokens, "tool_turn_tokens": tool_turn_tokens or [1],
            "turn_tokens_by_turn": by_turn}


def driver_seconds_per_row(stats: list[dict]) -> float:
    """The runner's work between two calls per conversation of either, over runs (ConversationRunner.stats):
    what multiturn.py charges each call after the first; 0 when no call followed another."""
    rows = sum(s["driver_rows"] for s in stats)
    return sum(s["driver_s"] for s in stats) / rows if rows else 0.0


def agent_workload(convs, settings, runner_stats: list[dict], tool_seconds: list[float] | None = None) -> AgentWorkload:
    """What `hflow-plan search --agent-workload FILE` reads (write it with `.model_dump_json()`): the
    distributions finished conversations showed, the tools' seconds per tool turn (None: those the
    conversations' tool turns took; else tool_latency's), the runner's work between calls per conversation
    measured on the runs that made them (`runner_stats`: each run's ConversationRunner.stats), the prompts'
    tokens as the chat template rendered them (the longest: rows are padded to it) and the run config's
    `agent` settings (tool_workers, overlap)."""
    d = observed_distributions(convs)
    if tool_seconds is None:
        tool_seconds = [end - start for c in convs for start, end in c.tool_spans]
    return AgentWorkload(turns=d["turns"], tool_seconds=tool_seconds or [0.0], turn_tokens=d["turn_tokens"],
                         turn_tokens_by_turn=d["turn_tokens_by_turn"], tool_turn_tokens=d["tool_turn_tokens"],
                         tool_workers=settings.tool_workers, overlap=settings.overlap,
                         driver_seconds_per_row=driver_seconds_per_row(runner_stats),
                         prompt_tokens=max(len(c.prompt_ids) for c in convs))


def probe_workload(folder, settings, rows: list[dict], rollouts: int = 2, seed: int = 0) -> AgentWorkload:
    """The agent workload of `rollouts` rollouts of `rows`' conversations run here on the native engine with
    the model in `folder` (an HF folder with a tool-aware chat template) and `settings`' tools: turns,
    tokens, the tools' seconds per tool turn and the runner's work between calls as this machine shows them
    (the first rollout's work between calls left out when there are more: the template's first render
    compiles it)."""
    from transformers import AutoTokenizer

    from hybridflow.runtime.agents.chat_format import ChatFormat
    from hybridflow.runtime.agents.conversation import ConversationRunner
    from hybridflow.runtime.agents.environments import load_environment
    from hybridflow.runtime.agents.loading import load_tools
    from hybridflow.runtime.engines.rollout.generation import GenerationEngine
    from hybridflow.runtime.models.hf_format import load_pretrained
    from hybridflow.runtime.tasks.model_tokenizer import generation_ids

    hf = AutoTokenizer.from_pretrained(str(folder), local_files_only=True)
    eos = generation_ids(folder)[0]
    tools = load_tools(settings.tools)
    chat = ChatFormat(hf, [t.schema for t in tools.values()], eos)
    engine = GenerationEngine(load_pretrained(folder).eval())
    env_class = load_environment(settings.environment) if settings.environment else None
    runner = ConversationRunner(engine.generate, chat, settings, tools, env_class, pad_id=hf.pad_token_id)
    sampling = SamplingParams(temperature=1.0, eos_token_id=eos, pad_token_id=hf.pad_token_id)
    convs, stats = [], []
    for k in range(rollouts):
        with torch.no_grad():
            convs += runner.run(rows, sampling, torch.Generator().manual_seed(seed + k), seed=seed + k)
        stats.append(runner.stats)
    return agent_workload(convs, settings, stats[1:] or stats)
