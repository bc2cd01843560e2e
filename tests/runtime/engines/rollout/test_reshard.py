"""3D-HybridEngine reshard: grouping, exact weights, bytes = paper Table 2, bit-identical round trip."""

from __future__ import annotations

import itertools

import pytest
import torch
from dist_util import run_distributed
from engine_util import tiny_model
from torch.distributed.tensor import DTensor

from hybridflow.runtime.engines.rollout.reshard import Resharder, ReshardLayout
from hybridflow.runtime.engines.train.fsdp.engine import FsdpEngine
from hybridflow.simulator.errors import HflowError
from hybridflow.simulator.vocabulary.parallel import ParallelConfig
from hybridflow.simulator.vocabulary.plan import IN_PLACE_RESHARDS

# ---- grouping (no processes) --------------------------------------------------------------------


def test_paper_figure_8_groups_t4_to_t2():
    hf = ReshardLayout(t=4, t_g=2)
    assert hf.d_g == 2
    assert hf.generation_tp_groups() == [[0, 2], [1, 3]]  # strided: ranks t/t_g apart
    assert hf.gather_groups() == [[0, 1], [2, 3]]  # micro-DP groups: neighbours
    v = ReshardLayout(t=4, t_g=2, mode="hybridflow-v")
    assert v.generation_tp_groups() == [[0, 1], [2, 3]]
    assert v.gather_groups() == [[0, 1, 2, 3]]
    assert ReshardLayout(t=2, t_g=1, d=2, mode="ds-chat").gather_groups() == [[0, 1, 2, 3]]


LAYOUTS = [(t, tg, p, pg, d) for t, p, d in itertools.product((1, 2, 4, 8), (1, 2, 4), (1, 2))
           for tg in (1, 2, 4, 8) for pg in (1, 2, 4) if t % tg == 0 and p % pg == 0]


@pytest.mark.parametrize("mode", IN_PLACE_RESHARDS)
def test_groups_partition_devices_and_bytes_follow_table_2(mode):
    model_bytes = 2 ** 20 * 3 * 5 * 7  # divisible by every t·p·d used here
    for t, tg, p, pg, d in LAYOUTS:
        lay = ReshardLayout(t=t, t_g=tg, p=p, p_g=pg, d=d, mode=mode)
        for groups in (lay.gather_groups(), lay.generation_tp_groups()):
            assert sorted(r for g in groups for r in g) == list(range(lay.world))
        assert all(len(g) == tg for g in lay.generation_tp_groups())
        for group in lay.gather_groups():
            # Each member holds M/(t·p) (DS-Chat: M/(t·p·d)) and receives every other member's piece.
            piece = model_bytes / (t * p * (d if mode == "ds-chat" else 1))
            assert (len(group) - 1) * piece == pytest.approx(lay.formula_bytes(model_bytes))
            if mode == "hybridflow":
                # The micro-DP group holds exactly the training shards its generation shard is made of.
                a_g, j, _ = lay.generation_coords(group[0])
                held = {(lay.coords(r)[0], lay.coords(r)[2]) for r in group}
                st, ss = t // tg, p // pg
                assert held == {(a, i) for a in range(a_g * ss, (a_g + 1) * ss) for i in range(j * st, (j + 1) * st)}
                assert {lay.generation_coords(r)[:2] for r in group} == {(a_g, j)}


def test_formulas_match_the_paper_numbers():
    m = 1000
    assert ReshardLayout(t=4, t_g=2).formula_bytes(m) == pytest.approx(250)  # (4-2)/(2·4)
    assert ReshardLayout(t=4, t_g=2, mode="hybridflow-v").formula_bytes(m) == pytest.approx(750)
    assert ReshardLayout(t=2, t_g=1, p=2, d=2, mode="ds-chat").formula_bytes(m) == pytest.approx(875)
    assert ReshardLayout(t=4, t_g=4).formula_bytes(m) == 0  # same layout: nothing moves
    assert ReshardLayout(t=4, t_g=2).formula_peak_bytes(m) == pytest.approx(500)  # M/(t_g·p_g)


