"""Probes for pricing multi-turn rollouts (simulator/agents/multiturn.py): the latency of the user's
tools on sample arguments, the cost of one `generate` call fitted as `DecodeCost`, and the distributions
a run of conversations showed (turns, tokens per turn, tokens per tool turn).

    latencies = tool_latency(tool, [{"expression": "2+3"}, ...], limits)
    cost = fit_decode_cost(engine.generate, vocab=500, pad_id=0)
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


def agent_workload(convs, tool_seconds: list[float], settings) -> AgentWorkload:
    """What `hflow-plan search --agent-workload FILE` reads (write it with `.model_dump_json()`): the
    distributions finished conversations showed, the tools' latencies (tool_latency) and the run config's
    `agent` settings (tool_workers, overlap)."""
    d = observed_distributions(convs)
    return AgentWorkload(turns=d["turns"], tool_seconds=tool_seconds or [0.0], turn_tokens=d["turn_tokens"],
                         turn_tokens_by_turn=d["turn_tokens_by_turn"], tool_turn_tokens=d["tool_turn_tokens"],
                         tool_workers=settings.tool_workers, overlap=settings.overlap)
