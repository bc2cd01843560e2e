"""How long a rule-based reward takes on the single controller: the `reward` op's price per sequence.

In a run the driver scores a rollout batch with `dataflow.rule_scores`: each response decoded, the
function called on it with its prompt row's fields, every score checked. This probe times that same
function on the built-in tasks — a batch as the trainer builds it (the task's prompts and answers,
each prompt repeated per sample), responses of the workload's length ending at EOS at different
lengths, the character tokenizer the built-in policy uses — one point per task; the calibration
prices a rule-based reward at the median seconds per sequence (simulator/calibration/fit.py).

    points = measure_reward(batch=128, response_len=8)  # one ProfilePoint per built-in task
"""

from __future__ import annotations

import random
import statistics
import time

import torch

from hybridflow.runtime.controller.batch import Batch
from hybridflow.runtime.rl.dataflow import rule_scores
from hybridflow.runtime.tasks.builtin import TASKS
from hybridflow.runtime.tasks.data import PromptDataset
from hybridflow.runtime.tasks.tokenizer import CharTokenizer
from hybridflow.simulator.calibration.profile import ProfilePoint

SAMPLES_PER_PROMPT = 8


def rollout_batch(task: str, batch: int, response_len: int, seed: int = 0) -> Batch:
    """`batch` rows of `task`'s prompts (each repeated SAMPLES_PER_PROMPT times) with responses of random
    digits, each cut by EOS after 1 to `response_len` tokens."""
    tok, rng = CharTokenizer(), random.Random(seed)
    prompts = max(1, batch // SAMPLES_PER_PROMPT)
    data = PromptDataset.from_task(task, prompts, seed)
    texts, cols = data.take(list(range(prompts)))
    rows = Batch({"data_row": torch.arange(prompts)}, non_tensors={"prompt": texts, **cols},
                 meta={"data_source": data.source}).repeat_interleave(SAMPLES_PER_PROMPT)[:batch]
    responses = torch.full((len(rows), response_len), tok.pad_id)
    mask = torch.zeros_like(responses)
    for i in range(len(rows)):
        n = rng.randint(1, response_len)
        ids = tok.encode("".join(rng.choice("0123456789") for _ in range(n - 1))) + [tok.eos_id]
        responses[i, :n], mask[i, :n] = torch.tensor(ids), 1
    rows["responses"], rows["response_mask"] = responses, mask
    return rows


def measure_reward(batch: int = 128, response_len: int = 8, repeats: int = 9, seed: int = 0) -> list[ProfilePoint]:
    """Median seconds of `rule_scores` over `batch` responses of up to `response_len` tokens, per built-in task."""
    tok = CharTokenizer()
    points = []
    for name, task in TASKS.items():
        rows = rollout_batch(name, batch, response_len, seed)
        seconds = []
        for _ in range(repeats + 1):  # the first call warms the path up
            start = time.perf_counter()
            rule_scores(task.reward, rows, tok, f"reward function '{task.reward_function}'")
            seconds.append(time.perf_counter() - start)
        seconds = seconds[1:]
        points.append(ProfilePoint(op="reward", mode=name, batch=len(rows), response_len=response_len,
                                   seconds=statistics.median(seconds), std=statistics.pstdev(seconds),
                                   repeats=repeats))
    return points
