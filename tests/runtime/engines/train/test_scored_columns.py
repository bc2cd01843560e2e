"""`score_width`: a trainer that reads only the responses' log-probs runs the LM head and the log-softmax
from the first position any row needs (as TRL's `logits_to_keep`), with the same numbers in the columns
it reads (to float rounding: the head's matmul has fewer rows) — packed micro-batches and general
(non-contiguous) masks alike — and the same step."""

import torch

from hybridflow.runtime.engines.rollout.generation import left_pad
from hybridflow.runtime.engines.train.fsdp.engine import FsdpEngine
from hybridflow.runtime.models.decoder import CausalLM, positions_from_mask
from hybridflow.simulator.vocabulary.model import model_preset

R = 4


def _engine(seed=0):
    torch.manual_seed(seed)
    return FsdpEngine(CausalLM(model_preset("tiny").decoder_config(num_hidden_layers=2)), micro_batch_size=2)


def _batch(contiguous=True):
    prompts, _ = left_pad([[5, 6, 7, 8, 9, 10], [11, 12, 13], [14, 15, 16, 17]])
    pmask = (prompts != 0).long()
    responses = torch.tensor([[20, 21, 2, 0], [22, 23, 24, 25], [26, 2, 0, 0]])
    rmask = torch.tensor([[1, 1, 1, 0], [1, 1, 1, 1], [1, 1, 0, 0]])
    ids, mask = torch.cat([prompts, responses], 1), torch.cat([pmask, rmask], 1)
    if not contiguous:  # a hole inside a row: the engine cannot pack it and runs the masked batch
        mask[1, 5] = 0
    return {"input_ids": ids, "attention_mask": mask, "position_ids": positions_from_mask(mask)}


def test_log_probs_of_the_scored_columns_are_unchanged_and_the_head_sees_fewer_positions():
    engine = _engine()
    seen = []
    engine.model.lm_head.register_forward_hook(lambda m, args, out: seen.append(args[0].shape[1]))
    for contiguous in (True, False):
        batch = _batch(contiguous)
        seen.clear()
        full = engine.compute_log_probs(batch)["log_probs"]
        full_positions = sum(seen)
        seen.clear()
        scored = engine.compute_log_probs(batch, score_width=R)["log_probs"]
        torch.testing.assert_close(scored[:, -R:], full[:, -R:], rtol=0, atol=1e-6)
        assert sum(seen) < full_positions


def test_a_training_step_reading_the_responses_is_the_same_step():
    def loss(out, micro):
        return -(out["log_probs"][:, -R:] * micro["attention_mask"][:, -R:]).sum() / 10 + \
            out["entropy"][:, -R:].mean() * 0.01

    a, b = _engine(), _engine()
    batch = _batch()
    ma = a.train_step(batch, loss)
    mb = b.train_step(batch, loss, score_width=R)
    assert abs(ma["loss"] - mb["loss"]) < 1e-6 and abs(ma["grad_norm"] - mb["grad_norm"]) < 1e-5
    for (n, pa), (_, pb) in zip(a.model.named_parameters(), b.model.named_parameters(), strict=True):
        torch.testing.assert_close(pa, pb, rtol=0, atol=1e-6, msg=n)
