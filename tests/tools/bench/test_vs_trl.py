"""The TRL peer benchmark: both sides train on a tiny batch, with and without KL, and report the same shape."""

from __future__ import annotations

import json

import pytest

from hybridflow.simulator.errors import HflowError
from hybridflow.tools.bench import vs_trl

TINY = ["--repeats", "1", "--steps", "2", "--prompts", "2", "--samples", "4", "--response-len", "8", "--micro-batch", "8",
        "--devices", "1", "--trl-threads", "1"]


def test_char_tokenizer_for_trl_has_our_ids():
    pytest.importorskip("tokenizers")
    from hybridflow.runtime.tasks.tokenizer import CharTokenizer

    hf, ours = vs_trl.hf_char_tokenizer(), CharTokenizer()
    for text in ("sort 4137:", "Add 27+58:", "a~b"):
        assert hf(text=[text])["input_ids"][0] == ours.encode(text, bos=True)
    assert (hf.pad_token_id, hf.bos_token_id, hf.eos_token_id) == (ours.pad_id, ours.bos_id, ours.eos_id)
    assert hf.decode(ours.encode("1347", eos=True), skip_special_tokens=True) == "1347"


def test_summary_excludes_the_first_step():
    s = vs_trl.summarize([{"tokens": 1000, "seconds": 100.0, "reward": 0.2},
                          {"tokens": 300, "seconds": 1.0, "reward": 0.4}, {"tokens": 100, "seconds": 1.0, "reward": 0.6}])
    assert s["tokens_per_second"] == pytest.approx(200.0)
    assert s["reward_first"] == 0.2 and s["reward_last"] == pytest.approx(0.5)


def test_median_run_and_spread():
    runs = [{"tokens_per_second": v, "steps": [v]} for v in (300.0, 100.0, 200.0)]
    m = vs_trl.median_run(runs)
    assert m["tokens_per_second"] == 200.0 and m["steps"] == [200.0]  # the median run itself
    assert m["spread"] == [100.0, 300.0] and m["repeats"] == [300.0, 100.0, 200.0]


def test_bad_steps_is_a_one_line_error():
    with pytest.raises(HflowError, match="--steps"):
        vs_trl.main(["--steps", "1"])
    with pytest.raises(HflowError, match="--model"):
        vs_trl.main(["--model", "gpt5"])


def test_missing_trl_is_a_one_line_error(monkeypatch):
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "trl" else real(name, *a))
    with pytest.raises(HflowError, match=r"pip install -e '\.\[bench\]'"):
        vs_trl.main(TINY)


def test_both_runs_side_by_side(capsys, ray_local):  # our runs on the session's Ray cluster, not one of their own
    pytest.importorskip("trl", reason="the TRL benchmark needs trl (pip install -e '.[bench]')")
    assert vs_trl.main([*TINY, "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert [r["kl"] for r in out["runs"]] == [0.0, 0.04]
    for run in out["runs"]:
        assert run["ratio"] == pytest.approx(run["ours"]["tokens_per_second"] / run["trl"]["tokens_per_second"])
        for side in (run["ours"], run["trl"]):
            assert len(side["steps"]) == 2 and side["tokens_per_second"] > 0
            assert side["spread"] == [side["tokens_per_second"]] * 2  # one run
            for step in side["steps"]:
                # 8 sequences of <bos> + "sort " + 3–6 digits + ":" and 1–8 response tokens
                assert 8 * (1 + 9 + 1) <= step["tokens"] <= 8 * (1 + 12 + 8)
                assert 0.0 <= step["reward"] <= 1.0 and step["seconds"] > 0
