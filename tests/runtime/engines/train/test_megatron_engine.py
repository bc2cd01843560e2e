"""The megatron-core engine on CPU (gloo, the CPU shim): the same steps as the FSDP2 engine's
single-process reference on the same weights, at tp = 2 × pp = 2, tp = 2 × dp = 2 and pp = 2 × dp = 2
(critic), tied embeddings across stages, a Mixtral MoE with its experts over ep = 2, save → load
exact, the HF weights back out exact, and the generation weights after the reshard equal to them.

megatron.core takes seconds to import in each rank, so one 4-rank group runs every case
(`_all_cases`, a module fixture) and the tests read its results.
"""

from __future__ import annotations

import pytest
import torch
from dist_util import needs_megatron, run_distributed
from engine_util import nll_loss, tiny_model, token_batch
from tensordict import TensorDict

from hybridflow.runtime.engines.train.fsdp.engine import FsdpEngine
from hybridflow.runtime.engines.train.optim import OptimConfig
from hybridflow.simulator.vocabulary.parallel import ParallelConfig

pytestmark = needs_megatron

STEPS = 3
OPTIM = OptimConfig(lr=3e-3, grad_clip=0.5)
LAYERS = 4
MOE = dict(family="mixtral", num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2)
# case -> (pp, tp, dp, score model, extra decoder options, ep)
CASES = {
    "tp2-pp2": (2, 2, 1, False, dict(num_key_value_heads=2), 1),
    "tp2-pp2-tied": (2, 2, 1, False, dict(num_key_value_heads=2, tie_word_embeddings=True, qkv_bias=True), 1),
    "tp2-dp2": (1, 2, 2, False, dict(num_key_value_heads=2), 1),
    "pp2-dp2-critic": (2, 1, 2, True, {}, 1),
    "moe-dp4-ep2": (1, 1, 4, False, MOE, 2),
}


def _batch(dp_rank: int = 0, dp: int = 1) -> TensorDict:
    full = token_batch(n=8)
    full["attention_mask"][:2, :3] = 0  # left padding: packing must put real tokens at column 0
    full["attention_mask"][5, -2:] = 0  # right padding
    m = full["attention_mask"]
    full["loss_mask"] = torch.zeros_like(m)
    full["loss_mask"][:, 1:] = m[:, 1:] * m[:, :-1]  # tokens with a prediction
    per = 8 // dp
    return TensorDict({k: v[dp_rank * per:(dp_rank + 1) * per] for k, v in full.items()}, batch_size=[per])


def _token_loss(out, micro):
    """The token-mean NLL; with token_weights="loss_mask" the step is that of the mean over the whole
    batch however rows are sharded over dp and grouped into micro-batches."""
    mask = micro["loss_mask"].float()
    return -(out["log_probs"] * mask).sum() / mask.sum(), {"entropy": float((out["entropy"] * mask).sum() / mask.sum())}


def _value_loss(out, micro):
    return ((out["values"] - 1.0) * micro["attention_mask"]).pow(2).mean()


def _run(engine, batch: TensorDict, score: bool):
    if score:
        before = engine.compute_values(batch, micro_batch_size=2)["values"]
    else:
        lp = engine.compute_log_probs(batch, micro_batch_size=2, entropy=True)
        before = torch.stack([lp["log_probs"], lp["entropy"]])
    metrics = [engine.train_step(batch, _value_loss if score else _token_loss, micro_batch_size=2,
                                 token_weights=None if score else "loss_mask") for _ in range(STEPS)]
    return [m["loss"] for m in metrics], [m["grad_norm"] for m in metrics], engine.full_state_dict(), before


def _model(score: bool, options: dict):
    return tiny_model(score=score, num_hidden_layers=LAYERS, **options)


def _training_state(engine) -> dict[str, torch.Tensor]:
    """Copies of the weights and optimizer states (copies: numpy views would pin the storage)."""
    state = {n: p.detach().clone() for n, p in engine.module.named_parameters()}
    for i, opt in enumerate(getattr(engine.optimizer, "chained_optimizers", [engine.optimizer])):
        for pid, st in opt.optimizer.state_dict()["state"].items():
            state |= {f"{i}.{pid}.{k}": v.clone() for k, v in st.items() if isinstance(v, torch.Tensor)}
    return state


