"""Peer benchmark: TRL's `GRPOTrainer` vs our GRPO, same model, task and batch, side by side on this CPU.

    python -m hybridflow.tools.bench.vs_trl [--model tiny] [--repeats 3] [--steps 6] [--prompts 64] [--samples 8]
        [--response-len 16] [--micro-batch 128] [--our-micro-batch 32] [--devices N] [--trl-threads N] [--kl 0.04]
        [--lr 5e-4] [--seed 0] [--json]

`--repeats` runs of each side per KL setting, interleaved (ours, TRL, ours, …): the table gives each
side's median tokens/s with the spread of the runs (slowest–fastest), the ratio of the medians, and
the reward trend of each side's median run. `--model qwen2-bpe` puts the Qwen2-shaped ~10 M-parameter
model with its BPE tokenizer (bench_models.py; random weights, so its reward need not rise) in place
of the tiny policy on both sides.

Both sides start from the same warmed-up tiny policy (`warm_policy`: hidden 128, 4 layers, 4 heads,
ffn 512, the 64-symbol character vocabulary, saved in HF format, which transformers' LlamaForCausalLM
loads), sample `--samples` responses of at most `--response-len` tokens for each of `--prompts`
prompts of the built-in `sort` task per step, score them with the same `sort_reward`, and take ONE
optimizer step per batch (TRL: num_iterations=1, gradient accumulation over the generation batch;
ours: ppo_epochs=1, mini_batches=1). Same lr (constant), clip 0.2, grad clip 1.0, temperature 1.
Two runs: without a reference model (TRL beta=0; ours kl.coef=0, no ref role), then with a KL term on
both (TRL beta=k, its k3 estimator in the loss; ours kl: coef k, placement loss, estimator k3).

Micro-batches: each side runs the size it is fastest at on this machine. TRL: `--micro-batch`
(per_device_train_batch_size, default 128; measured here 3,446 / 3,344 / 3,310 tok/s at 128 / 64 / 32,
so smaller does not help it). Ours: `--our-micro-batch` (default 32): our engine packs each micro-batch
one row per prompt (the prompt once, its samples' responses behind it: engines/train/fsdp/shared_prompts.py),
so a micro-batch of 32 rows is 4 prompts of 8 samples; the gradient is the token-mean over the whole
batch whatever the micro-batch size. Both sides do the same passes: no old-log-prob pass (one
iteration of one batch: TRL's and ours take the update's own, detached), plus one reference pass
with KL; tokens/s counts the same real tokens (prompt with BOS + response) on both sides.

Throughput = (prompt + response tokens of a step, padding excluded) / step wall seconds, summed over
the steps after the first (the first pays for warm-up: Ray workers, first generate). TRL runs in
this process with torch's default threads (all cores); ours runs the plan "one group of all cores,
data parallel" on a local Ray cluster, one thread per worker. Goal: ours ≥ 2× TRL.
TRL is optional (`pip install -e '.[bench]'`); without it this exits 2 with a one-line message.
"""

from __future__ import annotations

import contextlib
import importlib.util
import io
import json
import logging
import os
import statistics
import time
import warnings

from hybridflow.simulator.errors import HflowError
from hybridflow.tools.cli_help import OneLineErrorParser
from hybridflow.tools.outputs import run_main

TASK = "sort"
GOAL = 2.0


# ---- shared inputs ------------------------------------------------------------------------------
def policy_folder(seed: int) -> str:
    from hybridflow.runtime.tasks.warmup import WarmupConfig, warm_policy

    return str(warm_policy("tiny", WarmupConfig(task=TASK, seed=seed)))


def bench_policy(args, workdir: str) -> None:
    """Set args.folder (None: the built-in tiny policy), args.spec and args.model_folder (for TRL)."""
    from hybridflow.tools.bench.bench_models import bench_model

    args.folder, args.spec = bench_model(args.model, workdir, args.seed)
    args.model_folder = args.folder or policy_folder(args.seed)


def hf_char_tokenizer():
    """Our CharTokenizer as a `PreTrainedTokenizerFast` (same ids; `<bos>` prepended like ours)."""
    from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    from hybridflow.runtime.tasks.tokenizer import CHARS, SPECIALS

    vocab = {s: i for i, s in enumerate(SPECIALS)} | {c: i + len(SPECIALS) for i, c in enumerate(CHARS)}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.normalizer = normalizers.Lowercase()
    tok.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")  # one token per character
    tok.decoder = decoders.Fuse()
    tok.post_processor = processors.TemplateProcessing(single="<bos> $A", special_tokens=[("<bos>", 1)])
    tok.add_special_tokens(list(SPECIALS))
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<bos>", eos_token="<eos>", pad_token="<pad>",
                                   unk_token="<unk>", padding_side="left")


