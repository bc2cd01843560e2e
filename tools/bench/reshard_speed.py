"""Reshard benchmark: HybridFlow vs HybridFlow-V vs DS-Chat on local virtual devices.

Builds a Llama-shaped model, shards it tensor-parallel over t gloo processes (the training
layout), and switches it to generation tensor size t_g with each grouping of the 3D-HybridEngine
(`runtime/engines/rollout/reshard.py`), checking the generation weights against the full model every
time. Prints bytes received per device next to the paper's Table 2 formula, the peak weight
bytes held during the switch, and the seconds (median over repeats, slowest rank).

    python -m hybridflow.tools.bench.reshard_speed                 # t=4 -> t_g=2 on 4 devices
    python -m hybridflow.tools.bench.reshard_speed --t 4 --t-g 1 --json out.json

Goals (issue 5): bytes equal the formulas; HybridFlow takes ≤ 0.5× the DS-Chat time.
"""

from __future__ import annotations

import statistics
import sys
import time

from hybridflow.simulator.errors import HflowError
from hybridflow.simulator.io import write_json_atomic
from hybridflow.simulator.vocabulary.plan import IN_PLACE_RESHARDS
from hybridflow.simulator.vocabulary.units import MiB
from hybridflow.tools.cli_help import OneLineErrorParser
from hybridflow.tools.outputs import run_main


