"""host_adam_bandwidth recomputed from the published pairs that isolate ZeRO-Offload's host step
(simulator/calibration/host_adam.py), by hand: the default is what they give."""

import pytest

from hybridflow.simulator.calibration.host_adam import (
    GIST_OFFLOAD_PAIRS,
    host_adam_bandwidth,
    offload_step_seconds,
)
from hybridflow.simulator.pricing.cost import CostModel
from hybridflow.simulator.pricing.efficiency import EfficiencyParams
from hybridflow.simulator.vocabulary.hardware import ClusterSpec, hardware_preset
from hybridflow.simulator.vocabulary.model import model_preset
from hybridflow.simulator.vocabulary.parallel import ParallelConfig
from hybridflow.simulator.vocabulary.workload import Workload

LLAMA_7B = 6_738_415_616  # the llama2-7b preset's parameters (LLaMA-7B's shape)


def test_each_pair_gains_its_offloaded_step():
    zero2, zero3 = GIST_OFFLOAD_PAIRS
    assert offload_step_seconds(zero2) == pytest.approx(64 / 1.81 - 64 / 4.19)  # 35.36 − 15.27 = 20.08 s
    assert offload_step_seconds(zero3) == pytest.approx(64 / 2.05 - 64 / 4.45)  # 31.22 − 14.38 = 16.84 s


def test_the_default_is_what_the_pairs_give_less_the_priced_copies():
    assert model_preset("llama2-7b").num_params("lm") == LLAMA_7B
    p = EfficiencyParams()
    # one step's priced copies on 8 A800 (25 GB/s host link at 0.9): bf16 gradients out, weights back
    copies = 2 * 2 * LLAMA_7B / 8 / (25e9 * 0.9)
    assert copies == pytest.approx(0.1497, abs=1e-4)
    by_hand = LLAMA_7B * 28 / ((20.0847 - copies + 16.8375 - copies) / 2)
    assert host_adam_bandwidth(28, copies) == pytest.approx(by_hand, rel=1e-4)
    assert p.host_adam_bandwidth == pytest.approx(by_hand, rel=0.01)  # 10.3 GB/s, about 0.37 G parameters/s
    # and the copies are the ones CostModel.train prices for such a step
    cm = CostModel(ClusterSpec(hardware=hardware_preset("a800-80g"), nodes=1, devices_per_node=8), p)
    w = Workload(prompts=64, prompt_len=2048, response_len=2048, micro_batch_size=2, mini_batches=1)
    step = cm.train(model_preset("llama2-7b"), "lm", ParallelConfig(dp=8, backend="deepspeed"), w,
                    optimizer_offload=True)
    assert step.breakdown["host_copy"] == pytest.approx(copies)
    assert step.breakdown["host_optimizer"] == pytest.approx(LLAMA_7B * 28 / p.host_adam_bandwidth)
