"""The tiny policy: random init, then a short supervised phase on a built-in task, cached in HF format.

RL needs a policy that sometimes succeeds; no weights can be downloaded, so the first run that
needs one builds it (well under a minute on two CPU cores) and later runs reuse it. The cache
(policy_cache.py) is `$HFLOW_CACHE` or `~/.cache/hybridflow`; each policy lives in a folder named
by a hash of everything that shapes it (task, model shape, steps, seed), holding `config.json`,
`model.safetensors`, the tokenizer and `warmup.json` (the metrics, with the steps' FLOPs and
seconds; written last, so a folder without it is incomplete and is rebuilt).

Success is measured exactly, without sampling: a greedy decode produces the answer iff every
answer token is the argmax under teacher forcing, so the teacher-forced exact-match rate on held
out prompts is the greedy success rate. Training stops once it reaches `target_greedy_accuracy`
(a policy that "sometimes succeeds", leaving RL room to improve) or after `max_steps`.
"""

from __future__ import annotations

import json
import os
import random
import shutil
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict
from pathlib import Path

import torch
import torch.nn.functional as F

from hybridflow.runtime.controller.host import cache_dir
from hybridflow.runtime.tasks.builtin import get_task
from hybridflow.runtime.tasks.policy_cache import (
    METRICS_FILE,
    WarmupConfig,
    check_warmup_shape,
    policy_folder,
    step_flops,
)
from hybridflow.runtime.tasks.tokenizer import CharTokenizer
from hybridflow.simulator.io import write_atomic
from hybridflow.simulator.vocabulary.model import ModelSpec, model_preset


def sft_batch(examples: list[dict], tok: CharTokenizer) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Right-padded `<bos> prompt answer <eos>` rows: (input_ids, attention_mask, loss_mask); the loss
    mask marks the positions whose NEXT token is an answer token or the final <eos>."""
    rows, starts = [], []
    for ex in examples:
        p = tok.encode(ex["prompt"], bos=True)
        rows.append(p + tok.encode(ex["answer"], eos=True))
        starts.append(len(p))
    width = max(len(r) for r in rows)
    ids = torch.full((len(rows), width), tok.pad_id, dtype=torch.long)
    attn = torch.zeros_like(ids)
    loss_mask = torch.zeros_like(ids, dtype=torch.bool)
    for i, (r, s) in enumerate(zip(rows, starts, strict=True)):
        ids[i, :len(r)] = torch.tensor(r)
        attn[i, :len(r)] = 1
        loss_mask[i, s - 1:len(r) - 1] = True
    return ids, attn, loss_mask


def _loss_and_exact(model, ids, attn, loss_mask) -> tuple[torch.Tensor, torch.Tensor]:
    logits = model(ids, attention_mask=attn)[:, :-1]
    target, m = ids[:, 1:], loss_mask[:, :-1]
    loss = F.cross_entropy(logits[m], target[m])
    right = (logits.argmax(-1) == target) | ~m
    return loss, right.all(-1)


def sft_train(model, tok: CharTokenizer, cfg: WarmupConfig,
              on_step: Callable[[int, int], None] | None = None) -> dict:
    """Supervised training on the task until the greedy accuracy target; returns the metrics.
    `on_step(step, max_steps)` after each step (a progress bar)."""
    task = get_task(cfg.task)
    rng = random.Random(f"warmup:{cfg.task}:{cfg.seed}")
    held_out = sft_batch([task.make_example(rng) for _ in range(cfg.eval_size)], tok)
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.lr, weight_decay=0.0)
    accuracy, loss, step = 0.0, float("nan"), 0
    for step in range(1, cfg.max_steps + 1):
        model.train()
        batch = sft_batch([task.make_example(rng) for _ in range(cfg.batch_size)], tok)
        loss_t, _ = _loss_and_exact(model, *batch)
        opt.zero_grad(set_to_none=True)
        loss_t.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        loss = loss_t.item()
        if on_step:
            on_step(step, cfg.max_steps)
        if step % cfg.eval_every == 0 or step == cfg.max_steps:
            accuracy = greedy_accuracy(model, held_out)
            if accuracy >= cfg.target_greedy_accuracy:
                break
    return {"steps": step, "final_loss": loss, "greedy_accuracy": accuracy}


@torch.no_grad()
def greedy_accuracy(model, batch) -> float:
    model.eval()
    _, exact = _loss_and_exact(model, *batch)
    return exact.float().mean().item()



def warm_policy(spec: ModelSpec | str = "tiny", cfg: WarmupConfig = WarmupConfig(),
                root: str | Path | None = None, on_step: Callable[[int, int], None] | None = None) -> Path:
    """The folder of the warmed-up policy for (spec, cfg), building it the first time (`on_step` as
    in sft_train)."""
    from hybridflow.runtime.models.decoder import CausalLM
    from hybridflow.runtime.models.hf_format import save_pretrained

    spec = model_preset(spec) if isinstance(spec, str) else spec
    check_warmup_shape(spec)
    tok = CharTokenizer()
    root = Path(root) if root is not None else cache_dir()
    folder = policy_folder(spec, cfg, root)
    if (folder / METRICS_FILE).is_file():
        return folder
    root.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{folder.name}.", dir=root))
    try:
        torch.manual_seed(cfg.seed)
        model = CausalLM(spec.decoder_config())
        model.init_weights(torch.Generator().manual_seed(cfg.seed))
        start = time.perf_counter()
        metrics = sft_train(model, tok, cfg, on_step)
        timing = {"seconds": time.perf_counter() - start, "flops": step_flops(spec, cfg) * metrics["steps"]}
        save_pretrained(model, tmp)
        tok.save(tmp)
        write_atomic(tmp / METRICS_FILE, json.dumps({**metrics, **timing, "config": asdict(cfg), "spec": spec.name})
                     + "\n")
        if folder.exists() and not (folder / METRICS_FILE).is_file():
            shutil.rmtree(folder, ignore_errors=True)  # an incomplete earlier attempt
        try:
            os.replace(tmp, folder)
        except OSError:
            if not (folder / METRICS_FILE).is_file():  # lost a race to another builder: theirs is fine
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return folder


def warmup_metrics(folder: str | Path) -> dict:
    return json.loads((Path(folder) / METRICS_FILE).read_text())
