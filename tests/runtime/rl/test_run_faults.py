"""Faults a cluster job meets, on a real local Ray cluster with real signals (issue #38): a damaged latest
checkpoint resumed past, an in-process restart after a SIGKILLed worker timed on one clock, and SIGTERM
at five moments (generate, update, save, export, between iterations), each stopped with a checkpoint and
resumed bit-identically to a run without the fault. One unfaulted run is the reference for all, and its trainer
resumes every faulted run's checkpoint in turn (a trainer start costs seconds of worker start-up; a resume
loads all a run goes on from, whatever the trainer held before)."""

from __future__ import annotations

import os
import shutil
import signal
import threading
import time

import pytest
from rl_util import tiny_plan

from hybridflow.runtime.rl.checkpoint_lock import LOCK
from hybridflow.simulator import Workload

pytestmark = [pytest.mark.slow, pytest.mark.ray]

ITERATIONS = 3
PLAN = tiny_plan("ppo", workload=Workload(prompts=8, prompt_len=16, response_len=8, samples_per_prompt=1,
                                          micro_batch_size=8, mini_batches=1))


def _config(**cluster):
    from hybridflow.runtime.rl.run_config import RunConfig

    return RunConfig(cluster=cluster)


def _trainer(ckpt, cfg=None, **kw):
    from hybridflow.runtime.rl.trainer import Trainer

    return Trainer(PLAN, cfg or _config(), checkpoint_dir=ckpt, **kw)


class Lines:
    """RunEvents that keep every line and phase (the trainer's console)."""

    def __init__(self):
        self.said, self.phases = [], []

    def say(self, text):
        self.said.append(text)

    def phase(self, name, text, total=None):
        self.phases.append((name, text))

    def advance(self, done):
        pass


@pytest.fixture(scope="module")
def unfaulted(ray_local, tmp_path_factory):
    """The reference: ITERATIONS iterations straight, a checkpoint after each (`ckpt`: a copy no test writes to);
    its trainer, which `resume_once` uses, stays up."""
    root = tmp_path_factory.mktemp("unfaulted")
    with _trainer(root / "run") as t:
        metrics = t.run(ITERATIONS)
        shutil.copytree(root / "run", root / "ckpt", ignore=shutil.ignore_patterns(LOCK))
        yield {"ckpt": root / "ckpt", "metrics": metrics, "fingerprints": t.fingerprints(), "trainer": t,
               "folder": root / "run"}


def resume_once(unfaulted, ckpt, events=None) -> tuple[list[dict], dict]:
    """(the metrics, the fingerprints) of one iteration resumed from the latest checkpoint in `ckpt` by the
    reference run's trainer: ckpt's checkpoints replace those in its folder. `events`: its RunEvents meanwhile."""
    t, folder = unfaulted["trainer"], unfaulted["folder"]
    if not all(g.alive for g in t.groups.values()):  # a worker killed in another test shuts every group down
        t.stop_workers()
    for p in folder.iterdir():
        if p.name != LOCK:  # the trainer holds the folder's lock
            shutil.rmtree(p) if p.is_dir() else p.unlink()
    shutil.copytree(ckpt, folder, ignore=shutil.ignore_patterns(LOCK), dirs_exist_ok=True)
    before, t.events = t.events, events or t.events
    try:
        return t.run(1, resume=True), t.fingerprints()
    finally:
        t.events = before


