"""What every role worker shares: loading models from HF folders, op timing, batch slicing.

Workers time their own ops (wall clock of the process, `time.time()`), because only the worker
knows when a call really started: calls queued on a busy colocated process wait their turn. The
timings travel back in the output Batch's meta as `{"timing": {op: [start, end]}}`.
"""

from __future__ import annotations

import hashlib
import time
from contextlib import contextmanager
from pathlib import Path

import torch

from hybridflow.runtime.controller.batch import Batch
from hybridflow.runtime.controller.protocols import register
from hybridflow.runtime.engines.train.fsdp.engine import OptimConfig, TrainingEngine
from hybridflow.runtime.models.decoder import CausalLM, ScoreModel
from hybridflow.runtime.models.hf_format import load_pretrained


@contextmanager
def timed(timing: dict, op: str):
    start = time.time()
    try:
        yield
    finally:
        timing[op] = [start, time.time()]


def with_timing(batch: Batch, timing: dict) -> Batch:
    batch.meta["timing"] = dict(timing)
    return batch


def generation_seed(seed: int, iteration: int, replica: int, sample_round: int = 0) -> int:
    """The sampling seed of one generation replica: the tp ranks of a replica draw the same tokens, a
    resumed run draws what a straight one would, dynamic sampling's later rounds draw afresh."""
    return seed * 1_000_003 + iteration * 1009 + replica + sample_round * 7_919_993


def rollout_fields(out) -> dict[str, torch.Tensor]:
    """A Rollout (engines/generation.py) as the batch fields the dataflow reads, on the CPU."""
    return {"input_ids": out.tokens.cpu(), "attention_mask": out.attention_mask.cpu(),
            "position_ids": out.position_ids.cpu(), "responses": out.response.cpu(),
            "response_mask": out.response_mask.cpu()}


def load_causal_lm(path: str | Path) -> CausalLM:
    return load_pretrained(path, head="lm")


def load_score_model(path: str | Path) -> ScoreModel:
    """A scalar-head model from a score-model folder, or from a policy folder: the policy's backbone with
    a zero-initialised head (values start at 0; the usual critic initialisation from the policy)."""
    return load_pretrained(path, head="scalar")


def make_engine(model, parallel, optim: OptimConfig | None, micro_batch_size: int | None,
                temperature: float = 1.0) -> TrainingEngine:
    """The training engine the role's train config names (`backend`): FSDP2, or megatron-core (same interface)."""
    if parallel is not None and parallel.backend == "megatron":
        from hybridflow.runtime.engines.train.megatron.engine import MegatronEngine  # megatron-core: an extra

        return MegatronEngine(model, parallel, optim=optim, micro_batch_size=micro_batch_size, temperature=temperature)
    return TrainingEngine(model, parallel, optim=optim, micro_batch_size=micro_batch_size, temperature=temperature)


def response_slice(per_token: torch.Tensor, width: int) -> torch.Tensor:
    """The response columns of a [B, P+R] per-token tensor (aligned with input_ids)."""
    return per_token[:, -width:]


def _torch_optimizers(optimizer) -> list[torch.optim.Optimizer]:
    """The torch optimizers holding the states: itself, or those inside megatron's (chained) optimizer."""
    chained = getattr(optimizer, "chained_optimizers", None) or [optimizer]
    return [getattr(o, "optimizer", o) for o in chained]


def exact_bytes(t: torch.Tensor) -> bytes:
    """A tensor's exact bytes, read from a CPU copy (never a numpy view of live, possibly device,
    storage) as raw bytes: numpy has no bfloat16, and a 0-d tensor (an optimizer's step) has no byte view."""
    return t.detach().to("cpu", copy=True).contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()


