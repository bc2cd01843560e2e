"""How fast `hflow-plan` answers bad input: each case as a fresh process, its wall seconds beside
what the same input did before the checks ran ahead of torch and Ray.

    python -m hybridflow.tools.bench.cli_errors            # the table
    python -m hybridflow.tools.bench.cli_errors --json     # one JSON object per case

Every case must end in one line on stderr and exit code 2. The cases (`error_cases`) are also the
test suite's (tests/tools/bench/test_fast_errors.py), which asserts the line and the exit code and that
neither torch nor Ray was imported — no timing in the tests.
"""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from hybridflow.tools.cli_help import OneLineErrorParser
from hybridflow.tools.outputs import run_main

# A PNG's first bytes: a binary file given as a plan.
PNG_HEADER = b"\x89PNG\r\n\x1a\n\x00\x00\x00\rIHDR\x00\x00\x00\x01\x00\x00\x00\x01\x08\x02\x00\x00\x00"


@dataclass(frozen=True)
class ErrorCase:
    name: str
    argv: list[str]
    expect: str  # a phrase of the one-line message
    before: str  # what the same input did before (issue 16)


def _plan(path: Path, model: str, devices: int, hardware: str = "a100-80g", algorithm: str = "grpo",
          path_of_weights: str | None = None) -> str:
    """A one-group GRPO plan (actor and reference) of `model` on `devices` devices, with the built-in
    sort reward."""
    from hybridflow.simulator import (
        ClusterSpec,
        Device,
        DeviceGroup,
        ParallelConfig,
        Plan,
        RolePlan,
        Workload,
    )

    cluster = ClusterSpec(hardware=hardware, nodes=1, devices_per_node=devices) if hardware != "cpu" else \
        ClusterSpec(hardware={"name": "cpu-core", "peak_flops": 5e10, "hbm_bandwidth": 1e10, "hbm_bytes": 2**32,
                              "intra_node_bandwidth": 5e9, "inter_node_bandwidth": 1e9}, nodes=1,
                    devices_per_node=devices)
    group = DeviceGroup(name="all", devices=[Device(node=0, index=i) for i in range(devices)])
    plan = Plan(algorithm=algorithm, cluster=cluster, groups=[group],
                workload=Workload(prompts=max(16, devices), prompt_len=16, response_len=8, micro_batch_size=4),
                roles={r: RolePlan(model=model, group="all", train=ParallelConfig(dp=devices), path=path_of_weights)
                       for r in ("actor", "ref")},
                reward_function="hybridflow.runtime.tasks.builtin:sort_reward")
    path.write_text(plan.model_dump_json(indent=1))
    return str(path)


