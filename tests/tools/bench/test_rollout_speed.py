"""The rollout benchmark runs end to end on a small case and its greedy outputs agree with HF."""

from __future__ import annotations

import json

import pytest

pytest.importorskip("transformers")

from hybridflow.simulator.errors import HflowError  # noqa: E402
from hybridflow.tools.bench import rollout_speed  # noqa: E402


def test_bench_rows_and_greedy_agreement(tmp_path, capsys):
    out = tmp_path / "bench.json"
    assert rollout_speed.main(["--batch", "2", "--prompt-len", "6", "--new-tokens", "4", "--repeats", "3",
                               "--json", str(out)]) == 0
    rows = json.loads(out.read_text())["rows"]
    assert [r["batch"] for r in rows] == [2, 2, 2] and rows[0]["same_tokens"] is True
    assert all(r["ours_tok_s"] > 0 and r["hf_tok_s"] > 0 for r in rows)
    for r in rows:  # medians inside their spread (slowest, fastest)
        assert r["ours_tok_s_range"][0] <= r["ours_tok_s"] <= r["ours_tok_s_range"][1]
        assert r["hf_tok_s_range"][0] <= r["hf_tok_s"] <= r["hf_tok_s_range"][1]
    assert rows[0]["tokens"] == rows[1]["tokens"] == 8
    # EOS mode: rows end early (real tokens only, at most half on average) with the same tokens as HF
    assert rows[2]["mode"].startswith("greedy, EOS") and 2 <= rows[2]["tokens"] <= 4
    assert rows[2]["same_tokens"] is True
    assert "HF tok/s" in capsys.readouterr().out


def test_eos_set_ends_greedy_rows_at_half_length_on_average():
    import torch

    response = torch.tensor([[5, 6, 7, 8, 9, 10], [11, 12, 13, 14, 15, 16]])
    mask = rollout_speed._response_mask(response, [7, 14])
    assert mask.tolist() == [[1, 1, 1, 0, 0, 0], [1, 1, 1, 1, 0, 0]]


def test_bad_batch_list_is_a_one_line_error():
    with pytest.raises(HflowError, match="--batch"):
        rollout_speed.main(["--batch", "4,x"])


def test_matmul_floor_times_every_linear_of_the_hf_model():
    """The headroom columns' floor: every nn.Linear of the HF model on `batch` rows per step (lm_head
    included), the prefill's layer matmuls on every prompt position."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    hf = LlamaForCausalLM(LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                      num_attention_heads=2, num_key_value_heads=1)).eval()
    linears = [m for m in hf.modules() if isinstance(m, torch.nn.Linear)]
    secs, flops = rollout_speed._matmul_floor(linears, rows=3, repeats=3, device="cpu")
    per_layer = 32 * 32 + 2 * 32 * 16 + 32 * 32 + 3 * 32 * 64  # q, k and v (one kv head of 16), o, MLP
    assert flops == 2 * 3 * (2 * per_layer + 64 * 32) and secs > 0
    floor = rollout_speed._run_floor(hf, batch=3, prompt_len=5, new_tokens=4, repeats=3, device="cpu")
    assert floor["matmul_floor_run_s"] > 3 * floor["matmul_floor_step_s"] > 0
