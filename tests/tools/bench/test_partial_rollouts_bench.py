"""The partial-rollouts benchmark's `--predict`: on the CPU profile the simulator prices partial rollouts as no
gain where the trainers are the longer side, and as a gain only where the rollout's tail is longer (docs/rl.md):
the bench's own workload among them."""

import json

from hybridflow.tools.bench.partial_rollouts import main


def test_partial_rollouts_pay_only_where_the_rollout_is_the_longer_side(capsys):
    assert main(["--predict", "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)
    assert rows
    for r in rows:
        rollout, trainers = r["async"]["rollout_trainers"]
        if trainers > rollout:  # training-bound: the shorter rollout saves nothing but a controller gap or two (async
            assert r["speedup"] <= 1.05, r  # launches a batch as two calls, a round is one), the per-round sync costs
        if r["speedup"] > 1.05:  # a gain only where the round's tail, ending at the budget, shortens the longer side
            assert rollout > trainers and r["partial"]["rollout_trainers"][0] < rollout, r
    default = next(r for r in rows if (r["prompts"], r["mean"], r["longest"]) == (4, 64, 512))
    assert default["speedup"] > 1.05, default  # the bench's workload (4 prompts × 4, mean 64, max 512)
    assert {r["speedup"] > 1.0 for r in rows} == {True, False}  # both kinds of shape are in the sweep


def test_imposed_lengths_give_every_batch_the_whole_tail_however_the_prompts_are_drawn():
    from hybridflow.simulator.vocabulary.lengths import LengthDistribution
    from hybridflow.tools.bench.partial_rollouts import SHORTEST, ImposedLengths

    dist = LengthDistribution.max_entropy(64, 512, shortest=SHORTEST)
    whole = ImposedLengths(dist, 16, seed=0).next(48)
    drawn = ImposedLengths(dist, 16, seed=0)
    pieces = [drawn.next(n) for n in (8, 4, 20, 16)]  # a mode draws a chunk at a time
    assert [int(x) for p in pieces for x in p] == whole.tolist()
    for b in range(3):  # each batch's worth: the distribution's quantiles, the longest among them, shuffled
        block = whole[16 * b:16 * (b + 1)].tolist()
        assert sorted(block) == dist.sample(16) and max(block) == 512 and block != sorted(block)
    assert ImposedLengths(dist, 16, seed=1).next(16).tolist() != whole[:16].tolist()


def test_the_tail_past_the_answer_is_out_of_the_loss_and_in_the_sequence():
    import torch

    from hybridflow.runtime.controller.batch import Batch
    from hybridflow.tools.bench.partial_rollouts import tail_out_of_loss

    eos = 2
    responses = torch.tensor([[5, 6, eos, 7, eos, 8], [5, 6, 7, 8, 0, 0], [eos, 9, 9, 0, 0, 0]])
    mask = torch.tensor([[1, 1, 1, 1, 1, 1], [1, 1, 1, 1, 0, 0], [1, 1, 1, 0, 0, 0]])
    attention = torch.cat([torch.ones(3, 2, dtype=torch.long), mask], 1)
    out = tail_out_of_loss(Batch({"responses": responses, "response_mask": mask, "attention_mask": attention}), [eos])
    assert out["response_mask"].tolist() == [[1, 1, 1, 0, 0, 0], [1, 1, 1, 1, 0, 0], [1, 0, 0, 0, 0, 0]]
    assert torch.equal(out["attention_mask"], attention)


def test_a_cache_that_holds_the_tiny_model_prices_its_tail_cheaper(tmp_path, capsys):
    """A profile that names its core's cache share (8 MiB here) prices the tiny model's decode steps of a few rows
    from the cache, its 4 MB of fp32 weights in it: the tail costs less and partial rollouts gain less than on the
    same profile without; the p256 model's 17 MB outgrow it, and its tail still pays for them."""
    from hybridflow.simulator.calibration.profile import resolve_profile

    shipped = resolve_profile("cpu-2core")
    assert shipped.fingerprint.cache_bytes == 0  # measured before profiles recorded it: priced with no cache
    cached = shipped.model_copy(update={"fingerprint": shipped.fingerprint.model_copy(update={"cache_bytes": 8 << 20})})
    path = str(cached.save(tmp_path / "cached.json"))

    def default_row(*args):
        assert main(["--predict", "--json", *args]) == 0
        rows = json.loads(capsys.readouterr().out)
        return next(r for r in rows if (r["prompts"], r["mean"], r["longest"]) == (4, 64, 512))

    plain, tiny, p256 = default_row(), default_row("--profile", path), default_row("--profile", path, "--model", "p256")
    assert tiny["async"]["rollout_trainers"][0] < plain["async"]["rollout_trainers"][0]
    assert tiny["speedup"] < plain["speedup"]
    rollout, trainers = p256["async"]["rollout_trainers"]
    assert rollout > trainers and p256["speedup"] > 1.2, p256
