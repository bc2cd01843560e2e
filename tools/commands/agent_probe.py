"""`hflow-plan agent-probe ACTOR --prompts FILE --tools SPEC … --out agent.yaml`: the agent workload a
policy and the user's tools show here, for `search --agent-workload`.

The planner prices multi-turn rollouts from an agent workload (simulator/agents/workload.py); this
measures one: runtime/measure/agent_probe.py `probe_workload` runs the first --sample prompts'
conversations --rollouts times on the native engine in this process (no Ray) with the agent settings
taken as `run` takes them (the --config file's `agent` section, then --tools / --environment, then each
--set) and the user's tools really called, and writes the turns, tokens per turn, tool seconds per tool
turn, the rendered prompts' width and the runner's work between calls per conversation.
"""

from __future__ import annotations

import json
from pathlib import Path

from hybridflow.simulator.errors import HflowError
from hybridflow.tools.cli_help import examples
from hybridflow.tools.flags import parse_overrides, positive_int
from hybridflow.tools.outputs import write_outputs


def add_parser(subparsers) -> None:
    p = subparsers.add_parser(
        "agent-probe", help="measure an agent workload (turns, tokens, tool seconds) for search --agent-workload",
        description="Run conversations of the actor folder's model with the user's tools (or environment) on the "
                    "first prompts of the prompt file, here in one process on the native engine, and write what "
                    "they showed (turns per conversation, tokens per turn, seconds per tool turn, the rendered "
                    "prompt's width, the runner's work between calls) as the file `hflow-plan search "
                    "--agent-workload FILE` prices. The agent settings are read as `run` reads them: the --config "
                    "file's `agent` section, then --tools / --environment, then each --set.",
        epilog=examples("hflow-plan agent-probe my-model --prompts problems.jsonl --tools calculator mytools.py:lookup "
                        "--out agent.yaml",
                        "hflow-plan agent-probe my-model --prompts problems.jsonl --config run.yaml --set "
                        "agent.max_turns=6 --sample 32 --out agent.yaml"))
    p.add_argument("actor", metavar="ACTOR", help="the policy's Hugging Face folder (a chat template that renders "
                                                 "tools)")
    p.add_argument("--prompts", required=True, metavar="FILE", help="JSONL/Parquet prompts or a datasets folder "
                   "(the rows carry what the tools or the environment read)")
    p.add_argument("--split", help="the split of a datasets folder (default: train)")
    p.add_argument("--tools", nargs="+", metavar="SPEC", help="agent.tools: built-in names (calculator, python), "
                   "module:function or file.py:function (+ @inprocess); over the --config file's")
    p.add_argument("--environment", metavar="NAME", help="agent.environment instead of tools: guess-number or "
                   "module:Class; over the --config file's")
    p.add_argument("--config", metavar="RUN.yaml", help="a run config whose `agent` section gives the settings "
                   "(max_turns, max_tokens, turn_tokens, tool_workers, overlap, sandbox; docs/agents.md)")
    p.add_argument("--set", metavar="KEY=VALUE", action="append", default=[], dest="overrides",
                   help="set one run-config field by its dotted path, as `run --set` (repeatable), e.g. "
                        "--set agent.max_turns=6")
    p.add_argument("--sample", type=positive_int, default=16, metavar="N", help="prompts to run, the first N "
                   "(default: 16)")
    p.add_argument("--rollouts", type=positive_int, default=2, metavar="K",
                   help="times the prompts' conversations are run; the first run's work between calls is left out "
                        "when K > 1 (the template's first render compiles it) (default: 2)")
    p.add_argument("--seed", type=int, default=0, help="sampling and environment seed (default: 0)")
    p.add_argument("--out", required=True, metavar="FILE.yaml", help="where to write the workload (.yaml or .json)")
    p.add_argument("--json", action="store_true", help="print one JSON object (the summary) instead of text")
    p.set_defaults(func=run)


