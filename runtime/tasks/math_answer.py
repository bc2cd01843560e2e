"""A reward for math answers, checked with Hugging Face's `math-verify` (the runtime extra): the response's
final answer — `\\boxed{…}` first, else the last number or expression — compared with the row's `answer`
as mathematics, not as text (`\\frac{1}{2}` = `0.5`, `1,234` = `1234`).

    hflow-plan run plan.json --prompts gsm.jsonl --reward-function hybridflow.runtime.tasks.math_answer:math_answer

Signal-based time limits only work in a main thread, so they are used there and off elsewhere (a reward
run in a thread pool).
"""

from __future__ import annotations

import threading

from hybridflow.simulator.errors import HflowError


def _timeout() -> int | None:
    return 5 if threading.current_thread() is threading.main_thread() else None


def math_answer(prompt, response: str, answer, **_) -> float:
    """1.0 when the response's final answer equals `answer` mathematically, else 0.0."""
    try:
        from math_verify import parse, verify
    except ImportError:
        raise HflowError("the math_answer reward needs math-verify: pip install math-verify "
                         "(it comes with the runtime extra)") from None
    t = _timeout()
    gold = parse(str(answer), parsing_timeout=t)
    found = parse(response, parsing_timeout=t)
    if not gold or not found:
        return 0.0
    return float(verify(gold, found, timeout_seconds=t))
