"""Multi-turn rollouts with a slow tool through the Ray trainer, sync vs async, measured and priced
(docs/agents.md).

    python -m hybridflow.tools.bench.agent_overlap [--sleep 0.5] [--iterations 5] [--rounds 2] [--model FOLDER] [--json]

Builds (once, cached in --out) the tiny tool-calling model warmed up to call the calculator (or takes
--model), gives it a calculator that sleeps --sleep seconds per call (in the driver's process, on
`tool_workers` threads), probes the agent workload here (runtime/measure/agent_probe.py probe_workload:
one batch's conversations run twice in process), asks the planner (agent-aware:
simulator/agents/planning.py) for its best `sync` and `async` plans of GRPO on this machine's two devices
with that workload, and runs each for --iterations
iterations of the real trainer (`hflow-plan run`'s Trainer: Ray, the native engine, conversations), the
two modes in turn for --rounds rounds in one Ray session (training of --ppo-epochs x --mini-batches steps,
long enough for a rollout to hide behind). Measured: the median over rounds of the steady iteration of
each run's Timeline (the first iteration left out), as `run` reports it. Predicted: the simulator's
iteration of the same plan on the profile, its rollout priced multi-turn on what that mode's
conversations showed (turns, tokens per turn, tool seconds: tools/reports/agent_prediction.py) — `run`'s
own prediction — and on both modes' conversations together, which the predicted speed-up of async over
sync compares (the same task: what differs between the modes' conversations is sampling).
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

SLEEPY = '''import time

def calculator(expression: str):
    """Evaluate an arithmetic expression (slowly)."""
    time.sleep({sleep})
    try:
        return str(eval(expression, {{"__builtins__": {{}}}}))
    except Exception as e:
        return f"error: {{e}}"
'''
REWARD = "hybridflow.runtime.agents.word_problems:answer_reward"


def plans(folder: Path, agent, profile: str, batch: int, samples: int, epochs: int, mini_batches: int,
          micro: int) -> dict:
    """The planner's best sync and async (staleness 1) plans for the tool model on this machine's 2 devices."""
    from hybridflow.planner.modes import search_modes
    from hybridflow.planner.plans import scored_to_plan
    from hybridflow.planner.request import SearchRequest
    from hybridflow.simulator.calibration.fit import calibrate_file
    from hybridflow.simulator.vocabulary.model import ModelSpec
    from hybridflow.simulator.vocabulary.workload import Workload

    cal = calibrate_file(profile)
    cluster = cal.cluster(nodes=1, devices_per_node=2)
    workload = Workload(prompts=batch, prompt_len=64, response_len=64, samples_per_prompt=samples,
                        ppo_epochs=epochs, mini_batches=mini_batches, micro_batch_size=micro)
    req = SearchRequest(algorithm="grpo", models={"actor": ModelSpec.from_hf_config(folder)},
                        paths={"actor": str(folder)}, cluster=cluster, workload=workload, reward_function=REWARD,
                        agent=agent)
    results = search_modes(req, cal.cost_model(cluster), ["sync", "async"], max_staleness=1)
    return {mode: scored_to_plan(req, r.result.top[0]).model_copy(update={"profile": profile})
            for mode, r in results.items()}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sleep", type=float, default=0.5)
    ap.add_argument("--iterations", type=int, default=5)
    ap.add_argument("--batch", type=int, default=4, help="prompts per iteration (4 conversations each)")
    ap.add_argument("--rounds", type=int, default=2, help="runs per mode, alternating (the median is measured)")
    ap.add_argument("--tool-workers", type=int, default=8)
    # training long enough for a rollout to hide behind (the point of the async modes)
    ap.add_argument("--ppo-epochs", type=int, default=4)
    ap.add_argument("--mini-batches", type=int, default=4)
    ap.add_argument("--micro-batch", type=int, default=4)
    ap.add_argument("--profile", default="cpu-2core")
    ap.add_argument("--model", type=Path, help="a tool model folder (default: built and warmed up in --out)")
    ap.add_argument("--out", type=Path, default=Path("/tmp/hflow-agent-bench"))
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)

    import torch

    from hybridflow.runtime.agents.settings import AgentSettings
    from hybridflow.runtime.agents.tiny_tool_model import build_tool_model, warm_up
    from hybridflow.runtime.agents.word_problems import word_problems
    from hybridflow.runtime.controller.resource_pool import init_ray
    from hybridflow.runtime.measure.agent_probe import probe_workload
    from hybridflow.runtime.rl.run_config import RunConfig
    from hybridflow.runtime.rl.trainer import Trainer
    from hybridflow.tools.reports.agent_prediction import agent_workload_from_metrics, multi_turn_prediction
    from hybridflow.tools.reports.comparison import Comparison

    torch.set_num_threads(1)
    args.out.mkdir(parents=True, exist_ok=True)
    folder = args.model or args.out / "model"
    if not (folder / "model.safetensors").is_file():
        build_tool_model(folder, seed=0)
        warm_up(folder, steps=120, tool_share=1.0, seed=0, batch=8, problems=150)  # the call format
    tool_file = args.out / "sleepy_calculator.py"
    tool_file.write_text(SLEEPY.format(sleep=args.sleep))
    prompts = args.out / "problems.jsonl"
    prompts.write_text("".join(json.dumps({k: r[k] for k in ("prompt", "answer")}) + "\n"
                               for r in word_problems(256, seed=7)))
    settings = AgentSettings(tools=(f"{tool_file}:calculator@inprocess",), max_turns=3, max_tokens=64, turn_tokens=24,
                             tool_workers=args.tool_workers)
    # the planner's view before any run: the probe's (one batch's conversations run here on the native engine:
    # turns, tokens, the tool's seconds, the runner's work between calls), as `search --agent-workload` reads it
    problems = [{"prompt": r["prompt"], "answer": r["answer"]} for r in word_problems(4 * args.batch, seed=8)]
    probed = probe_workload(folder, settings, problems, rollouts=2)
    chosen = plans(folder, probed, args.profile, args.batch, 4, args.ppo_epochs, args.mini_batches, args.micro_batch)
    cfg = RunConfig(seed=0, data={"prompts_file": str(prompts)}, agent=settings.model_dump())
    from hybridflow.runtime.measure.profile_check import check_speed
    from hybridflow.simulator.calibration.profile import resolve_profile
    from hybridflow.tools.reports.run import SPEED_CHECK_MAX_SECONDS

    # the machine's speed now vs the profile's (the quick check `run` makes; sim_accuracy.py's method): the
    # predictions are on the profile, a drift of the shared machine shows here, not in the model
    speed = check_speed(resolve_profile(args.profile), max_seconds=SPEED_CHECK_MAX_SECONDS).index
    init_ray(num_cpus=8)
    out = {"sleep_s": args.sleep, "tool_workers": args.tool_workers, "conversations": 4 * args.batch,
           "speed_vs_profile": speed, "probed_driver_seconds_per_row": probed.driver_seconds_per_row, "modes": {}}
    runs: dict[str, list] = {mode: [] for mode in chosen}
    for r in range(args.rounds):  # sync and async in turn, each round in the other order: load falls on both
        for mode in (list(chosen) if r % 2 == 0 else list(chosen)[::-1]):
            with Trainer(chosen[mode], cfg) as trainer:
                metrics = [trainer.step() for _ in range(args.iterations)]
                runs[mode].append((metrics, trainer.timeline))
    # both modes priced on the conversations of every run (the same task: what differs between the runs'
    # turns and tool calls is sampling, not the mode)
    agent = agent_workload_from_metrics([m for rs in runs.values() for ms, _ in rs for m in ms[1:]], settings,
                                        skip_first=False)
    out["workload"] = agent.model_dump()
    for mode, plan in chosen.items():
        # as `run` predicts it: priced on this mode's own conversations; and on both modes' (the speed-up)
        own = agent_workload_from_metrics([m for ms, _ in runs[mode] for m in ms[1:]], settings, skip_first=False)
        predicted = multi_turn_prediction(plan, args.profile, cfg, [], own)
        pooled = multi_turn_prediction(plan, args.profile, cfg, [], agent)
        cs = [Comparison.from_timelines(predicted, timeline) for _, timeline in runs[mode]]
        measured = statistics.median(c.measured_iteration for c in cs)
        gen = predicted.op_seconds().get("generate", 0.0) if predicted else 0.0
        out["modes"][mode] = {
            "rollout_devices": len(plan.group(plan.roles["actor"].generate_group).devices)
            if plan.roles["actor"].generate_group else 0,
            "measured_s": measured, "measured_rounds": [c.measured_iteration for c in cs],
            "predicted_s": cs[0].predicted_iteration, "error": (cs[0].predicted_iteration - measured) / measured,
            "predicted_pooled_s": pooled.iteration_seconds(),
            "generate_measured_s": statistics.median(c.measured_ops.get("generate", 0.0) for c in cs),
            "generate_predicted_s": gen,
            "turns_mean": statistics.mean(m["agent/turns_mean"] for ms, _ in runs[mode] for m in ms[1:] or ms),
            # each op measured (the median over rounds) and predicted: where the iteration's error sits
            "ops": {op: {"measured_s": statistics.median(c.measured_ops.get(op, 0.0) for c in cs),
                         "predicted_s": cs[0].predicted_ops.get(op, 0.0)}
                    for op in sorted(set(cs[0].predicted_ops) | {o for c in cs for o in c.measured_ops})}}
    m = out["modes"]
    out["speedup_measured"] = m["sync"]["measured_s"] / m["async"]["measured_s"]
    out["speedup_predicted"] = m["sync"]["predicted_pooled_s"] / m["async"]["predicted_pooled_s"]
    if args.json:
        print(json.dumps(out, indent=2))
        return 0
    print(f"tool {args.sleep:g} s per call on {args.tool_workers} workers, {out['conversations']} conversations per "
          f"iteration, {args.ppo_epochs} epochs x {args.mini_batches} mini-batches, {args.iterations} iterations per "
          f"mode and round, {args.rounds} rounds (profile {args.profile}); priced with turns "
          f"{', '.join(f'{k}: {100 * agent.turns.count(k) // len(agent.turns)}%' for k in sorted(set(agent.turns)))} of conversations, "
          f"{statistics.median(agent.turn_tokens):g} tokens per calling "
          f"turn, {statistics.median(agent.final_turn_tokens or [0]):g} per answer, {max(agent.tool_seconds):.2f} s of tool in "
          f"{sum(s > 0 for s in agent.tool_seconds)}/{len(agent.tool_seconds)} tool turns; runner's work between "
          f"calls {1e3 * agent.driver_seconds_per_row:.2f} ms per conversation (the probe's before the runs: "
          f"{1e3 * probed.driver_seconds_per_row:.2f} ms)")
    for name, v in m.items():
        print(f"{name:6s} (rollout devices {v['rollout_devices']}): iteration measured {v['measured_s']:.2f} s "
              f"(rounds {', '.join(f'{x:.2f}' for x in v['measured_rounds'])}), "
              f"predicted {v['predicted_s']:.2f} s ({100 * v['error']:+.1f} %); generate measured "
              f"{v['generate_measured_s']:.2f} s, predicted {v['generate_predicted_s']:.2f} s; "
              f"turns {v['turns_mean']:.2f}; on both modes' conversations predicted {v['predicted_pooled_s']:.2f} s")
    print(f"machine speed now vs the profile's: {speed:.2f}x its seconds (the reference jobs `run` re-times)")
    print(f"async speed-up over sync: measured {out['speedup_measured']:.2f}x, predicted {out['speedup_predicted']:.2f}x "
          "(on both modes' conversations)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
