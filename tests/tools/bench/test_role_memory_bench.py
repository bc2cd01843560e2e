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
    # a rank's 32 sequences: its mean share plus one longest (48 + 1024), below the budget 8 · 1088
    held = 32 * (48 + w.mean_response_len) + 1072
    saves = 8 * 128 + 4 * 128 + 4 * 128 + 8 * 512  # bf16 bytes a token leaves in a layer (memory.py)
    per_token = 4 * saves + 64 * 8  # 4 layers, and the logits with their gradient
    layer = 4 * 128 * 128 + 3 * 128 * 512 + 2 * 128  # the largest FSDP unit: a decoder layer (norms included)
    assert tiny.layer_params() == layer
    policy = model_figure("policy", 2, 64, 128, 1024, 8, 4)["parts"]
    assert policy == pytest.approx({"weights": 4 * n / 2, "gradients": 4 * n / 2, "optimizer": 8 * n / 2,
                                    "activations": 2 * per_token * held, "kv_cache": 0.0,
                                    "buffers": 3 * 4 * layer}, rel=1e-12)
    ref = model_figure("reference", 2, 64, 128, 1024, 8, 4)["parts"]  # forward only: one layer at a time
    assert ref == pytest.approx({"weights": 4 * n / 2, "gradients": 0.0, "optimizer": 0.0,
                                 "activations": 2 * (saves + 64 * 6) * held, "kv_cache": 0.0,
                                 "buffers": 2 * 4 * layer}, rel=1e-12)
