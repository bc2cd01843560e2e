"""`hflow-plan lengths ACTOR --prompts FILE --out lengths.yaml`: the response lengths a policy produces.

The planner prices a distribution of response lengths (`search --response-lengths`); this measures one:
the actor folder's model samples responses to prompts from the prompt file on this machine (no Ray, one
process, the native generation engine on the local device), each until its end-of-sequence token or
`--max-tokens`, and the lengths are written as `observed:` (simulator/vocabulary/lengths.py) for
`search --response-lengths lengths.yaml`. A run's own metrics file serves too: its iterations record their
lengths' quantiles (`search --response-lengths metrics.jsonl`).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from hybridflow.simulator.errors import HflowError
from hybridflow.tools.cli_help import examples
from hybridflow.tools.flags import positive_int
from hybridflow.tools.outputs import write_outputs

BATCH = 16  # prompts generated at once


def add_parser(subparsers) -> None:
    p = subparsers.add_parser(
        "lengths", help="measure the response lengths a policy produces, for search --response-lengths",
        description="Sample responses from the actor folder's model to prompts of the prompt file (here, in one "
                    "process) and write their lengths as a distribution that `hflow-plan search "
                    "--response-lengths FILE` plans for. Responses stop at the model's end-of-sequence token "
                    "or --max-tokens (those are reported as cut: the real tail is longer).",
        epilog=examples("hflow-plan lengths my-model --prompts prompts.jsonl --out lengths.yaml",
                        "hflow-plan lengths my-model --prompts data --split train --sample 256 --max-tokens 4096 "
                        "--out lengths.yaml"))
    p.add_argument("actor", metavar="ACTOR", help="the policy's Hugging Face folder")
    p.add_argument("--prompts", required=True, metavar="FILE", help="JSONL/Parquet prompts or a datasets folder")
    p.add_argument("--split", help="the split of a datasets folder (default: train)")
    p.add_argument("--sample", type=positive_int, default=64, metavar="N", help="prompts to sample, the first N "
                   "(default: 64)")
    p.add_argument("--samples-per-prompt", type=positive_int, default=1, metavar="K",
                   help="responses per prompt (default: 1)")
    p.add_argument("--max-tokens", type=positive_int, default=1024, metavar="R",
                   help="longest response (default: 1024)")
    p.add_argument("--temperature", type=float, default=1.0, help="sampling temperature (default: 1.0)")
    p.add_argument("--seed", type=int, default=0, help="sampling seed (default: 0)")
    p.add_argument("--no-chat-template", action="store_true",
                   help="encode plain-text prompts as they are, not through the folder's chat template")
    p.add_argument("--out", required=True, metavar="FILE.yaml", help="where to write the lengths (.yaml or .json)")
    p.add_argument("--json", action="store_true", help="print one JSON object (the summary) instead of text")
    p.set_defaults(func=run)


def _check(args) -> None:
    """The inputs, before torch is imported: the actor folder as `run` checks a policy's (weights, shapes,
    tokenizer), the prompt file, the output file."""
    from hybridflow.runtime.models.folder_check import check_model_folder

    check_model_folder(args.actor, "actor")
    if not Path(args.prompts).exists():
        raise HflowError(f"--prompts {args.prompts}: no such file or folder")
    out = Path(args.out)
    if out.suffix.lower() not in (".yaml", ".yml", ".json"):
        raise HflowError(f"--out {args.out}: expected a file name ending in .yaml or .json")
    if out.is_dir():
        raise HflowError(f"--out {args.out}: is a folder; give a file name")
    if not 0.0 <= args.temperature <= 10.0:
        raise HflowError(f"--temperature {args.temperature}: give a value from 0 (greedy) to 10")


def measure(args) -> list[int]:
    """Response lengths of the first --sample prompts, --samples-per-prompt each."""
    import torch

    from hybridflow.runtime.engines.rollout.generation import GenerationEngine, SamplingParams, left_pad
    from hybridflow.runtime.models.hf_format import load_pretrained
    from hybridflow.runtime.tasks.data import PromptDataset
    from hybridflow.runtime.tasks.model_tokenizer import load_tokenizer

    model = load_pretrained(args.actor)
    model.eval()
    tok = load_tokenizer(args.actor, model.config.vocab_size)
    data = PromptDataset.from_file(args.prompts, args.split)
    chat = bool(getattr(tok, "has_chat_template", False)) and not args.no_chat_template
    prompts, _ = data.take(list(range(min(args.sample, len(data)))))
    encoded = [tok.encode_prompt(p, chat=chat) for p in prompts for _ in range(args.samples_per_prompt)]
    params = SamplingParams(max_new_tokens=args.max_tokens, temperature=args.temperature,
                            eos_token_id=list(getattr(tok, "eos_ids", [])) or None, pad_token_id=tok.pad_id)
    engine = GenerationEngine(model)
    generator = torch.Generator().manual_seed(args.seed)
    lengths: list[int] = []
    for i in range(0, len(encoded), BATCH):
        ids, mask = left_pad(encoded[i:i + BATCH], tok.pad_id)
        lengths += [int(n) for n in engine.generate(ids, mask, params, generator).response_lengths.tolist()]
    return lengths


def run(args) -> int:
    _check(args)
    import yaml

    from hybridflow.simulator.vocabulary.lengths import LengthDistribution

    lengths = measure(args)
    dist = LengthDistribution(observed=lengths)
    cut = sum(1 for n in lengths if n >= args.max_tokens) / len(lengths)
    text = (yaml.safe_dump({"observed": sorted(lengths)}, default_flow_style=None, width=100) if Path(args.out).suffix
            != ".json" else json.dumps({"observed": sorted(lengths)}))
    write_outputs([(args.out, text)])
    summary = {"responses": len(lengths), "mean": dist.mean, "p50": dist.quantile(0.5), "p90": dist.quantile(0.9),
               "max": dist.longest, "cut_at_max_tokens": cut, "out": args.out}
    if args.json:
        print(json.dumps(summary))
        return 0
    print(f"{len(lengths)} responses: {dist.describe()}; {cut:.0%} reached --max-tokens {args.max_tokens}"
          + (" (cut: the real tail is longer; raise --max-tokens)" if cut else ""))
    print(f"wrote {args.out}; plan with: hflow-plan search … --response-lengths {args.out}", file=sys.stdout)
    return 0
