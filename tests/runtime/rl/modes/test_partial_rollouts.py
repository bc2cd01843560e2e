"""Partial rollouts in the `async` mode (async_mode.partial_rollout_tokens; rl/partial_rollouts.py): the
buffer's bookkeeping by hand; the settings refused in one line; end to end (GRPO, tiny model, rollout on
devices of its own), responses paused and continued in later rounds, their behaviour log-probs those of one
uninterrupted pass when the policy did not change, the staleness bound held, every prompt trained once; a
checkpoint saves the paused responses and a resumed run trains what the uninterrupted one does; the simulator's price of the generation round bounded by the budget."""

import pytest
import torch
from rl_util import trained_batches
from test_async_rollout import WORKLOAD, async_plan

from hybridflow.runtime.controller.batch import Batch
from hybridflow.runtime.rl.partial_rollouts import OpenGroup, PartialRollouts
from hybridflow.runtime.rl.plan_support import check_runnable
from hybridflow.runtime.rl.run_config import RunConfig
from hybridflow.simulator import ParallelConfig
from hybridflow.simulator.errors import HflowError

EOS = 9


def _group(prompt_lens: list[int]) -> Batch:
    ids, mask = torch.zeros(len(prompt_lens), 4, dtype=torch.long), torch.zeros(len(prompt_lens), 4, dtype=torch.long)
    for i, n in enumerate(prompt_lens):
        ids[i, 4 - n:] = torch.arange(1, n + 1)
        mask[i, 4 - n:] = 1
    return Batch({"prompt_ids": ids, "prompt_mask": mask, "data_row": torch.zeros(len(prompt_lens), dtype=torch.long)})


def _call_output(rows: list[list[int]], width: int, version: int) -> Batch:
    """A generate call's output: each row's new tokens (EOS included), padded to the call's budget."""
    resp = torch.zeros(len(rows), width, dtype=torch.long)
    mask = torch.zeros(len(rows), width, dtype=torch.long)
    for i, r in enumerate(rows):
        resp[i, :len(r)], mask[i, :len(r)] = torch.tensor(r), 1
    logp = -0.1 * resp.float() * mask
    return Batch({"responses": resp, "response_mask": mask, "behaviour_log_probs": logp,
                  "policy_version": torch.full((len(rows),), version)})


def test_buffer_pauses_continues_and_restarts_stale_responses():
    buf = PartialRollouts(budget=3, response_len=7, eos_ids=[EOS])
    g = OpenGroup.new(_group([2, 3]))
    buf.open.append(g)
    first = buf.launch([g])
    assert first["prompt_ids"].tolist() == [[0, 1, 2], [1, 2, 3]] and g.in_flight
    assert buf.absorb(_call_output([[4, EOS], [5, 6, 7]], 3, version=0)) == []  # row 1 paused after 3 tokens
    assert g.done == [True, False] and buf.open_responses() == 1 and not g.in_flight
    second = buf.launch([g])  # only the paused row, its prompt followed by its tokens
    assert second["prompt_ids"].tolist() == [[1, 2, 3, 5, 6, 7]]
    assert buf.absorb(_call_output([[8, 8, 8]], 3, version=1)) == []  # still no EOS: 6 of 7 tokens
    buf.launch([g])
    (done,) = buf.absorb(_call_output([[4, 4, EOS]], 3, version=2))  # cut at response_len 7
    assert len(buf.open) == 0
    assert done["responses"].tolist() == [[4, EOS, 0, 0, 0, 0, 0], [5, 6, 7, 8, 8, 8, 4]]
    assert done["response_mask"].sum(-1).tolist() == [2, 7]
    assert done["token_policy_version"][1].tolist() == [0, 0, 0, 1, 1, 1, 2]
    assert done["policy_version"].tolist() == [0, 0] and done["partial_segments"].tolist() == [1, 3]
    assert torch.equal(done["behaviour_log_probs"], -0.1 * done["responses"].float() * done["response_mask"])
    assert done["input_ids"][1, -7:].tolist() == [5, 6, 7, 8, 8, 8, 4]
    assert done["position_ids"][1].tolist() == [0, *range(10)]  # one pad, a prompt of 3, 7 tokens
    # a paused response whose oldest token is more than k behind starts again, as does its group's finished one
    g = OpenGroup.new(_group([1, 1]))
    buf.open.append(g)
    buf.launch([g])
    buf.absorb(_call_output([[EOS], [5, 5, 5]], 3, version=3))
    assert buf.restart_stale(version=5, max_staleness=2) == 0  # 2 behind: still within k
    assert buf.restart_stale(version=6, max_staleness=2) == 2 and buf.restarted == 2
    assert g.tokens == [[], []] and g.done == [False, False]


