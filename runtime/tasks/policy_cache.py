"""The warmed-up built-in policies: where each one is cached and what building one costs.

Torch-free, so `hflow-plan run` can tell before importing torch whether a role without weights can
be warmed up on this machine at all (a 7B model cannot: its fp32 weights, gradients and Adam states
alone exceed most hosts' memory, and the supervised phase would take days) and, the first time,
how long the warm-up will take. warmup.py does the building.

A policy lives in `cache_dir()/policy-<task>-<model>-<hash>` (the hash of everything that shapes
it); `warmup.json`, written last, marks a complete one and records the steps it took, their FLOPs
and seconds — the next estimate on this machine uses that rate.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass
from pathlib import Path

from hybridflow.runtime.controller.host import cache_dir
from hybridflow.runtime.tasks.builtin import get_task
from hybridflow.runtime.tasks.char_vocab import VOCAB_SIZE
from hybridflow.simulator.errors import HflowError
from hybridflow.simulator.pricing.activations import activation_bytes_per_token_layer
from hybridflow.simulator.vocabulary.model import ModelSpec

WARMUP_VERSION = 1
METRICS_FILE = "warmup.json"
FP32_TRAIN_BYTES_PER_PARAM = 16  # fp32 weights, gradients, Adam m and v (no master copy on CPU)
# The first estimate's training rate, before any warm-up here has been timed: the tiny model's fp32
# training in one process of a small CPU machine, on the slow side (a quiet 2-core development machine
# runs it several times faster). Later estimates use the last warm-up's measured rate.
FIRST_GUESS_FLOPS_PER_S = 15e9
# A built-in policy that would take longer than this to warm up (all its steps) is refused: far above
# the tiny model's worst case on a slow, shared machine, far below what a 7B model would take.
TIME_LIMIT_S = 4 * 3600
MEMORY_SHARE = 0.8  # … and one that needs more than this share of the available host memory


@dataclass(frozen=True)
class WarmupConfig:
    task: str = "sort"
    max_steps: int = 400
    batch_size: int = 64
    lr: float = 3e-3
    seed: int = 0
    target_greedy_accuracy: float = 0.3
    eval_every: int = 25
    eval_size: int = 256


def check_warmup_shape(spec: ModelSpec) -> None:
    """The warm-up trains character-vocabulary models only: any other vocabulary would sample ids the
    character tokenizer cannot read, and a real model's weights come from its folder, not from here."""
    if spec.vocab != VOCAB_SIZE:
        raise HflowError(f"model '{spec.name}' has a vocabulary of {spec.vocab}: the built-in warm-up only builds "
                         f"models with the character tokenizer's {VOCAB_SIZE}; set the role's `path` in the plan to "
                         "the model's Hugging Face folder (weights and tokenizer)")


def _key(spec: ModelSpec, cfg: WarmupConfig) -> str:
    # the context length changes no weight: a spec that states it warms the same policy
    blob = json.dumps({"v": WARMUP_VERSION, "spec": spec.model_dump(exclude={"context_len"}), "cfg": asdict(cfg)},
                      sort_keys=True)
    return hashlib.sha256(blob.encode()).hexdigest()[:12]


def policy_folder(spec: ModelSpec, cfg: WarmupConfig, root: str | Path | None = None) -> Path:
    root = Path(root) if root is not None else cache_dir()
    return root / f"policy-{cfg.task}-{spec.name}-{_key(spec, cfg)}"


def cached_policy(spec: ModelSpec, cfg: WarmupConfig, root: str | Path | None = None) -> Path | None:
    """The folder of a complete warmed-up policy for (spec, cfg), or None if it must be built."""
    folder = policy_folder(spec, cfg, root)
    return folder if (folder / METRICS_FILE).is_file() else None


# ---- what a warm-up costs ----------------------------------------------------------------------
def _sequence_len(cfg: WarmupConfig) -> int:
    task = get_task(cfg.task)
    return task.max_prompt_chars + task.max_answer_chars + 2  # <bos> … <eos>


def step_flops(spec: ModelSpec, cfg: WarmupConfig) -> float:
    """FLOPs of one supervised step (forward + backward ≈ 3 forwards) plus its share of the evals."""
    seq = _sequence_len(cfg)
    forward = spec.sequence_forward_flops(seq)
    return 3 * forward * cfg.batch_size + forward * cfg.eval_size / cfg.eval_every


def peak_bytes(spec: ModelSpec, cfg: WarmupConfig) -> float:
    """Memory the driver holds while warming up: fp32 training states and one batch's activations
    (the memory model's, in fp32) and logits (+ their softmax and gradient)."""
    tokens = max(cfg.batch_size, cfg.eval_size) * _sequence_len(cfg)
    acts = activation_bytes_per_token_layer(spec, 1, element_bytes=4) * tokens * spec.layers
    logits = 3 * 4 * tokens * spec.vocab
    return FP32_TRAIN_BYTES_PER_PARAM * spec.num_params() + acts + logits


def measured_rate(root: str | Path | None = None) -> float | None:
    """FLOP/s of the most recent timed warm-up in the cache (this machine's own rate), if any."""
    root = Path(root) if root is not None else cache_dir()
    newest, rate = -1.0, None
    for f in root.glob(f"policy-*/{METRICS_FILE}"):
        try:
            m = json.loads(f.read_text())
            mtime = f.stat().st_mtime
        except (OSError, ValueError):
            continue
        if m.get("flops", 0) > 0 and m.get("seconds", 0) > 0 and mtime > newest:
            newest, rate = mtime, m["flops"] / m["seconds"]
    return rate


@dataclass(frozen=True)
class WarmupCost:
    """What warming up a policy would take here, at most (all `max_steps`; it usually stops early)."""

    params: int
    bytes: float
    seconds: float
    measured: bool  # the rate is this machine's last warm-up's, not the first guess

    def describe(self) -> str:
        return f"up to {fmt_duration(self.seconds)}{'' if self.measured else ' (a first guess)'}"


def warmup_cost(spec: ModelSpec, cfg: WarmupConfig, root: str | Path | None = None) -> WarmupCost:
    rate = measured_rate(root)
    seconds = step_flops(spec, cfg) * cfg.max_steps / (rate or FIRST_GUESS_FLOPS_PER_S)
    return WarmupCost(params=spec.num_params(), bytes=peak_bytes(spec, cfg), seconds=seconds, measured=rate is not None)


def fmt_duration(seconds: float) -> str:
    if seconds < 90:
        return f"{seconds:.0f} s"
    if seconds < 90 * 60:
        return f"{seconds / 60:.0f} min"
    if seconds < 48 * 3600:
        return f"{seconds / 3600:.0f} h"
    return f"{seconds / 86400:,.0f} days"
