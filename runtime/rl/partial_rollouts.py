"""Partial rollouts in the `async` mode (run config `async_mode.partial_rollout_tokens`: the budget b).

Each round (one refill of the rollout devices, rl/modes/streaming.py) generates at most b new tokens per
response; a response that has neither ended (EOS) nor reached `response_len` is paused, kept here, and
continued first in the next round: its prompt plus the tokens generated so far is the prompt of the next
`generate` call (the worker's `max_new_tokens` is b: trainer.py), whose new tokens are appended. So a long
response no longer holds its whole chunk back — the round ends after b decode steps, and the rollout
devices' next round continues it beside new prompts at a fuller batch (AReaL's interruptible generation,
verl's and slime's partial rollouts).

With imposed lengths (a benchmark's FORCED_LENGTH_FIELD column, engines/rollout/generation.py) a row's call
asks for its remaining tokens and the row ends at its length, an EOS inside it not ending it.

Per token the buffer keeps the sampler's log-prob (the behaviour policy's: the weights that generated
that token) and that policy's version. A prompt group enters the queue when all its responses have ended;
its rows then carry `behaviour_log_probs` per token (the actor's loss corrects each token for its own
generating policy), `token_policy_version` per token, `policy_version` per row = the oldest token's
(staleness is counted from it: the queue drops a group whose oldest token is more than k updates old) and
`partial_segments` (the generate calls that made the row; > 1: continued).

Staleness: when a round would continue a response whose oldest token is more than k updates behind the
version the round's groups are trained at (at the earliest), it can no longer be trained within the
bound — its tokens are discarded and it is regenerated from its prompt by the newest weights (counted in `partial/restarted_responses`; so is a
finished response of a group still open), so its group, and every prompt, is still trained once.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

import torch

from hybridflow.runtime.controller.batch import Batch
from hybridflow.runtime.engines.rollout.generation import FORCED_LENGTH_FIELD, left_pad
from hybridflow.runtime.models.decoder import positions_from_mask


@dataclass
class OpenGroup:
    """A prompt group whose responses are not all finished: per row the tokens so far, their log-probs and versions."""

    prompts: Batch  # the group's rows as drawn (prompt_ids / prompt_mask, data_row, the prompt's columns)
    tokens: list[list[int]]
    logprobs: list[list[float]]
    versions: list[list[int]]
    done: list[bool]
    segments: list[int]  # generate calls per row
    in_flight: bool = False

    @classmethod
    def new(cls, prompts: Batch) -> OpenGroup:
        n = len(prompts)
        return cls(prompts, [[] for _ in range(n)], [[] for _ in range(n)], [[] for _ in range(n)], [False] * n,
                   [0] * n)

    def open_rows(self) -> list[int]:
        return [i for i, d in enumerate(self.done) if not d]


@dataclass
class PartialRollouts:
    """The buffer of open groups, in the order they were first launched."""

    budget: int  # new tokens per response per round
    response_len: int  # a response's whole budget (it ends there, as an unpartitioned one does)
    eos_ids: list[int]
    pad_id: int = 0
    open: deque[OpenGroup] = field(default_factory=deque)
    flights: deque[list[tuple[OpenGroup, int]]] = field(default_factory=deque)  # each launched chunk's rows
    restarted: int = 0  # responses regenerated from their prompt (too stale to continue)

    def open_responses(self) -> int:
        return sum(len(g.open_rows()) for g in self.open)

    def restart_stale(self, version: int, max_staleness: int) -> int:
        """Discard the tokens of every response of a waiting group (finished or not) whose oldest token is more
        than `max_staleness` versions behind `version`; they start again from their prompts. Returns how many."""
        n = 0
        for g in self.open:
            for i in range(len(g.done)):
                if g.versions[i] and version - g.versions[i][0] > max_staleness:
                    g.tokens[i], g.logprobs[i], g.versions[i], g.done[i] = [], [], [], False
                    n += 1
        self.restarted += n
        return n

    def launch(self, groups: list[OpenGroup]) -> Batch:
        """The prompts of one generate call: every open row of `groups` (its prompt + tokens so far), left-padded;
        with imposed lengths (FORCED_LENGTH_FIELD) each row's remaining tokens."""
        rows, seqs, left = [], [], []
        for g in groups:
            g.in_flight = True
            ids, mask = g.prompts["prompt_ids"], g.prompts["prompt_mask"]
            for i in g.open_rows():
                rows.append((g, i))
                seqs.append(ids[i][mask[i].bool()].tolist() + g.tokens[i])
                if FORCED_LENGTH_FIELD in g.prompts:
                    left.append(int(g.prompts[FORCED_LENGTH_FIELD][i]) - len(g.tokens[i]))
        self.flights.append(rows)
        ids, mask = left_pad(seqs, self.pad_id)
        out = {"prompt_ids": ids, "prompt_mask": mask}
        if left and len(left) == len(rows):
            out[FORCED_LENGTH_FIELD] = torch.tensor(left, dtype=torch.long)
        return Batch(out)

    def absorb(self, out: Batch) -> list[Batch]:
        """The oldest launched call's output appended to its rows; returns the groups now finished, as batches."""
        rows = self.flights.popleft()
        eos = set(self.eos_ids)
        for k, (g, i) in enumerate(rows):
            n = int(out["response_mask"][k].sum())
            new = out["responses"][k, :n].tolist()[: self.response_len - len(g.tokens[i])]
            g.tokens[i] += new
            g.logprobs[i] += out["behaviour_log_probs"][k, :len(new)].tolist()
            g.versions[i] += [int(out["policy_version"][k])] * len(new)
            g.segments[i] += 1
            if FORCED_LENGTH_FIELD in g.prompts:  # an imposed length: EOS does not end it, its length does
                g.done[i] = len(g.tokens[i]) >= min(self.response_len, int(g.prompts[FORCED_LENGTH_FIELD][i]))
            else:
                g.done[i] = (bool(new) and new[-1] in eos) or len(g.tokens[i]) >= self.response_len \
                    or n < out["responses"].shape[1]  # ended before the call's budget: an EOS
        finished = []
        for g in {id(g): g for g, _ in rows}.values():
            g.in_flight = False
            if all(g.done):
                self.open.remove(g)
                finished.append(self.batch(g))
        return finished

    def batch(self, g: OpenGroup) -> Batch:
        """A finished group as the rollout batch a single generate call gives, `response_len` wide, plus the
        per-token versions and segment counts."""
        n, r = len(g.prompts), self.response_len
        resp = torch.full((n, r), self.pad_id, dtype=torch.long)
        mask = torch.zeros(n, r, dtype=torch.long)
        logp = torch.zeros(n, r, dtype=torch.float32)
        vers = torch.zeros(n, r, dtype=torch.long)
        for i in range(n):
            m = len(g.tokens[i])
            resp[i, :m] = torch.tensor(g.tokens[i], dtype=torch.long)
            mask[i, :m] = 1
            logp[i, :m] = torch.tensor(g.logprobs[i], dtype=torch.float32)
            vers[i, :m] = torch.tensor(g.versions[i], dtype=torch.long)
            vers[i, m:] = max(g.versions[i])  # padding: the newest (never read; keeps the row's minimum real)
        attention = torch.cat([g.prompts["prompt_mask"].long(), mask], dim=1)
        tensors = dict(g.prompts.tensors.items())
        tensors.update(input_ids=torch.cat([g.prompts["prompt_ids"], resp], dim=1), attention_mask=attention,
                       position_ids=positions_from_mask(attention), responses=resp, response_mask=mask,
                       behaviour_log_probs=logp, token_policy_version=vers,
                       policy_version=torch.tensor([min(v) for v in g.versions], dtype=torch.long),
                       partial_segments=torch.tensor(g.segments, dtype=torch.long))
        return Batch(tensors, g.prompts.non_tensors, g.prompts.meta)


def partial_stats(batch: Batch, version: int, buffer: PartialRollouts) -> dict[str, float]:
    """A trained batch's partial-rollout metrics: responses continued, segments, per-token staleness; the buffer."""
    segments = batch["partial_segments"].float()
    mask = batch["response_mask"].bool()
    token_staleness = (version - batch["token_policy_version"])[mask].float()
    return {"partial/continued_responses": float((segments > 1).sum()), "partial/segments_mean": segments.mean().item(),
            "partial/token_staleness_mean": token_staleness.mean().item() if token_staleness.numel() else 0.0,
            "partial/open_responses": float(buffer.open_responses()),
            "partial/restarted_responses": float(buffer.restarted)}
