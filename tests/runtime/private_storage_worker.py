"""Ray's worker setup script run in a mount namespace of its own, where $HFLOW_PRIVATE_DIR is an
empty tmpfs: the workers of a node started with it do not see that folder as the driver does, as
on a cluster whose nodes each have their own local disk (conftest.py's `ray_two_nodes`, node 1)."""

import ctypes
import os
import runpy
import subprocess
import sys

import ray._private.workers.setup_worker as ray_setup_worker

CLONE_NEWNS = 0x00020000  # a new mount namespace (linux/sched.h)

libc = ctypes.CDLL(None, use_errno=True)
if libc.unshare(CLONE_NEWNS) != 0:
    raise OSError(ctypes.get_errno(), "unshare(CLONE_NEWNS)")
subprocess.run(["mount", "--make-rprivate", "/"], check=True)  # our mounts stay ours
subprocess.run(["mount", "-t", "tmpfs", "tmpfs", os.environ["HFLOW_PRIVATE_DIR"]], check=True)
sys.argv[0] = ray_setup_worker.__file__
runpy.run_path(ray_setup_worker.__file__, run_name="__main__")
