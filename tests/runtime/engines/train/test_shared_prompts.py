"""Shared prompts (engines/shared_prompts.py): a GRPO-style batch, each prompt sampled several times, runs one
packed row per prompt group with a block mask. The responses' log-probs and entropies equal those of the
padded, row-packed pass to fp32 rounding, a training step is the same step, the pass computes fewer
tokens, and micro-batches and data-parallel shards keep each prompt's rows together."""

import torch

from hybridflow.runtime.engines.rollout.generation import left_pad
from hybridflow.runtime.engines.train.fsdp.engine import FsdpEngine
from hybridflow.runtime.engines.train.fsdp.shared_prompts import (
    micro_batch_rows,
    prompt_groups,
    share_prompts,
)
from hybridflow.runtime.models.decoder import CausalLM, positions_from_mask
from hybridflow.runtime.rl.batches import dp_balanced_order
from hybridflow.simulator.vocabulary.model import model_preset

R = 6  # response columns


def _batch(groups=4, samples=4, seed=0):
    """`groups` prompts of different lengths, each repeated `samples` times, with responses of different
    lengths (right-padded): the layout the rollout hands the trainer."""
    g = torch.Generator().manual_seed(seed)
    prompts = [torch.randint(3, 60, (int(torch.randint(2, 9, (), generator=g)),), generator=g).tolist()
               for _ in range(groups)]
    p, _ = left_pad([x for x in prompts for _ in range(samples)])
    n = groups * samples
    response_mask = (torch.arange(R)[None] < torch.randint(1, R + 1, (n, 1), generator=g)).long()
    responses = torch.randint(3, 60, (n, R), generator=g) * response_mask
    ids, mask = torch.cat([p, responses], 1), torch.cat([(p != 0).long(), response_mask], 1)
    return {"input_ids": ids, "attention_mask": mask, "position_ids": positions_from_mask(mask),
            "response_mask": response_mask}


def _engine(sharing: bool, temperature: float = 1.0) -> FsdpEngine:
    torch.manual_seed(1)  # GQA and q/k/v biases: the Qwen2 shape's attention
    cfg = model_preset("tiny").decoder_config(num_hidden_layers=2, num_key_value_heads=2, qkv_bias=True)
    engine = FsdpEngine(CausalLM(cfg), micro_batch_size=8, temperature=temperature)
    engine.prompt_sharing = sharing
    return engine


def _loss(out, micro):
    m = micro["response_mask"]
    lp, ent = out["log_probs"][:, -R:], out["entropy"][:, -R:]
    return -(lp * m).sum() / m.sum() + 0.01 * (ent * m).sum() / m.sum()


def test_responses_log_probs_and_entropy_equal_the_padded_pass():
    batch = _batch()
    shared, padded = _engine(True, temperature=0.7), _engine(False, temperature=0.7)
    a = shared.compute_log_probs(batch, entropy=True, score_width=R)
    b = padded.compute_log_probs(batch, entropy=True, score_width=R)
    m = batch["response_mask"].bool()
    for key in ("log_probs", "entropy"):
        torch.testing.assert_close(a[key][:, -R:][m], b[key][:, -R:][m], rtol=1e-5, atol=1e-5)
        assert (a[key][:, -R:][~m] == 0).all() and (a[key][:, :-R] == 0).all()  # padding and prompt: 0


def test_a_training_step_with_shared_prompts_is_the_same_step():
    batch = _batch(seed=1)
    a, b = _engine(True), _engine(False)
    ma = a.train_step(batch, _loss, score_width=R, token_weights="response_mask")
    mb = b.train_step(batch, _loss, score_width=R, token_weights="response_mask")
    assert abs(ma["loss"] - mb["loss"]) < 1e-5 and abs(ma["grad_norm"] - mb["grad_norm"]) < 1e-5
    for (n, pa), (_, pb) in zip(a.model.named_parameters(), b.model.named_parameters(), strict=True):
        torch.testing.assert_close(pa, pb, rtol=0, atol=1e-6, msg=n)


