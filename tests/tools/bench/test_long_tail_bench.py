"""The long-tail benchmark (tools/bench/long_tail.py): bad arguments are one line before torch starts; its price
of each side is the cost model's for that side's token budget (issue 34)."""

import subprocess
import sys

import pytest

from hybridflow.simulator.calibration.fit import calibrate_file
from hybridflow.simulator.errors import HflowError
from hybridflow.simulator.vocabulary.model import model_preset
from hybridflow.simulator.vocabulary.parallel import ParallelConfig
from hybridflow.tools.bench.long_tail import SIDES, packing_budget, predict


def test_bad_arguments_are_one_line():
    from hybridflow.tools.bench.long_tail import main

    for argv, says in [(["--sequences", "63"], "multiple of --dp 2"), (["--mean", "1024"], "below --max 1024"),
                       (["--micro-batch-size", "0"], "at least 1"), (["--profile", "no-such-profile"], "no-such")]:
        with pytest.raises(HflowError, match=says):
            main(argv)
    out = subprocess.run([sys.executable, "-m", "hybridflow.tools.bench.long_tail", "--mean", "0"],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 2 and len(out.stderr.strip().splitlines()) == 1, out.stderr


def test_each_side_is_priced_at_its_own_budget():
    prices = predict(2, 64, 128, 1024, 8, "cpu-2core")
    assert list(prices) == list(SIDES)
    assert prices["padded"] == prices["padded + balanced"]  # the price knows no row order: the slowest rank's
    # packing prices below half the padded rows here (measured 2.29× on a quiet machine: docs/engines.md)
    assert prices["packed + balanced"]["seconds"] < 0.5 * prices["padded"]["seconds"]
    cal = calibrate_file("cpu-2core")
    cm = cal.cost_model(cal.cluster(nodes=1, devices_per_node=2))
    from hybridflow.simulator.vocabulary.lengths import LengthDistribution
    from hybridflow.simulator.vocabulary.workload import Workload

    w = Workload(prompts=64, prompt_len=48, micro_batch_size=8, ppo_epochs=1, mini_batches=1,
                 response_lengths=LengthDistribution.max_entropy(128, 1024))
    budget = packing_budget(8, 1024)
    assert budget == 8 * 1088
    tiny, par = model_preset("tiny"), ParallelConfig(dp=2)
    assert prices["packed + balanced"]["seconds"] == pytest.approx(
        cm.forward(tiny, "lm", par, w, micro_batch_tokens=budget).seconds
        + cm.train(tiny, "lm", par, w, micro_batch_tokens=budget).seconds, rel=1e-12)
