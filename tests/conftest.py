"""Fixtures for every suite: Ray's (the two-node cluster is tests/runtime/conftest.py's) and the warmed-up tool model.

`ray_local`: ONE local Ray cluster for the whole test session, with 8 logical CPUs (more than the
physical cores: a virtual device is a process that mostly waits), so 8 one-CPU virtual devices
fit. It starts Ray on first use and leaves it running (Ray stops at exit); module-scoped worker
groups depend on it and shut themselves down in their teardown.

`ray_address`: that cluster's address, for an `hflow-plan run` subprocess (`--address`) whose test is
not about Ray's own start: it joins the running cluster instead of starting one of its own.

`call_format_tool_model`: the tiny tool model that has learnt the calculator's call format, built once for
the agent tests of the session (its warm-up takes seconds); each module copies it before use.
"""

from __future__ import annotations

import pytest

LOCAL_CPUS = 8


def _start_local():
    import ray

    from hybridflow.runtime.controller.resource_pool import init_ray

    if not ray.is_initialized():
        init_ray(num_cpus=LOCAL_CPUS)


@pytest.fixture(scope="module")
def ray_local():
    ray = pytest.importorskip("ray")
    _start_local()  # no-op while it runs
    return ray


@pytest.fixture(scope="module")
def ray_address(ray_local) -> str:
    return ray_local.get_runtime_context().gcs_address


@pytest.fixture(scope="session")
def call_format_tool_model(tmp_path_factory):
    """runtime/agents/tiny_tool_model.py's model, warmed up on demonstrations that all call the calculator (120
    steps, on one thread: the same weights whichever test builds it); a folder no test writes to."""
    import torch

    from hybridflow.runtime.agents.tiny_tool_model import build_tool_model, warm_up

    folder = build_tool_model(tmp_path_factory.mktemp("call-format") / "model", seed=0)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        warm_up(folder, steps=120, tool_share=1.0, seed=0, batch=8, problems=150)
    finally:
        torch.set_num_threads(threads)
    return folder
