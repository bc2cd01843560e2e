"""The search a command line asks for: the SearchRequest that the flags of `search` and `compare`
(tools/flags.py add_request_args) describe, and Algorithm 1 run on it with a progress bar on stderr."""

from __future__ import annotations

import sys
from pathlib import Path

from hybridflow.simulator.algorithms import get_algorithm
from hybridflow.simulator.errors import HflowError
from hybridflow.simulator.vocabulary.workload import Workload
from hybridflow.tools.flags import WORKLOAD_FLAGS, role_flag, role_values


def request_from_args(args):
    from hybridflow.planner.request import SearchRequest
    from hybridflow.simulator.io import SPEC_SUFFIXES, load_model_file, read_mapping
    from hybridflow.simulator.vocabulary.hardware import ClusterSpec, HardwareSpec, hardware_preset
    from hybridflow.simulator.vocabulary.lora import LoraConfig
    from hybridflow.simulator.vocabulary.model import hf_folder, resolve_model

    if args.cluster:
        cluster = load_model_file(ClusterSpec, args.cluster)
    else:
        gpu = args.gpu
        hw = load_model_file(HardwareSpec, gpu) if Path(gpu).suffix in SPEC_SUFFIXES else hardware_preset(gpu)
        cluster = ClusterSpec(hardware=hw, nodes=args.nodes, devices_per_node=args.gpus_per_node)
    fields = read_mapping(args.workload) if args.workload else {}
    for flag, field, _ in WORKLOAD_FLAGS:
        value = getattr(args, flag.replace("-", "_"))
        if value is not None:
            fields[field] = value
    if args.response_lengths is not None:
        fields["response_lengths"] = args.response_lengths
    workload = Workload.model_validate(fields)
    roles = get_algorithm(args.algo).roles
    given = role_values(args)
    unused = [r for r in given if r not in roles]
    if unused:
        raise HflowError(f"{role_flag(unused[0])} is not a role of {args.algo} (roles: {', '.join(roles)}); drop it")
    if not args.model and "actor" not in given:
        raise HflowError("give --model NAME (a preset such as llama2-7b, a HF folder or a ModelSpec YAML) "
                         "or --actor and the other roles")
    rules = {"reward": args.reward_function, "cost": args.cost_function}
    for r, fn in rules.items():
        if fn and (":" not in fn or r in given):
            raise HflowError(f"--{r}-function {fn}: give 'module:function' and drop --{r}")
    lora = getattr(args, "lora", None)
    if lora and "ref" in given:
        raise HflowError(f"--ref {given['ref']}: a LoRA run's reference is the actor's base model; drop --ref or --lora")
    models, paths = {}, {}
    for r in roles:
        if lora and r == "ref":
            continue
        ref = given.get(r) or (None if rules.get(r) else args.model)
        if ref:
            models[r] = resolve_model(ref)
            folder = hf_folder(ref)  # a preset or a ModelSpec file records no path: `run` has no weights for it
            if folder is not None:
                paths[r] = str(folder)
    if paths:  # weights the runtime cannot train are refused now, not after the search
        from hybridflow.tools.preflight.role_folders import check_search_folders

        check_search_folders(paths)
    return SearchRequest(algorithm=args.algo, models=models, paths=paths, cluster=cluster, workload=workload,
                         reward_function=args.reward_function, cost_function=args.cost_function,
                         max_pp=args.max_pp, max_gen_pp=args.max_gen_pp, max_sp=args.max_sp, top_k=args.top,
                         backends=args.backends,
                         offload=args.offload, lora=LoraConfig(rank=lora) if lora else None,
                         agent=agent_workload_arg(getattr(args, "agent_workload", None)))


def agent_workload_arg(path: str | None):
    """`--agent-workload FILE` read as an AgentWorkload (None without one); what is wrong, one line."""
    if not path:
        return None
    from pydantic import ValidationError

    from hybridflow.simulator.agents.planning import AgentWorkload
    from hybridflow.simulator.io import read_mapping

    if not Path(path).is_file():
        raise HflowError(f"--agent-workload {path}: no such file; give a YAML/JSON of turns, tool_seconds, …")
    try:
        return AgentWorkload.model_validate(read_mapping(path))
    except ValidationError as e:
        err = e.errors()[0]
        raise HflowError(f"--agent-workload {path}: {'.'.join(map(str, err['loc']))}: {err['msg']}") from None


def run_search(req, cm=None):
    """The search with a progress bar on stderr (never on stdout): (the planner, its result); a request
    nothing fits is one line saying why."""
    from rich.console import Console
    from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

    from hybridflow.planner.search import search_as_asked

    console = Console(file=sys.stderr)
    with Progress(TextColumn("searching placements"), BarColumn(), TextColumn("{task.completed}/{task.total}"),
                  TimeElapsedColumn(), console=console, transient=True, disable=not console.is_terminal) as bar:
        task = bar.add_task("search", total=None)

        def tick(done: int, total: int) -> None:
            bar.update(task, completed=done, total=total)

        planner, result = search_as_asked(req, cm, progress=tick)
    if result.best is None:
        from hybridflow.planner.diagnose import explain_infeasible

        raise HflowError(explain_infeasible(req, planner.cm, sys.stderr))
    return planner, result
