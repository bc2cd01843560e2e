"""One-step-off in the simulator: the steady iteration is the weight sync plus the longer of the rollout
and the trainers' side (the other side's remainder is its bubble), the rollout of batch k+1 overlaps the
training of batch k in the Timeline, weights come from two updates back (staleness 1)."""

import pytest

from hybridflow.simulator import ClusterSpec, Device, DeviceGroup, ParallelConfig, Plan, RolePlan, Workload
from hybridflow.simulator.calibration.gpu_fit import default_cost_model
from hybridflow.simulator.errors import HflowError
from hybridflow.simulator.pricing.rollout_calls import StreamedRollout
from hybridflow.simulator.schedule.schedule import simulate
from hybridflow.simulator.vocabulary.model import model_preset


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
    ev = {(e.op, e.iteration): e for e in tl.events}
    for it in (1, 2):  # batch it's rollout (iteration it's) runs while batch it−1 trains, after the sync it issued
        rollout, update, sync = ev["generate", it], ev["actor_update", it - 1], ev["weight_sync", it - 1]
        assert min(rollout.end, update.end) - max(rollout.start, update.start) > 0
        assert sync.end <= rollout.start and sync.group == "train+gen"
        # so an iteration's seconds run from one trained batch's end to the next
        assert tl.iteration_seconds(it) == pytest.approx(ev["actor_update", it].end - update.end)
    assert max(e.iteration for e in tl.events) == 2  # no rollout past the last trained batch
    # the weights batch 3 is generated with (synced in iteration 2) are from before batch 2's update
    sync2 = next(e for e in tl.events if e.op == "weight_sync" and e.iteration == 2)
    update2 = next(e for e in tl.events if e.op == "actor_update" and e.iteration == 2)
    assert sync2.end <= update2.start
    assert [e.iteration for e in tl.events if e.op == "weight_sync"] == [0, 1, 2]  # none for the first look-ahead


# ---- async with bound k, on hand-set op seconds -------------------------------------------------------
def _hand_schedule(mode: str, k: int, gen: float, train: float, sync: float, iterations: int):
    """The plan's pipelined dataflow scheduled with hand-set seconds: the rollout `gen`, the weight sync
    `sync`, the trainers' side `train` (ref log-probs 1 s, the actor update the rest; driver ops free)."""
    from hybridflow.simulator.schedule.dataflow import unroll
    from hybridflow.simulator.schedule.pipeline import copies_needed, pipeline
    from hybridflow.simulator.schedule.schedule import pipeline_period, plan_dataflow, schedule

    plan = disaggregated(mode).model_copy(update={"max_staleness": k})
    graph, lanes = plan_dataflow(plan)
    copies = copies_needed(iterations, plan.staleness)
    big, big_lanes = unroll(graph, lanes, copies)
    pipeline(graph, big, big_lanes, copies, plan.staleness)
    hand = {"generate": gen, "weight_sync": sync, "ref_logprob": 1.0, "actor_update": train - 1.0}
    times = schedule(big, big_lanes, {n: hand.get(big.nodes[n]["op"], 0.0) for n in big})
    return big, times, pipeline_period(big, times, iterations, plan.staleness)


@pytest.mark.parametrize(("gen", "train", "k", "period"), [
    (3.0, 3.0, 2, 1 / 2 + 3),  # balanced: the sync is paid once per k iterations, nothing else is exposed
    (5.0, 2.0, 2, 1 / 2 + 5),  # rollout-bound: the trainers idle 3 s per batch waiting for the queue
    (2.0, 5.0, 2, 1 / 2 + 5),  # train-bound: the rollout runs k ahead and waits for a slot
    (2.0, 5.0, 4, 1 / 4 + 5),
    (5.0, 2.0, 1, 1 + 5),  # k = 1: one-step-off's sync + max(rollout, training)
])
def test_async_period_is_sync_over_k_plus_the_slower_side(gen, train, k, period):
    _, _, got = _hand_schedule("async", k, gen, train, 1.0, iterations=4 * k)
    assert got == pytest.approx(period)


