"""The run's inputs, checked before torch or Ray load: every prompt row (tasks/prompt_files.py), every
prompt's token count against the plan's `prompt_len` (tasks/token_count.py), the reward and cost
functions imported and tried on a real row (tasks/user_functions.py), and the same for the held-out set.
A bad input is one line and exit code 2 within about a second (plus the time to tokenize the prompts),
before any Ray process exists.

    report = check_inputs(plan, resolved_config)      # → InputReport: rows, over-long prompts, the longest
"""

from __future__ import annotations

from dataclasses import dataclass

from hybridflow.runtime.tasks.prompt_files import held_out_source, prompt_preview, read_prompt_rows, task_rows
from hybridflow.runtime.tasks.token_count import prompt_counter
from hybridflow.runtime.tasks.user_functions import check_on_row, load_function
from hybridflow.simulator.algorithms import get_algorithm
from hybridflow.simulator.errors import HflowError

SCORE_STREAMS = ("reward", "cost")


@dataclass
class InputReport:
    rows: int  # training prompts (after drop-overlong)
    source: str
    longest: int | None  # tokens of the longest prompt (None: not countable before the run)
    overlong: int  # prompts over prompt_len (cut or dropped, as data.overlong says)
    eval_rows: int = 0
    eval_source: str | None = None

    def line(self, prompt_len: int, policy: str) -> str:
        out = f"{self.rows} prompt(s) from {self.source}"
        if self.longest is not None:
            out += f", the longest {self.longest} of {prompt_len} tokens"
        if self.overlong:
            out += f"; {self.overlong} over it {'dropped' if policy == 'drop' else policy.replace('-', 'd on the ')}"
        if self.eval_source:
            out += f"; {self.eval_rows} held-out prompt(s) from {self.eval_source}"
        return out


def _check_lengths(rows: list[dict], source: str, count, chat: bool, prompt_len: int, policy: str,
                   what: str = "prompt") -> tuple[list[int], int]:
    """(the token counts, how many are over prompt_len); an error naming the longest unless the policy
    cuts or drops them."""
    counts = [count(r["prompt"], chat) for r in rows]
    over = [i for i, n in enumerate(counts) if n > prompt_len]
    if over and policy == "error":
        worst = max(over, key=lambda i: counts[i])
        raise HflowError(f"{source}: {len(over)} of {len(rows)} {what}(s) are longer than the plan's prompt_len "
                         f"{prompt_len} tokens (row {worst + 1}: {counts[worst]} tokens, "
                         f"{prompt_preview(rows[worst]['prompt'])!r}); give --prompt-len {max(counts)} (re-checked "
                         "against memory), --truncate-prompts left|right, or --drop-overlong")
    if over and policy == "drop" and len(over) == len(rows):
        raise HflowError(f"{source}: every {what} is longer than prompt_len {prompt_len} tokens, so --drop-overlong "
                         f"leaves none; give --prompt-len {min(counts)} or more")
    return counts, len(over)


def check_functions(plan, rows: list[dict], source: str) -> None:
    """Each rule-based score the algorithm needs: imported, its columns in every row, one call on row 1."""
    for stream in get_algorithm(plan.algorithm).scores:
        if stream in plan.roles:
            continue
        ref = getattr(plan, f"{stream}_function")
        if ref is None:
            raise HflowError(f"the plan has neither a '{stream}' model nor a {stream}_function; give "
                             f"--{stream}-function file.py:function")
        name = f"{stream} function '{ref}'"
        check_on_row(load_function(ref, f"{stream} function"), name, rows, source)


def check_inputs(plan, cfg) -> InputReport:
    """Every input of the run `plan` and its resolved config `cfg` make (module docstring)."""
    data = cfg.data
    if data.prompts_file:
        rows, source = read_prompt_rows(data.prompts_file), data.prompts_file
    else:
        rows, source = task_rows(data.task, data.dataset_size, cfg.seed), f"task {data.task}"
    actor = plan.roles.get("actor")
    count = prompt_counter(actor.path if actor else None)
    prompt_len, policy = plan.workload.prompt_len, data.overlong
    longest, overlong = None, 0
    if count is not None:
        counts, overlong = _check_lengths(rows, source, count, bool(data.chat_template), prompt_len, policy)
        longest = max(counts)
        if policy == "drop":
            rows = [r for r, n in zip(rows, counts, strict=True) if n <= prompt_len]
    check_functions(plan, rows, source)
    report = InputReport(len(rows), source, longest, overlong)
    path, split = held_out_source(cfg.eval.prompts_file, data.prompts_file)
    if path and plan.mode != "sync" and not cfg.eval.prompts_file:
        path = None  # the training DatasetDict's test split: not evaluated in an overlapping mode (rl/evaluation.py)
    if path and plan.mode != "sync":
        raise HflowError(f"evaluation on held-out prompts runs between iterations, and mode '{plan.mode}' keeps a "
                         "rollout in flight across them; run in mode sync (--mode sync) to evaluate")
    if path:
        held = read_prompt_rows(path, split)[:cfg.eval.max_prompts]
        where = f"{path} ({split})" if split else path
        if count is not None:
            _check_lengths(held, where, count, bool(data.chat_template), prompt_len,
                           "truncate-left" if policy == "drop" else policy, "held-out prompt")
        check_functions(plan, held, where)
        report.eval_rows, report.eval_source = len(held), where
    elif cfg.eval.every:
        raise HflowError(f"--eval-every {cfg.eval.every}: no held-out prompts; give --eval-prompts PATH (or --prompts "
                         "a `datasets` folder with a test or validation split)")
    return report


def check_search_functions(req) -> None:
    """`search`'s check of what it is given: each reward / cost function importable and callable (no data yet:
    `run` tries it on a row)."""
    for stream in SCORE_STREAMS:
        ref = getattr(req, f"{stream}_function", None)
        if ref:
            load_function(ref, f"--{stream}-function")
