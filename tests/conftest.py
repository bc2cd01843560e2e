"""Ray fixtures for every suite (the two-node cluster is tests/runtime/conftest.py's).

`ray_local`: ONE local Ray cluster for the whole test session, with 8 logical CPUs (more than the
physical cores: a virtual device is a process that mostly waits), so 8 one-CPU virtual devices
fit. It starts Ray on first use and leaves it running (Ray stops at exit); module-scoped worker
groups depend on it and shut themselves down in their teardown.

`ray_address`: that cluster's address, for an `hflow-plan run` subprocess (`--address`) whose test is
not about Ray's own start: it joins the running cluster instead of starting one of its own.
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