@pytest.mark.parametrize(("gen", "train"), [(1.0, 6.0), (6.0, 1.0)])  # slow trainer + fast rollout, the reverse
@pytest.mark.parametrize("k", [1, 2, 3])
def test_staleness_never_exceeds_the_bound(gen, train, k):
    big, times, _ = _hand_schedule("async", k, gen, train, 0.5, iterations=3 * k + 1)
    node = {(j, a["op"]): n for n, a in big.nodes(data=True) for j in [n[0]]}
    syncs = sorted(j for j, op in node if op == "weight_sync")
    assert syncs == [0] + [j for j in range(2, max(syncs) + 1) if (j - 1) % k == 0]  # 0: the initial weights
    lags = []
    for j in sorted(j for j, op in node if op == "actor_update"):
        carried = [s for s in syncs if times[node[(s, "weight_sync")]][1] <= times[node[(j, "generate")]][0]]
        version = max(carried[-1] - 1, 0)  # sync s ≥ 2 carries the weights after update s − 2
        if carried[-1]:  # ... and starts only after that update ended
            assert times[node[(carried[-1] - 2, "actor_update")]][1] <= times[node[(carried[-1], "weight_sync")]][0]
        lags.append(j - version)
    assert max(lags) == k and min(lags[1:]) >= 1