def _all_cases(rank, world, ckpt):
    from megatron.core import parallel_state

    from hybridflow.runtime.engines.rollout.hybrid import HybridEngine
    from hybridflow.runtime.engines.train.megatron.engine import MegatronEngine
    from hybridflow.runtime.models.decoder import CausalLM

    def resharded(engine, gen: ParallelConfig) -> list[str]:
        """The HF names whose generation weights differ from the engine's after the switch."""
        whole = engine.full_state_dict()
        hybrid = HybridEngine(engine, CausalLM(engine.decoder_config), gen)
        hybrid.to_generation()
        got = {n: p.full_tensor() if hasattr(p, "full_tensor") else p.detach() for n, p in hybrid.model.state_dict().items()}
        return sorted(k for k in whole if not torch.equal(got[k], whole[k]))

    out = {}
    for name, (pp, tp, dp, score, options, ep) in CASES.items():
        parallel_state.destroy_model_parallel()  # a new layout: megatron's state is per process
        engine = MegatronEngine(_model(score, options), ParallelConfig(pp=pp, tp=tp, dp=dp, ep=ep, backend="megatron"),
                                optim=OPTIM)
        out[name] = (*_run(engine, _batch(engine.dp_rank, dp), score), engine.dp_rank)
    # every expert from the two ep ranks in each generation replica
    out["reshard-moe"] = resharded(engine, ParallelConfig(dp=4))
    # generating frees the trainer's weight and gradient buffers; to_training rebuilds them bit-identical
    from hybridflow.runtime.engines.rollout.generation import SamplingParams

    before = _training_state(engine)
    hybrid = HybridEngine(engine, CausalLM(engine.decoder_config), ParallelConfig(dp=4))
    hybrid.to_generation(release_training=True)
    held = sum(p.untyped_storage().nbytes() for p in engine.module.parameters())
    hybrid.generate(token_batch(n=2, seq=5)["input_ids"], None, SamplingParams(greedy=True, max_new_tokens=3))
    released = hybrid.released_bytes()
    hybrid.to_training()
    after = _training_state(engine)
    out["release"] = (held, released, after.keys() == before.keys() and all(torch.equal(after[k], v)
                                                                             for k, v in before.items()))
    # save -> load: the step after loading equals the step after saving (the MoE's experts sharded over ep)
    for name, cfg, options in (("save-load-moe", ParallelConfig(dp=4, ep=2, backend="megatron"), MOE),
                               ("save-load", ParallelConfig(tp=2, dp=2, backend="megatron"), CASES["tp2-dp2"][4])):
        parallel_state.destroy_model_parallel()
        engine = MegatronEngine(_model(False, options), cfg, optim=OptimConfig(lr=1e-2))
        batch = _batch(engine.dp_rank, cfg.dp)
        engine.train_step(batch, nll_loss)
        engine.save(f"{ckpt}-{name}")
        expect = engine.train_step(batch, nll_loss)
        other = tiny_model(seed=3, num_hidden_layers=LAYERS, **options)  # overwritten by the load
        fresh = MegatronEngine(other, cfg, optim=OptimConfig(lr=1e-2))
        fresh.load(f"{ckpt}-{name}")
        got = fresh.train_step(batch, nll_loss)
        out[name] = (expect["loss"], got["loss"], expect["grad_norm"], got["grad_norm"], fresh.step)
    # the 3D-HybridEngine from Megatron's tp = 2 shards into generation layouts t_g = 1 and 2
    for t_g in (1, 2):
        out[f"reshard-tg{t_g}"] = resharded(fresh, ParallelConfig(tp=t_g, dp=4 // t_g))
    out["profile"] = _profile_points(rank, world)
    return out


def _profile_points(rank, world):
    """`hflow-plan profile --megatron --quick`'s Megatron jobs (one timed run each) in this group."""
    from hybridflow.runtime.measure.profiling import measure_jobs
    from hybridflow.tools.commands.profile import megatron_grid

    return measure_jobs(rank, world, megatron_grid(world, quick=True), 0, 1)


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    return run_distributed(_all_cases, 4, str(tmp_path_factory.mktemp("megatron") / "ckpt"), timeout=600,
                           preload=["torch", "hybridflow.runtime.controller.tensordict_import",
                                    "hybridflow.runtime.engines.train.megatron.preload",
                                    "hybridflow.runtime.engines.train.megatron.engine"],
                           daemon=False)  # dist_checkpointing forks its file writers


def _reference(score: bool, options: dict):
    engine = FsdpEngine(_model(score, options), optim=OPTIM, micro_batch_size=2)
    return _run(engine, _batch(), score)


@pytest.mark.slow
@pytest.mark.parametrize("case", list(CASES))
def test_megatron_matches_the_fsdp_engine(results, case):
    pp, tp, dp, score, options, _ = CASES[case]
    ref_loss, ref_norm, ref_state, ref_before = _reference(score, options)
    assert ref_loss[-1] < ref_loss[0]
    per = 8 // dp
    for loss, norm, state, before, k in (r[case] for r in results):
        torch.testing.assert_close(before, ref_before[..., k * per:(k + 1) * per, :], rtol=0, atol=1e-5)
        assert loss == pytest.approx(ref_loss, rel=1e-5, abs=1e-6)
        assert norm == pytest.approx(ref_norm, rel=1e-4)
        assert state.keys() == ref_state.keys()
        for name, value in ref_state.items():
            torch.testing.assert_close(state[name], value, rtol=0, atol=1e-4, msg=name)


@pytest.mark.slow
@pytest.mark.parametrize("case", ["tg1", "tg2", "moe"])
def test_generation_weights_equal_megatron_training_weights_after_the_switch(results, case):
    assert all(r[f"reshard-{case}"] == [] for r in results)


@pytest.mark.slow
def test_generation_frees_the_megatron_trainers_buffers_and_rebuilds_them_exactly(results):
    n_params = sum(p.numel() for p in _model(False, MOE).parameters())
    for held, released, identical in (r["release"] for r in results):
        assert held == 0 and released >= 2 * 4 * n_params // 2  # weights and grads; half the experts per rank
        assert identical


@pytest.mark.slow
@pytest.mark.parametrize("case", ["save-load", "save-load-moe"])
def test_megatron_save_load_is_exact(results, case):
    for expect_loss, got_loss, expect_norm, got_norm, step in (r[case] for r in results):
        assert got_loss == expect_loss and got_norm == expect_norm and step == 2


@pytest.mark.slow
def test_the_profilers_megatron_jobs_run_the_megatron_engine(results):
    from hybridflow.simulator.calibration.profile import ProfilePoint

    points = [ProfilePoint.model_validate(r) for r in results[0]["profile"]]
    assert {p.op for p in points} == {"megatron_train", "megatron_forward"}
    # dp over the group, tp and pp (the quick grid's tiny model: 4 heads, 4 layers)
    assert {(p.parallel.tp, p.parallel.dp, p.parallel.pp) for p in points} == {(1, 4, 1), (4, 1, 1), (1, 1, 4)}
    assert all(p.parallel.backend == "megatron" and p.seconds > 0 and p.repeats == 1 for p in points)
    assert results[1]["profile"] == []  # rank 0 records the points