def test_imposed_lengths_end_each_response_at_its_length_past_eos_with_the_same_draws():
    """The engine's `lengths` (a benchmark's imposed response lengths, FORCED_LENGTH_FIELD): each row exactly that
    long, an EOS inside it not ending it, and until a row's first EOS the same tokens and log-probs as a call
    without them (the sampling is unchanged)."""
    from hybridflow.runtime.engines.rollout.generation import GenerationEngine, SamplingParams, left_pad
    from hybridflow.runtime.models.decoder import CausalLM
    from hybridflow.simulator.vocabulary.model import model_preset

    torch.manual_seed(0)
    model = CausalLM(model_preset("tiny").decoder_config(num_hidden_layers=2)).eval()
    ids, mask = left_pad([[5, 9, 2, 33, 7, 1], [4, 8], [60, 3, 3, 11], [7, 7, 7]])
    lengths = torch.tensor([3, 40, 17, 40])
    eos = list(range(10, 40))  # many ids end a response, so that most rows meet one early
    params = SamplingParams(max_new_tokens=40, temperature=1.0, eos_token_id=eos)
    free = GenerationEngine(model).generate(ids, mask, params, torch.Generator().manual_seed(3))
    forced = GenerationEngine(model).generate(ids, mask, params, torch.Generator().manual_seed(3), lengths)
    assert forced.response_mask.sum(-1).tolist() == lengths.tolist()
    ended_early = 0
    for i in range(4):
        n = int(free.response_mask[i].sum())  # up to and including its first EOS
        k = min(n, int(lengths[i]))
        assert torch.equal(forced.response[i, :k], free.response[i, :k])
        assert torch.allclose(forced.response_logprobs[i, :k], free.response_logprobs[i, :k])
        ended_early += int(n < lengths[i] and free.response[i, n - 1].item() in eos)
    assert ended_early >= 2  # EOS came before the imposed length, and the response went on


def test_buffer_continues_a_response_of_imposed_length_past_its_eos():
    from hybridflow.runtime.engines.rollout.generation import FORCED_LENGTH_FIELD

    buf = PartialRollouts(budget=3, response_len=7, eos_ids=[EOS])
    prompts = _group([2, 3])
    prompts[FORCED_LENGTH_FIELD] = torch.tensor([2, 5])
    g = OpenGroup.new(prompts)
    buf.open.append(g)
    assert buf.launch([g])[FORCED_LENGTH_FIELD].tolist() == [2, 5]
    assert buf.absorb(_call_output([[4, EOS], [5, EOS, 7]], 3, version=0)) == []  # row 1's EOS does not end it
    assert g.done == [True, False]
    assert buf.launch([g])[FORCED_LENGTH_FIELD].tolist() == [2]  # its 2 tokens left
    (done,) = buf.absorb(_call_output([[8, 8]], 3, version=1))
    assert done["responses"].tolist() == [[4, EOS, 0, 0, 0, 0, 0], [5, EOS, 7, 8, 8, 0, 0]]
    assert done["partial_segments"].tolist() == [1, 2] and done[FORCED_LENGTH_FIELD].tolist() == [2, 5]


