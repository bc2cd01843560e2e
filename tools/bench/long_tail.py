"""Long-tail benchmark: sequence packing with a token budget and token-balanced data-parallel ranks against the
padded path, on the same batch in the same run (issue 34).

A batch of GRPO-shaped sequences (prompts of 32-64 tokens, responses drawn from a long-tailed length
distribution whose maximum is about 8× its mean, in a seeded random order) goes to `--dp` gloo processes with
the tiny model, and each side runs what an iteration's training engine runs on it: the log-prob pass and one
optimizer step. The sides, interleaved repeat by repeat:

- padded: the rows as DP_COMPUTE cuts them (contiguous equal shares), micro-batches of `micro_batch_size`
  rows, each padded to its longest row (engines/train/packing.py: length buckets, the engine's path
  without a token budget);
- padded + balanced: the same, after the token-balanced row order (rl/batches.py dp_balanced_order);
- packed + balanced: that order, and micro-batches of at most micro_batch_size · seq_len real tokens, each
  one row of sequences with attention per sequence (engines/train/fsdp/packed.py).

tokens/s: the batch's real tokens (prompt + response) over the seconds of the pass and step (the slowest
rank; the step's collectives end together); the median over repeats.

Predicted: the simulator's price of the same work (the log-prob forward and one optimizer step of the batch on
dp devices, the distribution's workload with the batch's mean prompt length), each side with its own token
budget (None: rows padded to their length bucket's longest; packed: the engine's budget), by the profile's
calibrated cost model (`--profile`, default cpu-2core). As in sim_accuracy.py the profile's own reference
jobs are re-timed before and after the measurement (runtime/measure/profile_check.py), and the price is also
given scaled by the median ratio now / profiled: the model's error apart from the machine's drift.

    python -m hybridflow.tools.bench.long_tail                  # dp 2, 64 sequences, responses mean 128
    python -m hybridflow.tools.bench.long_tail --dp 4 --json out.json --check

Goals: packed + balanced ≥ 1.5× the padded path's tokens/s; the price at the machine's speed within 15 % of
the measured seconds.
"""

from __future__ import annotations

import statistics
import time

from hybridflow.simulator.errors import HflowError
from hybridflow.simulator.io import write_json_atomic
from hybridflow.simulator.vocabulary.lengths import LengthDistribution
from hybridflow.tools.cli_help import OneLineErrorParser
from hybridflow.tools.outputs import run_main

SIDES = ("padded", "padded + balanced", "packed + balanced")
GOAL = 1.5
PRICE_GOAL = 0.15  # |predicted at speed / measured - 1|
PROMPTS = (32, 64)  # prompt lengths, uniform, both ends included


def packing_budget(micro: int, longest: int) -> int:
    """The packed side's token budget: a padded micro-batch's tokens (micro rows of the longest prompt and response)."""
    return micro * (PROMPTS[1] + longest)


def bench_workload(n: int, mean: int, longest: int, micro: int):
    """The batch as the simulator sees it: the distribution's workload at the mean prompt length, one step."""
    from hybridflow.simulator.vocabulary.workload import Workload

    return Workload(prompts=n, prompt_len=round(sum(PROMPTS) / 2), micro_batch_size=micro, ppo_epochs=1,
                    mini_batches=1, response_lengths=LengthDistribution.max_entropy(mean, longest))


def predict(dp: int, n: int, mean: int, longest: int, micro: int, profile: str) -> dict[str, dict]:
    """Per side, the simulator's seconds for the log-prob pass plus one optimizer step of the batch, and the parts."""
    from hybridflow.simulator.calibration.fit import calibrate_file
    from hybridflow.simulator.vocabulary.model import model_preset
    from hybridflow.simulator.vocabulary.parallel import ParallelConfig

    cal = calibrate_file(profile)
    cm = cal.cost_model(cal.cluster(nodes=1, devices_per_node=dp))
    w = bench_workload(n, mean, longest, micro)
    model, par = model_preset("tiny"), ParallelConfig(dp=dp)
    out = {}
    for side in SIDES:
        budget = packing_budget(micro, longest) if side.startswith("packed") else None
        fwd = cm.forward(model, "lm", par, w, micro_batch_tokens=budget)
        step = cm.train(model, "lm", par, w, micro_batch_tokens=budget)
        out[side] = {"seconds": fwd.seconds + step.seconds, "log_prob": fwd.seconds, "update": step.seconds}
    return out


