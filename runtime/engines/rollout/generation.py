"""Native batched generation with a preallocated KV cache (runs on CPU and GPU, any tp size).

One prefill over the left-padded prompts, then one token per step for the whole batch; the
prefix is never recomputed. Sampling: greedy, temperature, top-k, top-p (nucleus), stop on EOS,
at most `max_new_tokens`. Returns the response tokens, the log-probability of each sampled token
and a mask of the real (pre-EOS, EOS included) positions. On the fused path (fast_decode.py)
rows that have emitted EOS leave the batch (a quarter at a time, one copy of the live rows'
cache), so a rollout whose responses end at different lengths computes only the live ones.

Log-probs are taken from `log_softmax(logits / temperature)` (temperature 1 when greedy), before
top-k / top-p truncation: the distribution a trainer recomputes from the same logits.

Determinism: all randomness comes from the `generator` passed in: one uniform per row of the full
batch at every step (so dropping finished rows changes no other row's draw). Tensor-parallel ranks see the
same (replicated) logits, so with the same seeded generator every rank draws the same tokens.
"""

from __future__ import annotations

from dataclasses import dataclass, fields

import torch
from pydantic import BaseModel, ConfigDict, Field, NonNegativeInt, PositiveInt, field_validator

from hybridflow.runtime.engines.cpu_decode import FusedDecoder, KeptMemory, Picked, pick_tokens, supports
from hybridflow.runtime.engines.phase_clock import PhaseClock
from hybridflow.runtime.models.decoder import KVCache, attention_bias_mask, positions_from_mask
from hybridflow.simulator.errors import HflowError

# A rollout batch's optional column of per-row response lengths, each at least 1 (`generate`'s `lengths`):
# a benchmark's imposed lengths (tools/bench/partial_rollouts.py)
FORCED_LENGTH_FIELD = "forced_response_len"


