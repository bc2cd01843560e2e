"""The RL batch between the driver's ops: its fields, and what the Dataflow does to batches itself.

A rollout batch holds each sample's left-padded prompt (`prompt_ids`, `prompt_mask`), then the whole
sequence — prompt + response, left-padded — (`input_ids`, `attention_mask`, `position_ids`), the
response alone (`responses`, `response_mask`), and what the ops add: scores, log-probs, values,
advantages and returns.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial

import torch
import torch.nn.functional as F

from hybridflow.runtime.controller.batch import Batch
from hybridflow.runtime.controller.protocols import balanced_partition
from hybridflow.runtime.tasks.reward_pool import ScoringPool
from hybridflow.runtime.tasks.rewards import score_responses
from hybridflow.runtime.tasks.tokenizer import Tokenizer
from hybridflow.simulator.vocabulary.lengths import RECORDED_QUANTILES

SEQ_FIELDS = ("input_ids", "attention_mask", "position_ids", "responses")
VALUE_FIELD = {"critic": "values", "cost_critic": "cost_values"}  # each critic's values in the batch
RETURN_FIELD = {"critic": "returns", "cost_critic": "cost_returns"}  # and the returns it learns
PROMPT_FIELDS = ("prompt_ids", "prompt_mask")  # left-padded prompts
FULL_FIELDS = ("input_ids", "attention_mask", "position_ids")  # left-padded prompt + response


def dp_balanced_order(attention_mask: torch.Tensor, dp: int, group: int = 1) -> torch.Tensor | None:
    """A row order that gives each of `dp` contiguous shards (DP_COMPUTE's split) the same number of rows
    holding about the same tokens (controller/protocols.py balanced_partition; verl's balance_batch idea).
    The ranks then reach FSDP's collectives together. `group`: consecutive rows that share a prompt
    (samples per prompt) go to a rank together, balanced by their total length, so a rank's engine
    computes each prompt once (engines/train/fsdp/shared_prompts.py); where the groups do not split evenly over
    the ranks, rows are balanced one by one. None when there is nothing to balance."""
    n = attention_mask.shape[0]
    if dp < 2 or n % dp:
        return None
    group = group if group > 1 and n % (group * dp) == 0 else 1
    units = n // group
    tokens = attention_mask.long().sum(-1).view(units, group).sum(-1).tolist()
    dealt = torch.tensor([u for part in balanced_partition(tokens, dp) for u in part])
    return (dealt[:, None] * group + torch.arange(group)).flatten()


def left_pad_prompts(batch: Batch, width: int) -> Batch:
    """The batch with its left-padded prompt part widened to `width` columns (to concatenate rollouts
    whose longest prompts differ)."""
    extra = width - batch["prompt_ids"].shape[1]
    if extra <= 0:
        return batch
    out = Batch(dict(batch.tensors.items()), dict(batch.non_tensors), dict(batch.meta))
    for k in (*PROMPT_FIELDS, *FULL_FIELDS):
        if k in batch:
            out[k] = F.pad(batch[k], (extra, 0))
    return out


def batch_origin(batch: Batch) -> dict:
    """The data rows and source of the samples, for errors that name them (see Trainer.prompt_batch)."""
    rows = batch["data_row"].tolist() if "data_row" in batch else None
    return {"rows": rows, "source": batch.meta.get("data_source", "")}


def rule_scores(fn: Callable, batch: Batch, tok: Tokenizer, name: str) -> torch.Tensor:
    """A rule-based function's scores of a rollout batch, as the driver computes them (the `reward` or
    `cost` op; runtime/measure/reward_probe.py times this): each response decoded, then fn(prompt, response,
    **the prompt row's other fields), every score checked."""
    fields = {k: list(v) for k, v in batch.non_tensors.items() if k != "prompt"}
    score = fn.score_responses if isinstance(fn, ScoringPool) else partial(score_responses, fn)  # pool: in processes
    return score(list(batch["prompt"]), tok.decode_responses(batch["responses"], batch["response_mask"]),
                 fields, name=name, **batch_origin(batch))


def response_length_quantiles(response_mask: torch.Tensor) -> dict[str, float]:
    """The iteration's response lengths at the shares a run records (vocabulary/lengths.py RECORDED_QUANTILES),
    which `hflow-plan search --response-lengths METRICS.jsonl` reads back."""
    lengths = response_mask.sum(-1).float()
    shares = torch.tensor(list(RECORDED_QUANTILES.values()), dtype=lengths.dtype)
    return dict(zip(RECORDED_QUANTILES, torch.quantile(lengths, shares).tolist(), strict=True))
