"""MegatronEngine: the TrainingEngine interface (engines/training.py) on megatron-core.

The model is Megatron's GPTModel (engines/megatron_model.py) for this rank's pipeline stage and
tensor shard, loaded from our decoder's HF-named weights (engines/megatron_weights.py); data
parallelism is Megatron's DistributedDataParallel with its distributed optimizer (Adam, states
sharded over dp); micro-batches run through Megatron's own schedule (`get_forward_backward_func`:
no pipelining at pp = 1, 1F1B above); checkpoints are `dist_checkpointing`. Ranks are ordered
(pp, dp, tp) with tp fastest, Megatron's default order and ParallelConfig's.

The loss plugs in as for the FSDP2 engine, `loss_fn(outputs, micro)`, and micro-batches are
weighted the same way (rows, or the tokens of `token_weights` over all dp ranks), so both engines
take the same step on the same batch. Each micro-batch is packed (packing.py) and padded on the right
to the local batch's longest row: pipeline stages exchange tensors of one shape. RoPE positions are
0.. within each packed row, as packing gives them.

On a machine without CUDA every megatron call runs inside `megatron_on_cpu()` (the shim).
"""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from tensordict import TensorDict

from hybridflow.simulator.decoder_config import Head
from hybridflow.simulator.errors import HflowError
from hybridflow.simulator.parallel import ParallelConfig

from .megatron_cpu_shim import megatron_on_cpu
from .megatron_model import build_stage, check_megatron
from .megatron_weights import (
    hf_to_megatron,
    hf_tp_dim,
    layer_index,
    megatron_to_hf,
    stage_layers,
    to_local_layer,
    tp_shard,
    tp_unshard,
)
from .packing import bucket_order, inverse_order, pack
from .phase_clock import PhaseClock
from .rank_state import load_rank_state, rank_state_file, save_rank_state
from .training import LossFn, OptimConfig, as_tensordict, token_entropy, token_log_probs


