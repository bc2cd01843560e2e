"""A local Ray cluster ends with the driver that started it, however the driver ends.

`ray.shutdown()` stops the cluster's processes when the driver exits normally; a driver killed with
SIGKILL runs no code, and Ray's own clean-up leaves its agents (dashboard agent, runtime-env agent)
and idle workers for one to two minutes. `reap_with_driver` starts a small watcher in a session of
its own: when the driver's pid is gone it ends the cluster's processes (the ones Ray's node lists,
and every process below them, noted every 2 s while the driver lives since they are reparented when
it dies: the raylet's agents and workers), each checked by its start time so
that a pid reused since is never touched; SIGTERM, then SIGKILL 2 s later. It exits then, or as soon
as those processes are all gone (a normal shutdown).
"""

from __future__ import annotations

import os
import subprocess
import sys

WATCH = r"""
import os, signal, sys, time

def start_time(pid):
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[19]
    except OSError:
        return None

def children():
    out = {}
    for name in os.listdir("/proc"):
        if name.isdigit():
            try:
                with open(f"/proc/{name}/stat") as f:
                    out.setdefault(int(f.read().rsplit(")", 1)[1].split()[1]), []).append(int(name))
            except (OSError, IndexError, ValueError):
                pass
    return out

def below(found):
    tree, todo = children(), list(found)
    while todo:
        for c in tree.get(todo.pop(), []):
            if c not in found:
                found[c] = start_time(c)
                todo.append(c)

driver, watched = int(sys.argv[1]), {int(p): start_time(int(p)) for p in sys.argv[2:]}
found, step = dict(watched), 0
while start_time(driver) is not None:
    if all(start_time(p) != t for p, t in watched.items()):
        sys.exit(0)  # the cluster shut down with the driver still alive: nothing left to watch
    if step % 4 == 0:  # kept up to date while the driver lives: once it dies, Ray's processes get reparented
        below(found)
    step += 1
    time.sleep(0.5)
below(found)
for sig in (signal.SIGTERM, signal.SIGKILL):
    for pid, t in found.items():
        if t is not None and start_time(pid) == t:
            try:
                os.kill(pid, sig)
            except OSError:
                pass
    time.sleep(2)
"""


def reap_with_driver() -> subprocess.Popen | None:
    """Start the watcher for the local Ray cluster this process started (None: no such cluster)."""
    import ray._private.worker as ray_worker

    node = getattr(ray_worker, "_global_node", None)
    if node is None or not node.head:
        return None
    pids = [str(p.process.pid) for procs in node.all_processes.values() for p in procs if p.process is not None]
    return subprocess.Popen([sys.executable, "-c", WATCH, str(os.getpid()), *pids], start_new_session=True,
                            stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