def test_a_truncated_latest_checkpoint_is_skipped_and_the_run_resumes_bit_exactly(unfaulted, tmp_path):
    ckpt = tmp_path / "ckpt"
    shutil.copytree(unfaulted["ckpt"], ckpt)
    shards = sorted((ckpt / "iter_000003" / "actor").rglob("*.distcp"))
    assert shards
    with open(shards[0], "r+b") as f:
        f.truncate(f.seek(0, 2) // 2)
    events = Lines()
    out, got = resume_once(unfaulted, ckpt, events)
    skipped = [s for s in events.said if s.startswith("skipped checkpoint")]
    assert len(skipped) == 1 and f"iter_000003: actor/{shards[0].relative_to(ckpt / 'iter_000003' / 'actor')}" \
        in skipped[0] and "the manifest says" in skipped[0], events.said
    assert [m["iteration"] for m in out] == [3] and got == unfaulted["fingerprints"]
    assert out[0]["reward_mean"] == unfaulted["metrics"][2]["reward_mean"]


def _when_call_issued(op):
    return lambda t: t.df is not None and t.df.recorder.iteration == 2 and any(o == op for o, _ in t.df.recorder.calls)


def _when_saving(t):
    return t.preemption.where == "while saving the checkpoint of iteration 2"


def _when_exporting(t):
    it = t.checkpoint_dir / "iter_000002"
    return _when_saving(t) and (it / "driver.json").is_file() and not (it / "manifest.json").is_file()


MOMENTS = {  # moment: (when to send SIGTERM, save_every: 3 makes the preemption itself save iteration 2)
    "generate": (_when_call_issued("generate"), 3),
    "update": (_when_call_issued("actor_update"), 3),
    "save": (_when_saving, 1),
    "export": (_when_exporting, 1),
}


@pytest.mark.parametrize("moment", [*MOMENTS, "between iterations"])
def test_sigterm_stops_with_a_checkpoint_and_resume_is_bit_exact(unfaulted, tmp_path, moment):
    from hybridflow.runtime.rl.run_config import RunConfig
    from hybridflow.simulator.errors import PreemptedError

    when, save_every = MOMENTS.get(moment, (None, 1))
    cfg = RunConfig(checkpoint={"save_every": save_every})
    ckpt, sent = tmp_path / "ckpt", []
    t = _trainer(ckpt, cfg, export_dir=tmp_path / "export")

    def watch():
        deadline = time.time() + 300
        while not sent and time.time() < deadline:
            if when(t):
                sent.append(t.preemption.where)
                os.kill(os.getpid(), signal.SIGTERM)
            time.sleep(0.0005)

    def between(m):
        if m["iteration"] == 2 and when is None:
            sent.append("between")
            os.kill(os.getpid(), signal.SIGTERM)

    watcher = threading.Thread(target=watch, daemon=True) if when else None
    if watcher:
        watcher.start()
    try:
        with pytest.raises(PreemptedError) as err:
            t.run(ITERATIONS, on_iteration=between)
    finally:
        sent.append("done")
        t.shutdown()
    assert sent[0] != "done", f"SIGTERM was never sent at {moment}"
    assert "stopped after iteration 2" in str(err.value) and "\n" not in str(err.value), err.value
    assert ("saved checkpoint" if save_every == 3 else "is complete") in str(err.value), err.value
    assert (ckpt / "latest").read_text().strip() == "iter_000002"
    out, got = resume_once(unfaulted, ckpt)
    assert got == unfaulted["fingerprints"]
    assert [m["reward_mean"] for m in out] == [unfaulted["metrics"][2]["reward_mean"]]


def test_a_step_past_the_grace_is_abandoned_and_the_last_checkpoint_stands(unfaulted, tmp_path):
    from hybridflow.simulator.errors import PreemptedError

    ckpt, sent = tmp_path / "ckpt", []
    t = _trainer(ckpt, _config(preempt_grace_s=0.001))
    when = _when_call_issued("generate")

    def watch():
        while not sent:
            if when(t):
                sent.append(1)
                os.kill(os.getpid(), signal.SIGTERM)
            time.sleep(0.0005)

    threading.Thread(target=watch, daemon=True).start()
    try:
        with pytest.raises(PreemptedError, match="ran out during iteration 2, which was abandoned"):
            t.run(ITERATIONS)
    finally:
        sent.append(1)
        t.shutdown()
    assert (ckpt / "latest").read_text().strip() == "iter_000001"


def test_a_restart_in_process_keeps_one_clock(unfaulted, tmp_path):
    # (last in the module: the killed worker shuts every live group down, the reference trainer's too)
    killed = []

    def kill_the_actor_after_iteration_1(m):
        if m["iteration"] == 1 and not killed:
            killed.append(t.groups["actor"].call("actor", "worker_info")[0]["pid"])
            os.kill(killed[0], signal.SIGKILL)

    events = Lines()
    t = _trainer(tmp_path / "ckpt", _config(max_restarts=1), metrics_path=tmp_path / "m.jsonl", events=events)
    try:
        out = t.run(ITERATIONS, on_iteration=kill_the_actor_after_iteration_1)
        got = t.fingerprints()
    finally:
        t.shutdown()
    assert killed and [n for n, _ in events.phases].count("restart") == 1
    assert got == unfaulted["fingerprints"]
    want = [m["seconds"] for m in unfaulted["metrics"]]
    seconds = [m["seconds"] for m in out]
    # every iteration timed by its own ops on the run's one clock: positive, and as long as without the fault
    # (iteration 2 is the restarted processes' first, as iteration 1 is a fresh run's: within 4x either way)
    assert all(m["tokens_per_second"] > 0 for m in out), out
    assert len(seconds) == len(want) and all(0 < s < max(want) * 4 and s * 4 > min(want) for s in seconds), \
        (seconds, want)
    assert all(t.timeline.iteration_seconds(i) > 0 for i in range(1, ITERATIONS + 1))
    assert t.timeline.iteration_seconds() > 0  # the run's figure the final table shows
