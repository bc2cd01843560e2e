"""Pipeline parallelism from outside the model (TorchTitan style), driven by torch.distributed.pipelining.

`split_stage` cuts a CausalLM / ScoreModel into this rank's stage in place, as its family's stage
cut (simulator/vocabulary/families.py) says: contiguous decoder layers (kept in a ModuleDict under their
global index, so parameter names, state dicts and checkpoints keep the Hugging Face names), the
embeddings on the first stage, the final norm and the head on the last. The model file only has
to run with those pieces set to None.

`PipelineRunner` is the FsdpEngine's pp > 1 path (fsdp/engine.py dispatches to it):

- the local batch is cut into m equal micro-batches (the largest size ≤ the requested micro-batch
  size that divides the batch: the schedule's receive buffers have one shape for all micro-batches);
- a GPipe (or 1F1B) schedule runs them; activations [mb, S, hidden] travel between stages, and the
  attention mask and position ids go to every stage as keyword arguments;
- the user's RL loss needs every per-token field of its micro-batch, which only the driver's batch
  has: the schedule's target is the row index of each sample, so the last stage's loss function
  picks the micro-batch out of the local batch by index and computes log-probs / entropy / values
  exactly as the pp = 1 engine does. Each micro-batch loss is weighted by its share of the batch
  (`scale_grads=False`), so the gradient is that of the batch mean, as at pp = 1;
- gradient clipping sums the squared norms of all stages (one all-reduce over the pp group);
  metrics and forward-only results (log-probs, values) are broadcast from the last stage, so every
  rank returns the same thing.

Stage shapes are given to `PipelineStage` up front (static metadata: no shape-inference pass);
schedules are cached per (micro-batch size, sequence length, count, train/eval).
"""

from __future__ import annotations

import math
from collections import defaultdict
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe

from hybridflow.runtime.controller.tensordict_import import TensorDict
from hybridflow.runtime.engines.parallelize import resolve_mixed_precision
from hybridflow.runtime.engines.train.base import as_tensordict
from hybridflow.runtime.engines.train.fsdp.clip import clip_grad_norm_
from hybridflow.runtime.engines.train.logits import token_entropy, token_log_probs
from hybridflow.runtime.engines.train.packing import bucket_order, inverse_order
from hybridflow.runtime.models.decoder import positions_from_mask
from hybridflow.simulator.errors import HflowError
from hybridflow.simulator.vocabulary.families import StageCut, family

SCHEDULES = {"gpipe": ScheduleGPipe, "1f1b": Schedule1F1B}
_MAX_CACHED = 6  # schedules (and their receive buffers) kept per runner


def stage_layers(num_layers: int, stage: int, num_stages: int) -> range:
    """The contiguous decoder layers of `stage`; earlier stages take one more when pp ∤ layers."""
    per, extra = divmod(num_layers, num_stages)
    start = stage * per + min(stage, extra)
    return range(start, start + per + (stage < extra))


def _stage_cut(model: nn.Module) -> StageCut:
    return family(model.config.family).stage_cut


def _set_module(model: nn.Module, path: str, module: nn.Module | None) -> None:
    parent, _, name = path.rpartition(".")
    owner = model.get_submodule(parent) if parent else model
    if hasattr(owner, name):  # a head the model lacks (lm_head of a score model) is skipped
        setattr(owner, name, module)


def split_stage(model: nn.Module, stage: int, num_stages: int) -> nn.Module:
    """Keep only `stage`'s part of a decoder model (in place); returns the model."""
    cfg, cut = model.config, _stage_cut(model)
    if num_stages > cfg.num_hidden_layers:
        raise HflowError(f"pp={num_stages} exceeds the model's {cfg.num_hidden_layers} layers; "
                         "use a pipeline size of at most the layer count")
    if cfg.tie_word_embeddings:
        raise HflowError("pp > 1 needs untied embeddings (the tied LM head would live on two stages); "
                         "use pp=1 for a model with tie_word_embeddings")
    layers = model.get_submodule(cut.layers)
    _set_module(model, cut.layers, nn.ModuleDict(
        {str(i): layers[i] for i in stage_layers(len(layers), stage, num_stages)}))
    for path in cut.first if stage > 0 else ():
        _set_module(model, path, None)
    for path in cut.last if stage < num_stages - 1 else ():
        _set_module(model, path, None)
    return model


def param_stages(model: nn.Module, num_stages: int) -> dict[str, int]:
    """The pipeline stage that holds each parameter of a whole model (as split_stage cuts it)."""
    cut = _stage_cut(model)
    layer_stage = {i: s for s in range(num_stages) for i in stage_layers(model.config.num_hidden_layers, s, num_stages)}
    out = {}
    for name, _ in model.named_parameters():
        if name.startswith(tuple(p + "." for p in cut.first)):
            out[name] = 0
        elif name.startswith(cut.layers + "."):
            out[name] = layer_stage[int(name.removeprefix(cut.layers + ".").split(".")[0])]
        else:  # final norm, LM head, scalar head
            out[name] = num_stages - 1
    return out


