"""Ray fixtures for the runtime tests (`ray_local`, the session's local cluster: tests/conftest.py).

`ray_two_nodes`: a real two-node Ray cluster on this machine (`ray.cluster_utils.Cluster`), node i
carrying the custom resource `hflow_node_<i>`, the nodes at different addresses, node 1 with a
folder of its own (a node-local disk); it replaces the local cluster. Tests that use it
are moved to the end of the session so that the local cluster is not started twice.
"""

from __future__ import annotations

import pytest


def pytest_collection_modifyitems(config, items):
    two_nodes = [i for i in items if "ray_two_nodes" in getattr(i, "fixturenames", ())]
    if two_nodes:
        items[:] = [i for i in items if i not in two_nodes] + two_nodes


def can_hide_folders() -> bool:
    """Whether this process may create mount namespaces (root, or CAP_SYS_ADMIN): node 1 of
    `ray_two_nodes` then has a folder of its own (see private_storage_worker.py)."""
    import shutil
    import subprocess

    tool = shutil.which("unshare")
    return bool(tool) and subprocess.run([tool, "-m", "true"], capture_output=True).returncode == 0


@pytest.fixture(scope="module")
def ray_two_nodes(ray_local, tmp_path_factory):
    """Two Ray nodes on this machine at different addresses (the head at this host's, node 1 at
    127.0.0.2). Where mount namespaces are allowed, `cluster.private_dir` is a folder the driver and
    node 0 share but node 1's workers see empty (a node-local disk); else it is None."""
    from pathlib import Path

    import ray
    from ray.cluster_utils import Cluster

    from hybridflow.runtime.controller.worker_group import shutdown_all

    shutdown_all()
    ray.shutdown()
    private = tmp_path_factory.mktemp("not-on-node-1") if can_hide_folders() else None
    hide = dict(setup_worker_path=str(Path(__file__).with_name("private_storage_worker.py")),
                env_vars={"HFLOW_PRIVATE_DIR": str(private)}) if private else {}
    for attempt in range(3):  # a loaded machine can miss Ray's fixed 30 s raylet start window
        cluster = Cluster()
        try:
            cluster.add_node(num_cpus=2, resources={"hflow_node_0": 100})
            cluster.add_node(num_cpus=2, resources={"hflow_node_1": 100}, node_ip_address="127.0.0.2", **hide)
            break
        except Exception as e:
            cluster.shutdown()
            if attempt == 2 or "timed out during startup" not in str(e):
                raise
    cluster.private_dir = private
    try:
        ray.init(address=cluster.address, include_dashboard=False, logging_level="WARNING")
        cluster.wait_for_nodes()
        yield cluster
    finally:
        shutdown_all()
        ray.shutdown()
        cluster.shutdown()  # a later module that needs Ray starts the local cluster again