def _batch(n: int, mean: int, longest: int, seed: int):
    """Left-padded prompts + right-padded responses (the rollout's layout) with response lengths from the
    maximum-entropy distribution of this mean and maximum (simulator/vocabulary/lengths.py)."""
    import torch

    from hybridflow.runtime.models.decoder import positions_from_mask

    g = torch.Generator().manual_seed(seed)
    responses = torch.tensor(LengthDistribution.max_entropy(mean, longest).sample(n))[torch.randperm(n, generator=g)]
    prompts = torch.randint(PROMPTS[0], PROMPTS[1] + 1, (n,), generator=g)
    p, r = PROMPTS[1], longest
    cols = torch.arange(p + r)
    mask = ((cols >= p - prompts[:, None]) & (cols < p + responses[:, None])).long()
    ids = torch.randint(1, 64, (n, p + r), generator=g) * mask
    return {"input_ids": ids, "attention_mask": mask, "position_ids": positions_from_mask(mask),
            "response_mask": mask[:, p:].clone(), "advantages": torch.randn(n, r, generator=g)}, r


def _loss(width):
    from hybridflow.runtime.algorithms.losses import aggregate

    def loss_fn(outputs, micro):
        per_token = -outputs["log_probs"][:, -width:] * micro["advantages"]
        return aggregate(per_token, micro["response_mask"], "token-mean")
    return loss_fn


def _bench_rank(rank, world, n, mean, longest, micro, repeats, seed):
    import torch
    import torch.distributed as dist

    from hybridflow.runtime.controller.batch import Batch
    from hybridflow.runtime.controller.protocols import get_protocol
    from hybridflow.runtime.engines.train.fsdp.engine import FsdpEngine, OptimConfig
    from hybridflow.runtime.models.decoder import CausalLM
    from hybridflow.runtime.rl.batches import dp_balanced_order
    from hybridflow.simulator.vocabulary.model import model_preset
    from hybridflow.simulator.vocabulary.parallel import ParallelConfig

    torch.set_num_threads(1)  # one core per rank: the ranks do not fight over threads
    data, width = _batch(n, mean, longest, seed)
    parallel = ParallelConfig(dp=world)
    whole = Batch(data)
    order = dp_balanced_order(data["attention_mask"], world)
    split = get_protocol("DP_COMPUTE").split
    balanced = whole if order is None else whole[order]  # one rank: nothing to balance
    shards = {"padded": split(whole, parallel)[0][rank], "balanced": split(balanced, parallel)[0][rank]}
    engines = {}
    for side in SIDES:
        torch.manual_seed(0)
        model = CausalLM(model_preset("tiny").decoder_config())
        kw = ({"micro_batch_tokens": packing_budget(micro, longest)} if side.startswith("packed")
              else {"micro_batch_size": micro})
        engines[side] = FsdpEngine(model, parallel, optim=OptimConfig(lr=1e-4), **kw)
    seconds: dict[str, list[float]] = {s: [] for s in SIDES}
    loss_fn = _loss(width)
    for _ in range(repeats + 1):  # the first round warms up
        for side in SIDES:
            local = shards["padded" if side == "padded" else "balanced"].tensors
            dist.barrier()
            start = time.perf_counter()
            engines[side].compute_log_probs(local, score_width=width)
            engines[side].train_step(local, loss_fn, token_weights="response_mask", score_width=width)
            dist.barrier()
            seconds[side].append(time.perf_counter() - start)
    tokens = [int(shards[k].tensors["attention_mask"].sum()) for k in ("padded", "balanced")]
    return {"seconds": {s: v[1:] for s, v in seconds.items()}, "rank_tokens": tokens,
            "tokens": int(data["attention_mask"].sum())}


def run(dp: int, n: int, mean: int, longest: int, micro: int, repeats: int, seed: int,
        profile: str | None = "cpu-2core") -> dict:
    """Measure the sides; with `profile`, their prices too, and the machine's speed against it before and after."""
    from hybridflow.runtime.engines.launch import run_local

    speed = []
    if profile is not None:
        from hybridflow.runtime.measure.profile_check import check_speed
        from hybridflow.simulator.calibration.profile import resolve_profile

        reference = resolve_profile(profile)
        speed.append(check_speed(reference, dp))
    results = run_local(_bench_rank, dp, n, mean, longest, micro, repeats, seed, timeout=1200.0)
    if profile is not None:
        speed.append(check_speed(reference, dp))
    tokens = results[0]["tokens"]
    out = {"dp": dp, "sequences": n, "response_mean": mean, "response_max": longest, "micro_batch_size": micro,
           "repeats": repeats, "tokens": tokens, "sides": {}}
    for side in SIDES:
        per_repeat = [max(r["seconds"][side][i] for r in results) for i in range(repeats)]
        s = statistics.median(per_repeat)
        out["sides"][side] = {"seconds": s, "tokens_per_second": tokens / s}
    for k, name in enumerate(("contiguous", "balanced")):
        loads = [r["rank_tokens"][k] for r in results]
        out[f"{name}_rank_spread"] = (max(loads) - min(loads)) / max(loads)
    base = out["sides"]["padded"]["tokens_per_second"]
    out["speedup"] = out["sides"]["packed + balanced"]["tokens_per_second"] / base
    if profile is not None:
        index = statistics.median(x for check in speed for x in check.ratios)
        out["profile"], out["speed_index"], out["speed_checks"] = profile, index, [c.index for c in speed]
        for side, price in predict(dp, n, mean, longest, micro, profile).items():
            v = out["sides"][side]
            v["predicted"], v["predicted_parts"] = price["seconds"], {k: price[k] for k in ("log_prob", "update")}
            v["predicted_at_speed"] = price["seconds"] * index
            v["error_at_speed"] = v["predicted_at_speed"] / v["seconds"] - 1.0
    return out


