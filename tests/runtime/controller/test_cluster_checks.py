"""`hflow-plan run --address`: the joined cluster's resources are checked before any worker starts
(tools/reports/run.py join_cluster on the session's local Ray cluster, read through ray.nodes())."""

from __future__ import annotations

import io

import pytest
from rich.console import Console
from rl_util import tiny_plan

from hybridflow.runtime.rl.run_config import RunConfig
from hybridflow.simulator import Workload
from hybridflow.simulator.errors import HflowError
from hybridflow.tools.preflight.checks import RunChecks
from hybridflow.tools.reports.run import ConsoleEvents, join_cluster

pytestmark = pytest.mark.ray


def test_the_joined_cluster_is_checked_before_workers_start(ray_local):
    buf = io.StringIO()
    events = ConsoleEvents(Console(file=buf, width=200))
    join_cluster("auto", RunChecks(tiny_plan("grpo", [["actor", "ref"]]), None, RunConfig()), events)
    assert "checked the cluster:" in buf.getvalue() and "CPU process(es) as devices" in buf.getvalue()
    crowd = tiny_plan("grpo", [["actor", "ref"]], [4096], workload=Workload(prompts=4096, prompt_len=16,
                                                                          response_len=8, micro_batch_size=4))
    with pytest.raises(HflowError, match="the plan's 4096 worker processes need about .* the Ray cluster at auto has"):
        join_cluster("auto", RunChecks(crowd, None, RunConfig()), events)
