"""`hflow-plan run` with sequence parallelism it cannot run: one line, exit 2, before Ray starts (the runs it
does run: tests/runtime/rl/test_sequence_parallel_e2e.py)."""

import json

import pytest
from rl_util import tiny_plan

from hybridflow.simulator import ParallelConfig
from hybridflow.tools.cli import main


@pytest.mark.parametrize("train,msg", [
    ({"dp": 8, "sp": 8}, "sp·tp=8 must divide heads=4"),  # the tiny model's 4 heads
    ({"dp": 8, "sp": 3}, "sp=3 must divide dp=8"),
    ({"dp": 8, "sp": 2, "backend": "megatron"}, "Megatron (context parallelism, ring attention), which the simulator "
                                                "prices but this runtime does not run"),
    ({"dp": 8, "sp": 2, "backend": "deepspeed"}, "sequence parallelism is priced for the fsdp (Ulysses) and megatron"),
    ({"pp": 2, "dp": 4, "sp": 2}, "this runtime splits sequences with pp=1 only"),
])
def test_sp_the_runtime_cannot_run_is_one_line(tmp_path, capsys, train, msg):
    plan = json.loads(tiny_plan("grpo", [["actor", "ref"]], [8], train={"ref": ParallelConfig(dp=8)},
                                generate=ParallelConfig(dp=8)).model_dump_json())
    plan["roles"]["actor"]["train"] = train
    (tmp_path / "plan.json").write_text(json.dumps(plan))
    assert main(["run", str(tmp_path / "plan.json"), "--iterations", "1"]) == 2
    err = capsys.readouterr().err.strip()
    assert msg in err and len(err.splitlines()) == 1, err
