"""The partial-rollouts benchmark's `--predict`: on the CPU profile the simulator prices partial rollouts as no
gain where the trainers are the longer side and as a gain where the rollout's tail is (docs/rl.md)."""

import json

from hybridflow.tools.bench.partial_rollouts import main


def test_partial_rollouts_pay_only_where_the_rollout_is_the_longer_side(capsys):
    assert main(["--predict", "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)
    assert rows
    for r in rows:
        rollout, trainers = r["async"]["rollout_trainers"]
        if trainers > rollout:  # training-bound: the per-iteration sync costs, the shorter rollout saves nothing
            assert r["speedup"] <= 1.0, r
        else:  # the round's tail ends at the budget: the rollout, the longer side, shortens
            assert r["partial"]["rollout_trainers"][0] < rollout / 1.5 and r["speedup"] > 1.05, r
    assert {r["speedup"] > 1.0 for r in rows} == {True, False}  # both kinds of shape are in the sweep
