"""MegatronEngine: the training-engine interface (engines/train/base.py) on megatron-core, the `megatron`
backend.

The model is Megatron's GPTModel (engines/train/megatron/model.py) for this rank's pipeline stage and
tensor shard, loaded from our decoder's HF-named weights (engines/train/megatron/weights.py); data
parallelism is Megatron's DistributedDataParallel with its distributed optimizer (Adam, states
sharded over dp); micro-batches run through Megatron's own schedule (`get_forward_backward_func`:
no pipelining at pp = 1, 1F1B above); checkpoints are `dist_checkpointing`. Ranks are ordered
(pp, dp, tp) with tp fastest, Megatron's default order and ParallelConfig's.

The loss plugs in as for the FSDP2 engine, `loss_fn(outputs, micro)`, and micro-batches are
weighted the same way (rows, or the tokens of `token_weights` over all dp ranks), so both engines
take the same step on the same batch. Each micro-batch is packed (packing.py) and padded on the right
to the local batch's longest row (under ep > 1 the longest over the dp ranks: the experts' token
all-gather needs as many tokens on each): pipeline stages exchange tensors of one shape. RoPE positions are
0.. within each packed row, as packing gives them.

Weights in HF names (loading, the reshard source, export) live in megatron/shards.py and checkpoints
in megatron/checkpoint.py, mixed into the engine. A MoE model's experts are split over the plan's
`ep` (megatron/model.py). On a machine without CUDA every megatron call runs inside
`megatron_on_cpu()` (the shim).
"""

from __future__ import annotations

import math
from collections import defaultdict

import torch
import torch.distributed as dist
import torch.nn.functional as F

from hybridflow.runtime.controller.tensordict_import import TensorDict
from hybridflow.runtime.engines.train.base import (
    TRAIN_ENGINES,
    LossFn,
    TrainEngine,
    as_tensordict,
)
from hybridflow.runtime.engines.train.logits import token_entropy, token_log_probs
from hybridflow.runtime.engines.train.megatron.checkpoint import MegatronCheckpoint
from hybridflow.runtime.engines.train.megatron.cpu_shim import megatron_on_cpu
from hybridflow.runtime.engines.train.megatron.model import build_stage, check_megatron
from hybridflow.runtime.engines.train.megatron.shards import MegatronShards
from hybridflow.runtime.engines.train.optim import OptimConfig
from hybridflow.runtime.engines.train.packing import bucket_order, inverse_order, pack
from hybridflow.simulator.errors import HflowError
from hybridflow.simulator.vocabulary.decoder_config import Head
from hybridflow.simulator.vocabulary.execution import COLOCATION_RULE, megatron_state, state_label
from hybridflow.simulator.vocabulary.parallel import ParallelConfig


