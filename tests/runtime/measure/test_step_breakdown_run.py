"""The step breakdown on real GRPO steps of the tiny model (the session's Ray cluster): every phase is there,
the top-level rows add up to the step, the compute phases report achieved FLOP/s and bytes/s."""

from __future__ import annotations

import json

import pytest

from hybridflow.tools.bench import step_breakdown

pytestmark = [pytest.mark.ray, pytest.mark.slow]


def test_breakdown_of_tiny_grpo_steps(ray_local, capsys):
    assert step_breakdown.main(["--model", "tiny", "--steps", "2", "--prompts", "2", "--samples", "2",
                                "--response-len", "4", "--micro-batch", "4", "--devices", "1", "--json"]) == 0
    result = json.loads(capsys.readouterr().out)["models"]["tiny"]
    rows = {(r["parent"], r["phase"]): r for r in result["rows"]}
    for key in [(None, "generate"), ("generate", "prefill"), ("generate", "decode"), (None, "ref_logprob"),
                ("ref_logprob", "infer"), (None, "actor_update"), ("actor_update", "backward"), (None, "controller")]:
        assert rows[key]["seconds"] > 0, key
    top = [r for r in result["rows"] if r["parent"] is None]
    assert sum(r["share"] for r in top) == pytest.approx(1.0, abs=1e-6)
    assert rows[("actor_update", "forward")]["flops_per_s"] > 0 and rows[("generate", "decode")]["bytes_per_s"] > 0
