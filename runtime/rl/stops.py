"""Stop strings (`sampling.stop`): a response ends at the first of them, as at an EOS — the text up to and
including it is the response; its later tokens are masked out (`response_mask`, `attention_mask`), so no
loss, log-prob, value or score reads them and the reward sees the text cut there. Applied to every rollout
on the driver, whatever the engine, so the native engine and vLLM stop alike."""

from __future__ import annotations

from collections.abc import Sequence

from hybridflow.runtime.controller.batch import Batch


def _has_stop(text: str, stops: Sequence[str]) -> bool:
    return any(s in text for s in stops)


def cut_at_stops(batch: Batch, tok, stops: Sequence[str]) -> Batch:
    """`batch` (a rollout) with each response masked after the token that completes its first stop string."""
    if not stops:
        return batch
    responses, rmask = batch["responses"], batch["response_mask"].clone()
    amask = batch["attention_mask"].clone()
    prompt_width = amask.shape[1] - responses.shape[1]
    changed = False
    for i, row in enumerate(responses.tolist()):
        n = int(rmask[i].sum())  # the real tokens: a prefix of the row
        if n == 0 or not _has_stop(tok.decode(row[:n]), stops):
            continue
        lo, hi = 1, n  # the fewest tokens whose text holds a stop string (holding one is monotone in the prefix)
        while lo < hi:
            mid = (lo + hi) // 2
            lo, hi = (lo, mid) if _has_stop(tok.decode(row[:mid]), stops) else (mid + 1, hi)
        if lo < n:
            rmask[i, lo:] = 0
            amask[i, prompt_width + lo:] = 0
            changed = True
    if changed:
        batch["response_mask"], batch["attention_mask"] = rmask, amask
    return batch
