"""Conversations as the Ray trainer's rollouts (`hflow-plan run` with an `agent` section).

`ConversationRollout.run(prompts, generate, ...)` runs the prompt batch's conversations with
conversation.py's loop on any `generate(ids, mask, params, generator)` — in the trainer, one call on
the worker group that holds the rollout per model turn (runtime/rl/rollout.py) — and returns the
trainer's rollout batch: conversation_batch's fields (the prompt as the chat template renders it with
the tools, `response_mask` 1 only on generated tokens, responses `agent.max_tokens` wide so that
rollouts concatenate), `behaviour_log_probs` (the sampler's, on generated tokens; 0 elsewhere) when the
workers return them, `policy_version`, an environment's per-turn `token_rewards`, and per row the
conversation's counts (`AGENT_FIELDS`). The prompt batch's own fields (`data_row`, the prompt rows'
columns) are kept.

`final_turns` is what a reward function reads of a conversation: its last model turn (the answer);
`conversation_stats` the iteration's metrics.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from hybridflow.runtime.agents.chat_format import ChatFormat
from hybridflow.runtime.agents.conversation import Conversation, ConversationRunner, conversation_batch
from hybridflow.runtime.agents.environments import load_environment
from hybridflow.runtime.agents.loading import load_tools
from hybridflow.runtime.agents.settings import AgentSettings
from hybridflow.runtime.controller.batch import Batch
from hybridflow.runtime.engines.rollout.generation import SamplingParams

STOPS = ("answer", "done", "turns", "budget")  # Conversation.stop, as `agent_stop` indexes it
AGENT_FIELDS = ("agent_turns", "agent_tool_calls", "agent_tool_errors", "agent_tool_seconds", "agent_answer_start",
                "agent_stop", "agent_driver_seconds", "agent_driver_rows")


@dataclass
class TurnOutput:
    """What the conversation loop reads of a `generate` call (the engines' Rollout has these too)."""

    response: torch.Tensor  # [B, R]
    response_mask: torch.Tensor
    response_logprobs: torch.Tensor  # the sampler's log-prob of each token (0 where the engine gives none)


class ConversationRollout:
    """The run's tools (or environment) and chat template, ready to run conversations for the trainer."""

    def __init__(self, settings: AgentSettings, hf_tokenizer, eos_ids: list[int], pad_id: int, seed: int = 0):
        self.settings, self.pad_id, self.seed = settings, pad_id, seed
        self.tools = load_tools(settings.tools)
        self.env_class = load_environment(settings.environment) if settings.environment else None
        self.chat = ChatFormat(hf_tokenizer, [t.schema for t in self.tools.values()], eos_ids)
        # the runner reads only the EOS ids (to decode a turn's text); the workers sample with their own settings
        self.sampling = SamplingParams(max_new_tokens=settings.turn_tokens, eos_token_id=eos_ids, pad_token_id=pad_id)

    def run(self, prompts: Batch, generate: Callable, episode_seed: int,
            versions: Callable[[], set[int]] | None = None) -> Batch:
        """The conversations of `prompts` (one per row) run to their end on `generate`; `episode_seed`
        seeds the environments' episodes; `versions()`: the policy versions that generated them."""
        rows = [{k: v[i] for k, v in prompts.non_tensors.items()} for i in range(len(prompts))]
        runner = ConversationRunner(generate, self.chat, self.settings, self.tools, self.env_class, pad_id=self.pad_id)
        convs = runner.run(rows, self.sampling, seed=self.seed * 1_000_003 + episode_seed)
        out = self.batch(prompts, convs, getattr(generate, "behaviour", True), versions() if versions else set())
        # the loop's own work between calls, spread over the rows so that it sums over concatenated rollouts
        n = len(convs)
        out["agent_driver_seconds"] = torch.full((n,), runner.stats["driver_s"] / n, dtype=torch.float32)
        out["agent_driver_rows"] = torch.full((n,), runner.stats["driver_rows"] / n, dtype=torch.float32)
        return out

    def batch(self, prompts: Batch, convs: list[Conversation], behaviour: bool, versions: set[int]) -> Batch:
        f = conversation_batch(convs, self.pad_id, width=self.settings.max_tokens)
        tensors = {k: v for k, v in prompts.tensors.items() if k not in f}
        tensors.update({k: f[k] for k in ("prompt_ids", "prompt_mask", "input_ids", "attention_mask", "position_ids",
                                          "responses", "response_mask")})
        if behaviour:
            tensors["behaviour_log_probs"] = f["rollout_log_probs"]
        if self.env_class is not None:
            tensors["token_rewards"] = f["token_rewards"]
        if versions:  # weights change only while no rollout is in flight: one version per rollout
            tensors["policy_version"] = torch.full((len(convs),), min(versions), dtype=torch.long)
        tensors.update({
            "agent_turns": torch.tensor([c.turns for c in convs]),
            "agent_tool_calls": torch.tensor([c.tool_calls for c in convs]),
            "agent_tool_errors": torch.tensor([c.tool_errors for c in convs]),
            "agent_tool_seconds": torch.tensor([c.tool_seconds for c in convs], dtype=torch.float32),
            "agent_answer_start": torch.tensor([c.turn_starts[-1] if c.turn_starts else 0 for c in convs]),
            "agent_stop": torch.tensor([STOPS.index(c.stop) for c in convs])})
        return Batch(tensors, prompts.non_tensors, prompts.meta)


def is_conversation_batch(batch: Batch) -> bool:
    return "agent_answer_start" in batch


def final_turns(batch: Batch) -> Batch:
    """`batch` with each response cut to its last model turn, moved to column 0 (what a reward function
    reads of a conversation: its answer)."""
    responses, mask = batch["responses"], batch["response_mask"]
    width = responses.shape[1]
    cols = batch["agent_answer_start"][:, None] + torch.arange(width)[None]
    inside = cols < width
    cols = cols.clamp(max=width - 1)
    out = Batch(dict(batch.tensors.items()), dict(batch.non_tensors), dict(batch.meta))
    out["responses"] = torch.gather(responses, 1, cols)
    out["response_mask"] = torch.gather(mask, 1, cols) * inside
    return out


def conversation_texts(batch: Batch, tok) -> list[str]:
    """Each conversation after its prompt as text: the model's turns and the tool turns between them."""
    real = batch["attention_mask"][:, -batch["responses"].shape[1]:].bool()
    return [tok.decode(row[keep].tolist()) for row, keep in zip(batch["responses"], real, strict=True)]


def _deciles(x: torch.Tensor) -> dict[str, float]:
    shares = torch.arange(0.05, 1.0, 0.1, dtype=torch.float32)
    return {f"q{round(100 * s):02d}": v for s, v in zip(shares.tolist(), torch.quantile(x.float(), shares).tolist(),
                                                          strict=True)}


def conversation_stats(batch: Batch) -> dict[str, float]:
    """The rollout's conversations in numbers: turns, tool calls (and their share), errors, tool seconds,
    the share of response tokens the model generated, how conversations ended."""
    turns, calls = batch["agent_turns"].float(), batch["agent_tool_calls"].float()
    real = batch["attention_mask"][:, -batch["responses"].shape[1]:].sum()
    stop = batch["agent_stop"]
    # generated tokens of the last model turn (the answer) and of each turn before it (the calls), as
    # deciles: a rollout's turn decodes as long as its longest row, so `run`'s multi-turn price
    # (tools/reports/agent_prediction.py) needs their spread, not only their mean
    mask = batch["response_mask"].float()
    after = torch.arange(mask.shape[1]) >= batch["agent_answer_start"][:, None]
    final, calls_tokens = (mask * after).sum(-1), (mask * ~after).sum(-1)
    multi = turns > 1
    counts = torch.bincount(batch["agent_turns"].long())
    spread = {"agent/final_turn_tokens": _deciles(final),  # and the share of conversations of k turns
              "agent/turns_share": {str(k): c / len(turns) for k, c in enumerate(counts.tolist()) if k and c}}
    if multi.any():
        spread["agent/call_turn_tokens"] = _deciles(calls_tokens[multi] / (turns[multi] - 1))
    return {**spread,
            "agent/turns_mean": turns.mean().item(), "agent/multi_turn_share": (turns > 1).float().mean().item(),
            "agent/tool_calls_mean": calls.mean().item(), "agent/tool_use_share": (calls > 0).float().mean().item(),
            "agent/tool_errors_mean": batch["agent_tool_errors"].float().mean().item(),
            "agent/tool_seconds_mean": batch["agent_tool_seconds"].mean().item(),
            "agent/generated_share": (batch["response_mask"].sum() / real.clamp(min=1)).item(),
            # the prompts as the chat template rendered them with the tools, padded to the longest
            "agent/prompt_tokens": float(batch["prompt_ids"].shape[1]),
            # seconds of the driver's own work between generate calls per conversation handled there
            "agent/driver_seconds_per_row": (batch["agent_driver_seconds"].sum()
                                             / batch["agent_driver_rows"].sum().clamp(min=1)).item()
            if "agent_driver_seconds" in batch else 0.0,
            **{f"agent/stop_{s}": (stop == i).float().mean().item() for i, s in enumerate(STOPS)}}