def summarize(steps: list[dict]) -> dict:
    """tokens/s over steps 2..n, and the reward trend (first step vs the mean of the last ≤3)."""
    rest = steps[1:]
    tokens, seconds = sum(s["tokens"] for s in rest), sum(s["seconds"] for s in rest)
    tail = steps[-min(3, len(steps) - 1):]
    last = sum(s["reward"] for s in tail) / len(tail)
    return {"tokens_per_second": tokens / seconds if seconds > 0 else 0.0, "reward_first": steps[0]["reward"],
            "reward_last": last, "reward_delta": last - steps[0]["reward"], "steps": steps}


# ---- ours ---------------------------------------------------------------------------------------
def our_plan(args, with_ref: bool):
    from hybridflow.runtime.measure.hardware_probe import local_cluster
    from hybridflow.runtime.tasks.builtin import get_task
    from hybridflow.simulator import Device, DeviceGroup, ParallelConfig, Plan, RolePlan, Workload
    from hybridflow.simulator.vocabulary.model import model_preset

    spec, n = getattr(args, "spec", None) or model_preset("tiny"), args.devices
    group = DeviceGroup(name="all", devices=[Device(node=0, index=i) for i in range(n)])
    names = ("actor", "ref") if with_ref else ("actor",)
    roles = {r: RolePlan(model=spec, group="all", train=ParallelConfig(dp=n), path=getattr(args, "folder", None))
             for r in names}
    workload = Workload(prompts=args.prompts, samples_per_prompt=args.samples, prompt_len=16,
                        response_len=args.response_len, micro_batch_size=args.our_micro_batch, ppo_epochs=1,
                        mini_batches=1)
    # the cluster only bounds the plan's devices here (nothing is simulated); the probe of this machine is
    # cached, and it needs ≥ 2 devices to measure an all-reduce link
    return Plan(algorithm="grpo", cluster=local_cluster(max(n, 2)), workload=workload, groups=[group], roles=roles,
                reward_function=get_task(TASK).reward_function, notes="vs_trl benchmark")


def run_ours(args, kl: float) -> dict:
    from hybridflow.runtime.rl.run_config import RunConfig
    from hybridflow.runtime.rl.trainer import Trainer

    cfg = RunConfig(seed=args.seed, data={"task": TASK}, sampling={"temperature": 1.0},
                    optimizer={"actor": {"lr": args.lr, "grad_clip": 1.0}}, loss={"clip_ratio": 0.2},
                    kl={"coef": kl, "placement": "loss", "estimator": "k3"})
    trainer = Trainer(our_plan(args, with_ref=kl > 0), cfg)
    try:
        metrics = trainer.run(args.steps)
    finally:
        trainer.shutdown()
    return summarize([{"tokens": m["tokens"], "seconds": m["wall_seconds"], "reward": m["reward_mean"]}
                      for m in metrics])