def test_partial_rollout_settings_refused_in_one_line():
    plan = async_plan("async", ParallelConfig(dp=1), max_staleness=2)
    check_runnable(plan, RunConfig(async_mode={"partial_rollout_tokens": 4}))  # 8 tokens in 2 rounds, k = 2
    for bad_plan, config, says in [
        (async_plan("one-step-off", ParallelConfig(dp=1)), {"async_mode": {"partial_rollout_tokens": 4}},
         "use --mode async"),
        (plan, {"async_mode": {"partial_rollout_tokens": WORKLOAD.response_len}}, "set it below"),
        (plan, {"async_mode": {"partial_rollout_tokens": 3}}, "takes 3 rounds .* set async_mode.partial_rollout_tokens to at least 4"),
        (async_plan("async", ParallelConfig(dp=1)), {"async_mode": {"partial_rollout_tokens": 4}},
         "raise max_staleness to 2"),
    ]:
        with pytest.raises(HflowError, match=says):
            check_runnable(bad_plan, RunConfig(**config))
    for bad in (0, "sometimes", 2.5, True):
        with pytest.raises(ValueError, match="expected a positive whole number of tokens, auto or null"):
            RunConfig(async_mode={"partial_rollout_tokens": bad})


def test_an_auto_budget_resolves_to_the_fastest_priced_before_anything_runs():
    from hybridflow.runtime.rl.resolve import resolve_run
    from hybridflow.simulator.calibration.fit import plan_on_profile
    from hybridflow.simulator.schedule.schedule import fastest_partial_budget
    from hybridflow.simulator.vocabulary.workload import Workload
    from hybridflow.tools.preflight.partial_budget import with_partial_budget

    auto = RunConfig(async_mode={"partial_rollout_tokens": "auto"})
    for lengths in (None, {"mean": 64, "max": 512}):  # fixed lengths (8 tokens) and a long tail
        plan = async_plan("async", ParallelConfig(dp=1), max_staleness=4)
        workload = Workload.model_validate({**plan.workload.model_dump(exclude={"response_len"}),
                                            "response_len": plan.workload.response_len if lengths is None else 512,
                                            "response_lengths": lengths})
        plan = plan.model_copy(update={"workload": workload})
        picked = with_partial_budget(plan, auto).async_mode.partial_rollout_tokens
        assert picked == fastest_partial_budget(plan)[0]  # a number, or None (off) where none pays
        assert resolve_run(plan, with_partial_budget(plan, auto)).config.async_mode.partial_rollout_tokens == picked
        on_profile = with_partial_budget(plan, auto, "cpu-2core").async_mode.partial_rollout_tokens
        assert on_profile == fastest_partial_budget(*plan_on_profile(plan, "cpu-2core")[:2])[0]  # priced there
    assert picked is not None  # the long tail's rounds pay on the plan's hardware
    fixed = RunConfig(async_mode={"partial_rollout_tokens": 4})
    assert with_partial_budget(plan, fixed) is fixed  # a number stays as given
    with pytest.raises(HflowError, match="auto is priced by the simulator before a run starts"):
        resolve_run(plan, auto)  # the runtime prices nothing: unresolved, it is refused in one line
    for bad_plan, says in [(async_plan("one-step-off", ParallelConfig(dp=1)), "use --mode async"),
                           (async_plan("async", ParallelConfig(dp=1)), "raise max_staleness to 2")]:
        with pytest.raises(HflowError, match=says):
            with_partial_budget(bad_plan, auto)


