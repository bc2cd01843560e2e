"""tp = 2 / dp = 2 training (FSDP2 + DTensor TP) equals one process for a few steps, for every
family (each TP path: vocabulary-split and tied embeddings, row/column biases, Qwen3's q/k norms,
Mistral's windowed masks, Mixtral's experts kept whole over tp) and a scalar head; one process group
for all of them.

The workers get the decoder configs (read from transformers' config classes here, in the parent):
this module imports no transformers, so the spawned processes start quickly."""

from __future__ import annotations

import pytest
import torch
from dist_util import run_distributed
from family_util import hf_config
from tensordict import TensorDict

from hybridflow.runtime.engines.train.fsdp.engine import FsdpEngine
from hybridflow.runtime.engines.train.optim import OptimConfig
from hybridflow.runtime.models.decoder import CausalLM, ScoreModel
from hybridflow.simulator.vocabulary.families import read_hf_config
from hybridflow.simulator.vocabulary.parallel import ParallelConfig

STEPS = 3
# family_util cases; the tied variants of Llama and Qwen3 take no other TP path than these.
TRAIN_CASES = ("llama3.1", "llama2-linear-bias", "mistral-window", "qwen2.5-tied", "qwen3", "mixtral")
OPTIM = OptimConfig(lr=3e-3, grad_clip=0.5)


def _train_model(cfg, head: str):
    torch.manual_seed(0)
    model = (CausalLM if head == "lm" else ScoreModel)(cfg)
    with torch.no_grad():  # norms and biases off 1 / 0, as in a trained model
        for name, p in model.named_parameters():
            if "norm" in name or name.endswith("bias"):
                p.add_(0.1 * torch.randn_like(p))
    return model


def _batch(dp_rank: int, dp: int) -> TensorDict:
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, 64, (8, 12), generator=g)
    full = TensorDict({"input_ids": ids, "attention_mask": torch.ones_like(ids),
                       "target": torch.randn(8, 12, generator=g)}, batch_size=[8])
    per = 8 // dp
    return full[dp_rank * per:(dp_rank + 1) * per]


def _loss(outputs, micro):
    if "values" in outputs:  # scalar head: regress each token's value onto a fixed target
        return ((outputs["values"] - micro["target"]) ** 2).mean(), {}
    mask = micro["attention_mask"][:, 1:].float()
    return -(outputs["log_probs"][:, 1:] * mask).sum() / mask.sum(), {}


def _losses(cfg, head, parallel=None, dp_rank=0, dp=1):
    engine = FsdpEngine(_train_model(cfg, head), parallel, optim=OPTIM, micro_batch_size=2)
    batch = _batch(engine.dp_rank if parallel else dp_rank, dp)
    return [engine.train_step(batch, _loss)["loss"] for _ in range(STEPS)]


def _train_all(rank, world, cases):
    return {name: _losses(cfg, head, ParallelConfig(tp=2, dp=2), dp=2) for name, cfg, head in cases}


@pytest.mark.slow
def test_tp2_dp2_training_equals_one_process():
    pytest.importorskip("transformers")
    configs = {c: read_hf_config(hf_config(c).to_dict()).decoder for c in TRAIN_CASES}
    cases = [(c, cfg, "lm") for c, cfg in configs.items()] + [("qwen2.5-score", configs["qwen2.5-tied"], "scalar")]
    results = run_distributed(_train_all, 4, cases)
    for name, cfg, head in cases:
        ref = _losses(cfg, head)
        assert ref[-1] < ref[0], name  # it learns
        for rank in results:
            assert rank[name] == pytest.approx(ref, rel=1e-5, abs=1e-6), name