# ---- TRL ----------------------------------------------------------------------------------------
def run_trl(args, kl: float, out_dir: str) -> dict:
    import datasets
    import torch
    from transformers import TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from hybridflow.runtime.tasks.builtin import get_task
    from hybridflow.runtime.tasks.data import PromptDataset
    from hybridflow.runtime.tasks.tokenizer import CharTokenizer

    reward = get_task(TASK).reward
    if args.folder:  # the model folder's own tokenizer (BOS prepended by its post-processor)
        from transformers import AutoTokenizer

        hf_tok = AutoTokenizer.from_pretrained(args.folder, padding_side="left")

        def prompt_tokens(p: str) -> int:
            return len(hf_tok(p)["input_ids"])
    else:
        char_tok, hf_tok = CharTokenizer(), hf_char_tokenizer()

        def prompt_tokens(p: str) -> int:
            return len(char_tok.encode(p, bos=True))
    rows = PromptDataset.from_task(TASK, args.prompts * (args.steps + 1), args.seed).rows  # same pool as ours
    per_step: list[dict] = []

    def sort_reward(prompts, completions, completion_ids, answer, **_):
        # one call per generation batch = one optimizer step; count tokens like ours (prompt with <bos> + response)
        scores = [reward(p, c, answer=a) for p, c, a in zip(prompts, completions, answer, strict=True)]
        tokens = sum(prompt_tokens(p) for p in prompts) + sum(len(c) for c in completion_ids)
        per_step.append({"tokens": tokens, "reward": sum(scores) / len(scores)})
        return scores

    class StepTimer(TrainerCallback):
        def on_train_begin(self, *a, **k):
            self.t = time.perf_counter()

        def on_step_end(self, *a, **k):
            now = time.perf_counter()
            per_step[-1]["seconds"], self.t = now - self.t, now

    batch = args.prompts * args.samples
    micro = min(args.micro_batch, batch)
    if batch % micro:
        raise HflowError(f"--micro-batch {args.micro_batch} must divide prompts × samples = {batch}")
    config = GRPOConfig(
        output_dir=out_dir, use_cpu=True, bf16=False, fp16=False, use_vllm=False, seed=args.seed,
        model_init_kwargs={"dtype": "float32"}, gradient_checkpointing=False,  # checkpointing only costs here
        per_device_train_batch_size=micro, gradient_accumulation_steps=batch // micro,
        steps_per_generation=batch // micro, num_iterations=1,  # one generation batch → one optimizer step
        num_generations=args.samples, max_completion_length=args.response_len, temperature=1.0, top_p=1.0,
        learning_rate=args.lr, lr_scheduler_type="constant", warmup_steps=0, weight_decay=0.0, max_grad_norm=1.0,
        epsilon=0.2, beta=kl, max_steps=args.steps, report_to="none", logging_strategy="no", save_strategy="no",
        disable_tqdm=True, log_completions=False, dataloader_num_workers=0, shuffle_dataset=True)
    trainer = GRPOTrainer(model=args.model_folder, reward_funcs=sort_reward, args=config,
                          train_dataset=datasets.Dataset.from_list(rows), processing_class=hf_tok,
                          callbacks=[StepTimer()])
    torch.manual_seed(args.seed)
    trainer.train()
    if len(per_step) != args.steps or any("seconds" not in s for s in per_step):
        raise RuntimeError(f"TRL ran {len(per_step)} generation batches for {args.steps} steps; expected one each")
    return summarize(per_step)


# ---- driver -------------------------------------------------------------------------------------
def run_bench(args) -> list[dict]:
    import tempfile

    import ray
    import torch

    workdir = tempfile.TemporaryDirectory(prefix="hflow-vs-trl-model-")
    bench_policy(args, workdir.name)  # build the policy once, before either side is timed
    torch.set_num_threads(args.trl_threads)  # TRL trains in this process
    own_ray = not ray.is_initialized()
    if own_ray:  # one local Ray cluster for both of our runs (a new one, never an outside `ray start` one)
        os.environ.setdefault("RAY_AUTH_MODE", "disabled")
        os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
        ray.init(address="local", num_cpus=max(os.cpu_count() or 1, args.devices), include_dashboard=False,
                 logging_level=logging.WARNING)
    runs = []
    try:
        for kl in (0.0, args.kl):
            sides: dict[str, list[dict]] = {"ours": [], "trl": []}
            for _ in range(args.repeats):  # interleaved: both sides see the same moments of a shared machine
                sides["ours"].append(run_ours(args, kl))
                with tempfile.TemporaryDirectory(prefix="hflow-vs-trl-") as out_dir, _quiet():
                    sides["trl"].append(run_trl(args, kl, out_dir))
            ours, trl = median_run(sides["ours"]), median_run(sides["trl"])
            ratio = ours["tokens_per_second"] / trl["tokens_per_second"] if trl["tokens_per_second"] > 0 else 0.0
            runs.append({"kl": kl, "ours": ours, "trl": trl, "ratio": ratio})
    finally:
        if own_ray:
            ray.shutdown()
        workdir.cleanup()
    return runs


def median_run(runs: list[dict]) -> dict:
    """The run with the median tokens/s (the lower one of an even count), with every run's tokens/s and
    their spread (slowest, fastest)."""
    speeds = [r["tokens_per_second"] for r in runs]
    median = statistics.median_low(speeds)
    return {**runs[speeds.index(median)], "repeats": speeds, "spread": [min(speeds), max(speeds)]}


@contextlib.contextmanager
def _quiet():
    """TRL and transformers print warnings and config dumps; keep the table readable."""
    from transformers.utils import logging as hf_logging

    level, bars = hf_logging.get_verbosity(), hf_logging.is_progress_bar_enabled()
    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
    with warnings.catch_warnings(), contextlib.redirect_stdout(io.StringIO()):
        warnings.simplefilter("ignore")
        try:
            yield
        finally:
            hf_logging.set_verbosity(level)
            if bars:
                hf_logging.enable_progress_bar()


