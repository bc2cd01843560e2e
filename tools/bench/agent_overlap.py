"""Multi-turn rollouts with a slow tool, measured and priced: lockstep vs overlap (docs/agents.md).

    python -m hybridflow.tools.bench.agent_overlap [--sleep 0.5] [--conversations 16] [--repeats 3]

Builds (once, cached in --out) the tiny tool-calling model warmed up to call the calculator, gives it a
calculator that sleeps --sleep seconds per call (in the rollout's process, on --tool-workers threads),
and runs the same conversations in lockstep and with overlap (the engine decoding ready conversations
while others wait on the tool), interleaved --repeats times; the medians are the measured seconds. The
simulator's price (simulator/agents/multiturn.py) takes the distributions those runs showed (turns,
tokens per turn, tokens per tool turn), the tool's latency from a probe, and a DecodeCost fitted to timed
generate calls on this machine (runtime/measure/agent_probe.py). Prints one line per mode and the
speed-up of overlap, measured and predicted.
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


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sleep", type=float, default=0.5)
    ap.add_argument("--conversations", type=int, default=16)
    ap.add_argument("--tool-workers", type=int, default=4)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--out", type=Path, default=Path("/tmp/hflow-agent-bench"))
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)

    import torch
    from transformers import AutoTokenizer

    from hybridflow.runtime.agents.chat_format import ChatFormat
    from hybridflow.runtime.agents.conversation import ConversationRunner
    from hybridflow.runtime.agents.loading import load_tools
    from hybridflow.runtime.agents.settings import AgentSettings
    from hybridflow.runtime.agents.tiny_tool_model import build_tool_model, warm_up
    from hybridflow.runtime.agents.word_problems import word_problems
    from hybridflow.runtime.engines.rollout.generation import GenerationEngine, SamplingParams
    from hybridflow.runtime.measure.agent_probe import fit_decode_cost, observed_distributions, tool_latency
    from hybridflow.runtime.models.hf_format import load_pretrained
    from hybridflow.runtime.tasks.model_tokenizer import generation_ids
    from hybridflow.simulator.agents.multiturn import MultiTurnWorkload, price_rollout

    torch.set_num_threads(1)
    folder = args.out / "model"
    if not (folder / "model.safetensors").is_file():
        build_tool_model(folder, seed=0)
        warm_up(folder, steps=300, tool_share=1.0, seed=0)
    tool_file = args.out / "sleepy_calculator.py"
    tool_file.write_text(SLEEPY.format(sleep=args.sleep))
    hf = AutoTokenizer.from_pretrained(str(folder), local_files_only=True)
    eos = generation_ids(folder)[0]
    engine = GenerationEngine(load_pretrained(folder))
    sampling = SamplingParams(temperature=1.0, eos_token_id=eos, pad_token_id=hf.pad_token_id)
    rows = word_problems(args.conversations, seed=11)
    measured: dict[bool, list[float]] = {False: [], True: []}
    convs_seen = []
    runners = {}
    for overlap in (False, True):
        settings = AgentSettings(tools=(f"{tool_file}:calculator@inprocess",), max_turns=3, max_tokens=96,
                                 turn_tokens=40, tool_workers=args.tool_workers, overlap=overlap)
        tools = load_tools(settings.tools)
        chat = ChatFormat(hf, [t.schema for t in tools.values()], eos)
        runners[overlap] = (ConversationRunner(engine.generate, chat, settings, tools, pad_id=hf.pad_token_id), tools)
    runners[False][0].run(rows[:4], sampling, torch.Generator().manual_seed(0))  # warm the kernels
    for r in range(args.repeats):
        for overlap in ((False, True) if r % 2 == 0 else (True, False)):
            runner = runners[overlap][0]
            convs = runner.run(rows, sampling, torch.Generator().manual_seed(r))
            measured[overlap].append(runner.stats["wall_s"])
            convs_seen += convs
    dist = observed_distributions(convs_seen)
    calc = runners[False][1]["calculator"]
    latency = tool_latency(calc, [{"expression": r["expression"]} for r in rows[:4]], runners[False][0].settings.sandbox)
    cost = fit_decode_cost(engine.generate, vocab=len(hf), pad_id=hf.pad_token_id)
    prompt = round(statistics.mean(len(c.prompt_ids) for c in convs_seen))
    out = {"decode_cost": cost.model_dump(),
           "distributions": {k: statistics.mean(v) for k, v in dist.items() if k != "turn_tokens_by_turn"},
           "tool_seconds": statistics.mean(latency), "modes": {}}
    for overlap in (False, True):
        w = MultiTurnWorkload(conversations=args.conversations, prompt_tokens=prompt, turns=dist["turns"],
                              turn_tokens=dist["turn_tokens"], turn_tokens_by_turn=dist["turn_tokens_by_turn"],
                              tool_turn_tokens=dist["tool_turn_tokens"],
                              tool_seconds=latency, tool_workers=args.tool_workers, overlap=overlap)
        pred, meas = price_rollout(w, cost), statistics.median(measured[overlap])
        out["modes"]["overlap" if overlap else "lockstep"] = {
            "measured_s": meas, "measured_all": measured[overlap], "predicted_s": pred, "error": (pred - meas) / meas}
    m, p = out["modes"], out["modes"]
    out["speedup_measured"] = m["lockstep"]["measured_s"] / m["overlap"]["measured_s"]
    out["speedup_predicted"] = p["lockstep"]["predicted_s"] / p["overlap"]["predicted_s"]
    if args.json:
        print(json.dumps(out, indent=2))
        return 0
    print(f"tool {args.sleep:g} s per call on {args.tool_workers} workers, {args.conversations} conversations; "
          f"turns {out['distributions']['turns']:.2f}, tokens per turn {out['distributions']['turn_tokens']:.1f}")
    for name, v in out["modes"].items():
        print(f"{name:9s} measured {v['measured_s']:.2f} s (runs {', '.join(f'{x:.2f}' for x in v['measured_all'])})"
              f"  predicted {v['predicted_s']:.2f} s  error {100 * v['error']:+.1f} %")
    print(f"overlap speed-up: measured {out['speedup_measured']:.2f}x, predicted {out['speedup_predicted']:.2f}x")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
