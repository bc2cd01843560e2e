"""3D-HybridEngine with pipeline stages in training (p = 2) → a whole generation model (p_g = 1)."""

from __future__ import annotations

import pytest
import torch
from dist_util import run_distributed
from engine_util import nll_loss, tiny_model, token_batch
from tensordict import TensorDict
from torch.distributed.tensor import DTensor

from hybridflow.runtime.engines.parallelize import tp_plan_dims
from hybridflow.runtime.engines.rollout.hybrid import HybridEngine
from hybridflow.runtime.engines.rollout.reshard import ReshardLayout
from hybridflow.runtime.engines.train.fsdp.engine import FsdpEngine
from hybridflow.runtime.engines.train.optim import OptimConfig
from hybridflow.runtime.models.decoder import CausalLM
from hybridflow.simulator.vocabulary.parallel import ParallelConfig

LAYERS = 4
CASES = [(2, 2, 1, 1), (2, 2, 1, 2), (2, 1, 2, 1)]  # (p, t, d, t_g) on 4 processes


def _local(p):
    return p.to_local() if isinstance(p, DTensor) else p.data


def _switch(rank, world):
    out = []
    batch = TensorDict(token_batch(n=4), batch_size=[4])
    for p, t, d, t_g in CASES:
        for mode in ("hybridflow", "hybridflow-v") if t_g == 2 else ("hybridflow",):
            trainer = FsdpEngine(tiny_model(num_hidden_layers=LAYERS), ParallelConfig(pp=p, tp=t, dp=d),
                                     optim=OptimConfig(lr=1e-2), micro_batch_size=2)
            trainer.train_step(batch, nll_loss)  # weights that differ from the initial ones
            full = trainer.full_state_dict()
            before = {n: _local(q).clone() for n, q in trainer.model.named_parameters()}
            gen_model = CausalLM(trainer.model.config)
            dims = tp_plan_dims(gen_model)
            hybrid = HybridEngine(trainer, gen_model, ParallelConfig(tp=t_g, dp=world // t_g), mode=mode)
            release = mode == "hybridflow"
            stats = hybrid.to_generation(release_training=release)
            j = hybrid.resharder.gen_tp_rank
            for name, q in hybrid.model.named_parameters():  # exactly the whole model's generation slice
                want = full[name] if dims[name] is None else full[name].chunk(t_g, dims[name])[j]
                assert torch.equal(_local(q), want), (mode, name)
            released = hybrid.released_bytes()
            hybrid.to_training()
            for n, q in trainer.model.named_parameters():  # round trip: bit-identical
                assert torch.equal(_local(q), before[n]), (mode, n)
            m_bytes = sum(v.numel() * v.element_size() for n, v in full.items() if dims[n] is not None)
            lay = ReshardLayout(t=t, t_g=t_g, p=p, d=d, mode=mode)
            out.append(dict(case=(p, t, d, t_g), mode=mode, bytes=stats.bytes_received,
                            formula=lay.formula_bytes(m_bytes), replicated=stats.replicated_bytes,
                            released=released, m=m_bytes))
            # the trainer still trains after the switch and back
            assert trainer.train_step(batch, nll_loss)["loss"] > 0
    return out


if __name__ == "__main__":  # the figures: python tests/runtime/engines/rollout/test_pipeline_reshard.py
    for r in run_distributed(_switch, 4)[0]:
        print(r)


def test_pipeline_reshard_weights_bytes_round_trip():
    results = run_distributed(_switch, 4)
    for per_rank in results:
        for r in per_rank:
            assert r["bytes"] == pytest.approx(r["formula"], abs=0.5), r  # measured == Table 2
            assert r["replicated"] < 0.02 * r["m"], r  # norms only
            if r["mode"] == "hybridflow":
                assert r["released"] > 0  # the training shard lives on only inside the generation weights
    first = {(r["case"], r["mode"]): r["bytes"] for r in results[0]}
    m = results[0][0]["m"]
    # (t·p − t_g)/(t_g·t·p)·M: p=2, t=2 → t_g=1: 3/4 M, t_g=2: 1/4 M; p=2, t=1 → 1/2 M
    assert first[((2, 2, 1, 1), "hybridflow")] == 3 * m // 4
    assert first[((2, 2, 1, 2), "hybridflow")] == m // 4 and first[((2, 2, 1, 2), "hybridflow-v")] == 3 * m // 4
    assert first[((2, 1, 2, 1), "hybridflow")] == m // 2