def print_table(args, runs: list[dict]) -> None:
    from rich.console import Console
    from rich.table import Table

    t = Table(title=f"GRPO tokens/s on this CPU — {args.model}, task {TASK}, {args.prompts} prompts × {args.samples} "
                    f"samples, ≤{args.response_len} new tokens, {args.steps} steps (first excluded), median of "
                    f"{args.repeats} runs (slowest–fastest); goal ≥ {GOAL}×",
              title_justify="left")
    for col in ("run", "ours tok/s", "TRL tok/s", "ratio", "ours reward first → last", "TRL reward first → last"):
        t.add_column(col, justify="left" if col == "run" else "right")
    for r in runs:
        o, h = r["ours"], r["trl"]
        mark = "[green]" if r["ratio"] >= GOAL else "[red]"
        t.add_row("no KL (beta 0)" if r["kl"] == 0 else f"KL {r['kl']:g} (k3, loss)",
                  f"{o['tokens_per_second']:,.0f} ({o['spread'][0]:,.0f}–{o['spread'][1]:,.0f})",
                  f"{h['tokens_per_second']:,.0f} ({h['spread'][0]:,.0f}–{h['spread'][1]:,.0f})", f"{mark}{r['ratio']:.2f}×",
                  _trend(o), _trend(h))
    Console(width=max(Console().width, 130)).print(t)


def _trend(s: dict) -> str:
    return f"{s['reward_first']:.3f} → {s['reward_last']:.3f} ({s['reward_delta']:+.3f})"


def main(argv: list[str] | None = None) -> int:
    ap = OneLineErrorParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="tiny", help="tiny (the warmed-up policy) or qwen2-bpe (default tiny)")
    ap.add_argument("--repeats", type=int, default=3, help="runs per side and KL setting, interleaved (default 3)")
    ap.add_argument("--steps", type=int, default=6, help="optimizer steps per side and run (≥ 2; default 6)")
    ap.add_argument("--prompts", type=int, default=64, help="prompts per step (default 64)")
    ap.add_argument("--samples", type=int, default=8, help="samples per prompt (default 8)")
    ap.add_argument("--response-len", type=int, default=16, help="max new tokens (default 16)")
    ap.add_argument("--micro-batch", type=int, default=128, help="TRL's sequences per forward/backward (default 128)")
    ap.add_argument("--our-micro-batch", type=int, default=None,
                    help="our sequences per forward/backward per worker (default 32, at most --micro-batch)")
    ap.add_argument("--devices", type=int, default=os.cpu_count() or 1, help="our Ray workers (default: cores)")
    ap.add_argument("--trl-threads", type=int, default=os.cpu_count() or 1,
                    help="torch threads of the TRL process (default: cores, torch's own default)")
    ap.add_argument("--kl", type=float, default=0.04, help="KL coefficient of the second run (default 0.04)")
    ap.add_argument("--lr", type=float, default=5e-4, help="learning rate on both sides (default 5e-4)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", action="store_true", help="print one JSON object instead of the table")
    args = ap.parse_args(argv)
    if args.our_micro_batch is None:
        args.our_micro_batch = min(32, args.micro_batch)
    from hybridflow.tools.bench.bench_models import BENCH_MODELS

    if args.model not in BENCH_MODELS:
        raise HflowError(f"--model {args.model}: choose one of {', '.join(BENCH_MODELS)}")
    if args.repeats < 1:
        raise HflowError(f"--repeats {args.repeats}: give at least 1 (3 or more for a median and a spread)")
    if args.steps < 2:
        raise HflowError(f"--steps {args.steps}: give at least 2 (the first step is excluded from tokens/s)")
    if min(args.prompts, args.response_len, args.micro_batch, args.our_micro_batch, args.devices,
           args.trl_threads) < 1 or args.samples < 2:
        raise HflowError("--prompts, --response-len, --micro-batch, --our-micro-batch, --devices, --trl-threads must be "
                         "≥ 1 and --samples ≥ 2 "
                         "(GRPO compares samples of a prompt)")
    if args.kl <= 0:
        raise HflowError(f"--kl {args.kl}: the second run needs a KL coefficient > 0, e.g. 0.04")
    if importlib.util.find_spec("trl") is None:
        raise HflowError("the TRL benchmark needs trl: pip install -e '.[bench]' (trl==1.16.0)")
    logging.getLogger("ray").setLevel(logging.WARNING)
    runs = run_bench(args)
    if args.json:
        shown = {k: v for k, v in vars(args).items() if k not in ("spec", "folder", "model_folder")}
        print(json.dumps({"args": shown, "goal_ratio": GOAL, "runs": runs}))
    else:
        print_table(args, runs)
    return 0


if __name__ == "__main__":
    run_main(main)
