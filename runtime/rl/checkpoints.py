"""A run's checkpoint folder (a local path or a URL: runtime/controller/locations.py): what is in it, which
checkpoint is the latest, which ones go.

    CKPT/iter_000004/actor/...      each rank's shards (DCP) and step/RNG state, written by the workers
    CKPT/iter_000004/driver.json    the driver's state: written once every rank's save returned
    CKPT/latest                     "iter_000004": published last, so it names only complete checkpoints

A checkpoint is complete once its driver.json is there; `latest` moves to it only then (a crash
mid-save leaves the previous one as the one a resume reads).
"""

from __future__ import annotations

from hybridflow.runtime.controller.locations import Location
from hybridflow.simulator.errors import HflowError
from hybridflow.simulator.vocabulary.plan import Plan

LATEST = "latest"
DRIVER_STATE = "driver.json"


def check_checkpoint_dir(plan: Plan, folder: Location | None) -> None:
    """One line for a checkpoint dir this plan's engines cannot write: megatron's dist_checkpointing
    writes local paths only (FSDP2's DCP writes URLs too)."""
    megatron = [r for r, rp in plan.roles.items() if rp.train.backend == "megatron"]
    if folder is not None and folder.is_remote and megatron:
        raise HflowError(f"--checkpoint-dir {folder}: {', '.join(megatron)} train with megatron, whose checkpoints go "
                         "to a path; give a path every node mounts (a mounted bucket: s3fs, gcsfuse)")


def latest_name(folder: Location | None) -> str | None:
    """The checkpoint `latest` names in `folder` (None: no folder, or no complete checkpoint yet)."""
    latest = folder / LATEST if folder is not None else None
    return latest.read_text().strip() if latest is not None and latest.is_file() else None


def publish_latest(folder: Location, name: str) -> None:
    (folder / LATEST).write(name + "\n")


def prune_checkpoints(folder: Location, keep_last: int) -> list[Location]:
    """Delete all but the newest `keep_last` complete checkpoints (a folder `iter_N` with driver.json)
    and any incomplete one older than the newest complete one (a save that crashed). The one
    `latest` names is never deleted. Returns what was deleted."""
    latest = latest_name(folder)
    found = [p for p in folder.children() if p.name.startswith("iter_") and p.name[5:].isdigit() and p.is_dir()]
    complete = [p for p in found if (p / DRIVER_STATE).is_file()]
    keep = {p.name for p in complete[-keep_last:]} | {latest}
    newest = complete[-1].name if complete else ""
    doomed = [p for p in found if p.name not in keep and (p in complete or p.name < newest)]
    for p in doomed:
        p.remove()
    return doomed
