"""A profile's calibration on the console: the fitted figures and the fit's error per op kind, as
`profile` prints it after measuring and `replay` before pricing."""

from __future__ import annotations


def print_fit(cal, console, title: str = "") -> None:
    """The calibration's fitted figures and its error per op kind."""
    from rich.table import Table

    t = Table(title=title or f"fit of profile '{cal.profile}'")
    for col in ("op kind", "points", "median |err|", "max |err|", "bias"):
        t.add_column(col, justify="right" if col != "op kind" else "left")
    for op, e in cal.errors.items():
        t.add_row(op, str(e.points), f"{e.median:.1%}", f"{e.max:.1%}", f"{e.bias:+.1%}")
    console.print(t)
    hw = cal.hardware
    if not cal.overheads.megatron_fitted:
        console.print("no Megatron points: roles with train.backend megatron are priced by the analytic terms on "
                      "these figures (measure them with --megatron, or --add-megatron FILE.json)")
    console.print(f"fitted: {hw.peak_flops / 1e9:.2f} GFLOP/s, memory {hw.hbm_bandwidth / 1e9:.2f} GB/s, link "
                  f"{hw.intra_node_bandwidth / 1e9:.3f} GB/s, latency {hw.intra_node_latency * 1e3:.2f} ms, "
                  f"tokens_half {cal.params.tokens_half:.3g}, width_half {cal.params.width_half:.3g}, decode step "
                  f"overhead {cal.params.decode_step_overhead * 1e3:.2f} ms, dispatch "
                  f"{cal.overheads.dispatch_seconds * 1e3:.1f} ms, alone speedup {cal.overheads.alone_speedup:.2f}")
