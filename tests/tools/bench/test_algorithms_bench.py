"""The reward-curves benchmark: a runnable plan for every registered algorithm, the PNG, one-line errors
(the training itself is tested end to end in tests/runtime/rl/test_algorithms_e2e.py)."""

import pytest

from hybridflow.simulator.algorithms import algorithm_names, get_algorithm
from hybridflow.tools.bench import algorithms as bench


@pytest.mark.parametrize("name", algorithm_names())
def test_every_algorithm_gets_a_plan_with_the_same_responses_per_iteration(name):
    plan = bench.bench_plan(name, prompts=32, samples=4)
    assert plan.workload.sequences == 128 and plan.workload.mini_batches == 2
    assert set(plan.roles) == {"actor", "ref", *get_algorithm(name).critics}
    assert plan.roles["actor"].group == "g0" and len(plan.groups) == 1


def test_moving_average_by_hand():
    assert bench.moving_average([1.0, 3.0, 5.0, 7.0], 2) == [1.0, 2.0, 4.0, 6.0]


def test_curves_png_draws_one_line_per_algorithm():
    png = bench.curves_png({"grpo": [0.5, 0.6, 0.7], "ppo": [0.5, 0.55, 0.6]}, "t")
    assert png[:4] == b"\x89PNG" and len(png) > 5000


def test_bad_input_is_one_line(capsys):
    with pytest.raises(Exception, match="unknown algorithm 'dpo'"):
        bench.main(["--algos", "dpo"])
    with pytest.raises(Exception, match="ending in .png"):
        bench.main(["--out", "curves.svg"])
