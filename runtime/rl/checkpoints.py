"""A run's checkpoint folder (a local path or a URL: runtime/controller/locations.py): what is in it, which
checkpoint is the latest, which ones go.

    CKPT/iter_000004/actor/...      each rank's shards (DCP) and step/RNG state, written by the workers
    CKPT/iter_000004/driver.json    the driver's state: written once every rank's save returned
    CKPT/iter_000004/manifest.json  every file's size and checksum, written last (checkpoint_manifest.py)
    CKPT/latest                     "iter_000004": published after the manifest
    CKPT/run.lock                   who runs on the folder now (checkpoint_lock.py)

A checkpoint is complete once its manifest is there; `latest` moves to it only then (a crash
mid-save leaves the previous one as the one a resume reads). A resume verifies the checkpoint against
its manifest and falls back to the newest older one that verifies, naming each it skipped. `RunCheckpoints` writes and reads a
running Trainer's: the trained roles' shards (each worker writes its own), the driver's state (data
order, the algorithm's driver state such as Safe-RLHF's Lagrange multiplier, the KL coefficient) and,
with an export dir, every checkpoint also as Hugging Face folders.
"""

from __future__ import annotations

import json
import pickle
import time
from pathlib import Path

from hybridflow.runtime.controller.locations import Location
from hybridflow.runtime.rl.checkpoint_manifest import MANIFEST, resume_point, write_manifest
from hybridflow.runtime.rl.metrics_file import drop_after
from hybridflow.runtime.rl.storage_faults import check_room, checkpoint_bytes, storage_fault
from hybridflow.simulator.errors import HflowError
from hybridflow.simulator.vocabulary.plan import Plan
from hybridflow.simulator.vocabulary.roles import TRAINED_ROLES

LATEST = "latest"
DRIVER_STATE = "driver.json"
MODE_STATE = "rollout_buffer.pkl"  # the execution mode's rollouts not yet trained (Mode.checkpoint_state), if any


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
    """Delete all but the newest `keep_last` complete checkpoints (a folder `iter_N` with its manifest)
    and any incomplete one older than the newest complete one (a save that crashed). The one
    `latest` names is never deleted. Returns what was deleted."""
    latest = latest_name(folder)
    found = [p for p in folder.children() if p.name.startswith("iter_") and p.name[5:].isdigit() and p.is_dir()]
    complete = [p for p in found if (p / MANIFEST).is_file()]
    keep = {p.name for p in complete[-keep_last:]} | {latest}
    newest = complete[-1].name if complete else ""
    doomed = [p for p in found if p.name not in keep and (p in complete or p.name < newest)]
    for p in doomed:
        p.remove()
    return doomed


class RunCheckpoints:
    """A Trainer's checkpoints in its checkpoint dir (and their HF exports in its export dir)."""

    def __init__(self, trainer):
        self.t = trainer
        self.saved_iteration = 0  # the iteration of the last checkpoint this trainer saved or loaded
        self.last_save_s = 0.0  # how long the last save took (is there time for one before a preemption's end)

    def _driver_state(self, mode_saved: bool) -> dict:
        t = self.t
        # prompts of a rollout in flight are not trained on yet: a resume draws (and generates) them again,
        # and then jumps over any drawn after them, trained already — unless the mode saved them (mode_saved)
        mode = t.df.mode
        after = mode.prompts_drawn_after_in_flight()
        sampler = t.sampler.state_dict(rewind=(0 if mode_saved else mode.prompts_in_flight()) + after, skip=after)
        return {"iteration": t.iteration, "algorithm": t.plan.algorithm, "sampler": sampler,
                "algorithm_state": t.df.state.state_dict() if t.df.state is not None else None,
                "kl_coef": t.df.kl.state_dict(), "placement": t.plan.placement()}

    def save(self) -> Location:
        t = self.t
        if not t.checkpoint_dir:
            raise HflowError("no checkpoint directory; pass checkpoint_dir")
        path = t.checkpoint_dir / f"iter_{t.iteration:06d}"
        latest = latest_name(t.checkpoint_dir)
        need = checkpoint_bytes(t.checkpoint_dir / latest) if latest else None  # the previous one's size
        check_room(t.checkpoint_dir, need, latest)  # before writing anything: one line, exit 4
        start = time.monotonic()
        try:
            self._write(path)
        except Exception as e:
            fault = storage_fault(t.checkpoint_dir, path, e, need, latest)
            if fault is None:
                raise
            path.remove()  # the partial checkpoint: no resume takes it, and it holds the space
            raise fault from None
        self.saved_iteration, self.last_save_s = t.iteration, time.monotonic() - start
        for old in prune_checkpoints(t.checkpoint_dir, t.config.checkpoint.keep_last):
            if t.export_dir:  # a pruned checkpoint's HF export goes with it
                (t.export_dir / old.name).remove()
        return path

    def _write(self, path: Location) -> None:
        t = self.t
        (path / MANIFEST).remove()  # a save over an older one: whole again only once its new manifest is written
        for role in TRAINED_ROLES:
            if role in t.groups:
                t.groups[role].call(role, "save", str(path))  # returns once every rank's shards are written
        recorded = len(t.df.events)
        mode_state = t.df.mode.checkpoint_state()
        t.timeline.events.extend(t.df.events[recorded:])  # a round it collected: the next iteration's ops
        if mode_state is not None:
            (path / MODE_STATE).write(pickle.dumps(mode_state))
        (path / DRIVER_STATE).write(json.dumps(self._driver_state(mode_state is not None), indent=2) + "\n")
        if t.export_dir:
            self.export_hf(t.export_dir / path.name)
        write_manifest(path)  # last in the folder: a checkpoint with a manifest is whole
        publish_latest(t.checkpoint_dir, path.name)

    def export_hf(self, folder: str | Path | Location | None = None) -> list[Location]:
        t = self.t
        folder = Location(str(folder)) if folder is not None else t.export_dir
        if folder is None:
            raise HflowError("no export directory; pass export_dir or a folder")
        roles = [r for r in TRAINED_ROLES if r in t.groups]
        for role in roles:
            t.groups[role].call(role, "export_hf", str(folder / role))
        return [folder / r for r in roles]

    def load(self) -> Location:
        t = self.t
        point = resume_point(t.checkpoint_dir, latest_name(t.checkpoint_dir))
        for line in point.skipped_lines():
            t.events.say(line)
        if point.checkpoint is None:
            raise HflowError(point.none_line(t.checkpoint_dir))
        path = point.checkpoint
        state = json.loads((path / DRIVER_STATE).read_text())
        if state["algorithm"] != t.plan.algorithm or state["placement"] != t.plan.placement():
            raise HflowError(f"{path} was written by a {state['algorithm']} run with placement {state['placement']}; "
                             "resume with the same plan")
        for role in TRAINED_ROLES:
            if role in t.groups:
                t.groups[role].call(role, "load", str(path))
        t.iteration = self.saved_iteration = state["iteration"]
        t.sampler.load_state_dict(state["sampler"])
        if t.df.state is not None and state["algorithm_state"] is not None:
            t.df.state.load_state_dict(state["algorithm_state"])
        t.df.kl.load_state_dict(state["kl_coef"])
        if (path / MODE_STATE).is_file():  # our own file, checked against the manifest above
            t.df.mode.load_checkpoint_state(pickle.loads((path / MODE_STATE).read_bytes()))
        drop_after(t.metrics_path, t.iteration)  # iterations after the checkpoint run again
        return path