class SamplingParams(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    max_new_tokens: PositiveInt = 32
    temperature: float = Field(1.0, ge=0.0)  # 0 means greedy
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    top_k: NonNegativeInt = 0  # 0 = off
    greedy: bool = False
    eos_token_id: int | list[int] | None = None  # None: never stop early
    pad_token_id: int = 0  # fills the response after EOS

    @field_validator("eos_token_id")
    @classmethod
    def _eos_list(cls, v):
        return [v] if isinstance(v, int) else v

    @property
    def is_greedy(self) -> bool:
        return self.greedy or self.temperature == 0.0


@dataclass
class Rollout:
    """A batch of prompts and their sampled responses (B rows; P prompt and R response columns)."""

    prompt_ids: torch.Tensor  # [B, P] left-padded
    prompt_mask: torch.Tensor  # [B, P] 1 = real token
    response: torch.Tensor  # [B, R] pad after EOS
    response_logprobs: torch.Tensor  # [B, R] fp32, 0 where masked
    response_mask: torch.Tensor  # [B, R] 1 up to and including EOS

    @property
    def tokens(self) -> torch.Tensor:  # [B, P+R]
        return torch.cat([self.prompt_ids, self.response], dim=1)

    @property
    def attention_mask(self) -> torch.Tensor:  # [B, P+R]
        return torch.cat([self.prompt_mask, self.response_mask], dim=1)

    @property
    def position_ids(self) -> torch.Tensor:  # [B, P+R], as used during generation
        return positions_from_mask(self.attention_mask)

    @property
    def response_lengths(self) -> torch.Tensor:  # [B]
        return self.response_mask.sum(-1)

    def to_tensordict(self):
        """The rollout as a TensorDict (batch size [B]) with tokens/attention_mask/position_ids added."""
        from hybridflow.runtime.controller.tensordict_import import TensorDict

        data = {f.name: getattr(self, f.name) for f in fields(self)}
        data.update(tokens=self.tokens, attention_mask=self.attention_mask, position_ids=self.position_ids)
        return TensorDict(data, batch_size=[self.prompt_ids.shape[0]])


# ---- sampling ---------------------------------------------------------------------------------


def _uniforms(n: int, generator: torch.Generator | None, rows: torch.Tensor | None, batch: int,
              device: torch.device) -> torch.Tensor:
    """One uniform in [0, 1) per row [n, 1], fp32. `rows` (of a full batch of `batch`): drawn for
    the full batch and these rows taken, so a row's draw does not depend on which other rows are
    still generating. Drawn on the generator's device (e.g. one CPU generator for every rank,
    whatever its GPU)."""
    device = device if generator is None else generator.device
    u = torch.rand(n if rows is None else batch, 1, dtype=torch.float32, device=device, generator=generator)
    return u if rows is None else u[rows.to(device)]


def _draw(logits: torch.Tensor, generator: torch.Generator | None, rows: torch.Tensor | None = None,
          batch: int = 0) -> torch.Tensor:
    """One index per row from softmax(logits): [B]. Inverse CDF: a row's uniform u, scaled to the
    row's total mass, picks the first index whose cumulative probability exceeds it — probability
    p_i for index i, to the fp32 rounding of the cumulative sum; an index of probability 0 is never
    drawn. One uniform per row (`_uniforms`): noise per vocabulary entry (an exponential race,
    Gumbel-max) is most of a sampled step's sampling at a large vocabulary."""
    cdf = torch.softmax(logits, dim=-1, dtype=torch.float32).cumsum_(-1)  # fp32 sums whatever the logits' dtype
    u = _uniforms(cdf.shape[0], generator, rows, batch, cdf.device)
    total = cdf[:, -1:]
    # u < 1, but u · total can round up to total: keep the point below it, so that it falls in a
    # step of positive probability (an index past the last one would be out of range).
    point = torch.minimum(u.to(cdf.device) * total, total.nextafter(torch.zeros_like(total)))
    return torch.searchsorted(cdf, point, right=True).squeeze(1)


def _pick_c(logits: torch.Tensor, params: SamplingParams, generator: torch.Generator | None,
            rows: torch.Tensor | None, batch: int) -> tuple[torch.Tensor, torch.Tensor] | None:
    """`sample_tokens` in one call of the C kernels, or None where they do not apply (cpu_decode)."""
    return pick_tokens(logits, params.is_greedy, params.temperature, params.top_k, params.top_p,
                       lambda: _uniforms(logits.shape[0], generator, rows, batch, logits.device))  # `_draw`'s


def sample_tokens(logits: torch.Tensor, params: SamplingParams, generator: torch.Generator | None = None,
                  rows: torch.Tensor | None = None, batch: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Next tokens [B] and their log-probs [B] from fp32 logits [B, V]; `rows`/`batch`: these are
    rows `rows` of a batch of `batch` (see `_uniforms`). On CPU one C call (`_pick_c`), else torch's
    ops; the same rules either way."""
    picked = _pick_c(logits, params, generator, rows, batch)
    return picked if picked is not None else _sample_torch(logits, params, generator, rows, batch)


def _sample_torch(logits: torch.Tensor, params: SamplingParams, generator: torch.Generator | None,
                  rows: torch.Tensor | None, batch: int) -> tuple[torch.Tensor, torch.Tensor]:
    """`sample_tokens` in torch's ops (any device and dtype)."""
    if params.is_greedy:
        tokens = logits.argmax(-1)
        logp = torch.log_softmax(logits, dim=-1).gather(1, tokens[:, None]).squeeze(1)
        return tokens, logp
    if params.temperature != 1.0:
        logits = logits / params.temperature
    logp_all = torch.log_softmax(logits, dim=-1)
    vals = idx = None
    if 0 < params.top_k < logits.shape[-1]:  # fast path: only k candidates, already sorted
        vals, idx = logits.topk(params.top_k, dim=-1)
    if params.top_p < 1.0:
        if vals is None:
            vals, idx = logits.sort(dim=-1, descending=True)
        probs = torch.softmax(vals, dim=-1)
        # Drop a candidate when the ones before it already hold top_p of the mass (keeps the first).
        drop = probs.cumsum(-1) - probs > params.top_p
        vals = vals.masked_fill(drop, float("-inf"))
    if vals is None:
        tokens = _draw(logits, generator, rows, batch)
    else:
        tokens = idx.gather(1, _draw(vals, generator, rows, batch)[:, None]).squeeze(1)
    return tokens, logp_all.gather(1, tokens[:, None]).squeeze(1)


# ---- the engine -------------------------------------------------------------------------------


def check_left_padded(prompt_ids: torch.Tensor, mask: torch.Tensor) -> None:
    if prompt_ids.dim() != 2 or mask.shape != prompt_ids.shape:
        raise HflowError(f"prompt_ids {tuple(prompt_ids.shape)} and attention_mask {tuple(mask.shape)} must "
                         "both be [batch, prompt_len]")
    m = mask.long()
    if not bool((m[:, 1:] >= m[:, :-1]).all()) or not bool(m[:, -1].all()):
        raise HflowError("prompts must be left-padded (attention_mask 0…0 1…1 per row, non-empty); "
                         "pad on the left before generating")


class GenerationEngine:
    """Generates with any model shaped like `CausalLM`: `model(ids, attention_mask,
    position_ids, cache, last_only=True) -> logits [B, 1, V]` and `model.config.num_hidden_layers`."""

    def __init__(self, model: torch.nn.Module, fast_decode: bool = True, drop_finished: bool = True):
        self.model = model
        self.fast_decode = fast_decode  # fused module-free path where the model allows it (fast_decode.py)
        # On the fused path, rows that have emitted EOS leave the batch once a quarter of it has:
        # the rest of the rollout computes live rows only (Hugging Face `generate` computes every
        # row until the last one ends). Outputs are the same either way.
        self.drop_finished = drop_finished
        self.last_batch_sizes: list[int] = []  # rows computed at each decode step of the last call
        # seconds and work by phase (fuse_weights, prefill, decode, sample) for the step breakdown; off by default
        self.clock = PhaseClock()
        self.memory = KeptMemory()  # the C kernels' KV cache and packed weights, reused from call to call

    @torch.inference_mode()
    def generate(self, prompt_ids: torch.Tensor, attention_mask: torch.Tensor | None = None,
                 params: SamplingParams | None = None, generator: torch.Generator | None = None,
                 lengths: torch.Tensor | None = None) -> Rollout:
        """`lengths` [B] (optional): each row's response is exactly that many tokens (at most
        max_new_tokens): EOS does not end it (vLLM's per-request `max_tokens` with `ignore_eos`, how
        serving benchmarks impose output lengths); the sampling is unchanged."""
        params = params or SamplingParams()
        device = prompt_ids.device
        b, p = prompt_ids.shape
        r = params.max_new_tokens
        mask = torch.ones_like(prompt_ids) if attention_mask is None else attention_mask.to(device)
        check_left_padded(prompt_ids, mask)
        padded = not bool(mask.all())

        # Key validity for the whole run: prompt padding is False, every generated slot True.
        key_mask = torch.ones(b, p + r, dtype=torch.bool, device=device)
        key_mask[:, :p] = mask.bool()
        positions = positions_from_mask(mask)
        # Finished rows leave the batch on the fused path (its cache can drop rows; the module path's
        # cache, possibly tensor-parallel, keeps every row to the end).
        fused = self.fast_decode and supports(self.model, p + r)
        compact = fused and self.drop_finished
        args = (self.model, prompt_ids, key_mask if padded else None, positions, r, self.clock)
        step = _fused_steps(*args, self.memory, params.is_greedy) if fused else _module_steps(*args)
        logits = next(step)
        self.last_batch_sizes = []

        response = torch.full((b, r), params.pad_token_id, dtype=torch.long, device=device)
        logprobs = torch.zeros(b, r, dtype=torch.float32, device=device)
        eos = torch.tensor(params.eos_token_id or [], dtype=torch.long, device=device)
        stop_at = None if lengths is None else lengths.to(device).clamp(max=r)  # rows end there, not at EOS
        ends = bool(eos.numel()) or stop_at is not None  # rows can end before max_new_tokens
        resp_mask = torch.zeros(b, r, dtype=torch.long, device=device) if ends else \
            torch.ones(b, r, dtype=torch.long, device=device)
        finished = torch.zeros(b, dtype=torch.bool, device=device)
        alive = None  # the rows still in the batch (their original indices); None: all of them
        for t in range(r):
            with self.clock.span("sample"):
                tokens, logp = logits if isinstance(logits, Picked) else \
                    sample_tokens(logits.float(), params, generator, alive, b)
                rows = slice(None) if alive is None else alive
                response[rows, t] = tokens
                logprobs[rows, t] = logp
                keep = None
                if ends:  # rows that had finished before this step stay masked out
                    done = finished[rows]
                    resp_mask[rows, t] = (~done).long()
                    done |= torch.isin(tokens, eos) if stop_at is None else stop_at[rows] <= t + 1
                    finished[rows] = done
                    n_done = int(done.sum())  # the one host sync per step
                    if n_done < done.numel() and compact and n_done * 4 >= done.numel():
                        keep = (~done).nonzero().squeeze(1)  # a quarter finished: drop them (one KV copy)
                        alive = keep if alive is None else alive[keep]
            if ends and n_done == done.numel():  # every row has finished: the rest stays padding
                break
            if t + 1 < r:
                logits = step.send((tokens, keep))
                self.last_batch_sizes.append(len(logits.tokens) if isinstance(logits, Picked) else logits.shape[0])
        step.close()
        if ends:
            response.masked_fill_(resp_mask == 0, params.pad_token_id)
            logprobs.masked_fill_(resp_mask == 0, 0.0)
        return Rollout(prompt_ids=prompt_ids, prompt_mask=mask.long(), response=response,
                       response_logprobs=logprobs, response_mask=resp_mask)


def _count(clock: PhaseClock, rows: int, new: int, length: int, tokens: int | None = None) -> None:
    """A forward of `new` tokens per row for `rows` rows ending at cache length `length`: tokens (the
    matmuls' rows: `tokens` where fewer than rows × new, as a prefill without its padding), and the
    keys their attention reads (context), for the breakdown's FLOP count."""
    if not clock.enabled:
        return
    clock.count("tokens", rows * new if tokens is None else tokens)
    clock.count("context", rows * sum(range(length - new + 1, length + 1)))
    clock.count("calls", 1)


def _module_steps(model, prompt_ids, key_mask, positions, r, clock: PhaseClock):
    """Logits [B, V] of the prompt, then of each token sent in: through the model's modules."""
    b, p = prompt_ids.shape
    cache = KVCache(model.config.num_hidden_layers, p + r)
    with clock.span("prefill"):
        logits = model(prompt_ids, key_mask, positions, cache, last_only=True)[:, -1]
        _count(clock, b, p, p)
    tokens, _ = yield logits
    next_pos = positions[:, -1:] + 1
    length = p
    while True:  # every row to the end: the caller never asks to drop rows here
        length += 1
        with clock.span("decode"):
            logits = model(tokens[:, None], key_mask, next_pos, cache, last_only=True)[:, -1]
            _count(clock, b, 1, length)
        tokens, _ = yield logits
        next_pos = next_pos + 1


def _fused_steps(model, prompt_ids, key_mask, positions, r, clock: PhaseClock, memory: KeptMemory, greedy: bool):
    """The same as `_module_steps` through `FusedDecoder` (fast_decode.py): weights fused from the
    model as it is now, RoPE of every position of the run computed once, masks built once; `greedy`:
    where the decoder can, it yields each step's greedy pick (`Picked`) instead of its logits."""
    b, p = prompt_ids.shape
    with clock.span("fuse_weights"):  # with the cache allocation, masks and RoPE tables: once per call
        fused = FusedDecoder(model, b, p + r, memory=memory, greedy=greedy)
        dtype, device = fused.embed.dtype, prompt_ids.device
        prefill_mask = step_mask = None
        # additive masks (0 or dtype min); decode's has one row per (batch, kv head). The C kernels need none: their
        # prefill reads each row's real tokens and stores them from slot 0 (B·P² of mask for nothing)
        if key_mask is not None and fused.c is None:
            neg = torch.finfo(dtype).min
            prefill_mask = torch.zeros(b, 1, p, p, dtype=dtype, device=device).masked_fill_(
                ~attention_bias_mask(key_mask, p, 0), neg)
            step_mask = torch.zeros(b, 1, p + r, dtype=dtype, device=device).masked_fill_(~key_mask[:, None], neg)
            step_mask = step_mask.repeat_interleave(fused.kv_heads, dim=0)  # [B·Hkv, 1, P+R]
        step_positions = positions[:, -1] + torch.arange(1, r + 1, device=positions.device)[:, None]  # [R, B]
        rotations = fused.rotations(step_positions)  # [R, B, 1, head_dim/2]
    with clock.span("prefill"):
        real = None if key_mask is None else key_mask[:, :p].reshape(-1).nonzero().squeeze(1)
        logits = fused.prefill(prompt_ids, fused.rotations(positions), prefill_mask, real)
        _count(clock, b, p, p, None if real is None else len(real))
    tokens, keep = yield logits
    for t in range(r):
        with clock.span("decode"):
            if keep is not None:  # rows `keep` of the current batch go on; the others have finished
                fused.keep_rows(keep)
                tokens, rotations = tokens[keep], rotations[:, keep]
                if step_mask is not None:
                    step_mask = step_mask.unflatten(0, (-1, fused.kv_heads))[keep].flatten(0, 1)
            logits = fused.decode(tokens, rotations[t], step_mask)
            _count(clock, tokens.shape[0], 1, p + t + 1)
        tokens, keep = yield logits


def left_pad(sequences: list[list[int]], pad_token_id: int = 0,
             device: str | torch.device = "cpu") -> tuple[torch.Tensor, torch.Tensor]:
    """Token lists -> (ids [B, P], attention_mask [B, P]) left-padded to the longest."""
    if not sequences or any(len(s) == 0 for s in sequences):
        raise HflowError("every prompt needs at least one token; drop empty prompts before generating")
    p = max(len(s) for s in sequences)
    ids = torch.full((len(sequences), p), pad_token_id, dtype=torch.long)
    mask = torch.zeros(len(sequences), p, dtype=torch.long)
    for i, s in enumerate(sequences):
        ids[i, p - len(s):] = torch.tensor(s, dtype=torch.long)
        mask[i, p - len(s):] = 1
    return ids.to(device), mask.to(device)
