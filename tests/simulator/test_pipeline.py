"""One-step-off in the simulator: the steady iteration is the weight sync plus the longer of the rollout
and the trainers' side (the other side's remainder is its bubble), the rollout of batch k+1 overlaps the
training of batch k in the Timeline, weights come from two updates back (staleness 1)."""

import pytest

from hybridflow.simulator import ClusterSpec, Device, DeviceGroup, ParallelConfig, Plan, RolePlan, Workload
from hybridflow.simulator.model import model_preset
from hybridflow.simulator.schedule import simulate


def disaggregated(mode: str, response_len: int = 256) -> Plan:
    """GRPO on 8 GPUs: actor + reference train on 4, the actor generates on the other 4 (tp 2, 2 replicas)."""
    m = model_preset("llama2-7b")
    dev = [Device(node=0, index=i) for i in range(8)]
    return Plan(algorithm="grpo", cluster=ClusterSpec(hardware="a100-80g", nodes=1, devices_per_node=8),
                workload=Workload(prompts=64, prompt_len=256, response_len=response_len, samples_per_prompt=4),
                groups=[DeviceGroup(name="train", devices=dev[:4]), DeviceGroup(name="gen", devices=dev[4:])],
                roles={"actor": RolePlan(model=m, group="train", train=ParallelConfig(dp=4), generate_group="gen",
                                         generate=ParallelConfig(tp=2, dp=2)),
                       "ref": RolePlan(model=m, group="train", train=ParallelConfig(dp=4))},
                reward_function="hybridflow.runtime.tasks.builtin:sort_reward", reshard="broadcast", mode=mode)


def _seconds(tl, op, it=1):
    return sum(e.seconds for e in tl.events if e.op == op and e.iteration == it)


@pytest.mark.parametrize("response_len", [16, 1024])  # training the longer side; then the rollout
def test_steady_iteration_is_sync_plus_the_longer_side(response_len):
    sync = simulate(disaggregated("sync", response_len), iterations=3)
    off = simulate(disaggregated("one-step-off", response_len), iterations=3)
    assert off.meta["staleness"] == 1 and sync.meta["staleness"] == 0
    assert off.steady_iterations() == [1, 2, 3]  # iteration 0, whose rollout nothing overlaps, is the warm-up
    ws, gen = _seconds(sync, "weight_sync"), _seconds(sync, "generate")
    trainers = sync.iteration_seconds(1) - ws - gen  # scoring, log-probs, update: after the rollout when sync
    assert sync.iteration_seconds() == pytest.approx(ws + gen + trainers)
    assert off.iteration_seconds() == pytest.approx(ws + max(gen, trainers), rel=1e-6)
    assert off.iteration_seconds() < sync.iteration_seconds()


def test_timeline_shows_the_overlap_and_the_stale_weights():
    tl = simulate(disaggregated("one-step-off"), iterations=2)
    for it in (1, 2):
        evs = {e.op: e for e in tl.events if e.iteration == it}
        rollout, update = evs["generate"], evs["actor_update"]  # batch it+1's rollout, batch it's update
        assert min(rollout.end, update.end) - max(rollout.start, update.start) > 0
        assert evs["weight_sync"].end <= rollout.start and evs["weight_sync"].group == "train+gen"
    # the weights batch 3 is generated with (synced in iteration 2) are from before batch 2's update
    sync2 = next(e for e in tl.events if e.op == "weight_sync" and e.iteration == 2)
    update2 = next(e for e in tl.events if e.op == "actor_update" and e.iteration == 2)
    assert sync2.end <= update2.start
    assert [e.iteration for e in tl.events if e.op == "weight_sync"] == [0, 1, 2]  # none for the first look-ahead
