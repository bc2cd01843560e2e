"""Each role's model folder, before anything starts: recorded in the plan, overridden by `run --actor …`,
and checked (torch-free, Ray-free) so that a bad folder is one line and exit 2 within a second, not a
worker's traceback after start-up.
"""

from __future__ import annotations

from hybridflow.simulator.errors import HflowError
from hybridflow.simulator.model import ModelSpec, hf_folder
from hybridflow.simulator.plan import Plan


def resolve_role_paths(plan: Plan, overrides: dict[str, str] | None = None) -> Plan:
    """The plan with `overrides` ({role: folder}, from `run --actor FOLDER …`) as its roles' paths and
    every path absolute (workers may run in another directory)."""
    overrides = overrides or {}
    for role in overrides:
        if role not in plan.roles:
            raise HflowError(f"--{role}: the plan has no '{role}' model (its roles: {', '.join(plan.roles)}); "
                             f"drop --{role} or re-plan with it")
    roles = {}
    for role, rp in plan.roles.items():
        ref = overrides.get(role, rp.path)
        folder = hf_folder(ref) if ref else None
        if ref and folder is None:
            how = f"--{role} {ref}" if role in overrides else f"the plan's {role} path '{ref}'"
            raise HflowError(f"{how}: no such folder; give a Hugging Face model folder (config.json, weights, "
                             "tokenizer)")
        roles[role] = rp.model_copy(update={"path": str(folder) if folder else None})
    return plan.model_copy(update={"roles": roles})


def _shape(spec: ModelSpec) -> dict:
    d = spec.model_dump(exclude={"name", "head_dim"})
    d["head_dim"] = spec.dim_head  # an explicit head_dim equal to hidden / heads is the same shape
    return d


def check_role_folders(plan: Plan) -> None:
    """Every role folder of the plan describes the model the plan was made for (one-line HflowError)."""
    for role, rp in plan.roles.items():
        if not rp.path:
            continue
        found = _shape(ModelSpec.from_hf_config(rp.path))
        planned = _shape(rp.model)
        diff = [k for k in planned if planned[k] != found.get(k)]
        if diff:
            k = diff[0]
            raise HflowError(f"{rp.path}: its model has {k} = {found.get(k)} but the plan's {role} has {planned[k]}; "
                             f"re-plan with `hflow-plan search --{role} {rp.path}` or give a folder of the "
                             "planned shape")
