"""Each role's model folder, before anything starts: recorded in the plan, overridden by `run --actor …`,
and checked (torch-free, Ray-free) so that a bad folder is one line and exit 2 within a second, not a
worker's traceback after start-up.
"""

from __future__ import annotations

from pathlib import Path

from hybridflow.runtime.models.folder_check import (
    HFLOW_TOKENIZER_FILE,
    INDEX_FILE,
    WEIGHTS_FILE,
    ModelFolder,
    check_model_folder,
    read_json,
    tokenizer_max_id,
)
from hybridflow.simulator.errors import HflowError
from hybridflow.simulator.vocabulary.model import ModelSpec, hf_folder
from hybridflow.simulator.vocabulary.plan import Plan, context_problem
from hybridflow.tools.flags import role_flag


def resolve_role_paths(plan: Plan, overrides: dict[str, str] | None = None) -> Plan:
    """The plan with `overrides` ({role: folder}, from `run --actor FOLDER …`) as its roles' paths and
    every path absolute (workers may run in another directory)."""
    overrides = overrides or {}
    for role in overrides:
        if role not in plan.roles:
            raise HflowError(f"{role_flag(role)}: the plan has no '{role}' model (its roles: {', '.join(plan.roles)}); "
                             f"drop {role_flag(role)} or re-plan with it")
    roles = {}
    for role, rp in plan.roles.items():
        ref = overrides.get(role, rp.path)
        folder = hf_folder(ref) if ref else None
        if ref and folder is None:
            how = f"{role_flag(role)} {ref}" if role in overrides else f"the plan's {role} path '{ref}'"
            raise HflowError(f"{how}: no such folder; give a Hugging Face model folder (config.json, weights, "
                             "tokenizer)")
        roles[role] = rp.model_copy(update={"path": str(folder) if folder else None})
    return plan.model_copy(update={"roles": roles})


def _shape(spec: ModelSpec) -> dict:
    d = spec.model_dump(exclude={"name", "head_dim", "context_len"})  # the context is checked against the lengths
    d["head_dim"] = spec.dim_head  # an explicit head_dim equal to hidden / heads is the same shape
    return d


def _check_planned_shape(role: str, folder: str, planned: ModelSpec) -> None:
    found, want = _shape(ModelSpec.from_hf_config(folder)), _shape(planned)
    diff = [k for k in want if want[k] != found.get(k)]
    if diff:
        k = diff[0]
        raise HflowError(f"{folder}: its model has {k} = {found.get(k)} but the plan's {role} has {want[k]}; "
                         f"re-plan with `hflow-plan search {role_flag(role)} {folder}` or give a folder of the planned shape")


def tokenizer_vocab(folder: Path) -> dict[str, int] | None:
    """The token → id map of a folder's tokenizer (None without one): what 'the same tokenizer' means."""
    path, _ = tokenizer_max_id(Path(folder))
    if path is None:
        return None
    if path.name == "tokenizer.json":
        from tokenizers import Tokenizer

        return Tokenizer.from_file(str(path)).get_vocab(with_added_tokens=True)
    if path.name == HFLOW_TOKENIZER_FILE:
        char = read_json(path, "hybridflow's character tokenizer")
        return {t: i for i, t in enumerate([*char.get("specials", []), *char.get("chars", "")])}
    return None  # tokenizer_config.json alone names no vocabulary to compare


def check_folders(paths: dict[str, str], planned: dict[str, ModelSpec] | None = None) -> dict[str, ModelFolder]:
    """Each role's folder can be that role's model (folder_check: config, family, weights, tokenizer), holds the
    planned shape, and reads the actor's token ids: every other role's embedding fits the actor's tokenizer,
    and a folder with a tokenizer of its own has the actor's vocabulary. One-line HflowError otherwise."""
    found = {}
    for role, path in paths.items():
        # Only the actor's tokenizer encodes; the others read its ids (compared below, not required).
        found[role] = check_model_folder(path, role, tokenizer=role == "actor")
        if planned and role in planned:
            _check_planned_shape(role, path, planned[role])
    actor = found.get("actor")
    if actor is None:
        return found
    actor_vocab = None
    for role, f in found.items():
        if role == "actor" or f.path == actor.path:
            continue
        vocab = f.config.decoder.vocab_size
        if actor.max_token_id is not None and actor.max_token_id >= vocab:
            raise HflowError(f"{f.path}: the {role} model's embedding (vocab_size {vocab}) cannot read the actor's "
                             f"token ids (up to {actor.max_token_id}); give a {role} model trained with the actor's "
                             "tokenizer")
        theirs = tokenizer_vocab(f.path)
        if theirs is not None:
            actor_vocab = actor_vocab if actor_vocab is not None else tokenizer_vocab(actor.path)
            if actor_vocab is not None and theirs != actor_vocab:
                differ = len(set(theirs.items()) ^ set(actor_vocab.items()))
                raise HflowError(f"{f.path}: the {role} model's tokenizer is not the actor's ({differ} token entries "
                                 f"differ from {actor.path}'s); the {role} reads the actor's token ids: give it a "
                                 "model trained with the actor's tokenizer")
    return found


def check_search_folders(paths: dict[str, str]) -> None:
    """`search`'s check: a folder that holds weights is checked as `run` will check it, so a plan is not
    written for weights that cannot run; a folder of config.json alone is planned from it (pricing a
    model not downloaded), and `run` refuses it."""
    holding = {r: p for r, p in paths.items() if any((Path(p) / f).is_file() for f in (WEIGHTS_FILE, INDEX_FILE))}
    if holding:
        check_folders(holding)


def check_role_folders(plan: Plan) -> None:
    """Every role folder the plan names (see check_folders); torch-free and Ray-free, for `run`'s preflight."""
    check_folders({r: rp.path for r, rp in plan.roles.items() if rp.path},
                  {r: rp.model for r, rp in plan.roles.items()})
    for role, rp in plan.roles.items():  # the folder's own context (`run --actor DIR` may differ from the plan's)
        if rp.path:
            try:
                context_problem(role, ModelSpec.from_hf_config(rp.path), plan.workload)
            except ValueError as e:
                raise HflowError(f"{rp.path}: {e}") from None
