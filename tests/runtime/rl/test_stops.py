"""Stop strings (`sampling.stop`, `run --stop`): a response ends at the token that completes the first stop
string; later tokens are masked out of the response and the sequence."""

import torch

from hybridflow.runtime.controller.batch import Batch
from hybridflow.runtime.rl.stops import cut_at_stops
from hybridflow.runtime.tasks.tokenizer import CharTokenizer


def _rollout(tok, texts, width=8, prompt=3):
    rows = [tok.encode(t)[:width] for t in texts]
    responses = torch.tensor([r + [tok.pad_id] * (width - len(r)) for r in rows])
    rmask = torch.tensor([[1] * len(r) + [0] * (width - len(r)) for r in rows])
    return Batch({"responses": responses, "response_mask": rmask,
                  "attention_mask": torch.cat([torch.ones(len(rows), prompt, dtype=torch.long), rmask], 1)})


def test_responses_end_at_the_first_stop_string():
    tok = CharTokenizer()
    batch = cut_at_stops(_rollout(tok, ["12.3456", "789", "4a5b6"]), tok, ["a", "."])
    assert tok.decode_responses(batch["responses"], batch["response_mask"]) == ["12.", "789", "4a"]
    assert batch["response_mask"].sum(-1).tolist() == [3, 3, 2]
    assert batch["attention_mask"].sum(-1).tolist() == [6, 6, 5]  # the prompt's 3 and the kept response
    same = _rollout(tok, ["12.3456"])
    assert cut_at_stops(same, tok, [])["response_mask"].sum().item() == 7  # no stop strings: untouched
