"""The calculator task: short word problems (one addition or subtraction of two-digit numbers), each
with its answer; the reward is 1 when the conversation's final answer is that number. A tiny model
cannot add in its head but can copy numbers: calling the calculator is how it gets them right.
Torch-free (the rows, the reward and the demonstrations the tiny model is warmed up on)."""

from __future__ import annotations

import json
import random
import re

ADD = ["{n} has {a} apples and buys {b} more. How many apples now?",
       "A box holds {a} pens; {b} pens are added. How many pens?",
       "{n} read {a} pages, then {b} more. How many pages in all?"]
SUB = ["{n} has {a} apples and eats {b}. How many apples are left?",
       "A bus carries {a} people; {b} get off. How many are on the bus?"]
NAMES = ["Tom", "Ana", "Li", "Sam", "Mia"]


def word_problems(n: int, seed: int = 0) -> list[dict]:
    """`n` rows {"prompt", "answer", "expression"}: a + b or a − b (a ≥ b), a, b in 10…79."""
    rng = random.Random(seed)
    rows = []
    for _ in range(n):
        a, b = rng.randint(10, 79), rng.randint(10, 79)
        if rng.random() < 0.5:
            text, expr, ans = rng.choice(ADD), f"{a}+{b}", a + b
        else:
            a, b = max(a, b), min(a, b)
            text, expr, ans = rng.choice(SUB), f"{a}-{b}", a - b
        rows.append({"prompt": text.format(n=rng.choice(NAMES), a=a, b=b), "answer": ans, "expression": expr})
    return rows


def final_number(text: str) -> int | None:
    numbers = re.findall(r"-?\d+", text)
    return int(numbers[-1]) if numbers else None


def answer_reward(prompt, response: str, answer: int | str = "", **_) -> float:
    """1.0 when the last number of the final answer is the row's answer, else 0.0."""
    return float(final_number(response) == int(answer)) if str(answer).lstrip("-").isdigit() else 0.0


def tool_call_text(expression: str) -> str:
    return "<tool_call>\n" + json.dumps({"name": "calculator", "arguments": {"expression": expression}}) + \
        "\n</tool_call>"


def demonstration(row: dict, use_tool: bool, rng: random.Random) -> list[str]:
    """The assistant turns of one demonstration: a calculator call then the tool's number, or a direct
    guess (one of the problem's numbers: usually wrong, as a model without the tool would be)."""
    if use_tool:
        return [tool_call_text(row["expression"]), str(row["answer"])]
    return [str(rng.choice([int(x) for x in re.findall(r"\d+", row["expression"])]))]