class MegatronEngine:
    """A CausalLM or ScoreModel (our decoder, whole, on CPU) trained by megatron-core as `parallel` says."""

    def __init__(self, model, parallel: ParallelConfig | None = None, *, optim: OptimConfig | None = None,
                 micro_batch_size: int | None = None, mixed_precision: bool | None = None,
                 temperature: float = 1.0, seed: int = 1234):
        if temperature <= 0:
            raise HflowError(f"temperature {temperature}: log-probs need a positive temperature")
        self.parallel = parallel or ParallelConfig()
        if not (dist.is_available() and dist.is_initialized()):
            raise HflowError("the megatron backend needs an initialised torch.distributed group; "
                             "call torch.distributed.init_process_group first (workers do)")
        if dist.get_world_size() != self.parallel.world_size:
            raise HflowError(f"parallel config {self.parallel} needs {self.parallel.world_size} processes but the "
                             f"group has {dist.get_world_size()}; start as many workers as pp·tp·dp")
        self.decoder_config = model.config
        self.head: Head = "lm" if hasattr(model, "lm_head") else "scalar"
        self.is_lm = self.head == "lm"
        check_megatron(self.decoder_config, self.parallel.tp, self.parallel.pp)
        self.optim_config = optim or OptimConfig()
        self.micro_batch_size = micro_batch_size
        self.temperature = temperature
        self.skipped_in_a_row = 0
        self.step = 0
        self.clock = PhaseClock()  # the step breakdown times FSDP's phases; Megatron's schedule is not split
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
        # megatron-core keeps one parallel state per process: colocated megatron roles share it.
        if not ps.model_parallel_is_initialized():
            ps.initialize_model_parallel(tensor_model_parallel_size=pc.tp, pipeline_model_parallel_size=pc.pp)
            model_parallel_cuda_manual_seed(seed)
        elif (ps.get_tensor_model_parallel_world_size(), ps.get_pipeline_model_parallel_world_size()) != (pc.tp, pc.pp):
            raise HflowError(f"megatron roles colocated in one process must share tp and pp (megatron-core keeps one "
                             f"parallel state per process); {pc} differs from tp{ps.get_tensor_model_parallel_world_size()}"
                             f"·pp{ps.get_pipeline_model_parallel_world_size()}: give them the same, or train one "
                             "with train.backend: fsdp")
        self.tp_rank = ps.get_tensor_model_parallel_rank()
        self.pp_rank = ps.get_pipeline_model_parallel_rank()
        self.dp_rank = ps.get_data_parallel_rank()
        self.first_stage, self.last_stage = self.pp_rank == 0, self.pp_rank == pc.pp - 1
        module = build_stage(self.decoder_config, self.head, pc.tp, pc.pp, self.pp_rank, dtype)
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

    def _stage_names(self) -> dict[str, str]:
        return self._stage_names_of(self.module)

    @torch.no_grad()
    def _load_hf(self, module, hf_state: dict[str, torch.Tensor]) -> None:
        mg = hf_to_megatron(hf_state, self.decoder_config)
        if self.decoder_config.tie_word_embeddings and self.is_lm and self.last_stage and not self.first_stage:
            mg["output_layer.weight"] = mg["embedding.word_embeddings.weight"]  # the last stage's copy
        own = module.state_dict()
        for global_name, local in self._stage_names_of(module).items():
            own[local].copy_(tp_shard(global_name, mg[global_name], self.tp_rank, self.parallel.tp,
                                      scalar_head=not self.is_lm))

    def _stage_names_of(self, module) -> dict[str, str]:
        """Global megatron name -> the stage's own parameter name, for the tensors the stage holds."""
        layers = stage_layers(self.decoder_config, self.pp_rank, self.parallel.pp)
        out = {}
        for local, t in module.state_dict().items():
            if local.endswith("_extra_state") or not isinstance(t, torch.Tensor):
                continue
            out[local if layer_index(local) is None else to_local_layer(local, -layers.start)] = local
        return out

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
        return batch["input_ids"].shape[1] if mask is None else max(int(mask.long().sum(-1).max()), 1)

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
    def _dp_mean(self, values: list[float]) -> list[float]:
        if self.parallel.dp == 1:
            return values
        from megatron.core import parallel_state as ps

        t = torch.tensor(values, dtype=torch.float64)
        dist.all_reduce(t, group=ps.get_data_parallel_group())
        return (t / self.parallel.dp).tolist()

    def train_step(self, batch, loss_fn: LossFn, micro_batch_size: int | None = None, *,
                   token_weights: str | None = None, entropy: bool = True,
                   score_width: int | None = None) -> dict[str, float]:
        """One optimizer step on the local batch (see TrainingEngine.train_step: same weights, same metrics;
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

    def _set_lr(self) -> float:
        oc = self.optim_config
        lr = oc.lr * min(1.0, (self.step + 1) / oc.warmup_steps) if oc.warmup_steps else oc.lr
        for g in self.optimizer.param_groups:
            g["lr"] = lr
        return lr

    def _finish_step(self, sums: dict[str, float]) -> dict[str, float]:
        """Clip and step with Megatron's optimizer; a non-finite gradient norm or loss skips the step."""
        sums = {"nonfinite_loss": 0.0, **sums}
        keys = list(sums)
        metrics = dict(zip(keys, self._dp_mean([sums[k] for k in keys]), strict=True))
        lr = self._set_lr()
        with megatron_on_cpu():
            self.optimizer.prepare_grads()
            grad_norm = float(self.optimizer.get_grad_norm())
            skip = not math.isfinite(grad_norm) or metrics.pop("nonfinite_loss") > 0
            if not skip:
                if self.optim_config.grad_clip > 0:
                    self.optimizer.clip_grad_norm(self.optim_config.grad_clip)
                self.optimizer.step_with_ready_grads()
        if skip:
            self.skipped_in_a_row += 1
            if self.skipped_in_a_row >= self.optim_config.max_skipped_steps:
                raise HflowError(f"{self.skipped_in_a_row} optimizer steps in a row had a non-finite gradient or loss "
                                 f"(after step {self.step}); lower the learning rate or check the rewards")
        else:
            self.step += 1
            self.skipped_in_a_row = 0
        metrics.update(grad_norm=grad_norm, lr=lr, step=self.step, skipped=float(skip))
        return metrics

    # ---- tensor-parallel shards in HF names (the 3D-HybridEngine's source, engines/hybrid.py) ----
    def _tied(self) -> bool:
        return self.is_lm and self.decoder_config.tie_word_embeddings

    def tp_shard_dims(self) -> dict[str, int | None]:
        """For each HF-named tensor this stage holds, the dim split over tensor parallelism (None: whole)."""
        return {n: hf_tp_dim(n, self._tied()) for n in self.tp_shards()}

    @contextmanager
    def gathered_tp_shards(self) -> Iterator[dict[str, torch.Tensor]]:
        """This rank's tensor-parallel shard of every parameter of its stage, in HF names. Megatron keeps
        the weights whole over dp (its distributed optimizer shards only optimizer states), so nothing
        is gathered but a tied embedding, which the generation layout keeps whole."""
        yield self.tp_shards()

    @torch.no_grad()
    def tp_shards(self) -> dict[str, torch.Tensor]:
        own = self.module.state_dict()
        mine = {g: own[local].detach() for g, local in self._stage_names().items()}
        if self._tied():
            mine.pop("output_layer.weight", None)  # the last stage's copy of the embedding
            if "embedding.word_embeddings.weight" in mine and self.parallel.tp > 1:
                from megatron.core import parallel_state as ps

                t = mine["embedding.word_embeddings.weight"]
                shards = [torch.empty_like(t) for _ in range(self.parallel.tp)]
                dist.all_gather(shards, t.contiguous(), group=ps.get_tensor_model_parallel_group())
                mine["embedding.word_embeddings.weight"] = torch.cat(shards)
        hf = megatron_to_hf(mine, self.decoder_config, self.head, tp=self.parallel.tp)
        if self._tied() and "model.embed_tokens.weight" in hf and self.last_stage:
            hf["lm_head.weight"] = hf["model.embed_tokens.weight"]
        return hf

    @torch.no_grad()
    def load_tp_shards(self, shards: dict[str, torch.Tensor]) -> None:
        """The inverse of tp_shards: HF-named shards of this rank back into its megatron parameters."""
        mg = hf_to_megatron({k: v for k, v in shards.items() if k != "lm_head.weight" or not self._tied()},
                            self.decoder_config, tp=self.parallel.tp)
        own = self.module.state_dict()
        for g, local in self._stage_names().items():
            if g in mg and not (self._tied() and g == "embedding.word_embeddings.weight" and self.parallel.tp > 1):
                own[local].copy_(mg[g])

    # ---- weights out: HF names (export) -------------------------------------------------------
    @torch.no_grad()
    def full_state_dict(self, rank0_only: bool = False) -> dict[str, torch.Tensor]:
        """Whole fp32 weights in HF names on CPU, on every rank (gathered over tp and pp)."""
        from megatron.core import parallel_state as ps

        own = self.module.state_dict()
        mine = {g: own[local].detach().float().cpu() for g, local in self._stage_names().items()}
        tp_group = ps.get_tensor_model_parallel_group()
        whole = {}
        for name, t in mine.items():
            shards = [torch.empty_like(t) for _ in range(self.parallel.tp)]
            dist.all_gather(shards, t.contiguous(), group=tp_group)
            whole[name] = tp_unshard(name, shards, scalar_head=not self.is_lm)
        if self.parallel.pp > 1:
            stages = [None] * self.parallel.pp
            dist.all_gather_object(stages, whole, group=ps.get_pipeline_model_parallel_group())
            whole = {}
            for s in stages:  # the last stage's copy of a tied embedding is the first's
                whole |= {k: v for k, v in s.items() if k not in whole}
        if self.decoder_config.tie_word_embeddings and self.is_lm:
            whole.pop("output_layer.weight", None)
        hf = megatron_to_hf(whole, self.decoder_config, self.head)
        if self.is_lm and self.decoder_config.tie_word_embeddings:
            hf["lm_head.weight"] = hf["model.embed_tokens.weight"]
        return {} if rank0_only and dist.get_rank() != 0 else hf

    # ---- checkpoints --------------------------------------------------------------------------
    def _sharded_state(self, loading: bool = False):
        # "dp_reshardable": the optimizer states as the dp buckets hold them (torch Adam keeps "step" there).
        if loading:  # the load fills optimizer states in place: a fresh optimizer must have them
            for opt in getattr(self.optimizer, "chained_optimizers", [self.optimizer]):
                if not opt.optimizer.state:
                    opt._init_optimizer_states_with_dummy_values()
        model_sd = self.module.sharded_state_dict()
        optim_sd = self.optimizer.sharded_state_dict(model_sd, is_loading=loading,
                                                     metadata={"distrib_optim_sharding_type": "dp_reshardable"})
        return {"model": model_sd, "optim": optim_sd}

    def save(self, path: str | Path) -> Path:
        """Model + distributed optimizer with megatron's dist_checkpointing, and per-rank step and RNG."""
        from megatron.core import dist_checkpointing

        path = Path(path)
        (path / "dist").mkdir(parents=True, exist_ok=True)
        with megatron_on_cpu():
            dist_checkpointing.save(self._sharded_state(), str(path / "dist"))
        save_rank_state(path, dist.get_rank(), self.step)
        dist.barrier()
        return path

    def load(self, path: str | Path) -> None:
        from megatron.core import dist_checkpointing

        path = Path(path)
        extra_file = rank_state_file(path, dist.get_rank())
        if not (path / "dist").is_dir() or not extra_file.is_file():
            raise HflowError(f"{path}: not a megatron training checkpoint of this layout (need dist/ and "
                             f"{extra_file.name}); pass a folder written by MegatronEngine.save")
        with megatron_on_cpu(), torch.no_grad():  # states are copied into leaf parameters in place
            state = dist_checkpointing.load(self._sharded_state(loading=True), str(path / "dist"))
            self.module.load_state_dict(state["model"])
            self.optimizer.load_state_dict(state["optim"])
        self.step = load_rank_state(path, dist.get_rank())
