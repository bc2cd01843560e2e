"""The reshard benchmark runs end to end on 4 local processes and its bytes equal Table 2."""

from __future__ import annotations

import json

import pytest

pytest.importorskip("torch")

from hybridflow.tools.bench import reshard_speed  # noqa: E402


def test_bench_bytes_match_formulas_and_json(tmp_path, capsys):
    out = tmp_path / "reshard.json"
    rc = reshard_speed.main(["--hidden", "64", "--ffn", "128", "--vocab", "256", "--layers", "1",
                             "--repeats", "1", "--json", str(out)])
    assert rc == 0
    res = json.loads(out.read_text())
    m = res["model_bytes"]
    modes = res["modes"]
    assert modes["hybridflow"]["bytes"] == m // 4  # (4-2)/(2·4)·M
    assert modes["hybridflow-v"]["bytes"] == modes["ds-chat"]["bytes"] == 3 * m // 4
    assert all(v["bytes_match"] for v in modes.values())
    assert modes["hybridflow"]["peak"] == m // 2 and modes["ds-chat"]["peak"] == m + m // 2
    assert "HybridFlow ≤ 0.5× DS-Chat time" in capsys.readouterr().out


def test_bench_rejects_bad_layout(capsys):
    assert reshard_speed.main(["--t", "4", "--t-g", "3"]) == 2
    assert "t_g | t" in capsys.readouterr().err