def equal_micro_size(n: int, requested: int) -> int:
    """The largest micro-batch size ≤ requested that divides n (pipeline micro-batches are equal)."""
    return max(s for s in range(1, min(n, requested) + 1) if n % s == 0)


@dataclass
class _Job:
    """What the last stage's loss function needs for the current step."""

    batch: TensorDict  # rows in micro-batch order
    loss_fn: object = None  # training: the user's loss; forward-only: None
    keys: tuple[str, ...] = ()
    entropy: bool = True
    token_weights: str | None = None  # weigh micro-batches by their share of these tokens (else rows)
    total: float = 0.0
    sums: dict = field(default_factory=lambda: defaultdict(float))
    parts: list = field(default_factory=list)
    finite: bool = True
    order: torch.Tensor | None = None


class PipelineRunner:
    """Train and evaluate a FsdpEngine's stage with a torch.distributed.pipelining schedule."""

    def __init__(self, engine, schedule: str = "gpipe", mixed_precision: bool | None = None):
        if schedule not in SCHEDULES:
            raise HflowError(f"unknown pipeline schedule '{schedule}'; use one of {', '.join(SCHEDULES)}")
        self.engine, self.schedule_cls = engine, SCHEDULES[schedule]
        pp_mesh = engine.mesh["pp"]
        self.group = pp_mesh.get_group()
        self.stage, self.num_stages = pp_mesh.get_local_rank(), engine.parallel.pp
        self.is_first, self.is_last = self.stage == 0, self.stage == self.num_stages - 1
        self.last_rank = dist.get_global_rank(self.group, self.num_stages - 1)
        cfg = engine.model.config
        self.hidden, self.vocab = cfg.hidden_size, cfg.vocab_size
        self.act_dtype = torch.bfloat16 if resolve_mixed_precision(engine.mesh, mixed_precision) else torch.float32
        self._schedules: dict[tuple, object] = {}
        self._job: _Job | None = None

    # ---- schedules ----------------------------------------------------------------------------
    def _schedule(self, mb: int, seq: int, m: int, train: bool):
        key = (mb, seq, m, train)
        if key not in self._schedules:
            if len(self._schedules) >= _MAX_CACHED:
                self._schedules.pop(next(iter(self._schedules)))

            def meta(shape, dtype):
                return torch.empty(shape, dtype=dtype, device="meta", requires_grad=train and dtype.is_floating_point)

            act = (mb, seq, self.hidden)
            inp = meta((mb, seq), torch.long) if self.is_first else meta(act, self.act_dtype)
            if not self.is_last:
                out = meta(act, self.act_dtype)
            else:
                out = meta((mb, seq, self.vocab), self.act_dtype) if self.engine.is_lm else meta((mb, seq), torch.float32)
            stage = PipelineStage(self.engine.model, self.stage, self.num_stages, self.engine.device,
                                  input_args=inp, output_args=out, group=self.group)
            if self.schedule_cls is Schedule1F1B and m < self.num_stages:
                raise HflowError(f"the 1F1B schedule needs at least pp={self.num_stages} micro-batches, got {m}; "
                                 "use a smaller micro_batch_size or schedule 'gpipe'")
            self._schedules[key] = self.schedule_cls(stage, n_microbatches=m, loss_fn=self._loss, scale_grads=False)
        return self._schedules[key]

    def _run(self, batch, micro_batch_size: int | None, job_args: dict, train: bool) -> _Job:
        batch = as_tensordict(batch)
        n = batch.batch_size[0]
        if n == 0:
            raise HflowError("the pipeline got an empty batch; give each data-parallel rank at least one sample")
        dev = self.engine.device
        ids = batch["input_ids"]
        mask = batch.get("attention_mask", None)
        mask = torch.ones_like(ids) if mask is None else mask
        pos = batch.get("position_ids", None)
        pos = positions_from_mask(mask) if pos is None else pos
        size = equal_micro_size(n, micro_batch_size or self.engine.micro_batch_size or n)
        # Rows of similar length share a micro-batch, as at pp = 1 (same micro-batches, same per-micro means).
        order = bucket_order(mask, size)
        if order is not None:
            batch, ids, mask, pos = batch[order], ids[order], mask[order], pos[order]
        schedule = self._schedule(size, ids.shape[1], n // size, train)
        self._job = job = _Job(batch=batch, **job_args)
        tw = job.token_weights
        job.total = float(batch[tw].sum()) if tw else float(n)
        args = (ids.to(dev),) if self.is_first else ()
        kwargs = dict(attention_mask=mask.to(dev), position_ids=pos.to(dev))
        target = torch.arange(n, device=dev) if self.is_last else None
        run = schedule.step if train else schedule.eval
        run(*args, target=target, return_outputs=False, **kwargs)
        self._job = None
        job.order = order
        return job

    # ---- the last stage's loss: the user's loss on the micro-batch picked by index ---------------
    def _outputs(self, out: torch.Tensor, micro: TensorDict, entropy: bool) -> dict[str, torch.Tensor]:
        """As FsdpEngine.forward returns them: per-token fields, 0 on padding."""
        mask = micro.get("attention_mask", None)
        real = None if mask is None else mask.to(out.device).bool()

        def clean(x, keep):
            return x if keep is None else torch.where(keep, x, torch.zeros((), dtype=x.dtype, device=x.device))

        if not self.engine.is_lm:
            return {"values": clean(out.float(), real)}
        # A prediction needs a real token before it: a row's first real token has none (as packed at pp = 1).
        predicted = None if real is None else real & F.pad(real[:, :-1], (1, 0))
        ids = micro["input_ids"].to(out.device)
        scaled = self.engine.tempered(out)
        res = {"logits": out, "log_probs": clean(token_log_probs(scaled, ids), predicted)}
        if entropy:
            res["entropy"] = clean(token_entropy(scaled), predicted)
        return res

    def _loss(self, out: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
        job = self._job
        micro = job.batch[index.cpu()]
        if job.loss_fn is None:  # forward only: keep the per-token results, no loss
            outputs = self._outputs(out, micro, entropy="entropy" in job.keys)
            job.parts.append({k: outputs[k].detach() for k in job.keys})
            return out.new_zeros(())
        result = job.loss_fn(self._outputs(out, micro, entropy=job.entropy), micro)
        loss, stats = result if isinstance(result, tuple) else (result, {})
        share = float(micro[job.token_weights].sum()) if job.token_weights else float(index.numel())
        weight = share / job.total if job.total > 0 else index.numel() / job.batch.batch_size[0]
        job.finite &= bool(torch.isfinite(loss))
        job.sums["loss"] += loss.item() * weight
        for k, v in stats.items():
            job.sums[k] += float(v) * weight
        return loss * weight

    # ---- the engine's entry points ------------------------------------------------------------
    def train_step(self, batch, loss_fn, micro_batch_size: int | None = None, *, token_weights: str | None = None,
                   entropy: bool = True) -> dict[str, float]:
        eng = self.engine
        eng.model.train()
        eng.optimizer.zero_grad(set_to_none=True)
        job = self._run(batch, micro_batch_size, dict(loss_fn=loss_fn, token_weights=token_weights, entropy=entropy),
                        train=True)
        box = [(dict(job.sums), job.finite)]
        dist.broadcast_object_list(box, src=self.last_rank, group=self.group)
        sums, finite = box[0]
        sums["nonfinite_loss"] = float(not finite)  # the engine skips the step (every stage alike)
        return eng._finish_step(sums)  # its _apply_step clips over every stage (clip_grad_norm_)

    def clip_grad_norm_(self, max_norm: float) -> float:
        """Clip by the 2-norm over every stage's gradients (each stage's norm is whole over its dp/tp)."""
        params = [p for p in self.engine.model.parameters() if p.grad is not None]
        stage_norm = clip_grad_norm_(params, 0.0)  # 0: measure only
        sq = torch.tensor([stage_norm ** 2], dtype=torch.float64)
        dist.all_reduce(sq, group=self.group)
        total = math.sqrt(float(sq))
        if max_norm > 0 and total > max_norm:
            coef = max_norm / (total + 1e-6)
            for p in params:
                p.grad.mul_(coef)
        return total

    @torch.no_grad()
    def infer(self, batch, micro_batch_size: int | None, keys: tuple[str, ...]) -> TensorDict:
        """Forward only: per-token `keys` ([B, S] each) of the local batch, on every rank."""
        batch = as_tensordict(batch)
        self.engine.model.eval()
        try:
            job = self._run(batch, micro_batch_size, dict(keys=keys), train=False)
        finally:
            self.engine.model.train()
        n, seq = batch.batch_size[0], batch["input_ids"].shape[1]
        back = slice(None) if job.order is None else inverse_order(job.order)  # the caller's row order
        out = {}
        for k in keys:
            t = (torch.cat([p[k] for p in job.parts]).float().contiguous() if self.is_last
                 else torch.empty(n, seq, dtype=torch.float32, device=self.engine.device))
            dist.broadcast(t, src=self.last_rank, group=self.group)
            out[k] = t.cpu()[back]
        return TensorDict(out, batch_size=batch.batch_size)

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """The whole model's weights on every rank: each stage's full state dict, gathered over pp."""
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        sd = get_model_state_dict(self.engine.model, options=StateDictOptions(full_state_dict=True))
        parts: list = [None] * self.num_stages
        dist.all_gather_object(parts, {k: v.detach().cpu() for k, v in sd.items()}, group=self.group)
        return {k: v for part in parts for k, v in part.items()}
