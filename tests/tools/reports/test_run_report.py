"""How a run's phases look on the console (tools/reports/run.py ConsoleEvents): a line per phase with
the seconds since the start, the warm-up's steps, a line per iteration when the output is a file."""

from __future__ import annotations

import io
import re

from rich.console import Console

from hybridflow.tools.reports.run import LOG_EVERY_STEPS, ConsoleEvents


def test_every_phase_has_its_line_and_a_log_file_gets_the_steps_and_iterations():
    buf = io.StringIO()
    events = ConsoleEvents(Console(file=buf, width=200))  # a file, not a terminal: no live bars
    with events:
        events.phase("ray", "starting a local Ray cluster (2 logical CPUs)")
        events.phase("warmup", "warming up the built-in policy 'tiny'", total=2 * LOG_EVERY_STEPS + 10)
        for step in range(1, 2 * LOG_EVERY_STEPS + 1):  # stops early, as a warm-up that reached its target
            events.advance(step)
        events.phase("workers", "starting 2 worker process(es) for group 'g' (actor, ref)")
        events.phase("weights", "loading actor's weights")
        events.iterations(2)
        events.iteration({"iteration": 1, "reward_mean": 0.5, "kl": 0.01, "seconds": 1.25, "tokens_per_second": 800.0})
        events.iteration({"iteration": 2, "reward_mean": 0.625, "seconds": 1.0, "tokens_per_second": 1000.0})
    lines = [line for line in buf.getvalue().splitlines() if re.match(r"\s+\d+\.\d s  ", line)]
    said = [line.split(" s  ", 1)[1] for line in lines]
    assert said[:2] == ["starting a local Ray cluster (2 logical CPUs)", "warming up the built-in policy 'tiny'"]
    assert said[2].startswith(f"step {LOG_EVERY_STEPS} of at most 60, at most ")
    assert said[3].startswith(f"step {2 * LOG_EVERY_STEPS} of at most 60, at most ")
    assert said[4].startswith(f"done: {2 * LOG_EVERY_STEPS} steps in ")
    assert said[5:] == [
        "starting 2 worker process(es) for group 'g' (actor, ref)",
        "loading actor's weights",
        "it 1: reward 0.500 kl +0.0100, 1.25 s, 800 tokens/s",
        "it 2: reward 0.625, 1.00 s, 1,000 tokens/s",
    ]


def test_quiet_mode_keeps_the_phase_lines_only():
    buf = io.StringIO()
    events = ConsoleEvents(Console(file=buf, width=200), quiet=True)  # --json: stderr, no bars
    with events:
        events.phase("workers", "starting 1 worker process(es) for group 'g' (actor)")
        events.iterations(1)
        events.iteration({"iteration": 1, "reward_mean": 0.5, "seconds": 1.0, "tokens_per_second": 1.0})
    text = buf.getvalue()
    assert "starting 1 worker process(es)" in text and "it 1:" not in text
