"""The flags with which `run` changes, per run, what a plan or a run config says of the user's task — each
mapped onto the plan (`--reward-function`, `--prompt-len`, …) or onto a run-config field (`--temperature` is
`sampling.temperature`), so a flag, the `--config` file and `--set` are one setting, validated together
(every bad field named in one line):

    --reward-function / --cost-function REF    the plan's reward_function / cost_function
    --prompt-len / --response-len N            the plan's workload (its memory re-checked by the preflight)
    --truncate-prompts left|right, --drop-overlong     data.overlong (default: error, before anything starts)
    --chat-template / --no-chat-template       data.chat_template (default: when the actor's tokenizer has one)
    --temperature --top-p --top-k --stop       sampling.*
    --lr --warmup-steps --lr-schedule --decay-steps --weight-decay --betas    optimizer.actor.*
    --eval-prompts --eval-every --eval-samples --eval-max-prompts             eval.*
    --more N                                   iterations after the checkpoint (--iterations is the total)
"""

from __future__ import annotations

import argparse

from hybridflow.simulator.errors import HflowError

# flag dest → run-config path
CONFIG_FLAGS = {
    "temperature": "sampling.temperature", "top_p": "sampling.top_p", "top_k": "sampling.top_k",
    "stop": "sampling.stop", "lr": "optimizer.actor.lr", "warmup_steps": "optimizer.actor.warmup_steps",
    "lr_schedule": "optimizer.actor.schedule", "decay_steps": "optimizer.actor.decay_steps",
    "weight_decay": "optimizer.actor.weight_decay", "betas": "optimizer.actor.betas",
    "eval_prompts": "eval.prompts_file", "eval_every": "eval.every", "eval_samples": "eval.samples",
    "eval_max_prompts": "eval.max_prompts", "chat_template": "data.chat_template",
}


def betas_arg(text: str) -> list[float]:
    try:
        b1, b2 = (float(x) for x in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"give two numbers as B1,B2 (e.g. 0.9,0.95), got '{text}'") from None
    return [b1, b2]


def add_task_flags(p, *, iterations_flag: bool = True) -> None:
    """`run`'s per-run overrides of the task (see the module docstring)."""
    t = p.add_argument_group("the task (over the plan's and the --config file's)")
    t.add_argument("--reward-function", metavar="REF", help="the reward as 'file.py:function' or 'module:function', "
                   "instead of the plan's")
    t.add_argument("--cost-function", metavar="REF", help="the cost function (safe-rlhf), instead of the plan's")
    t.add_argument("--prompt-len", type=int, metavar="N", help="prompt tokens per sample, instead of the plan's "
                   "(its memory is checked again)")
    t.add_argument("--response-len", type=int, metavar="N", help="response tokens per sample, instead of the plan's")
    over = t.add_mutually_exclusive_group()
    over.add_argument("--truncate-prompts", choices=("left", "right"), help="cut a prompt over --prompt-len to its "
                      "last (left) or first (right) tokens (default: such a prompt is an error before the run)")
    over.add_argument("--drop-overlong", action="store_true", help="leave prompts over --prompt-len out of the data")
    chat = t.add_mutually_exclusive_group()
    chat.add_argument("--chat-template", dest="chat_template", action="store_const", const=True,
                      help="send plain-text prompts through the actor tokenizer's chat template")
    chat.add_argument("--no-chat-template", dest="chat_template", action="store_const", const=False,
                      help="send plain-text prompts as they are (default: through the chat template when the actor's "
                           "tokenizer has one)")
    s = p.add_argument_group("sampling and optimizer (run-config fields sampling.*, optimizer.actor.*)")
    s.add_argument("--temperature", type=float, metavar="T", help="sampling temperature")
    s.add_argument("--top-p", type=float, metavar="P", help="nucleus sampling: the smallest set of tokens of mass P")
    s.add_argument("--top-k", type=int, metavar="K", help="sample among the K likeliest tokens (0: all)")
    s.add_argument("--stop", action="append", metavar="TEXT", help="end a response at TEXT (repeatable)")
    s.add_argument("--lr", type=float, metavar="LR", help="the actor's learning rate")
    s.add_argument("--warmup-steps", type=int, metavar="N", help="linear learning-rate warm-up, optimizer steps")
    s.add_argument("--lr-schedule", metavar="NAME", help="after the warm-up: constant, linear or cosine")
    s.add_argument("--decay-steps", type=int, metavar="N", help="linear / cosine: optimizer steps of the decay")
    s.add_argument("--weight-decay", type=float, metavar="W", help="AdamW's weight decay")
    s.add_argument("--betas", type=betas_arg, metavar="B1,B2", help="AdamW's betas, e.g. 0.9,0.95")
    e = p.add_argument_group("evaluation on held-out prompts (run-config section eval)")
    e.add_argument("--eval-prompts", metavar="PATH", help="held-out prompts: a .jsonl / .parquet file or a `datasets` "
                   "folder (its test or validation split); default: the test / validation split of --prompts' "
                   "DatasetDict, if it has one")
    e.add_argument("--eval-every", type=int, metavar="N", help="evaluate every N iterations (and always before the "
                   "first update and at the end)")
    e.add_argument("--eval-samples", type=int, metavar="K", help="sampled responses per held-out prompt (pass@K)")
    e.add_argument("--eval-max-prompts", type=int, metavar="N", help="held-out prompts evaluated (the first N)")
    if iterations_flag:
        p.add_argument("--more", type=int, metavar="N", help="with --resume: N iterations after the checkpoint "
                       "(--iterations is the total a resumed run ends at)")
    p.add_argument("--debug", action="store_true", help="with an error in your own code (reward or cost function), "
                   "also print its traceback")


