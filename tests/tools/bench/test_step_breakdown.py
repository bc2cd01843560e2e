"""The step breakdown: a step's time split into the measured ops, the engines' phases inside them and the
controller's gaps between them, adding up to the step (a real run: tests/runtime/measure/test_step_breakdown_run.py)."""

from __future__ import annotations

import pytest

from hybridflow.simulator.errors import HflowError
from hybridflow.simulator.vocabulary.model import model_preset
from hybridflow.tools.bench import step_breakdown


def _event(op, start, end, group="all", role="actor", nbytes=0.0):
    return {"op": op, "role": role, "group": group, "start": start, "end": end, "bytes": nbytes}


def test_a_step_splits_into_ops_phases_and_controller_gaps():
    step = {"start": 0.0, "end": 10.0, "tokens": 100, "reward": 0.5, "events": [
        _event("reshard", 0.5, 1.0), _event("generate", 1.0, 4.0), _event("reward", 4.5, 5.0, group="driver"),
        _event("actor_update", 6.0, 9.0)],
        "phases": {"actor": [{"prefill": 1.0, "decode": 1.5, "sample": 0.2, "prefill.tokens": 40,
                              "prefill.context": 400, "decode.tokens": 60, "decode.context": 900,
                              "decode.calls": 15, "forward": 1.0, "forward.tokens": 100, "forward.context": 1000,
                              "backward": 1.5, "optimizer": 0.25}] * 2}}
    rows = step_breakdown.split_step(step, model_preset("tiny"), world=2)
    top = {r["phase"]: r for r in rows if r["parent"] is None}
    assert list(top) == ["reshard", "generate", "reward", "actor_update", "controller"]
    assert sum(r["seconds"] for r in top.values()) == pytest.approx(10.0)  # the whole step, once
    sub = {(r["parent"], r["phase"]): r["seconds"] for r in rows if r["parent"]}
    assert sub[("generate", "other")] == pytest.approx(3.0 - 2.7)
    assert sub[("actor_update", "other")] == pytest.approx(0.25)
    assert sub[("controller", "→ reshard")] == pytest.approx(0.5) and sub[("controller", "→ reward")] == 0.5
    assert sub[("controller", "→ actor_update")] == 1.0 and sub[("controller", "after the last op")] == 1.0
    backward = next(r for r in rows if r["phase"] == "backward")
    forward = next(r for r in rows if r["phase"] == "forward")
    assert backward["flops"] == pytest.approx(2 * forward["flops"]) and forward["flops"] > 0
    assert next(r for r in rows if r["phase"] == "decode")["bytes"] > 0


def test_time_two_ops_share_or_past_the_step_counts_once():
    """The driver's work beside a call in flight, and an event past the step's end: the rows still add up
    to the step (the shared time goes to the op first in the step's order)."""
    step = {"start": 0.0, "end": 10.0, "tokens": 100, "reward": 0.5, "phases": {}, "events": [
        _event("generate", 1.0, 4.0), _event("ref_logprob", 4.0, 6.0, role="ref"),
        _event("reward", 4.5, 5.5, group="driver"), _event("actor_update", 7.0, 10.5)]}
    top = {r["phase"]: r["seconds"] for r in step_breakdown.split_step(step, model_preset("tiny"), world=1)
           if r["parent"] is None}
    assert sum(top.values()) == pytest.approx(10.0)
    assert top["actor_update"] == pytest.approx(3.0) and top["controller"] == pytest.approx(2.0)
    assert top["reward"] + top["ref_logprob"] == pytest.approx(2.0)


def test_bad_arguments_are_one_line_errors():
    with pytest.raises(HflowError, match="--model"):
        step_breakdown.main(["--model", "gpt5"])
    with pytest.raises(HflowError, match="--steps"):
        step_breakdown.main(["--steps", "1"])


def test_the_breakdown_is_that_of_the_median_step():
    from hybridflow.simulator.vocabulary.hardware import HARDWARE_PRESETS

    def step(span):
        return {"start": 0.0, "end": span, "tokens": 100, "reward": 0.0, "phases": {"actor": [{}]},
                "events": [_event("generate", 0.1, span / 2)]}

    result = step_breakdown.breakdown([step(9.0), step(3.0), step(1.0), step(2.0)], model_preset("tiny"), 1,
                                      HARDWARE_PRESETS["a100-80g"])
    assert result["step_spans"] == [3.0, 1.0, 2.0] and result["step_seconds"] == 2.0  # the first left out
    assert result["tokens_per_second"] == 50.0
    top = [r for r in result["rows"] if r["parent"] is None]
    assert sum(r["share"] for r in top) == pytest.approx(1.0)
    assert top[0]["seconds"] == pytest.approx(0.9)