def test_each_prompt_is_computed_once_and_the_padding_is_gone():
    batch = _batch(groups=3, samples=5)
    ids, mask = batch["input_ids"], batch["attention_mask"]
    packed = share_prompts(ids, mask, batch["position_ids"], ids.shape[1] - R)
    assert packed.input_ids.shape[0] == 3  # one row per prompt
    prompt_tokens = mask[:, :-R].sum(-1).view(3, 5)[:, 0].sum()
    assert packed.real_tokens == int(prompt_tokens + batch["response_mask"].sum())
    assert packed.input_ids.numel() < ids.numel()
    # no prompt repeats: nothing to share, the engine's row packing runs instead
    distinct = _batch(groups=6, samples=1)
    assert share_prompts(distinct["input_ids"], distinct["attention_mask"], None, distinct["input_ids"].shape[1] - R) is None


def test_micro_batches_and_dp_shards_keep_each_prompts_rows_together():
    batch = _batch(groups=4, samples=4, seed=2)
    ids, mask = batch["input_ids"], batch["attention_mask"]
    groups = prompt_groups(ids, mask, ids.shape[1] - R)
    rows = micro_batch_rows(ids, mask, 8, ids.shape[1] - R)
    assert sorted(torch.cat(rows).tolist()) == list(range(16)) and all(r.numel() <= 8 for r in rows)
    assert all(len(set(groups[r].tolist())) * 4 == r.numel() for r in rows)  # whole groups only
    # the driver deals whole groups to the ranks, balanced by their tokens
    order = dp_balanced_order(mask, 2, group=4)
    assert sorted(order.tolist()) == list(range(16))
    for shard in order.view(2, -1):
        assert all(int((groups[shard] == g).sum()) in (0, 4) for g in range(4))
    assert dp_balanced_order(mask, 2, group=3).tolist() == dp_balanced_order(mask, 2).tolist()  # 16 % 6: by rows


def test_rows_of_a_prompt_apart_in_one_micro_batch_give_the_same_log_probs():
    """One micro-batch of the whole batch keeps the caller's row order: a prompt's rows interleaved with
    others' are shared where they are neighbours and computed again where not — the same numbers."""
    batch = _batch(groups=3, samples=4, seed=3)
    perm = torch.randperm(12, generator=torch.Generator().manual_seed(0))
    batch = {k: v[perm] for k, v in batch.items()}
    a = _engine(True).compute_log_probs(batch, micro_batch_size=12, score_width=R)["log_probs"]
    b = _engine(False).compute_log_probs(batch, micro_batch_size=12, score_width=R)["log_probs"]
    m = batch["response_mask"].bool()
    torch.testing.assert_close(a[:, -R:][m], b[:, -R:][m], rtol=1e-5, atol=1e-5)


def test_a_sliding_window_shares_prompts_only_where_the_rows_stay_inside_it():
    """The block mask has no window: an engine shares prompts when every row fits in the shortest window (the
    window then hides nothing) and runs its row packing otherwise — the same rule the simulator prices."""
    from hybridflow.simulator.vocabulary.model import ModelSpec

    batch = _batch()
    columns = batch["input_ids"].shape[1]
    for window, shares in ((columns, True), (columns - 1, False)):
        torch.manual_seed(1)
        cfg = model_preset("tiny").decoder_config(num_hidden_layers=2, family="mistral", sliding_window=window)
        engine = FsdpEngine(CausalLM(cfg), micro_batch_size=8)
        assert engine._shares_prompts(R, columns) is shares
        assert ModelSpec.from_decoder_config(cfg, "w").attention_window == window
        reference = FsdpEngine(CausalLM(cfg), micro_batch_size=8)
        reference.prompt_sharing = False
        reference.model.load_state_dict(engine.model.state_dict())
        a = engine.compute_log_probs(batch, entropy=False, score_width=R)["log_probs"][:, -R:]
        b = reference.compute_log_probs(batch, entropy=False, score_width=R)["log_probs"][:, -R:]
        m = batch["response_mask"].bool()
        torch.testing.assert_close(a[m], b[m], rtol=1e-5, atol=1e-5)