@pytest.mark.ray
@pytest.mark.slow
def test_async_partial_rollouts_continue_responses_within_the_staleness_bound(ray_local):
    from hybridflow.runtime.rl.batches import PROMPT_FIELDS, SEQ_FIELDS
    from hybridflow.runtime.rl.modes.streaming import concat_groups
    from hybridflow.runtime.rl.trainer import Trainer
    from hybridflow.runtime.tasks.data import PromptSampler

    k, budget = 2, 4
    plan = async_plan("async", ParallelConfig(dp=1), max_staleness=k)
    # an update that leaves the weights as they are (lr far below fp32's resolution): every version is
    # one policy, so a continued response's behaviour log-probs must be those of one uninterrupted pass
    config = RunConfig(async_mode={"partial_rollout_tokens": budget}, optimizer={"actor": {"lr": 1e-30}})
    with Trainer(plan, config) as t:
        trained = trained_batches(t)
        out = []
        for i in range(4):
            out.append(t.step())
            assert len(t.df.mode.in_flight) == 1  # the next round, launched while this batch trained: one call
            # the weights this update made handed over behind it (rl/rollout.py hand_over), waited for by the
            # next iteration's refill before its round
            assert t.df.rollout.handover is not None and t.df.rollout.handover[0] == i + 1
            assert t.df.rollout.synced_version == i
        whole = concat_groups([b.select(*SEQ_FIELDS, *PROMPT_FIELDS, "response_mask", "behaviour_log_probs",
                                        "partial_segments", "token_policy_version", "data_row", meta=False)
                               for b in trained])  # the batches' prompts left-padded to one width
        recomputed = t.groups["actor"].call_async("actor", "compute_log_prob",
                                                  whole.select(*SEQ_FIELDS, meta=False)).get()["old_log_probs"]
        sampler = PromptSampler(len(t.dataset), WORKLOAD.prompts, t.config.seed)
    mask = whole["response_mask"].bool()
    continued = whole["partial_segments"] > 1
    assert int(continued.sum()) > 0 and sum(m["partial/continued_responses"] for m in out) == int(continued.sum())
    assert int((whole["response_mask"].sum(-1) > budget).sum()) == int(continued.sum())  # longer: continued
    diff = (whole["behaviour_log_probs"] - recomputed).abs()[mask]
    assert diff.max().item() < 1e-4, diff.max().item()
    versions = [set(v[m].tolist()) for v, m in zip(whole["token_policy_version"][continued], mask[continued],
                                                    strict=True)]
    assert any(len(v) > 1 for v in versions)  # some continued in a later iteration, by newer weights
    for m in out:
        assert m["staleness/max"] <= k and m["async/dropped_groups"] == 0
        assert 0 <= m["partial/token_staleness_mean"] <= m["staleness/max"]
    # every prompt trained once: the groups finish out of their draw order, but none twice and none skipped
    # beyond those still open, in the queue or unlaunched
    got = whole["data_row"][::WORKLOAD.samples_per_prompt].tolist()
    drawn = [i for _ in range(6) for i in sampler.next_indices()]
    assert len(got) == len(set(got)) == 4 * WORKLOAD.prompts and set(got) <= set(drawn)


def _run(plan, config, checkpoint_dir, steps: int, resume: bool = False) -> tuple[list[Batch], list[dict]]:
    """`steps` iterations (after a resume, when asked): the batches trained and the metrics."""
    from hybridflow.runtime.rl.trainer import Trainer

    with Trainer(plan, config, checkpoint_dir=checkpoint_dir) as t:
        if resume:
            t.resume()
        trained = trained_batches(t)
        return trained, [t.step() for _ in range(steps)]


@pytest.mark.ray
@pytest.mark.slow
def test_a_resumed_run_goes_on_from_the_checkpoint_s_paused_responses(ray_local, tmp_path):
    import pickle

    from hybridflow.runtime.rl.checkpoints import MODE_STATE

    plan = async_plan("async", ParallelConfig(dp=1), max_staleness=2)
    config = RunConfig(async_mode={"partial_rollout_tokens": 4}, checkpoint={"save_every": 3})
    straight, straight_metrics = _run(plan, config, None, 6)
    first, _ = _run(plan, config, tmp_path, 3)
    state = pickle.loads((tmp_path / "iter_000003" / MODE_STATE).read_bytes())
    paused = [t for g in state["open"] for t, done in zip(g.tokens, g.done, strict=True) if t and not done]
    assert paused and state["queue"]  # responses half made, and finished groups waiting, at the checkpoint
    resumed, resumed_metrics = _run(plan, config, tmp_path, 3, resume=True)
    fields = ("data_row", "responses", "response_mask", "behaviour_log_probs", "token_policy_version",
              "partial_segments", "advantages")
    for a, b in zip(straight, first + resumed, strict=True):  # the same batches, to the bit
        for f in fields:
            assert torch.equal(a[f], b[f]), f
    for a, b in zip(straight_metrics[3:], resumed_metrics, strict=True):
        for key in ("reward_mean", "actor/pg_loss", "actor/grad_norm", "staleness/max", "partial/continued_responses"):
            assert a[key] == b[key], key


