"""Ray fixtures for the runtime tests.

`ray_local`: ONE local Ray cluster for the whole test session, with 8 logical CPUs (more than the
physical cores: a virtual device is a process that mostly waits), so 8 one-CPU virtual devices
fit. It starts Ray on first use and leaves it running (Ray stops at exit); module-scoped worker
groups depend on it and shut themselves down in their teardown.

`ray_two_nodes`: a real two-node Ray cluster on this machine (`ray.cluster_utils.Cluster`), node i
carrying the custom resource `hflow_node_<i>`; it replaces the local cluster. Tests that use it
are moved to the end of the session so that the local cluster is not started twice.
"""

from __future__ import annotations

import pytest

LOCAL_CPUS = 8


def _start_local():
    import ray

    from hybridflow.runtime.resource_pool import init_ray

    if not ray.is_initialized():
        init_ray(num_cpus=LOCAL_CPUS)


def pytest_collection_modifyitems(config, items):
    two_nodes = [i for i in items if "ray_two_nodes" in getattr(i, "fixturenames", ())]
    if two_nodes:
        items[:] = [i for i in items if i not in two_nodes] + two_nodes


@pytest.fixture(scope="module")
def ray_local():
    ray = pytest.importorskip("ray")
    _start_local()  # no-op while it runs
    return ray


@pytest.fixture(scope="module")
def ray_two_nodes(ray_local):
    import ray
    from ray.cluster_utils import Cluster

    from hybridflow.runtime.worker_group import shutdown_all

    shutdown_all()
    ray.shutdown()
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 2, "resources": {"hflow_node_0": 100}})
    cluster.add_node(num_cpus=2, resources={"hflow_node_1": 100})
    try:
        ray.init(address=cluster.address, include_dashboard=False, logging_level="WARNING")
        cluster.wait_for_nodes()
        yield cluster
    finally:
        shutdown_all()
        ray.shutdown()
        cluster.shutdown()  # a later module that needs Ray starts the local cluster again