def config_overrides(args) -> dict[str, object]:
    """{run-config path: value} of the task flags given."""
    out = {path: getattr(args, dest) for dest, path in CONFIG_FLAGS.items() if getattr(args, dest, None) is not None}
    if getattr(args, "truncate_prompts", None):
        out["data.overlong"] = f"truncate-{args.truncate_prompts}"
    elif getattr(args, "drop_overlong", False):
        out["data.overlong"] = "drop"
    return out


def plan_overrides(plan, args):
    """The plan with the task flags' reward / cost functions and prompt / response lengths (validated)."""
    from pydantic import ValidationError

    from hybridflow.simulator.errors import describe_validation_error
    from hybridflow.simulator.vocabulary.plan import Plan

    update: dict = {}
    for what in ("reward", "cost"):
        ref = getattr(args, f"{what}_function", None)
        if ref is None:
            continue
        if what in plan.roles:
            raise HflowError(f"--{what}-function {ref}: the plan scores with a {what} model ({plan.roles[what].path or 'built-in'}); "
                             f"re-plan with `search --{what}-function` to use a function instead")
        update[f"{what}_function"] = ref
    lengths = {k: getattr(args, k) for k in ("prompt_len", "response_len") if getattr(args, k, None) is not None}
    if lengths:
        update["workload"] = {**plan.workload.model_dump(exclude_unset=True), **lengths}
    if not update:
        return plan
    data = {**plan.model_dump(exclude_unset=True), **update}
    try:
        return Plan.model_validate(data).validate_parallel()
    except ValidationError as e:
        flags = ", ".join(f"--{k.replace('_', '-')}" for k in [*lengths, *(f"{w}_function" for w in ("reward", "cost")
                                                                          if f"{w}_function" in update)])
        raise HflowError(describe_validation_error(e, f"the plan with {flags}")) from None


def resumed_iterations(args, done: int | None) -> int:
    """How many iterations to run now: --iterations is the total a run ends at (after `done`, the
    checkpoint's iteration, with --resume), --more N is N after the checkpoint."""
    more = getattr(args, "more", None)
    if more is not None:
        if more < 1:
            raise HflowError(f"--more {more}: give a positive number of iterations to run after the checkpoint")
        if not args.resume:
            raise HflowError("--more counts iterations after a checkpoint; add --resume (without it, give --iterations)")
        return more
    if not args.resume or done is None:
        return args.iterations
    if args.iterations <= done:
        raise HflowError(f"the checkpoint is at iteration {done} and --iterations {args.iterations} is the total to "
                         f"reach; give --iterations above {done}, or --more N for N more")
    return args.iterations - done


GROUP_ESTIMATORS = ("grpo", "rloo", "reinforce++-baseline")  # advantages against the other samples of a prompt


def one_sample_group(estimator: str, samples: int, algorithm: str) -> str | None:
    """What is wrong with a group-based advantage over one sample per prompt (None: nothing)."""
    if estimator not in GROUP_ESTIMATORS or samples > 1:
        return None
    return (f"{algorithm} compares the samples of each prompt (advantage '{estimator}'), and there is 1 sample per "
            "prompt: every advantage is 0 and the policy does not learn; give --samples 4 (or more)")


def check_search_task(args) -> str | None:
    """`search`'s checks of the task it is given, before it searches: each reward / cost function importable
    (`run` tries it on a data row; a module not installed here is only noted), and a group-based algorithm
    given more than one sample per prompt (`--samples 1` refused; left at its default, a warning). The notes
    are returned, said once the search is done."""
    import importlib.util

    from hybridflow.runtime.tasks.user_functions import load_function
    from hybridflow.simulator.algorithms import get_algorithm

    notes = []
    for what in ("reward", "cost"):
        ref = getattr(args, f"{what}_function", None)
        if not ref or ":" not in ref:
            continue
        module = ref.split(":")[0]
        if not module.endswith(".py") and importlib.util.find_spec(module.split(".")[0]) is None:
            # a package of the cluster's, not installed where the plan is made: priced, imported by `run`
            notes.append(f"note: --{what}-function {ref}: no module '{module}' here; `run` imports it")
            continue
        load_function(ref, f"--{what}-function")
    samples = getattr(args, "samples", None)
    problem = one_sample_group(get_algorithm(args.algo).defaults.advantage.estimator, samples or 1, args.algo)
    if problem and samples is not None:
        raise HflowError(f"--samples {samples}: {problem}")
    if problem and not getattr(args, "workload", None):
        notes.append(f"warning: {problem}")
    return "\n".join(notes) or None