def add_batch_args(ap) -> None:
    """The long-tail batch's flags, shared with role_memory.py (the same batch and packed plan)."""
    ap.add_argument("--dp", type=int, default=2, help="data-parallel gloo processes (default 2)")
    ap.add_argument("--sequences", type=int, default=64, help="sequences in the batch (default 64)")
    ap.add_argument("--mean", type=int, default=128, help="mean response length (default 128)")
    ap.add_argument("--max", type=int, default=1024, help="longest response (default 1024, 8× the mean)")
    ap.add_argument("--micro-batch-size", type=int, default=8, help="rows per padded micro-batch, whose tokens are "
                    "the packing budget (default 8)")
    ap.add_argument("--seed", type=int, default=0)


def check_batch_args(a) -> None:
    """One line naming the flag for a batch that cannot be built."""
    if a.dp < 1 or a.sequences % a.dp or a.sequences < a.dp:
        raise HflowError(f"--sequences {a.sequences} must be a positive multiple of --dp {a.dp}")
    if not 1 <= a.mean < a.max:
        raise HflowError(f"--mean {a.mean} must be at least 1 and below --max {a.max}")
    if a.micro_batch_size < 1:
        raise HflowError(f"--micro-batch-size {a.micro_batch_size} must be at least 1")


def main(argv: list[str] | None = None) -> int:
    ap = OneLineErrorParser(prog="long_tail", description=__doc__.split("\n\n")[0])
    add_batch_args(ap)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--profile", default="cpu-2core", help="profile file or shipped name to price with (default "
                    "cpu-2core)")
    ap.add_argument("--no-prediction", action="store_true", help="measure only: no price, no speed check")
    ap.add_argument("--json", default=None, help="also write the figures to this JSON file")
    ap.add_argument("--check", action="store_true", help=f"exit 1 when packed + balanced is below {GOAL}× padded, "
                    f"or its price at the machine's speed is more than {PRICE_GOAL * 100:.0f} %% off")
    a = ap.parse_args(argv)
    check_batch_args(a)
    if a.repeats < 1:
        raise HflowError(f"--repeats {a.repeats} must be at least 1")
    profile = None
    if not a.no_prediction:
        from hybridflow.simulator.calibration.profile import resolve_profile

        profile = a.profile
        resolve_profile(profile)  # a profile that does not resolve: one line before torch starts
    out = run(a.dp, a.sequences, a.mean, a.max, a.micro_batch_size, a.repeats, a.seed, profile)
    print(f"long tail: {a.sequences} sequences, responses mean {a.mean} max {a.max}, dp {a.dp}, "
          f"{out['tokens']:,} real tokens; rank token spread: contiguous {out['contiguous_rank_spread']:.1%}, "
          f"balanced {out['balanced_rank_spread']:.1%}")
    for side, v in out["sides"].items():
        price = (f"  predicted {v['predicted']:.3f} s, × speed {v['predicted_at_speed']:.3f} s "
                 f"({v['error_at_speed']:+.1%})" if profile else "")
        print(f"  {side:<18} {v['seconds']:7.3f} s  {v['tokens_per_second']:9,.0f} tokens/s{price}")
    print(f"  packed + balanced / padded: {out['speedup']:.2f}× (goal ≥ {GOAL}×)")
    ok = out["speedup"] >= GOAL
    if profile:
        err = out["sides"]["packed + balanced"]["error_at_speed"]
        ok = ok and abs(err) <= PRICE_GOAL
        print(f"  machine speed: the profile '{profile}' reference jobs ran {out['speed_index']:.2f}× their profiled "
              f"time (before, after: {', '.join(f'{x:.2f}' for x in out['speed_checks'])}); packed + balanced "
              f"predicted at speed {err:+.1%} of measured (goal within ±{PRICE_GOAL:.0%})")
    if a.json:
        write_json_atomic(a.json, out)
    return 1 if a.check and not ok else 0


if __name__ == "__main__":
    run_main(main)