def test_async_with_k_1_is_one_step_off_with_its_rollout_in_two_calls():
    """k = 1 schedules as one-step-off; only the rollout differs: the async mode makes a batch's in STREAM_CHUNKS
    calls, one after another (runtime/rl/modes/streaming.py), each at its share of the batch."""
    plan = disaggregated("one-step-off")
    cm = default_cost_model(plan.cluster)
    off = simulate(plan, StreamedRollout(cm), iterations=3)
    k1 = simulate(disaggregated("async"), iterations=3)  # max_staleness defaults to 1
    assert [(e.op, e.iteration, e.start, e.end) for e in off.events] == \
           [(e.op, e.iteration, e.start, e.end) for e in k1.events]
    assert k1.iteration_seconds() == off.iteration_seconds()
    # two calls of half the batch each: more decode steps than one call of the whole batch
    one_call = _seconds(simulate(plan, cm, iterations=3), "generate")
    half = cm.generate(plan.roles["actor"].model, plan.generation_config(), plan.workload, plan.workload.sequences // 2)
    assert _seconds(k1, "generate") == pytest.approx(2 * half.seconds) and _seconds(k1, "generate") > one_call


def test_async_timeline_overlaps_rollout_and_training_across_iterations():
    tl = simulate(disaggregated("async").model_copy(update={"max_staleness": 2}), iterations=4)
    assert tl.meta["staleness"] == 2
    assert [e.iteration for e in tl.events if e.op == "weight_sync"] == [0, 2, 4]  # before batches 0, 3 and 5
    rollouts = sorted((e.start, e.end) for e in tl.events if e.op == "generate")
    updates = sorted((e.start, e.end) for e in tl.events if e.op == "actor_update")
    overlap = sum(max(0.0, min(r[1], u[1]) - max(r[0], u[0])) for r in rollouts for u in updates)
    assert overlap > 0


def test_op_seconds_count_a_sync_paid_once_per_k_iterations_as_its_share():
    tl = simulate(disaggregated("async").model_copy(update={"max_staleness": 2}), iterations=4)
    steady = tl.steady_iterations()
    synced = [i for i in steady if tl.op_seconds(i).get("weight_sync")]
    assert 0 < len(synced) < len(steady)  # not every iteration syncs: a median would say 0
    total = sum(tl.op_seconds(i).get("weight_sync", 0.0) for i in steady)
    assert tl.op_seconds()["weight_sync"] == pytest.approx(total / len(steady))
    assert tl.op_seconds()["actor_update"] == pytest.approx(_seconds(tl, "actor_update", steady[0]))  # every one: median


@pytest.mark.parametrize("response_len", [16, 1024])
def test_the_last_trained_batch_trains_beside_the_next_rollout(response_len):
    """A device whose neighbours idle runs faster (neighbours.py): the rollout after the last trained batch is
    scheduled (not reported), so the last iteration is priced as busy as the ones before it."""
    from hybridflow.simulator.calibration.profiled_cost import EngineOverheads, ProfiledCostModel
    from hybridflow.simulator.pricing.efficiency import EfficiencyParams

    plan = disaggregated("one-step-off", response_len)
    cm = ProfiledCostModel(plan.cluster, EfficiencyParams(), EngineOverheads(alone_speedup=1.5))
    tl = simulate(plan, cm, iterations=3)
    steady = [tl.iteration_seconds(i) for i in tl.steady_iterations()]
    assert steady == pytest.approx([steady[0]] * 3, rel=1e-9)
    assert max(e.iteration for e in tl.events) == 3  # the look-ahead rollout is not one of the iterations


@pytest.mark.parametrize("partial, gap", [(None, 0.05), (128, 0.01)])
def test_partial_rollouts_hand_the_weights_over_behind_the_update(partial, gap):
    """With partial rollouts the runtime submits each sync with the update it carries (rl/rollout.py
    hand_over): it queues behind it, a queued call's gap, not the driver's round trip; on the rollout devices
    it queues behind the round (batch i's rollout, before batch i + 1's)."""
    from hybridflow.simulator.calibration.profiled_cost import EngineOverheads, ProfiledCostModel
    from hybridflow.simulator.pricing.efficiency import EfficiencyParams

    plan = disaggregated("async", 256).model_copy(update={"max_staleness": 1})
    cm = ProfiledCostModel(plan.cluster, EfficiencyParams(), EngineOverheads(dispatch_seconds=0.05,
                                                                             queued_call_seconds=0.01))
    tl = simulate(plan, cm, partial_rollout_tokens=partial)
    ends = {(e.op, e.iteration): e.end for e in tl.events}
    syncs = [e for e in tl.events if e.op == "weight_sync" and ("actor_update", e.iteration - 1) in ends]
    assert len(syncs) == 2 and all(e.start == pytest.approx(max(ends["actor_update", e.iteration - 1] + gap,
                                                                ends["generate", e.iteration] + 0.01), rel=1e-9)
                                   for e in syncs)
    if partial:  # here the update ends last: the gap shows
        assert any(ends["actor_update", e.iteration - 1] + gap > ends["generate", e.iteration] for e in syncs)


def test_partial_budgets_cut_the_longest_into_two_to_k_rounds():
    from hybridflow.simulator.vocabulary.execution import partial_budgets

    assert partial_budgets(512, 4) == [256, 171, 128]
    assert partial_budgets(512, 2) == [256]
    assert partial_budgets(512, 1) == []  # a paused response would outlive a bound of 1
    assert partial_budgets(3, 4) == [2, 1]  # 2 and 3 rounds; 4 rounds of 1 token would be 3 of them


def test_the_fastest_partial_budget_is_the_cheapest_simulation_or_none():
    from hybridflow.simulator.schedule.schedule import fastest_partial_budget
    from hybridflow.simulator.vocabulary.execution import check_partial_budget

    def plan(response_len: int, tail: bool) -> Plan:
        p = disaggregated("async", response_len=response_len).model_copy(update={"max_staleness": 4})
        lengths = {"mean": response_len // 8, "max": response_len} if tail else None
        return p.model_copy(update={"workload": Workload.model_validate(
            {**p.workload.model_dump(), "response_lengths": lengths})})

    for p, budgets in ((plan(64, False), [32, 22, 16]), (plan(1024, True), [512, 342, 256])):
        best, seconds = fastest_partial_budget(p)
        assert list(seconds) == [None, *budgets]
        brute = {b: simulate(p, partial_rollout_tokens=b).iteration_seconds() for b in seconds}
        least = min(brute.values())  # the fastest; of budgets priced alike (to the last bits), the first
        assert seconds == pytest.approx(brute) and best == next(b for b, t in brute.items() if t <= least * (1 + 1e-9))
    # 64-token responses: a round only re-prefills them and syncs every iteration; a long tail's rounds cut it short
    assert fastest_partial_budget(plan(64, False))[0] is None
    assert fastest_partial_budget(plan(1024, True))[0] is not None
    with pytest.raises(HflowError, match="the plan's mode is 'one-step-off': use --mode async"):
        fastest_partial_budget(disaggregated("one-step-off"))
    with pytest.raises(HflowError, match="takes 6 rounds of async_mode.partial_rollout_tokens 200"):
        check_partial_budget(plan(1024, False), 200)