def agent_settings(args):
    """The run config's `agent` section as `run` builds it: the --config file, then --tools /
    --environment, then each --set (tools/flags.py `parse_overrides`, as `run` reads them)."""
    from hybridflow.runtime.rl.run_config import RunConfig

    cfg = RunConfig.load(args.config) if args.config else RunConfig()
    flags = {k: v for k, v in (("agent.tools", args.tools and list(args.tools)),
                               ("agent.environment", args.environment)) if v}
    return cfg.with_overrides({**flags, **parse_overrides(args.overrides)}).agent


def _check(args):
    """The inputs, before torch is imported: the output file, the prompt file's rows, the agent settings
    (every tool imports and has a schema, the environment loads), the actor folder as `run` checks a
    policy's and its chat template. Returns (settings, the first --sample rows)."""
    from hybridflow.runtime.agents.chat_format import check_template
    from hybridflow.runtime.agents.checks import check_agent
    from hybridflow.runtime.models.folder_check import check_model_folder
    from hybridflow.runtime.tasks.prompt_files import read_prompt_rows

    out = Path(args.out)
    if out.suffix.lower() not in (".yaml", ".yml", ".json"):
        raise HflowError(f"--out {args.out}: expected a file name ending in .yaml or .json")
    if out.is_dir():
        raise HflowError(f"--out {args.out}: is a folder; give a file name")
    if args.config and not Path(args.config).is_file():
        raise HflowError(f"--config {args.config}: no such file; give a run config (YAML or JSON)")
    if not Path(args.prompts).exists():
        raise HflowError(f"--prompts {args.prompts}: no such file or folder")
    rows = read_prompt_rows(args.prompts, args.split)[:args.sample]
    settings = agent_settings(args)
    check_agent(settings)
    check_model_folder(args.actor, "actor")
    check_template(args.actor, needs_tools=bool(settings.tools))
    return settings, rows


def quantile(values: list[float], q: float) -> float:
    import numpy as np

    return float(np.quantile(values, q))


def summary(workload, out: str) -> dict:
    w = workload
    return {"conversations": len(w.turns), "turns_mean": sum(w.turns) / len(w.turns), "turns_max": max(w.turns),
            "tool_seconds_p50": quantile(w.tool_seconds, 0.5), "tool_seconds_p90": quantile(w.tool_seconds, 0.9),
            "turn_tokens_mean": sum(w.turn_tokens) / len(w.turn_tokens),
            "tool_turn_tokens_mean": sum(w.tool_turn_tokens) / len(w.tool_turn_tokens),
            "prompt_tokens": w.prompt_tokens, "driver_seconds_per_row": w.driver_seconds_per_row, "out": out}


def run(args) -> int:
    settings, rows = _check(args)
    import yaml

    from hybridflow.runtime.measure.agent_probe import probe_workload

    workload = probe_workload(args.actor, settings, rows, rollouts=args.rollouts, seed=args.seed)
    doc = workload.model_dump(mode="json", exclude_none=True)
    text = (json.dumps(doc, indent=1) + "\n" if Path(args.out).suffix.lower() == ".json"
            else yaml.safe_dump(doc, default_flow_style=None, sort_keys=False, width=100))
    write_outputs([(args.out, text)])
    s = summary(workload, args.out)
    if args.json:
        print(json.dumps(s))
        return 0
    print(f"{s['conversations']} conversations ({len(rows)} prompts × {args.rollouts}): turns mean "
          f"{s['turns_mean']:.2f}, max {s['turns_max']}; tool seconds per tool turn p50 {s['tool_seconds_p50']:.3g}, "
          f"p90 {s['tool_seconds_p90']:.3g}; tokens per model turn {s['turn_tokens_mean']:.1f}, per tool turn "
          f"{s['tool_turn_tokens_mean']:.1f}; prompt {s['prompt_tokens']} tokens; driver "
          f"{s['driver_seconds_per_row'] * 1e3:.2f} ms per conversation between calls")
    print(f"wrote {args.out}; plan with: hflow-plan search … --agent-workload {args.out}")
    return 0
