"""The flags and argument types the subcommands share: a bad value is one line and exit code 2 (argparse
names the type), a name matches in any case with "did you mean" on a near miss. The subcommands take
their shared flags from here and never from one another."""

from __future__ import annotations

import argparse
import math
from collections.abc import Callable
from pathlib import Path

from hybridflow.simulator.algorithms import algorithm_names
from hybridflow.simulator.errors import HflowError
from hybridflow.simulator.vocabulary.parallel import TRAIN_BACKENDS
from hybridflow.simulator.vocabulary.roles import ROLES
from hybridflow.simulator.vocabulary.workload import Workload


# ---- argument types ------------------------------------------------------------------------------
def bounded_number(kind: type[int] | type[float], least: float, expected: str,
                   least_allowed: bool = True) -> Callable[[str], int | float]:
    """An argparse type: a finite `kind` (int or float) of at least `least` (above it, unless
    `least_allowed`); anything else is one line saying what was `expected`."""
    def parse(text: str) -> int | float:
        try:
            x = kind(text)
        except ValueError:
            x = None
        if x is None or not math.isfinite(x) or x < least or (x == least and not least_allowed):
            raise argparse.ArgumentTypeError(f"expected {expected}, got '{text}'")
        return x

    parse.__name__ = expected  # argparse names the type by it
    return parse


positive_int = bounded_number(int, 1, "a positive whole number")
non_negative_int = bounded_number(int, 0, "a whole number (0 or more)")
positive_float = bounded_number(float, 0.0, "a positive number of seconds", least_allowed=False)


def partial_budget_arg(text: str) -> int | str:
    """`--partial-rollout-tokens N|auto`: a positive whole number, or auto (the budget the simulator prices fastest)."""
    if text.strip().lower() == "auto":
        return "auto"
    return bounded_number(int, 1, "a positive whole number of tokens or auto")(text)


def backends_arg(text: str) -> tuple[str, ...]:
    """`--backends fsdp,megatron`: the training engines a search may pick per role (one line on a typo)."""
    names = tuple(dict.fromkeys(t.strip().lower() for t in text.split(",") if t.strip()))
    bad = [n for n in names if n not in TRAIN_BACKENDS]
    if bad or not names:
        raise argparse.ArgumentTypeError(f"unknown training backend '{(bad or [text])[0]}'; choose fsdp, megatron "
                                         "or fsdp,megatron")
    return names


def modes_arg(text: str) -> tuple[str, ...]:
    """`--modes sync,one-step-off,async`: execution modes to search side by side (one line on a typo)."""
    from hybridflow.simulator.vocabulary.plan import EXECUTION_MODES

    names = tuple(dict.fromkeys(t.strip().lower() for t in text.split(",") if t.strip()))
    bad = [n for n in names if n not in EXECUTION_MODES]
    if bad or not names:
        raise argparse.ArgumentTypeError(f"unknown mode '{(bad or [text])[0]}'; choose from "
                                         f"{', '.join(EXECUTION_MODES)} (comma-separated)")
    return names


def algorithm_arg(text: str) -> str:
    """`--algo`: any case, with "did you mean" on a near miss (one line, exit 2)."""
    from hybridflow.simulator.vocabulary.plan import algorithm_name

    try:
        return algorithm_name(text)
    except HflowError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def mode_arg(text: str) -> str:
    """`--mode`: an execution mode, any case, with "did you mean" on a near miss."""
    from hybridflow.simulator.names import lookup
    from hybridflow.simulator.vocabulary.plan import EXECUTION_MODES

    try:
        return lookup(text, EXECUTION_MODES, "execution mode", known_as="modes")
    except HflowError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def rollout_arg(text: str) -> str:
    """`--rollout`: a generation backend, any case, with "did you mean" on a near miss."""
    from hybridflow.simulator.names import lookup
    from hybridflow.simulator.vocabulary.plan import ROLLOUT_BACKENDS

    try:
        return lookup(text, ROLLOUT_BACKENDS, "rollout backend", known_as="backends")
    except HflowError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def task_arg(text: str) -> str:
    """`--task`: a built-in task, any case, with "did you mean" on a near miss (one line, exit 2)."""
    from hybridflow.runtime.tasks.builtin import get_task

    try:
        return get_task(text).name
    except HflowError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


# ---- shared flags --------------------------------------------------------------------------------
def role_flag(role: str) -> str:
    """The command-line flag of a role: --actor, --cost-critic."""
    return f"--{role.replace('_', '-')}"