def _bench_rank(rank, world, t, t_g, model_kw, repeats):
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    from hybridflow.runtime.engines.parallelize import apply_tp, tp_local, tp_shard_dim
    from hybridflow.runtime.engines.rollout.reshard import Resharder
    from hybridflow.runtime.models.decoder import CausalLM
    from hybridflow.simulator.vocabulary.decoder_config import DecoderConfig

    torch.manual_seed(0)
    model = CausalLM(DecoderConfig(**model_kw))
    full = {n: p.detach().clone() for n, p in model.named_parameters()}
    apply_tp(model, init_device_mesh("cpu", (world // t, t), mesh_dim_names=("dp", "tp"))["tp"])
    shards = {n: tp_local(p.detach()) for n, p in model.named_parameters()}
    dims = {n: tp_shard_dim(p) for n, p in model.named_parameters()}
    model_bytes = sum(full[n].numel() * full[n].element_size() for n, d in dims.items() if d is not None)
    out = {}
    for mode in IN_PLACE_RESHARDS:
        rs = Resharder(t=t, t_g=t_g, d=world // t, mode=mode)
        times, stats = [], None
        for rep in range(repeats + 1):  # the first run warms up the groups and the allocator
            dist.barrier()
            start = time.perf_counter()
            gen, stats = rs.to_generation(shards, dims)
            dist.barrier()
            elapsed = torch.tensor(time.perf_counter() - start, dtype=torch.float64)
            dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
            if rep:
                times.append(elapsed.item())
            for name, g in gen.items():  # the switch must deliver exactly the generation slice
                d = dims[name]
                want = full[name] if d is None else full[name].chunk(t_g, d)[rs.gen_tp_rank]
                if not torch.equal(g, want):
                    raise AssertionError(f"{mode}: generation weight {name} differs from the training weights")
            del gen
        out[mode] = dict(bytes=stats.bytes_received, formula=rs.layout.formula_bytes(model_bytes),
                         peak=stats.peak_bytes, peak_formula=rs.layout.formula_peak_bytes(model_bytes),
                         seconds=statistics.median(times), collectives=stats.collectives)
    return dict(model_bytes=model_bytes, modes=out)


def run_benchmark(t: int = 4, t_g: int = 2, world: int | None = None, hidden: int = 768, layers: int = 4,
                  ffn: int = 2048, vocab: int = 8192, heads: int = 16, repeats: int = 3) -> dict:
    from hybridflow.runtime.engines.launch import run_local
    from hybridflow.runtime.engines.rollout.reshard import ReshardLayout

    world = world or t
    if world % t:
        raise HflowError(f"--world {world} must be a multiple of --t {t} (data-parallel replicas of the TP group)")
    ReshardLayout(t=t, t_g=t_g, d=world // t)  # validates t_g | t
    model_kw = dict(vocab_size=vocab, hidden_size=hidden, intermediate_size=ffn, num_hidden_layers=layers,
                    num_attention_heads=heads, num_key_value_heads=heads)
    results = run_local(_bench_rank, world, t, t_g, model_kw, repeats, timeout=1200.0)
    modes = {}
    for mode in IN_PLACE_RESHARDS:
        per = [r["modes"][mode] for r in results]
        modes[mode] = dict(per[0], bytes_max=max(p["bytes"] for p in per),
                           bytes_match=all(abs(p["bytes"] - p["formula"]) < 0.5 for p in per))
    hf, ds = modes["hybridflow"]["seconds"], modes["ds-chat"]["seconds"]
    return dict(t=t, t_g=t_g, world=world, model_bytes=results[0]["model_bytes"], repeats=repeats,
                modes=modes, time_ratio_hybridflow_vs_dschat=hf / ds if ds > 0 else float("nan"))


def print_report(res: dict) -> bool:
    from rich.console import Console
    from rich.table import Table

    table = Table(title=f"reshard t={res['t']} → t_g={res['t_g']} on {res['world']} local devices, "
                        f"M = {res['model_bytes'] / MiB:.1f} MiB (tensor-parallel weights)")
    for col in ("mode", "MiB/device", "Table 2 MiB", "match", "peak MiB", "seconds", "× DS-Chat"):
        table.add_column(col, justify="left" if col == "mode" else "right")
    ds = res["modes"]["ds-chat"]["seconds"]
    for mode, m in res["modes"].items():
        table.add_row(mode, f"{m['bytes'] / MiB:.2f}", f"{m['formula'] / MiB:.2f}", "yes" if m["bytes_match"] else "NO",
                      f"{m['peak'] / MiB:.1f}", f"{m['seconds']:.3f}", f"{m['seconds'] / ds:.2f}")
    console = Console(width=max(Console().width, 100))
    console.print(table)
    bytes_ok = all(m["bytes_match"] for m in res["modes"].values())
    time_ok = res["time_ratio_hybridflow_vs_dschat"] <= 0.5
    console.print(f"goal: bytes equal the formulas — {'met' if bytes_ok else 'NOT met'}; "
                  f"HybridFlow ≤ 0.5× DS-Chat time — {'met' if time_ok else 'NOT met'} "
                  f"({res['time_ratio_hybridflow_vs_dschat']:.2f}×)")
    return bytes_ok and time_ok


def main(argv: list[str] | None = None) -> int:
    ap = OneLineErrorParser(prog="reshard_speed", description=__doc__.split("\n\n")[0])
    ap.add_argument("--t", type=int, default=4, help="training tensor-parallel size (default 4)")
    ap.add_argument("--t-g", type=int, default=2, help="generation tensor-parallel size (default 2)")
    ap.add_argument("--world", type=int, default=None, help="devices (default t; a multiple of t adds dp replicas)")
    ap.add_argument("--hidden", type=int, default=768)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--ffn", type=int, default=2048)
    ap.add_argument("--vocab", type=int, default=8192)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--json", default=None, help="also write the figures to this JSON file")
    ap.add_argument("--check", action="store_true", help="exit 1 when a goal is not met")
    args = ap.parse_args(argv)
    try:
        res = run_benchmark(args.t, args.t_g, args.world, args.hidden, args.layers, args.ffn, args.vocab,
                            repeats=args.repeats)
    except HflowError as e:
        print(f"reshard_speed: error: {e}", file=sys.stderr)
        return 2
    ok = print_report(res)
    if args.json:
        write_json_atomic(args.json, res)
    return 1 if args.check and not ok else 0


if __name__ == "__main__":
    run_main(main)