def test_bad_layouts_are_one_line_errors():
    with pytest.raises(HflowError, match="t_g | t"):
        ReshardLayout(t=4, t_g=3)
    with pytest.raises(HflowError, match="unknown reshard mode"):
        ReshardLayout(t=2, t_g=1, mode="magic")
    with pytest.raises(HflowError, match="process group"):
        Resharder(t=2, t_g=1)


# ---- moving real shards on 4 gloo processes -----------------------------------------------------

def _local(p):
    return p.to_local() if isinstance(p, DTensor) else p.data


CASES = [(4, 1, 2), (4, 1, 1), (2, 2, 1)]  # (t, d, t_g)


def _reshard_all(rank, world):
    out = []
    for t, d, t_g in CASES:
        full = {n: p.detach().clone() for n, p in tiny_model().named_parameters()}
        engine = FsdpEngine(tiny_model(), ParallelConfig(tp=t, dp=d))
        dims = engine.tp_shard_dims()
        shards = engine.tp_shards()
        model_bytes = sum(full[n].numel() * 4 for n, dim in dims.items() if dim is not None)
        params_before = {n: _local(p).clone() for n, p in engine.model.named_parameters()}
        for mode in IN_PLACE_RESHARDS:
            rs = Resharder(t=t, t_g=t_g, d=d, mode=mode)
            gen, stats = rs.to_generation(shards, dims)
            for name, g in gen.items():  # exactly the generation slice of the full weights
                dim = dims[name]
                want = full[name] if dim is None else full[name].chunk(t_g, dim)[rs.gen_tp_rank]
                assert torch.equal(g, want), (mode, name)
            out.append(dict(t=t, d=d, t_g=t_g, mode=mode, bytes=stats.bytes_received, peak=stats.peak_bytes,
                            formula=rs.layout.formula_bytes(model_bytes), model_bytes=model_bytes,
                            peak_formula=rs.layout.formula_peak_bytes(model_bytes)))
            if mode != "hybridflow":
                continue
            # Zero redundancy: this device's training shard is a slice of its generation weights.
            for name, view in rs.own_views.items():
                assert torch.equal(view, shards[name])
                assert view.untyped_storage().data_ptr() == gen[name].untyped_storage().data_ptr()
            # Round trip: drop the sharded training weights (the replicated ones ARE the generation
            # tensors, shared), restore them from the generation layout.
            with torch.no_grad():
                for n, p in engine.model.named_parameters():
                    if dims[n] is not None:
                        _local(p).zero_()
            assert all(not v.any() for n, v in engine.tp_shards().items() if dims[n] is not None)  # really dropped
            engine.load_tp_shards(rs.to_training(gen, dims))
            for n, p in engine.model.named_parameters():
                assert torch.equal(_local(p), params_before[n]), n
    return out


def test_reshard_on_four_devices_bytes_weights_round_trip():
    results = run_distributed(_reshard_all, 4)
    for per_rank in zip(*results, strict=True):
        for r in per_rank:
            assert r["bytes"] == pytest.approx(r["formula"], abs=0.5), r  # measured == Table 2
            assert r["peak"] == pytest.approx(r["peak_formula"] + (r["model_bytes"] / r["t_g"]
                                               if r["mode"] != "hybridflow" else 0), abs=0.5), r
    summary = {(r["t"], r["d"], r["t_g"], r["mode"]): r["bytes"] for r in results[0]}
    m = results[0][0]["model_bytes"]
    assert summary[(4, 1, 2, "hybridflow")] == m // 4 and summary[(4, 1, 2, "hybridflow-v")] == 3 * m // 4
    assert summary[(4, 1, 1, "hybridflow")] == 3 * m // 4
    assert summary[(2, 2, 1, "hybridflow")] == m // 2 and summary[(2, 2, 1, "ds-chat")] == 3 * m // 4