def add_role_flags(p, metavar: str, help_of: Callable[[str], str]) -> None:
    """One flag per role (--actor, --critic, --cost-critic, …), read back as `args.<role>`."""
    for r in ROLES:
        p.add_argument(role_flag(r), dest=r, metavar=metavar, help=help_of(r))


def role_values(args) -> dict[str, str]:
    """{role: value} of the role flags given."""
    return {r: getattr(args, r) for r in ROLES if getattr(args, r)}


def add_algorithm_flag(p, default: str) -> None:
    p.add_argument("--algo", default=default, type=algorithm_arg, metavar="ALGO",
                   help=f"{', '.join(algorithm_names())} (any case)")


def add_profile_arg(parser) -> None:
    parser.add_argument("--profile", metavar="FILE", help="price on a measured profile's hardware (a file written "
                        "by `hflow-plan profile`, or a shipped name such as cpu-2core)")


# (flag, Workload field, help): the workload flags override the --workload file's fields
WORKLOAD_FLAGS = (
    ("prompt-len", "prompt_len", "prompt tokens"),
    ("response-len", "response_len", "response tokens"),
    ("batch", "prompts", "prompts per iteration"),
    ("samples", "samples_per_prompt", "responses per prompt (GRPO/RLOO draw several)"),
    ("ppo-epochs", "ppo_epochs", "passes over each iteration's batch"),
    ("mini-batches", "mini_batches", "optimizer steps per epoch"),
    ("micro-batch", "micro_batch_size", "sequences per device per forward/backward"),
)


RECENT_ITERATIONS = 5  # a metrics file's last iterations: the lengths the policy produces now


def _recorded_lengths(path: str):
    """The response lengths a run recorded (its --metrics file): the mean of each quantile over its last
    RECENT_ITERATIONS iterations."""
    import json

    from hybridflow.simulator.vocabulary.lengths import LengthDistribution

    if not Path(path).is_file():
        raise argparse.ArgumentTypeError(f"no file {path}")
    records = []
    for n, line in enumerate(Path(path).read_text().splitlines(), 1):
        try:
            row = json.loads(line) if line.strip() else {}
        except json.JSONDecodeError:
            raise argparse.ArgumentTypeError(f"{path} line {n} is not JSON; give the metrics file `run --metrics` "
                                             "wrote") from None
        if isinstance(row, dict) and isinstance(row.get("response_lengths"), dict):
            records.append(row["response_lengths"])
    if not records:
        raise argparse.ArgumentTypeError(f"{path} records no response lengths (runs record them per iteration "
                                         "since this version); give quantiles instead")
    return LengthDistribution.from_recorded(records[-RECENT_ITERATIONS:])


def lengths_arg(text: str):
    """`--response-lengths`: quantiles `p50=1500,p90=5000,max=16000` (shares as pNN, 0.NN, `min`, `max`), a
    YAML/JSON file holding a LengthDistribution (quantiles, histogram or observed lengths), or a run's metrics
    file (.jsonl: the lengths its last iterations produced)."""
    from pydantic import ValidationError

    from hybridflow.simulator.io import SPEC_SUFFIXES, read_mapping
    from hybridflow.simulator.vocabulary.lengths import LengthDistribution

    try:
        if Path(text).suffix.lower() == ".jsonl":
            return _recorded_lengths(text)
        if Path(text).suffix.lower() in SPEC_SUFFIXES:
            if not Path(text).is_file():
                raise argparse.ArgumentTypeError(f"no file {text}")
            return LengthDistribution.model_validate(read_mapping(text))
        pairs = dict(item.strip().partition("=")[::2] for item in text.split(","))
        if "mean" in pairs:  # the least-assuming lengths with that mean and maximum
            if set(pairs) != {"mean", "max"}:
                raise ValueError("give mean with max only (mean=930,max=4000), or quantiles")
            return LengthDistribution(mean=float(pairs["mean"]), max=int(pairs["max"]))
        quantiles = {}
        for key, value in pairs.items():
            key = key.strip().lower()
            share = {"min": 0.0, "max": 1.0}.get(key)
            if share is None:
                share = float(key[1:]) / 100.0 if key.startswith("p") else float(key)
            quantiles[share] = int(value)
        return LengthDistribution(quantiles=quantiles)
    except (ValueError, ValidationError) as e:
        detail = e.errors()[0]["msg"].removeprefix("Value error, ") if isinstance(e, ValidationError) else str(e)
        raise argparse.ArgumentTypeError(f"'{text}' is not a length distribution ({detail}); give quantiles such as "
                                         "p50=1500,p90=5000,max=16000 or a YAML/JSON file") from None