def engine_fingerprint(engine: TrainingEngine) -> str:
    """sha256 over this rank's parameters and optimizer state (exact bytes): resume checks compare it."""
    h = hashlib.sha256()
    for name, p in sorted(engine.model.state_dict().items()):
        if not isinstance(p, torch.Tensor):  # megatron's `_extra_state` entries
            continue
        t = p.to_local() if hasattr(p, "to_local") else p
        h.update(name.encode())
        h.update(exact_bytes(t))
    for i, optimizer in enumerate(_torch_optimizers(engine.optimizer)):
        for pid, st in sorted(optimizer.state_dict()["state"].items()):
            for k, v in sorted(st.items()):
                if isinstance(v, torch.Tensor):
                    v = v.to_local() if hasattr(v, "to_local") else v
                    h.update(f"{i}.{pid}.{k}".encode() if i else f"{pid}.{k}".encode())
                    h.update(exact_bytes(v))
    h.update(str(engine.step).encode())
    return h.hexdigest()


def run_updates(engine: TrainingEngine, batch: Batch, loss_fn, epochs: int, mini_batches: int,
                micro_batch_size: int | None, entropy: bool = True,
                token_weights: str | None = "response_mask", score_width: int | None = None) -> dict[str, float]:
    """`epochs` passes over the local batch in `mini_batches` optimizer steps each (fixed order, so a
    resumed run repeats it exactly); returns the metrics averaged over the steps taken, and
    `skipped_steps`, the steps the engine skipped for a non-finite gradient. `token_weights`: the
    mask of a token-mean loss (micro-batches count by their share of its tokens); None for a loss
    that is a mean over sequences (they count by rows). `score_width`: the loss reads only the last
    columns of the LM outputs (TrainingEngine.train_step)."""
    td = batch.tensors
    parts = max(1, min(mini_batches, len(batch)))
    sums: dict[str, float] = {}
    steps = skipped = 0
    for _ in range(epochs):
        for mb in td.chunk(parts):
            m = engine.train_step(mb, loss_fn, micro_batch_size, token_weights=token_weights, entropy=entropy,
                                  score_width=score_width)
            if m.pop("skipped"):
                skipped += 1
                continue
            for k, v in m.items():
                sums[k] = sums.get(k, 0.0) + float(v)
            steps += 1
    return {**{k: v / steps for k, v in sums.items()}, "skipped_steps": float(skipped)}


class PhaseTiming:
    """The step breakdown's view into a worker's engine (tools/bench/step_breakdown.py): turn its phase
    clock (engines/phase_clock.py) on, then take the seconds and work per phase since the last take."""

    @register("ONE_TO_ALL")
    def time_phases(self, on: bool = True) -> None:
        self.engine.clock.enabled = on
        self.engine.clock.take()

    @register("ONE_TO_ALL")
    def take_phases(self) -> dict[str, float]:
        return self.engine.clock.take()


class EngineState:
    """Checkpoint, HF export and fingerprint of a worker's `self.engine` (a TrainingEngine), under
    path/role. Mixed into the trained workers (actor, critic), which set `self.model_path` (the folder
    their weights came from), so they share one implementation."""

    @register("ONE_TO_ALL")
    def save(self, path: str) -> None:
        """Save under path/role; `path` is a local folder or a URL (runtime/controller/locations.py)."""
        from hybridflow.runtime.controller.locations import Location

        self.engine.save(f"{path}/{self.role}")
        for folder in (f"{path}/{self.role}/dcp", f"{path}/{self.role}", path):  # the shards' names durable too
            Location(folder).sync()
        if self.rank == 0:  # the checkpoint carries its model's config and tokenizer (hf_export.py)
            from hybridflow.runtime.models.hf_export import copy_model_files

            copy_model_files(self.model_path, f"{path}/{self.role}")

    @register("ONE_TO_ALL")
    def export_hf(self, path: str) -> None:
        """Write the current weights as an HF folder at `path` (gathering is collective; rank 0 writes),
        with the config and tokenizer files of the folder the weights came from."""
        from hybridflow.runtime.models.hf_export import export_engine

        export_engine(self.engine, self.role, path, source=self.model_path, rank=self.rank)

    @register("ONE_TO_ALL")
    def load(self, path: str) -> None:
        self.engine.load(f"{path}/{self.role}")

    @register("ONE_TO_ALL")
    def fingerprint(self) -> str:
        return engine_fingerprint(self.engine)