def error_cases(folder: Path) -> list[ErrorCase]:
    """The bad-input cases, their input files written into `folder`."""
    folder.mkdir(parents=True, exist_ok=True)
    tiny = _plan(folder / "tiny.json", "tiny", 1, hardware="cpu")
    crowd = _plan(folder / "crowd.json", "tiny", 4096, hardware="cpu")
    heavy = _plan(folder / "heavy.json", "llama2-13b", 1, path_of_weights=str(folder))
    unwarmed = _plan(folder / "unwarmed.json", "llama2-7b", 8)
    reward_model = json.loads(Path(tiny).read_text())
    reward_model["roles"]["reward"] = {"model": "tiny", "group": "all"}
    reward_model.pop("reward_function")
    (folder / "reward-model.json").write_text(json.dumps(reward_model))
    (folder / "picture.png").write_bytes(PNG_HEADER)
    (folder / "a-folder").mkdir(exist_ok=True)
    (folder / "empty-ckpt").mkdir(exist_ok=True)
    slow = "about 20 s (torch and Ray imported first)"
    # a user's task (issue 39): prompt files and a reward file with the mistakes a new user makes
    (folder / "reward.py").write_text("def last_number(prompt, response, answer, **_):\n"
                                      "    words = response.split()\n    return float(bool(words) and words[-1] == answer)\n")
    row = json.dumps({"prompt": "sort 312:", "answer": "123"})
    for name, bad in (("malformed", '{"prompt": "sort 21:"'), ("no-prompt", json.dumps({"question": "sort 21:"})),
                      ("not-text", json.dumps({"prompt": {"text": "sort 21:"}})),
                      ("overlong", json.dumps({"prompt": "sort " + "9" * 40 + ":", "answer": "9"})),
                      ("no-answer", json.dumps({"prompt": "sort 21:"}))):
        (folder / f"{name}.jsonl").write_text(f"{row}\n{bad}\n")
    reward = str(folder / "reward.py")
    late = "after Ray and the weights loaded (issue 39: ~8 s in)"
    # long-tail lengths (issue 34): beyond the model's context, a token budget below the longest sequence
    for name, response_len, budget in (("too-long", 4096, None), ("small-budget", 8, 16), ("budget-64", 8, 64)):
        doc = json.loads(Path(tiny).read_text())
        doc["workload"]["response_len"] = response_len
        if budget:
            doc["roles"]["actor"]["micro_batch_tokens"] = budget
        (folder / f"{name}.json").write_text(json.dumps(doc))
    unchecked, checked = "accepted: the model's context was not checked", "refused in one line already (issue 34)"
    length_cases = [
        ErrorCase("search --response-lengths that does not parse", ["search", "--model", "tiny", "--algo", "grpo",
                                                                      "--response-lengths", "p50=many,max=64"],
                  "is not a length distribution", checked),
        ErrorCase("search lengths beyond the model's context", ["search", "--model", "llama2-7b", "--algo", "grpo",
                                                                "--response-lengths", "p50=1500,max=16000"],
                  "beyond llama2-7b's context of 4096", unchecked),
        ErrorCase("simulate a plan whose lengths pass the model's context", ["simulate", str(folder / "too-long.json")],
                  "beyond tiny's context of 2048", unchecked),
        ErrorCase("run --response-len beyond the model's context", ["run", tiny, "--response-len", "4096"],
                  "beyond tiny's context of 2048", unchecked),
        ErrorCase("simulate a token budget below the longest sequence", ["simulate", str(folder / "small-budget.json")],
                  "below the longest sequence", checked),
        ErrorCase("run --response-len past the plan's token budget", ["run", str(folder / "budget-64.json"),
                                                                      "--response-len", "100"],
                  "below the longest sequence", checked),
    ]
    task_cases = [
        ErrorCase("run --prompts with a malformed JSONL line", ["run", tiny, "--prompts", str(folder / "malformed.jsonl")],
                  "line 2 is not JSON", late),
        ErrorCase("run --prompts with a row without 'prompt'", ["run", tiny, "--prompts", str(folder / "no-prompt.jsonl")],
                  "line 2 has no 'prompt'", late),
        ErrorCase("run --prompts with a prompt that is not text", ["run", tiny, "--prompts",
                                                                   str(folder / "not-text.jsonl")],
                  "line 2: 'prompt' must be text", late),
        ErrorCase("run --prompts with a prompt over prompt_len", ["run", tiny, "--prompts", str(folder / "overlong.jsonl")],
                  "longer than the plan's prompt_len 16 tokens", "22.6 s in (issue 39)"),
        ErrorCase("run a reward needing a column a row lacks", ["run", tiny, "--prompts", str(folder / "no-answer.jsonl"),
                                                                "--reward-function", f"{reward}:last_number"],
                  "needs the column 'answer'", "27.5 s in, inside the reward (issue 39)"),
        ErrorCase("run --reward-function with a typo'd function", ["run", tiny, "--reward-function", f"{reward}:last_nmber"],
                  "has no 'last_nmber'", "no such flag; a typo in the plan failed at run"),
        ErrorCase("search --reward-function with a typo'd file", ["search", "--model", "tiny", "--algo", "grpo",
                                                                  "--samples", "4", "--reward-function",
                                                                  f"{folder / 'rewrd.py'}:last_number"],
                  "no file", "accepted: exit 0, plan written (issue 39)"),
    ]
    # the agent workload probe (issue 36): its settings checked as `run` checks an agent section, before the folder
    (folder / "agent-prompts.jsonl").write_text(row + "\n")
    probe = ["agent-probe", str(folder / "no-model"), "--prompts", str(folder / "agent-prompts.jsonl"), "--out",
             str(folder / "agent.yaml")]
    new = "no command: probe_workload was a Python call (issue 36)"
    agent_cases = [
        ErrorCase("agent-probe with a tool that does not import", [*probe, "--tools", "no_such_module_here:lookup"],
                  "cannot import module 'no_such_module_here'", new),
        ErrorCase("agent-probe with neither tools nor an environment", probe, "needs agent.tools", new),
        ErrorCase("agent-probe --out agent.txt", [*probe[:-1], str(folder / "agent.txt"), "--tools", "calculator"],
                  "ending in .yaml or .json", new),
    ]
    return [
        ErrorCase("run --resume without --checkpoint-dir", ["run", tiny, "--resume"], "--resume needs --checkpoint-dir",
                  slow),
        ErrorCase("run --resume, nothing to resume", ["run", tiny, "--resume", "--checkpoint-dir",
                                                      str(folder / "empty-ckpt")], "nothing to resume", slow),
        ErrorCase("run --iterations 0", ["run", tiny, "--iterations", "0"], "expected a positive whole number", slow),
        ErrorCase("run --timeline t.svg", ["run", tiny, "--timeline", "t.svg"], "ending in .png", slow),
        ErrorCase("run --task srot (near miss)", ["run", tiny, "--task", "srot"], "did you mean 'sort'", slow),
        ErrorCase("run --prompts missing.jsonl", ["run", tiny, "--prompts", str(folder / "missing.jsonl")],
                  "no such prompt file", slow),
        ErrorCase("run a plan larger than the machine (4096 virtual devices)", ["run", crowd],
                  "4096 worker processes need about", "not refused: Ray waited for resources"),
        ErrorCase("run a model too large for its device (13B on one A100)", ["run", heavy], "GiB per device",
                  "not refused"),
        ErrorCase("run a model preset without a path (7B)", ["run", unwarmed], "too large to warm up",
                  "warmed a fp32 7B up in the driver: killed by the kernel after 22 min, no message"),
        ErrorCase("run a reward role without a path", ["run", str(folder / "reward-model.json")],
                  "role 'reward' has no path", "refused after the warm-up and Ray's start"),
        ErrorCase("simulate picture.png (a binary file)", ["simulate", str(folder / "picture.png")],
                  "not a text file", "a UnicodeDecodeError traceback"),
        ErrorCase("simulate a folder", ["simulate", str(folder / "a-folder")], "is a folder", "said 'no such file'"),
        ErrorCase("search --gpus 4 (a prefix of --gpus-per-node)", ["search", "--gpus", "4", "--model", "tiny"],
                  "unrecognized arguments: --gpus", "accepted as --gpus-per-node 4"),
        ErrorCase("search --algo ppp (near miss)", ["search", "--algo", "ppp", "--model", "tiny"], "did you mean 'ppo'",
                  "refused without a suggestion"),
        *task_cases,
        *length_cases,
        *agent_cases,
    ]