def add_request_args(p: argparse.ArgumentParser) -> None:
    """The flags `search` and `compare` share: cluster, algorithm, models, workload (read back by
    tools/search_request.py)."""
    c = p.add_argument_group("cluster")
    c.add_argument("--gpu", default="a100-80g", help="hardware preset (a100-80g, h100-80g, h200-141g; any case) or a "
                   "HardwareSpec YAML/JSON file")
    c.add_argument("--nodes", type=positive_int, default=1, help="machines")
    c.add_argument("--gpus-per-node", type=positive_int, default=8, help="devices per machine")
    c.add_argument("--cluster", metavar="FILE.yaml", help="a ClusterSpec file instead of the three flags above")
    m = p.add_argument_group("models")
    add_algorithm_flag(m, "ppo")
    m.add_argument("--model", help="every role's model: a preset (llama2-70b …; any case), a HF folder or a "
                   "ModelSpec YAML; a folder is recorded in the plan as the weights `run` trains")
    add_role_flags(m, "MODEL", lambda r: f"the {r} model (overrides --model); a folder is recorded in the plan")
    m.add_argument("--reward-function", metavar="MOD:FN", help="a rule-based reward on the driver instead of a model")
    m.add_argument("--cost-function", metavar="MOD:FN", help="a rule-based cost (safe-rlhf) instead of a model")
    w = p.add_argument_group("workload")
    w.add_argument("--workload", metavar="FILE.yaml", help="a Workload file; the flags below override its fields")
    for flag, field, text in WORKLOAD_FLAGS:
        w.add_argument(f"--{flag}", type=positive_int, metavar="N", help=f"{text} (default: the --workload file's, "
                       f"else {Workload.model_fields[field].default})")
    w.add_argument("--response-lengths", type=lengths_arg, metavar="QUANTILES|FILE",
                   help="response lengths as a distribution instead of every response --response-len long: "
                   "quantiles p50=1500,p90=5000,max=16000, mean=2000,max=16000 (the maximum-entropy lengths with that "
                   "mean), a YAML/JSON file (quantiles, histogram or observed "
                   "lengths) or a run's --metrics file (.jsonl: its last iterations' lengths); --response-len then "
                   "defaults to its longest")
    s = p.add_argument_group("search")
    s.add_argument("--max-pp", type=positive_int, help="largest training pipeline-parallel size to consider")
    s.add_argument("--max-gen-pp", type=positive_int, help="largest generation pipeline-parallel size "
                   "(`hflow-plan run` generates with pp=1: give 1 for a plan it can run)")
    s.add_argument("--max-sp", type=positive_int, help="largest Ulysses sequence-parallel size to consider (searched "
                   "for sequences of 4,096 tokens or more; `hflow-plan run` runs sp > 1 at pp=1)")
    s.add_argument("--top", type=positive_int, default=5, metavar="K", help="plans to list")
    s.add_argument("--backends", type=backends_arg, default="fsdp", metavar="LIST",
                   help="training engines to choose from per role: fsdp, megatron or fsdp,megatron (default: fsdp)")
    s.add_argument("--offload", choices=("auto", "never", "always"), default="auto",
                   help="move colocated models' states to host memory while another model of their set runs: auto "
                   "only when no plan fits without it, never, or always (default: auto)")
    s.add_argument("--lora", type=positive_int, metavar="RANK", help="train LoRA adapters of this rank on the frozen "
                   "models (the actor's base is the reference: no ref model); `search` also compares full fine-tuning")
    add_profile_arg(s)


def parse_overrides(items: list[str]) -> dict[str, object]:
    """`--set KEY=VALUE` items as {dotted path: value}, each value read as YAML (1e-4, true, [0.9, 0.95])."""
    import yaml

    out: dict[str, object] = {}
    for item in items:
        key, eq, text = item.partition("=")
        if not eq or not key.strip():
            raise HflowError(f"--set {item}: give KEY=VALUE with a dotted run-config path, e.g. optimizer.actor.lr=1e-4")
        try:
            out[key.strip()] = yaml.safe_load(text) if text.strip() else None
        except yaml.YAMLError:
            raise HflowError(f"--set {item}: the value is not valid YAML; quote it") from None
    return out
