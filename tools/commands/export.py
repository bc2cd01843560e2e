"""`hflow-plan export CHECKPOINT --out DIR`: a saved checkpoint's trained models as Hugging Face folders.

In this process, without Ray: DCP reads the sharded weights of whatever layout the run trained with
into whole tensors (runtime/models/hf_export.py). DIR/actor and, when the run had one, DIR/critic; each with
the config.json, generation_config.json and tokenizer files the checkpoint carries from the folder the
run started from.
"""

from __future__ import annotations

import sys

from hybridflow.runtime.controller.locations import Location, check_url, is_url, readable
from hybridflow.runtime.rl.checkpoints import latest_name
from hybridflow.simulator.errors import HflowError
from hybridflow.simulator.vocabulary.roles import TRAINED_ROLES
from hybridflow.tools.cli_help import examples


def add_parser(subparsers) -> None:
    p = subparsers.add_parser(
        "export", help="turn a run's checkpoint into Hugging Face model folders (no Ray, one process)",
        description="Write the actor (and critic) of a checkpoint written by `hflow-plan run --checkpoint-dir` as "
                    "Hugging Face folders that transformers loads: OUT/actor, OUT/critic. CHECKPOINT is one "
                    "checkpoint (CKPT/iter_000010) or the checkpoint directory (its latest checkpoint).",
        epilog=examples("hflow-plan export ckpt --out trained",
                        "hflow-plan export ckpt/iter_000010 --out trained-10"))
    p.add_argument("checkpoint", metavar="CHECKPOINT", help="CKPT/iter_N, or CKPT for its latest checkpoint")
    p.add_argument("--out", required=True, metavar="DIR", help="folder for the HF model folders (DIR/actor, DIR/critic)")
    p.set_defaults(func=run)


def checkpoint_roles(checkpoint: str) -> dict[str, Location]:
    """The trained roles a checkpoint (a path or a URL) holds: {role: its folder}; one-line errors for
    anything else. The layout is the trainer's (runtime/rl/checkpoints.py): CKPT/latest names CKPT/iter_N,
    which holds actor/ and critic/, each with dcp/ (FsdpEngine.save) and the model's config.json
    (EngineState.save)."""
    if is_url(checkpoint):
        check_url(checkpoint, "CHECKPOINT")
    path = Location(checkpoint)
    if (name := latest_name(path)) is not None:
        path = path / name
    if not path.is_dir():
        raise HflowError(f"{checkpoint}: no such checkpoint; pass a checkpoint folder (CKPT/iter_N) or the "
                         "--checkpoint-dir of a run")
    roles = {r: path / r for r in TRAINED_ROLES if (path / r / "dcp" / ".metadata").is_file()}
    if not roles:
        raise HflowError(f"{path}: not a checkpoint (no actor/dcp or critic/dcp in it); pass a folder written "
                         "by `hflow-plan run --checkpoint-dir`")
    for role, folder in roles.items():
        if not (folder / "config.json").is_file():
            raise HflowError(f"{folder}: no config.json for the {role} (a checkpoint of an older version); copy "
                             "the config.json of the model it was trained from into it")
    return roles


def run(args) -> int:
    with readable(args.checkpoint, "CHECKPOINT"):
        roles = checkpoint_roles(args.checkpoint)
    if is_url(args.out):
        check_url(args.out, "--out")
    out = Location(args.out)
    if out.is_file():
        raise HflowError(f"--out {out}: is a file; give a folder")
    taken = [str(out / r) for r in roles if (out / r).exists()]
    if taken:
        raise HflowError(f"--out {out}: {taken[0]} already exists; give a new folder or remove it")
    try:
        from hybridflow.runtime.models.hf_export import export_checkpoint
    except ImportError as e:
        raise HflowError(f"`export` needs the runtime extra ({e.name} is missing): pip install -e '.[runtime]'") from None
    written = export_checkpoint(roles, out)
    print(f"wrote {', '.join(str(p) for p in written.values())}", file=sys.stdout)
    return 0