def time_case(case: ErrorCase) -> dict:
    """The case as a fresh `hflow-plan` process: wall seconds, exit code, its stderr lines."""
    t0 = time.perf_counter()
    proc = subprocess.run([sys.executable, "-m", "hybridflow.tools.cli", *case.argv], capture_output=True, text=True)
    wall = time.perf_counter() - t0
    lines = proc.stderr.strip().splitlines()
    ok = proc.returncode == 2 and len(lines) == 1 and case.expect in lines[0]
    return {"case": case.name, "wall_seconds": wall, "exit_code": proc.returncode, "ok": ok,
            "message": lines[0] if lines else "", "before": case.before}


def main(argv: list[str] | None = None) -> int:
    ap = OneLineErrorParser(prog="cli_errors", description=__doc__.split("\n\n")[0])
    ap.add_argument("--json", action="store_true", help="print one JSON object per case")
    args = ap.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="hflow-cli-errors-") as tmp:
        rows = [time_case(c) for c in error_cases(Path(tmp))]
    if args.json:
        for r in rows:
            print(json.dumps(r))
        return 0 if all(r["ok"] for r in rows) else 1
    from rich.console import Console
    from rich.table import Table

    t = Table(title="hflow-plan on bad input: one line, exit 2 (each case a fresh process)", title_justify="left")
    for col, kw in (("case", {}), ("wall s", {"justify": "right"}), ("exit", {"justify": "right"}),
                    ("before", {}), ("message", {"overflow": "fold"})):
        t.add_column(col, **kw)
    for r in rows:
        t.add_row(r["case"], f"{r['wall_seconds']:.2f}", str(r["exit_code"]) + ("" if r["ok"] else " ✗"), r["before"],
                  r["message"])
    Console(width=160).print(t)
    return 0 if all(r["ok"] for r in rows) else 1


if __name__ == "__main__":
    run_main(main)
