"""Generation on separate rollout devices, end to end on a local Ray cluster with the tiny model (GRPO):
the rollout weights equal the trainer's after every sync (exact bytes), each sync moves the model's bytes
to every rollout rank, the calls are the simulator's graph; one step off, rollout overlaps training and a
trained batch's policy is never more than one update old — with a fast trainer and a slow rollout, and
the reverse; synchronous on rollout devices learns exactly what the hybrid engine on the training device
learns."""

import json
import math
import time

import pytest
from rl_util import TINY, simulated_calls, tiny_plan

from hybridflow.runtime.controller.calls import WorkerDiedError
from hybridflow.simulator import OPS, Device, DeviceGroup, ParallelConfig, Plan, Workload

pytestmark = [pytest.mark.ray, pytest.mark.slow]


def plan_for(mode: str, generate: ParallelConfig | None, algorithm: str = "grpo", rollout_devices: int = 2) -> Plan:
    """The actor and reference on device 0; the actor's rollout on devices 1, 2, … (`rollout_devices` of them)."""
    plan = tiny_plan(algorithm, placement=[["actor", "ref"]],
                     workload=Workload(prompts=4, prompt_len=16, response_len=8, samples_per_prompt=2,
                                       micro_batch_size=8, mini_batches=1))
    gen = DeviceGroup(name="gen", devices=[Device(node=0, index=1 + i) for i in range(rollout_devices)])
    doc = plan.model_dump()
    doc["groups"].append(gen.model_dump())
    doc["roles"]["actor"].update(generate_group="gen", generate=generate and generate.model_dump())
    return Plan.model_validate({**doc, "mode": mode}).validate_parallel()


def tiny_model_bytes() -> int:
    """The tiny policy's parameter bytes, counted on a model built here (fp32, as the trainer holds it)."""
    from hybridflow.runtime.models.decoder import CausalLM

    return sum(p.numel() * p.element_size() for p in CausalLM(TINY.decoder_config()).parameters())


def step_checked(t) -> dict:
    """One iteration; the weights its rollout synced are the actor's before its update, on every rollout rank."""
    before = t.groups["actor"].call("actor", "weights_digest", t.df.rollout.sync.specs)[0]
    m = t.step()
    assert set(t.groups["rollout"].call("rollout", "weights_digest")) == {before}
    return m


def test_sync_two_rollout_replicas_weights_exact_and_bytes(ray_local):
    from hybridflow.runtime.rl.run_config import RunConfig
    from hybridflow.runtime.rl.trainer import Trainer

    plan = plan_for("sync", None)  # two data-parallel rollout replicas
    with Trainer(plan, RunConfig()) as t:
        out = [step_checked(t) for _ in range(2)]
        assert t.df.calls == simulated_calls(plan, t.config.kl_in_reward)
        timeline = t.timeline
        ray_local.kill(t.groups["rollout"].hosts[1])  # a rollout worker dies: one error naming it
        with pytest.raises(WorkerDiedError, match="worker 'rollout' rank 1 of group 'gen'.*during 'receive_weights'"):
            t.step()
    syncs = [e for e in timeline.events if e.op == "weight_sync"]
    assert [e.iteration for e in syncs] == [1, 2] and {e.group for e in syncs} == {"g0+gen"}
    assert {e.bytes for e in syncs} == {tiny_model_bytes()}  # the whole model to each rollout rank …
    assert {e.group for e in timeline.events if e.op == "generate"} == {"gen"}
    assert {e.op for e in timeline.events} <= set(OPS)
    for m in out:
        assert m["weight_sync/bytes"] == 2 * tiny_model_bytes()  # … of the two
        assert m["staleness/max"] == 0 and "actor/is_weight_mean" not in m  # on-policy: no correction
        assert 0.0 <= m["reward_mean"] <= 1.0 and math.isfinite(m["actor/pg_loss"])