def test_simulator_prices_the_rounds_of_partial_rollouts():
    from hybridflow.simulator.schedule.pipeline import partial_rollout_workload
    from hybridflow.simulator.schedule.schedule import simulate
    from hybridflow.simulator.vocabulary.workload import Workload

    fixed = partial_rollout_workload(Workload(prompts=4, prompt_len=16, response_len=100), budget=30)
    # 100 tokens: segments 30, 30, 30, 10 after prefixes 0, 30, 60, 90, one batch's in a round; steps 0-9 decode
    # all four (mean prefix 45), steps 10-29 the three of 30 tokens (mean prefix 30): 16 + (10·45 + 20·30) / 30
    assert (fixed.prompts, fixed.response_len, fixed.prompt_len) == (16, 30, 16 + 35)
    assert fixed.prefill_len == 16 + 45  # the prefill on the segments' own prompts: the mean prefix of 0, 30, 60, 90
    assert fixed.response_lengths.sample(16) == [10] * 4 + [30] * 12  # the segments themselves, as a call draws them
    # a batch of 2 × 2 responses draws 10, 10, 10 and the longest, 40 (a generate call's sample: the tail it
    # meets); budget 20: segments 10, 10, 10, 20, 20 (prefixes 0, 0, 0, 0, 20) — 5 rows, 3 groups of 2 wide;
    # steps 0-9 decode all five (mean prefix 4), steps 10-19 the two of 20 (mean prefix 10): 16 + (40 + 100) / 20
    skewed = Workload(prompts=2, samples_per_prompt=2, prompt_len=16,
                      response_lengths={"histogram": {"lengths": [10, 40], "counts": [3, 1]}})
    round_ = partial_rollout_workload(skewed, budget=20)
    assert (round_.prompts, round_.response_len, round_.prompt_len) == (3, 20, 16 + 7)
    assert round_.prefill_len == 16 + 4  # prefixes 0, 0, 0, 0, 20
    assert round_.response_lengths.sample(5) == [10, 10, 10, 20, 20]
    tail = Workload(prompts=64, prompt_len=16, response_lengths={"mean": 128, "max": 1024})
    rounds = partial_rollout_workload(tail, budget=256)
    assert rounds.response_len == 256 and rounds.response_lengths.longest == 256
    tokens = sum(tail.response_lengths.sample(tail.sequences))  # the batch's, as a generate call draws them
    assert abs(rounds.sequences * rounds.mean_response_len - tokens) / tokens < 0.02  # the same tokens, re-cut
    plan = async_plan("async", ParallelConfig(dp=1), max_staleness=4)
    plan = plan.model_copy(update={"workload": tail})
    whole, partial = (simulate(plan, partial_rollout_tokens=b).op_seconds() for b in (None, 256))
    assert whole["generate"] != partial["generate"]  # the rollout repriced as the round
    # the weights move before every round (each iteration), not every k = 4 iterations
    assert partial["weight_sync"] == pytest.approx(4 * whole["weight_sync"], rel=1e-9)
    for op in whole.keys() - {"generate", "weight_sync"}:  # (to the rounding of times scheduled around another generate)
        assert partial[op] == pytest.approx(whole[op], rel=1e-9), op


def test_bench_refuses_bad_arguments_in_one_line():
    from hybridflow.tools.bench.partial_rollouts import main

    for argv, says in [(["--budget", "512"], "below --response-len 512"), (["--iterations", "2"], "at least 3"),
                       (["--temperature", "0"], "above 0"), (["--samples", "1"], "at least 2"),
                       (["--mean", "600"], "--mean 600 must lie between"), (["--staleness", "1"], "at least 2")]:
        with pytest.raises(HflowError, match=says):
            main(argv)
