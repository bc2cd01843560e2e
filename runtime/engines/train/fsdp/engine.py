"""FsdpEngine: one model, sharded by a ParallelConfig with FSDP2 + DTensor tensor parallelism, trained with
AdamW (the `fsdp` backend of the training-engine interface, engines/train/base.py).

The engine owns the model (parallelized from the outside by parallelize.py), its optimizer and the
bookkeeping of a step: split the local batch into micro-batches, accumulate gradients, clip them,
step (the learning-rate schedule, the skipped-step guard and checkpoints: base.py). It does not know
RL: a loss function plugs in,

    loss_fn(outputs, micro) -> loss | (loss, {name: float})

where `outputs` holds the forward results for the micro-batch (`log_probs`, `entropy` for an LM;
`values` for a scalar head) and `micro` is the micro-batch (a TensorDict with
`input_ids`, `attention_mask` and whatever the loss reads). The loss is a mean over the
micro-batch; the engine weights each micro-batch by its share of the local batch — of its rows, or
with `token_weights="response_mask"` of the tokens a token-mean loss averages over, counted over
all data-parallel ranks — and FSDP averages over data-parallel ranks, so the gradient is that of
the mean over the whole batch (with row weights exactly so when the ranks hold equal shares; with
token weights however the batch is sharded and cut into micro-batches).

Padding is removed before the model runs (packing.py): rows are bucketed by real length into
micro-batches and each micro-batch is repacked to its own longest row; outputs come back in the
caller's layout. With a token budget (`micro_batch_tokens`) the engine packs sequences instead: micro-batches
of at most so many real tokens, each one row of sequences back to back with attention confined to each
(fsdp/packed.py; prompts are then not shared). A pass that reads only the responses (`score_width`) over rows that repeat a prompt
(GRPO's samples) runs each prompt once instead, with its responses packed behind it (shared_prompts.py).

Token log-probs and entropy are aligned with `input_ids`: position i holds log p(input_ids[i] |
tokens < i) and the entropy of that predictive distribution; position 0 has no prediction and holds 0.
They are those of softmax(logits / temperature): a policy sampled at temperature T is scored by the
distribution it was sampled from. `score_width=R` says only the last R columns (the responses) are
read: the LM head and the log-softmax then run from the first position any row needs (as TRL's
`logits_to_keep`), and the columns before hold 0. The engine knows nothing of Ray; workers wrap it.

LoRA (`lora=`, engines/train/lora.py): peft's adapters are injected before the model is sharded, only they
(and a critic's scalar head) train and reach the optimizer; `base_policy()` switches them off (a LoRA
actor's reference log-probs). The tensor-parallel shards the 3D-HybridEngine reads are the merged weights
under the plain model's names (`gathered_tp_shards`, weight_views.py), so generation runs the plain decoder.

Ulysses sequence parallelism (`parallel.sp > 1`, ulysses.py): each micro-batch's sequence is split over the
rank's sp group (which holds the same rows), attention exchanges heads for sequence by all-to-all, the
per-token outputs are gathered along the sequence, and the backward is scaled by sp: the step is sp = 1's.
"""

from __future__ import annotations

import math
import warnings
from collections import defaultdict

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor

from hybridflow.runtime.controller.tensordict_import import TensorDict
from hybridflow.runtime.engines.parallelize import (
    build_mesh,
    parallelize,
    resolve_mixed_precision,
)
from hybridflow.runtime.engines.train.base import (
    TRAIN_ENGINES,
    LossFn,
    TrainEngine,
    as_tensordict,
)
from hybridflow.runtime.engines.train.fsdp.checkpoint import FsdpCheckpoint
from hybridflow.runtime.engines.train.fsdp.clip import clip_grad_norm_
from hybridflow.runtime.engines.train.fsdp.packed import packed_forward, packing_core, token_micro_rows
from hybridflow.runtime.engines.train.fsdp.pipeline import PipelineRunner, split_stage
from hybridflow.runtime.engines.train.fsdp.shared_prompts import (
    SharedPrompts,
    micro_batch_rows,
    share_prompts,
)
from hybridflow.runtime.engines.train.fsdp.ulysses import SequenceSplit, apply_ulysses, check_sp, new_sp_group
from hybridflow.runtime.engines.train.fsdp.weight_views import FsdpWeightViews
from hybridflow.runtime.engines.train.logits import (
    entropy_of,
    first_scored_logit,
    picked_log_probs,
    token_entropy,
    token_log_probs,
)
from hybridflow.runtime.engines.train.lora import apply_lora
from hybridflow.runtime.engines.train.optim import OptimConfig
from hybridflow.runtime.engines.train.packing import inverse_order, pack, pack_sequences
from hybridflow.simulator.errors import HflowError
from hybridflow.simulator.vocabulary.execution import shares_prompts
from hybridflow.simulator.vocabulary.lora import LoraConfig
from hybridflow.simulator.vocabulary.parallel import ParallelConfig