def test_one_step_off_overlaps_and_staleness_stays_bounded(ray_local, tmp_path):
    from hybridflow.runtime.rl.run_config import RunConfig
    from hybridflow.runtime.rl.trainer import Trainer

    plan = plan_for("one-step-off", ParallelConfig(tp=2))  # one rollout replica, tensor-parallel over 2
    with Trainer(plan, RunConfig(checkpoint={"save_every": 5}), checkpoint_dir=tmp_path) as t:
        out = [step_checked(t) for _ in range(3)]  # the tiny update is fast, the tp=2 rollout slow
        gen = [e.seconds for e in t.timeline.events if e.op == "generate" and e.iteration == 2]
        reward = t.df.functions["reward"]

        def slow_reward(prompt, response, **kw):  # now the trainer's side is the slow one
            time.sleep(2 * gen[0] / (plan.workload.prompts * plan.workload.samples_per_prompt))
            return reward(prompt, response, **kw)

        t.df.functions["reward"] = slow_reward
        out += [step_checked(t) for _ in range(2)]
        timeline = t.timeline
    assert [m["staleness/max"] for m in out] == [0, 1, 1, 1, 1]  # the bound, 1, in both regimes
    # the checkpoint after 5 iterations (6 batches of prompts drawn, the 6th in flight) resumes at the 6th
    driver = json.loads((tmp_path / "iter_000005" / "driver.json").read_text())
    assert driver["sampler"]["cursor"] == 5 * plan.workload.prompts
    for m in out[1:]:
        assert m["actor/is_weight_mean"] > 0 and 0 <= m["actor/is_weight_capped"] <= 1
    ev = {}
    for e in timeline.events:
        ev.setdefault((e.op, e.iteration), []).append(e)
    for it in (2, 3, 4):  # the next batch's rollout (the next iteration's) runs while this one is scored and trained
        rollout, start, end = ev[("generate", it + 1)][0], ev[("reward", it)][0].start, ev[("actor_update", it)][0].end
        assert min(rollout.end, end) - max(rollout.start, start) > 0, f"no overlap in iteration {it}"
        # so an iteration's seconds, as simulated, run from one trained batch's end to the next
        assert timeline.iteration_seconds(it + 1) == pytest.approx(ev[("actor_update", it + 1)][0].end - end)
    assert ev[("generate", 2)][0].seconds > ev[("actor_update", 2)][0].seconds  # slow rollout …
    trainer_side = ev[("actor_update", 5)][0].end - ev[("reward", 5)][0].start
    assert trainer_side > ev[("generate", 4)][0].seconds  # … then a slow trainer


def test_one_step_off_dynamic_sampling_resumes_without_replaying_or_losing_prompts(ray_local, tmp_path):
    """DAPO one step off: an extra sampling round draws its prompts after the look-ahead's (in flight) and trains
    them at once; the checkpoint makes a resumed run draw the look-ahead's again and then carry on after the
    round's — the sampler's order, no prompt trained twice or skipped."""
    from hybridflow.runtime.rl.run_config import RunConfig
    from hybridflow.runtime.rl.trainer import Trainer
    from hybridflow.runtime.tasks.builtin import sort_reward
    from hybridflow.runtime.tasks.data import PromptSampler

    # one rollout replica: the claim is about the sampler's order, and each worker process costs seconds to start
    plan = plan_for("one-step-off", None, algorithm="dapo", rollout_devices=1)

    def half_flat(prompt, response, **kw):  # groups of prompts with an odd first digit score alike: filtered
        return 0.0 if int(prompt.split(" ")[1][0]) % 2 else sort_reward(prompt, response, **kw)

    def run(trainer, steps: int, resume: bool = False) -> tuple[list[list[int]], list[dict]]:
        trainer.start()
        if resume:
            trainer.resume()
        trainer.df.functions["reward"] = half_flat
        draws, draw = [], trainer.sampler.next_indices
        trainer.sampler.next_indices = lambda count=None: draws.append(draw(count)) or draws[-1]
        return draws, [trainer.step() for _ in range(steps)]

    with Trainer(plan, RunConfig(checkpoint={"save_every": 3}), checkpoint_dir=tmp_path) as t:
        before, out = run(t, 3)  # the checkpoint after iteration 3, the 4th batch in flight
        in_flight = t.df.mode.ahead.batch["data_row"][::plan.workload.samples_per_prompt].tolist()
        size = t.sampler.size
    assert out[2]["sampling/rounds"] > 1  # an extra round in its iteration, drawn after the 4th batch
    with Trainer(plan, RunConfig(checkpoint={"save_every": 3}), checkpoint_dir=tmp_path) as t:
        after, _ = run(t, 2, resume=True)
    drawn, then = sum(before, []), sum(after[1:], [])
    order = PromptSampler(size, plan.workload.prompts, RunConfig().seed).next_indices(len(drawn) + len(then))
    assert after[0] == in_flight  # the batch in flight at the checkpoint, drawn again …
    assert then == order[len(drawn):]  # … then on from the last prompt drawn before it: none twice, none lost


def test_sync_on_rollout_devices_trains_exactly_as_the_hybrid_engine(ray_local):
    """The same rollouts (weights applied on the rollout side, the same sampler seeds) and so the same updates:
    a rollout that generated from stale weights, drew other randomness or trained with other settings differs."""
    from hybridflow.runtime.rl.run_config import RunConfig
    from hybridflow.runtime.rl.trainer import Trainer

    disaggregated = plan_for("sync", None, rollout_devices=1)  # one rollout replica, as on one training device
    plans = {"hybrid engine": tiny_plan("grpo", placement=[["actor", "ref"]], workload=disaggregated.workload),
             "rollout devices": disaggregated}
    runs = {}
    for name, plan in plans.items():
        with Trainer(plan, RunConfig(optimizer={"actor": {"lr": 1e-3}})) as t:
            runs[name] = [t.step() for _ in range(2)], t.fingerprints()["actor"]
    (hybrid, hybrid_weights), (separate, separate_weights) = runs.values()
    for a, b in zip(hybrid, separate, strict=True):
        for key in ("reward_mean", "response_length", "actor/pg_loss", "kl"):
            assert a.get(key) == b.get(key), (key, a["iteration"])
    assert hybrid_weights == separate_weights
