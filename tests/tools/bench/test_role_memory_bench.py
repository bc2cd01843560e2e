"""The role memory benchmark (tools/bench/role_memory.py): bad arguments are one line before torch starts; the
memory model's figure it compares with is the plan role's states and largest transient in fp32 (issue 34)."""

import subprocess
import sys

import pytest

from hybridflow.simulator.errors import HflowError
from hybridflow.simulator.vocabulary.model import model_preset
from hybridflow.tools.bench.long_tail import bench_workload


def test_bad_arguments_are_one_line():
    from hybridflow.tools.bench.role_memory import main

    for argv, says in [(["--sequences", "63"], "multiple of --dp 2"), (["--mean", "1024"], "below --max 1024"),
                       (["--micro-batch-size", "0"], "at least 1")]:
        with pytest.raises(HflowError, match=says):
            main(argv)
    out = subprocess.run([sys.executable, "-m", "hybridflow.tools.bench.role_memory", "--mean", "0"],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 2 and len(out.stderr.strip().splitlines()) == 1, out.stderr


def test_the_figure_is_the_role_s_states_and_largest_transient_in_fp32():
    from hybridflow.tools.bench.role_memory import model_figure

    tiny = model_preset("tiny")
    n = tiny.num_params("lm")
    w = bench_workload(64, 128, 1024, 8)
    # a rank's 32 sequences, the balanced partition's mean share of the representative lengths (budget 8 · 1088)
    held = sum(48 + r for r in w.response_lengths.sample(64)) / 2
    # fp32 bytes a token leaves in a layer of the eager decoder (memory.py): each norm its fp32 input, normalised
    # and weighted outputs (3·h); q, k, v, the attention output and its copy (5·128); gate, up, act, product
    saves = 4 * (2 * 3 * 128 + 5 * 128 + 4 * 512)
    # 4 layers, the final norm, the backward's first gradients (ffn + h), the logits (+ log-softmax, gradient)
    per_token = 4 * saves + 4 * 3 * 128 + 4 * (512 + 128) + 64 * 12
    layer = 4 * 128 * 128 + 3 * 128 * 512 + 2 * 128  # the largest FSDP unit: a decoder layer (norms included)
    assert tiny.layer_params() == layer
    policy = model_figure("policy", 2, 64, 128, 1024, 8, 4)["parts"]
    assert policy == pytest.approx({"weights": 4 * n / 2, "gradients": 4 * n / 2, "optimizer": 8 * n / 2,
                                    "activations": per_token * held, "kv_cache": 0.0,
                                    "buffers": 3 * 4 * layer}, rel=1e-12)
    ref = model_figure("reference", 2, 64, 128, 1024, 8, 4)["parts"]  # forward only: one layer's working set
    assert ref == pytest.approx({"weights": 4 * n / 2, "gradients": 0.0, "optimizer": 0.0,
                                 "activations": (4 * (3 * 512 + 3 * 128) + 64 * 8) * held, "kv_cache": 0.0,
                                 "buffers": 2 * 4 * layer}, rel=1e-12)