@TRAIN_ENGINES.register("megatron")
class MegatronEngine(MegatronShards, MegatronCheckpoint, TrainEngine):
    """A CausalLM or ScoreModel (our decoder, whole, on CPU) trained by megatron-core as `parallel` says."""

    def __init__(self, model, parallel: ParallelConfig | None = None, *, optim: OptimConfig | None = None,
                 micro_batch_size: int | None = None, mixed_precision: bool | None = None,
                 temperature: float = 1.0, seed: int = 1234):
        super().__init__(parallel, optim, micro_batch_size, temperature)
        if not (dist.is_available() and dist.is_initialized()):
            raise HflowError("the megatron backend needs an initialised torch.distributed group; "
                             "call torch.distributed.init_process_group first (workers do)")
        if dist.get_world_size() != self.parallel.world_size:
            raise HflowError(f"parallel config {self.parallel} needs {self.parallel.world_size} processes but the "
                             f"group has {dist.get_world_size()}; start as many workers as pp·tp·dp")
        self.decoder_config = model.config
        self.head: Head = "lm" if hasattr(model, "lm_head") else "scalar"
        self.is_lm = self.head == "lm"
        check_megatron(self.decoder_config, self.parallel.tp, self.parallel.pp, self.parallel.ep)
        self.distributed = True
        self._kept: dict[str, torch.Tensor] = {}  # what release_weights keeps aside
        dtype = torch.bfloat16 if mixed_precision and torch.cuda.is_available() else torch.float32
        hf_state = {k: v.detach().cpu() for k, v in model.state_dict().items()}
        with megatron_on_cpu():
            self._build(hf_state, dtype, seed)

    # ---- construction ---------------------------------------------------------------------------
    def _build(self, hf_state: dict[str, torch.Tensor], dtype: torch.dtype, seed: int) -> None:
        from megatron.core import parallel_state as ps
        from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
        from megatron.core.distributed.finalize_model_grads import finalize_model_grads
        from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
        from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

        pc = self.parallel
        # megatron-core keeps one parallel state per process: colocated megatron roles share it
        # (simulator/vocabulary/execution.py; check_runnable refuses a plan that breaks it before Ray starts).
        live = (ps.get_tensor_model_parallel_world_size(), ps.get_pipeline_model_parallel_world_size(),
                ps.get_expert_model_parallel_world_size()) if ps.model_parallel_is_initialized() else None
        if live is None:
            ps.initialize_model_parallel(tensor_model_parallel_size=pc.tp, pipeline_model_parallel_size=pc.pp,
                                         expert_model_parallel_size=pc.ep, expert_tensor_parallel_size=1)
            model_parallel_cuda_manual_seed(seed)
        elif live != megatron_state(pc):
            raise HflowError(f"this process's megatron-core parallel state is {state_label(live)} and {pc} differs: "
                             f"{COLOCATION_RULE}")
        self.tp_rank = ps.get_tensor_model_parallel_rank()
        self.pp_rank = ps.get_pipeline_model_parallel_rank()
        self.dp_rank = ps.get_data_parallel_rank()
        self.ep_rank = ps.get_expert_model_parallel_rank()
        self.first_stage, self.last_stage = self.pp_rank == 0, self.pp_rank == pc.pp - 1
        module = build_stage(self.decoder_config, self.head, pc.tp, pc.pp, self.pp_rank, dtype, pc.ep)
        if torch.cuda.is_available():
            module = module.cuda()
        self._load_hf(module, hf_state)
        oc = self.optim_config
        ddp_config = DistributedDataParallelConfig(grad_reduce_in_fp32=True, overlap_grad_reduce=False,
                                                   use_distributed_optimizer=True)
        self.model = DistributedDataParallel(module.config, ddp_config, module)
        self.optimizer = get_megatron_optimizer(
            OptimizerConfig(optimizer="adam", lr=oc.lr, adam_beta1=oc.betas[0], adam_beta2=oc.betas[1],
                            adam_eps=oc.eps, weight_decay=oc.weight_decay, clip_grad=oc.grad_clip,
                            bf16=dtype == torch.bfloat16, params_dtype=dtype, use_distributed_optimizer=True),
            [self.model])
        cfg = module.config
        cfg.finalize_model_grads_func = finalize_model_grads  # dp reduce-scatter, tied-embedding sync over pp
        cfg.no_sync_func = self.model.no_sync
        cfg.grad_scale_func = self.optimizer.scale_loss

    @property
    def module(self):
        return self.model.module

    @property
    def device(self) -> torch.device:
        return next(self.module.parameters()).device

    # ---- forward ------------------------------------------------------------------------------
    def _micro_batches(self, batch: TensorDict, micro_batch_size: int | None) -> list[TensorDict]:
        n = batch.batch_size[0]
        size = micro_batch_size or self.micro_batch_size or n
        if self.parallel.pp > 1 and n % size:
            raise HflowError(f"the megatron backend at pp={self.parallel.pp} needs equal micro-batches: "
                             f"{n} local rows are not a multiple of micro_batch_size {size}")
        # Rows of similar length together, as the FSDP engine groups them (the same micro-batches).
        order = bucket_order(batch.get("attention_mask", None), size)
        return list(batch.split(size)) if order is None else [batch[i] for i in order.split(size)]

    def _packed(self, micro: TensorDict, width: int):
        """(ids [b, width], unpack): real tokens from column 0, padded on the right to `width`."""
        ids = micro["input_ids"]
        mask = micro.get("attention_mask", None)
        packed = pack(ids, mask, None) if mask is not None else None
        if packed is None:
            return F.pad(ids, (0, width - ids.shape[1])), lambda x: x[:, :ids.shape[1]]
        return F.pad(packed.input_ids, (0, width - packed.input_ids.shape[1])), packed.unpack

    def _width(self, batch: TensorDict) -> int:
        mask = batch.get("attention_mask", None)
        width = batch["input_ids"].shape[1] if mask is None else max(int(mask.long().sum(-1).max()), 1)
        if self.parallel.ep == 1:
            return width
        # The experts' token all-gather over the ep ranks (other dp ranks) needs as many tokens on each.
        from megatron.core import parallel_state as ps

        t = torch.tensor([width])
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=ps.get_data_parallel_group())
        return int(t)

    def _outputs(self, out: torch.Tensor, ids: torch.Tensor, unpack, entropy: bool) -> dict[str, torch.Tensor]:
        if not self.is_lm:
            return {"values": unpack(out.squeeze(-1).float())}
        scaled = out if self.temperature == 1.0 else out.float() / self.temperature
        res = {"logits": unpack(out), "log_probs": unpack(token_log_probs(scaled, ids))}
        if entropy:
            res["entropy"] = unpack(token_entropy(scaled))
        return res

    def _run(self, batch: TensorDict, micro_batch_size: int | None, on_output, forward_only: bool,
             entropy: bool) -> list:
        """Megatron's schedule over the micro-batches; `on_output(outputs, micro)` on the last stage
        returns (loss tensor, dict) and its dicts come back in order (empty on other stages)."""
        from megatron.core.pipeline_parallel import get_forward_backward_func

        micros = self._micro_batches(batch, micro_batch_size)
        width = self._width(batch)
        device = self.device

        def step(data_iterator, model):
            micro = next(data_iterator)
            ids, unpack = self._packed(micro, width)
            ids = ids.to(device)
            positions = torch.arange(width, device=device).expand_as(ids)
            out = model(ids, positions, None)

            def loss_func(output):
                return on_output(self._outputs(output, ids, unpack, entropy), micro)

            return out, loss_func

        with megatron_on_cpu():
            return get_forward_backward_func()(
                forward_step_func=step, data_iterator=iter(micros), model=[self.model],
                num_microbatches=len(micros), seq_length=width, micro_batch_size=micros[0].batch_size[0],
                forward_only=forward_only)

    def _from_last_stage(self, obj):
        """An object the last pipeline stage computed, on every stage."""
        if self.parallel.pp == 1:
            return obj
        from megatron.core import parallel_state as ps

        box = [obj]
        dist.broadcast_object_list(box, src=ps.get_pipeline_model_parallel_last_rank(),
                                   group=ps.get_pipeline_model_parallel_group())
        return box[0]

    @torch.no_grad()
    def compute_log_probs(self, batch, micro_batch_size: int | None = None, entropy: bool = False,
                          score_width: int | None = None) -> TensorDict:
        """Every column's log-probs (`score_width`, which lets the FSDP engine skip the prompt's, is
        accepted for the same call and not used: the loss reads only the response columns either way)."""
        return self._infer(batch, micro_batch_size, ("log_probs", "entropy") if entropy else ("log_probs",))

    @torch.no_grad()
    def compute_values(self, batch, micro_batch_size: int | None = None) -> TensorDict:
        return self._infer(batch, micro_batch_size, ("values",))

    def _infer(self, batch, micro_batch_size, keys) -> TensorDict:
        batch = as_tensordict(batch)
        self.model.eval()

        def keep(outputs, micro):
            return torch.zeros(()), {k: outputs[k].detach().cpu() for k in keys}

        parts = self._from_last_stage(self._run(batch, micro_batch_size, keep, forward_only=True,
                                                    entropy="entropy" in keys))
        self.model.train()
        order = bucket_order(batch.get("attention_mask", None),
                             micro_batch_size or self.micro_batch_size or batch.batch_size[0])
        back = slice(None) if order is None else inverse_order(order)  # the caller's row order
        return TensorDict({k: torch.cat([p[k] for p in parts])[back] for k in keys}, batch_size=batch.batch_size)

    # ---- training -----------------------------------------------------------------------------
    def _dp_group(self):
        from megatron.core import parallel_state as ps

        return ps.get_data_parallel_group()

    def train_step(self, batch, loss_fn: LossFn, micro_batch_size: int | None = None, *,
                   token_weights: str | None = None, entropy: bool = True,
                   score_width: int | None = None) -> dict[str, float]:
        """One optimizer step on the local batch (see FsdpEngine.train_step: same weights, same metrics;
        `score_width` accepted and not used, as in compute_log_probs)."""
        batch = as_tensordict(batch)
        n = batch.batch_size[0]
        if n == 0:
            raise HflowError("train_step got an empty batch; give each data-parallel rank at least one sample")
        self.model.train()
        self.model.zero_grad_buffer()
        self.optimizer.zero_grad()
        total = self._dp_mean([float(batch[token_weights].sum())])[0] if token_weights else 0.0
        num_micro = len(self._micro_batches(batch, micro_batch_size))

        def weighted(outputs, micro):
            weight = float(micro[token_weights].sum()) / total if total > 0 else micro.batch_size[0] / n
            result = loss_fn(outputs, micro)
            loss, stats = result if isinstance(result, tuple) else (result, {})
            record = {"loss": loss.item() * weight, "nonfinite_loss": float(not torch.isfinite(loss)),
                      **{k: float(v) * weight for k, v in stats.items()}}
            # The schedule divides by the number of micro-batches; the weight is the micro-batch's share.
            return loss * weight * num_micro, record

        records = self._from_last_stage(self._run(batch, micro_batch_size, weighted, forward_only=False,
                                                   entropy=entropy))
        sums: dict[str, float] = defaultdict(float)
        for r in records:
            for k, v in r.items():
                sums[k] = max(sums[k], v) if k == "nonfinite_loss" else sums[k] + v
        return self._finish_step(dict(sums))

    def _clip(self, total_norm: float) -> None:
        """Scale the gradients to grad_clip by the norm over all of them: of a MoE model the optimizer is
        a chain (dense and expert parameters, reduced over different groups) sharing that one norm."""
        from megatron.core.optimizer.clip_grads import clip_grad_by_total_norm_fp32

        for opt in getattr(self.optimizer, "chained_optimizers", [self.optimizer]):
            params = opt.get_parameters()
            if params:
                clip_grad_by_total_norm_fp32(params, max_norm=self.optim_config.grad_clip, total_norm=total_norm)

    def _apply_step(self, skip: bool) -> float:
        with megatron_on_cpu():
            self.optimizer.prepare_grads()
            grad_norm = float(self.optimizer.get_grad_norm())
            if not skip and math.isfinite(grad_norm):
                if self.optim_config.grad_clip > 0:
                    self._clip(grad_norm)
                self.optimizer.step_with_ready_grads()
        return grad_norm
