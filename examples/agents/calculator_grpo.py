"""GRPO on word problems where the tiny model learns to call the calculator (docs/agents.md).

    python examples/agents/calculator_grpo.py --iterations 30 --out /tmp/calc

Builds a tiny tool-calling model here (tokenizer trained with `tokenizers`, a chat template with tool
support, transformers' config class; runtime/agents/tiny_tool_model.py), warms it up on demonstrations
of which a share call the calculator, then runs multi-turn rollouts on the native engine (tool calls
parsed from `<tool_call>` JSON, results appended as tool turns) and GRPO updates on them, tool results
and template scaffolding masked out of the loss. Each iteration prints the mean reward and the share of
conversations that called the tool; both should rise. Copy it and swap in your own model folder, tools
(`AgentSettings.tools`: `module:function`) and reward.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time
from pathlib import Path

from hybridflow.runtime.agents.checks import check_agent
from hybridflow.runtime.agents.settings import AgentSettings
from hybridflow.runtime.rl.run_config import RunConfig
from hybridflow.simulator.errors import HflowError


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--iterations", type=int, default=30)
    ap.add_argument("--prompts", type=int, default=8, help="problems per iteration")
    ap.add_argument("--samples", type=int, default=4, help="conversations per problem (the GRPO group)")
    ap.add_argument("--warmup-steps", type=int, default=300)
    ap.add_argument("--tool-share", type=float, default=0.3, help="share of warm-up demonstrations that call the tool")
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", type=Path, default=Path("calculator-grpo"))
    ap.add_argument("--metrics", type=Path, default=None, help="a JSON line per iteration")
    ap.add_argument("--tool", action="append", default=None,
                    help="a tool: calculator, python, module:function or file.py:function (repeatable)")
    ap.add_argument("--config", type=Path, default=None,
                    help="a run config (YAML) whose `agent` section sets the tools, turns and sandbox limits")
    ap.add_argument("--model", type=Path, default=None,
                    help="a model folder of your own (its chat template must render tools); default: built here")
    args = ap.parse_args(argv)
    try:  # every check before torch loads: one line and exit 2
        if args.iterations < 1 or args.prompts < 1 or args.samples < 2:
            raise HflowError("--iterations and --prompts must be ≥ 1 and --samples ≥ 2 (a GRPO group)")
        settings = AgentSettings(tools=tuple(args.tool or ["calculator"]), max_turns=3, max_tokens=96,
                                 turn_tokens=40)
        if args.config is not None:
            settings = RunConfig.load(args.config).agent
            if not settings.tools:
                raise HflowError(f"{args.config}: this example needs agent.tools (e.g. [calculator])")
        check_agent(settings, args.model)
    except HflowError as e:
        print(f"calculator_grpo: {e}", file=sys.stderr)
        return 2

    return train(args, settings)


def train(args, settings) -> int:
    import torch
    from transformers import AutoTokenizer

    from hybridflow.runtime.agents.chat_format import ChatFormat
    from hybridflow.runtime.agents.conversation import ConversationRunner, conversation_batch
    from hybridflow.runtime.agents.loading import load_tools
    from hybridflow.runtime.agents.tiny_tool_model import build_tool_model, warm_up
    from hybridflow.runtime.agents.train import conversation_update
    from hybridflow.runtime.agents.word_problems import answer_reward, word_problems
    from hybridflow.runtime.engines.rollout.generation import GenerationEngine, SamplingParams
    from hybridflow.runtime.models.hf_format import load_pretrained
    from hybridflow.runtime.tasks.model_tokenizer import generation_ids
    from hybridflow.simulator.algorithms.settings import AdvantageSettings, PolicyLossSettings

    torch.manual_seed(args.seed)
    torch.set_num_threads(1)
    folder = args.model or args.out / "model"
    if args.model is None and not (folder / "model.safetensors").is_file():
        t = time.perf_counter()
        build_tool_model(folder, seed=args.seed)
        warm = warm_up(folder, steps=args.warmup_steps, tool_share=args.tool_share, seed=args.seed)
        print(f"warmed up the tiny tool model in {time.perf_counter() - t:.0f} s (loss {warm['loss']:.3f})")
    hf = AutoTokenizer.from_pretrained(str(folder), local_files_only=True)
    eos = generation_ids(folder)[0]
    tools = load_tools(settings.tools)
    chat = ChatFormat(hf, [t.schema for t in tools.values()], eos)
    model = load_pretrained(folder)
    engine = GenerationEngine(model)
    runner = ConversationRunner(engine.generate, chat, settings, tools, pad_id=hf.pad_token_id)
    sampling = SamplingParams(temperature=1.0, eos_token_id=eos, pad_token_id=hf.pad_token_id)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr)
    problems = word_problems(4096, seed=args.seed + 100)
    rng = random.Random(args.seed)
    out = open(args.metrics, "w") if args.metrics else None
    for it in range(args.iterations):
        t = time.perf_counter()
        rows = [r for r in rng.sample(problems, args.prompts) for _ in range(args.samples)]
        model.eval()
        convs = runner.run(rows, sampling, torch.Generator().manual_seed(args.seed * 7919 + it))
        scores = torch.tensor([answer_reward(r["prompt"], c.answer, answer=r["answer"]) for r, c in zip(rows, convs,
                                                                                                        strict=True)])
        batch = conversation_batch(convs, hf.pad_token_id)
        model.train()
        stats = conversation_update(model, opt, batch, scores, group_size=args.samples,
                                    advantage=AdvantageSettings(estimator="grpo"), loss=PolicyLossSettings())
        line = {"iteration": it, "reward": float(scores.mean()),
                "tool_use": sum(c.tool_calls > 0 for c in convs) / len(convs),
                "tool_errors": sum(c.tool_errors for c in convs), "turns": sum(c.turns for c in convs) / len(convs),
                "generated_share": float(batch["response_mask"].sum() / batch["attention_mask"][:, -batch["responses"]
                                                                                                .shape[1]:].sum()),
                "pg_loss": stats["pg_loss"], "seconds": time.perf_counter() - t}
        print(f"iter {it:3d}  reward {line['reward']:.3f}  tool use {line['tool_use']:.2f}  turns {line['turns']:.2f}"
              f"  {line['seconds']:.1f} s", flush=True)
        if out:
            out.write(json.dumps(line) + "\n")
            out.flush()
    return 0


if __name__ == "__main__":
    sys.exit(main())