# FSDP2 warns that the root returns a view; the engine never modifies outputs in place.
warnings.filterwarnings("ignore", message=".*returned a view tensor.*", module=r"torch\.distributed\.fsdp")

# ---- the engine ---------------------------------------------------------------------------------


@TRAIN_ENGINES.register("fsdp")
class FsdpEngine(FsdpCheckpoint, FsdpWeightViews, TrainEngine):
    """A model sharded as `parallel` says (pp·tp·dp = the process group), with AdamW.

    Without an initialised process group (or with `parallel=None`) the model runs unsharded in
    this process: the single-process reference the parity tests compare against.
    """

    def __init__(self, model: nn.Module, parallel: ParallelConfig | None = None, *,
                 optim: OptimConfig | None = None, micro_batch_size: int | None = None,
                 mixed_precision: bool | None = None, temperature: float = 1.0, lora: LoraConfig | None = None,
                 lora_seed: int = 0, micro_batch_tokens: int | None = None):
        super().__init__(parallel, optim, micro_batch_size, temperature)
        self.decoder_config = getattr(model, "config", None)  # what the model is, whichever engine trains it
        self.lora = lora
        self._adapters_off = False  # inside base_policy()
        if lora is not None:
            if self.parallel.pp > 1:
                raise HflowError(f"LoRA trains with pp=1 on this runtime (got {self.parallel}); use tp·dp")
            model = apply_lora(model, lora, lora_seed)
        self.micro_batch_tokens = micro_batch_tokens  # sequence packing's token budget (fsdp/packed.py)
        self.segments = packing_core(model, self.parallel, micro_batch_tokens)
        # one forward per prompt group (shared_prompts.py) where the batch allows; packing replaces it
        self.prompt_sharing = micro_batch_tokens is None
        self.distributed = parallel is not None and dist.is_available() and dist.is_initialized()
        self.mesh = None
        self.pipeline = None  # pipeline.PipelineRunner when pp > 1
        self.sequence_split = None  # ulysses.SequenceSplit when sp > 1
        if self.distributed:
            self.mesh = build_mesh(self.parallel)
            if self.mesh.device_type == "cuda":  # the worker has set this process's device
                model = model.to(torch.device("cuda", torch.cuda.current_device()))
            if self.parallel.pp > 1:  # keep this rank's stage; pipeline.py runs the schedule
                model = split_stage(model, self.mesh["pp"].get_local_rank(), self.parallel.pp)
            if lora is not None and resolve_mixed_precision(self.mesh, mixed_precision):
                # bf16 compute: the frozen base is kept in bf16 too (no fp32 master: it never steps), the
                # adapters in fp32 with their Adam states — the memory model's LoRA (simulator/pricing/memory.py)
                for p in model.parameters():
                    if not p.requires_grad:
                        p.data = p.data.to(torch.bfloat16)
            if self.parallel.sp > 1:  # Ulysses: each sequence split over sp dp ranks (ulysses.py)
                check_sp(model, self.parallel)
                group = new_sp_group(self.parallel)
                self.sequence_split = SequenceSplit(group)
                apply_ulysses(model, group, self.segments)
            model = parallelize(model, self.mesh, self.parallel, mixed_precision=mixed_precision)
        elif self.parallel.world_size > 1:
            raise HflowError(f"parallel config {self.parallel} needs an initialised torch.distributed group; "
                             "call torch.distributed.init_process_group first (workers do)")
        self.model = model
        # FSDP units whose unshard gathers the fp32 weights themselves (not bf16 compute copies):
        # gathered_tp_shards then moves each unit's weights in one collective.
        mixed = self.distributed and resolve_mixed_precision(self.mesh, mixed_precision)
        self._fsdp_units = [] if mixed else [m for m in model.modules() if isinstance(m, FSDPModule)]
        self.is_lm = hasattr(model, "lm_head")
        oc = self.optim_config
        # Two groups: foreach kernels cannot mix DTensor (TP, FSDP) and plain parameters. The plain ones
        # take the fused kernel (one pass over each tensor; several times faster than foreach on CPU).
        params = [p for p in model.parameters() if p.requires_grad]  # LoRA: the adapters alone
        groups = [{"params": g, **kernel} for g, kernel in (
            ([p for p in params if isinstance(p, DTensor)], {"foreach": True}),
            ([p for p in params if not isinstance(p, DTensor)], {"fused": True})) if g]
        self.optimizer = torch.optim.AdamW(groups, lr=oc.lr, betas=oc.betas, eps=oc.eps,
                                           weight_decay=oc.weight_decay)
        if self.parallel.pp > 1 and self.distributed:
            self.pipeline = PipelineRunner(self, mixed_precision=mixed_precision)

    # ---- properties ---------------------------------------------------------------------------
    @property
    def device(self) -> torch.device:
        p = next(self.model.parameters())
        return p.to_local().device if isinstance(p, DTensor) else p.device

    @property
    def dp_rank(self) -> int:
        return self.mesh["dp"].get_local_rank() if self.mesh is not None else 0

    def _dp_group(self):
        return self.mesh["dp"].get_group() if self.mesh is not None else None

    # ---- forward ------------------------------------------------------------------------------
    def _micro_size(self, batch: TensorDict, micro_batch_size: int | None) -> int:
        return micro_batch_size or self.micro_batch_size or batch.batch_size[0]

    def _micro_rows(self, batch: TensorDict, micro_batch_size: int | None,
                    score_width: int | None) -> list[torch.Tensor] | None:
        """Each micro-batch's rows: by the token budget (packed.py), else prompt groups together or length buckets
        (shared_prompts.micro_batch_rows)."""
        if self.micro_batch_tokens is not None:
            return token_micro_rows(batch["input_ids"], batch.get("attention_mask", None), self.micro_batch_tokens,
                                    self._dp_group())
        columns = batch["input_ids"].shape[1]
        width = columns - score_width if self._shares_prompts(score_width, columns) else None
        return micro_batch_rows(batch["input_ids"], batch.get("attention_mask", None),
                                self._micro_size(batch, micro_batch_size), width)

    def _micro_batches(self, batch: TensorDict, micro_batch_size: int | None,
                       rows: list[torch.Tensor] | None = None) -> list[TensorDict]:
        """Consecutive rows, or the given rows of each micro-batch (`_micro_rows`)."""
        size = self._micro_size(batch, micro_batch_size)
        return list(batch.split(size)) if rows is None else [batch[i] for i in rows]

    def forward(self, micro: TensorDict, *, entropy: bool = True,
                score_width: int | None = None) -> dict[str, torch.Tensor]:
        """Forward one micro-batch: log-probs (+ entropy) for an LM, values for a scalar head; `score_width`:
        only the last columns an LM's caller reads (see the module docstring)."""
        ids = micro["input_ids"].to(self.device)
        mask = micro.get("attention_mask", None)
        pos = micro.get("position_ids", None)
        mask, pos = None if mask is None else mask.to(self.device), None if pos is None else pos.to(self.device)
        if self.segments is not None and mask is not None and (seq := pack_sequences(ids, mask, pos)) is not None:
            if self.sequence_split is not None:
                return self.sequence_split.forward_packed(self.model, seq, self.segments, lm=self.is_lm,
                                                          tempered=self.tempered, entropy=entropy, clock=self.clock)
            return packed_forward(self.model, seq, self.segments, lm=self.is_lm, tempered=self.tempered,
                                  entropy=entropy, score_width=score_width, clock=self.clock)
        if self.sequence_split is not None:
            return self.sequence_split.forward(self.model, ids, mask, pos, lm=self.is_lm, tempered=self.tempered,
                                               entropy=entropy, score_width=score_width, clock=self.clock)
        if self._shares_prompts(score_width, ids.shape[1]) and mask is not None and \
                (shared := share_prompts(ids, mask, pos, ids.shape[1] - score_width)) is not None:
            return self._forward_shared(shared, entropy)
        packed = pack(ids, mask, pos) if mask is not None else None
        if packed is not None:  # real tokens from column 0, trimmed: plain causal attention, no mask
            ids, mask, pos = packed.input_ids, None, packed.position_ids
        if self.clock.enabled:
            real = packed.mask if packed is not None else mask
            self.clock.count_pass(*ids.shape, ids.numel() if real is None else real.sum().item())
        unpack = packed.unpack if packed is not None else (lambda x: x)
        if not self.is_lm:
            return {"values": unpack(self.model(ids, mask, pos).float())}
        start = first_scored_logit(ids.shape[1], score_width, packed)
        logits = self.model(ids, mask, pos, logits_from=start) if start else self.model(ids, mask, pos)
        scaled = self.tempered(logits)
        res = {"log_probs": unpack(token_log_probs(scaled, ids, start))}
        if entropy:
            res["entropy"] = unpack(token_entropy(scaled, start))
        return res

    def _shares_prompts(self, score_width: int | None, columns: int) -> bool:
        """Whether an LM pass over rows of `columns` reading the last `score_width` packs rows by prompt
        (shared_prompts.py)."""
        cfg = self.decoder_config
        return bool(self.prompt_sharing and self.is_lm and score_width and cfg is not None) and \
            shares_prompts("lm", self.parallel, cfg.shortest_window, columns)

    def _forward_shared(self, shared: SharedPrompts, entropy: bool) -> dict[str, torch.Tensor]:
        if self.clock.enabled:
            self.clock.count_pass(*shared.input_ids.shape, shared.real_tokens)
        logits = self.tempered(self.model(shared.input_ids, shared.attention, shared.position_ids,
                                          logits_at=shared.predictor))
        res = {"log_probs": shared.unpack(picked_log_probs(logits, shared.targets))}
        if entropy:
            res["entropy"] = shared.unpack(entropy_of(logits))
        return res

    def tempered(self, logits: torch.Tensor) -> torch.Tensor:
        """The logits of the distribution the policy samples from (logits / temperature)."""
        return logits if self.temperature == 1.0 else logits.float() / self.temperature

    @torch.no_grad()
    def compute_log_probs(self, batch, micro_batch_size: int | None = None, entropy: bool = False,
                          score_width: int | None = None) -> TensorDict:
        """Token log-probs (and entropy) of the whole local batch, no gradient: [B, S] fields (with
        `score_width`, only the last columns are computed; the others hold 0)."""
        return self._infer(batch, micro_batch_size, ("log_probs", "entropy") if entropy else ("log_probs",),
                           score_width)

    @torch.no_grad()
    def compute_values(self, batch, micro_batch_size: int | None = None) -> TensorDict:
        """Per-token values of a scalar-head model: {"values": [B, S]}."""
        return self._infer(batch, micro_batch_size, ("values",))

    def _infer(self, batch, micro_batch_size, keys, score_width: int | None = None) -> TensorDict:
        if self.pipeline is not None:
            return self.pipeline.infer(batch, micro_batch_size, keys)
        batch = as_tensordict(batch)
        self.model.eval()
        rows = self._micro_rows(batch, micro_batch_size, score_width)
        fsdp = [m for m in self.model.modules() if isinstance(m, FSDPModule)]
        # The weights gathered once for all micro-batches, not once per micro-batch. The memory model
        # counts one gathered layer and the cost model a gather per micro-batch: docs/engines.md says
        # where they part.
        for m in fsdp:
            m.set_reshard_after_forward(False, recurse=False)
        try:
            with self.clock.span("infer"):
                parts = [self.forward(m, entropy="entropy" in keys, score_width=score_width)
                         for m in self._micro_batches(batch, micro_batch_size, rows)]
        finally:
            for m in fsdp:
                m.reshard()
                m.set_reshard_after_forward(True, recurse=False)
        self.model.train()
        back = slice(None) if rows is None else inverse_order(torch.cat(rows))  # the caller's row order
        return TensorDict({k: torch.cat([p[k] for p in parts])[back].cpu() for k in keys}, batch_size=batch.batch_size)

    # ---- training -----------------------------------------------------------------------------
    def train_step(self, batch, loss_fn: LossFn, micro_batch_size: int | None = None, *,
                   token_weights: str | None = None, entropy: bool = True,
                   score_width: int | None = None) -> dict[str, float]:
        """One optimizer step on the local batch; returns metrics averaged over micro-batches and dp.

        `token_weights`: the [B, T] mask a token-mean loss averages over (e.g. "response_mask"); each
        micro-batch then counts by its share of those tokens (over all dp ranks), so the step is that of
        the token-mean over the whole batch. `entropy=False` skips the entropy (and its graph) when the loss ignores it;
        `score_width`: the loss reads only the last columns of the LM outputs (see the module docstring).
        """
        if self.pipeline is not None:
            return self.pipeline.train_step(batch, loss_fn, micro_batch_size, token_weights=token_weights,
                                            entropy=entropy)
        batch = as_tensordict(batch)
        n = batch.batch_size[0]
        if n == 0:
            raise HflowError("train_step got an empty batch; give each data-parallel rank at least one sample")
        self.model.train()
        self.optimizer.zero_grad(set_to_none=True)
        micros = self._micro_batches(batch, micro_batch_size, self._micro_rows(batch, micro_batch_size, score_width))
        # Token-mean losses: the mean token count per dp rank, so that after FSDP's average over the ranks
        # the gradient is that of the token-mean over the whole batch, however it is sharded and cut.
        total = self._dp_mean([float(batch[token_weights].sum())])[0] if token_weights else 0.0
        sums: dict[str, float] = defaultdict(float)
        for i, micro in enumerate(micros):
            if hasattr(self.model, "set_requires_gradient_sync"):  # FSDP2 gradient accumulation: the weights
                last = i == len(micros) - 1  # stay gathered until the last backward; one reduce-scatter, at the end
                self.model.set_requires_gradient_sync(last)
                self.model.set_reshard_after_forward(False, recurse=True)
                self.model.set_reshard_after_backward(last, recurse=True)
            weight = float(micro[token_weights].sum()) / total if total > 0 else micro.batch_size[0] / n
            with self.clock.span("forward"):
                result = loss_fn(self.forward(micro, entropy=entropy, score_width=score_width), micro)
            loss, stats = result if isinstance(result, tuple) else (result, {})
            sums["nonfinite_loss"] = max(sums["nonfinite_loss"], float(not torch.isfinite(loss)))
            # every rank backs up every micro-batch: FSDP's collectives stay matched
            with self.clock.span("backward"):
                # sp > 1: FSDP averages over all dp ranks, sp of which computed each sequence between them
                (loss * (weight * (self.sequence_split.grad_scale if self.sequence_split else 1))).backward()
            sums["loss"] += loss.item() * weight
            for k, v in stats.items():
                sums[k] += float(v) * weight
        if hasattr(self.model, "set_reshard_after_forward"):
            self.model.set_reshard_after_forward(True, recurse=True)  # forward-only passes free the weights again
        return self._finish_step(sums)

    def _apply_step(self, skip: bool) -> float:
        with self.clock.span("optimizer"):
            grad_clip = self.optim_config.grad_clip
            norm = (self.pipeline.clip_grad_norm_(grad_clip) if self.pipeline is not None
                    else clip_grad_norm_(list(self.model.parameters()), grad_clip))
            if skip or not math.isfinite(norm):
                self.optimizer.zero_grad(set_to_none=True)
            else:
                self.optimizer.step()
        return norm
