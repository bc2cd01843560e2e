"""Built-in verifiable tasks: a prompt generator and a rule-based reward in [0, 1] with partial credit.

- `sort`: "sort 4137:" → "1347" (sort 3–6 digits ascending).
- `add`:  "add 27+58:" → "85" (two numbers below 100).

A reward function has the signature users give too (`module:function`):
`reward(prompt: str, response: str, **fields) -> float`, where `fields` are the prompt row's other
columns (here `answer`). Partial credit is the fraction of characters in the right place, over the
longer of the response and the answer, so only the exact answer scores 1.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import dataclass

from hybridflow.simulator.names import lookup


def positional_credit(response: str, answer: str, align: str = "left") -> float:
    """Fraction of positions where response and answer agree, over the longer of the two."""
    response, answer = response.strip(), answer.strip()
    width = max(len(response), len(answer))
    if width == 0:
        return 1.0
    if align == "right":
        response, answer = response.rjust(width), answer.rjust(width)
    hits = sum(1 for a, b in zip(response, answer, strict=False) if a == b and a != " ")
    return hits / width


@dataclass(frozen=True)
class Task:
    name: str
    make_example: Callable[[random.Random], dict[str, str]]  # -> {"prompt": ..., "answer": ...}
    reward: Callable[..., float]
    max_prompt_chars: int
    max_answer_chars: int

    @property
    def reward_function(self) -> str:
        """The reward's `module:function` name (what a Plan's reward_function holds)."""
        return f"{self.reward.__module__}:{self.reward.__name__}"


def _sort_example(rng: random.Random) -> dict[str, str]:
    digits = "".join(rng.choice("0123456789") for _ in range(rng.randint(3, 6)))
    return {"prompt": f"sort {digits}:", "answer": "".join(sorted(digits))}


def sort_reward(prompt: str, response: str, answer: str | None = None, **_) -> float:
    """Reward for `sort`: 1 for the digits in ascending order, partial credit per right position."""
    if answer is None:  # recompute from the prompt: the task is verifiable without a stored answer
        answer = "".join(sorted(c for c in prompt.split(" ", 1)[-1] if c.isdigit()))
    return positional_credit(response, answer)


def _add_example(rng: random.Random) -> dict[str, str]:
    a, b = rng.randrange(100), rng.randrange(100)
    return {"prompt": f"add {a}+{b}:", "answer": str(a + b)}


def add_reward(prompt: str, response: str, answer: str | None = None, **_) -> float:
    """Reward for `add`: 1 for the exact sum, partial credit per right digit counted from the right."""
    if answer is None:
        a, b = prompt.split(" ", 1)[-1].rstrip(":").split("+")
        answer = str(int(a) + int(b))
    return positional_credit(response, answer, align="right")


TASKS: dict[str, Task] = {
    t.name: t
    for t in (
        Task("sort", _sort_example, sort_reward, max_prompt_chars=12, max_answer_chars=6),
        Task("add", _add_example, add_reward, max_prompt_chars=10, max_answer_chars=3),
    )
}
DEFAULT_TASK = "sort"


def get_task(name: str) -> Task:
    """A built-in task by name (any case; a near miss is answered with "did you mean")."""
    return TASKS[lookup(name, TASKS, "task", "or give a prompt file and a reward function", known_as="built-in tasks")]


def non_digit_cost(prompt: str, response: str, **_) -> float:
    """A rule-based cost for Safe-RLHF tests and demos: the fraction of response characters that are not
    digits (the "unsafe" behaviour to keep under the threshold)."""
    response = response.strip()
    return sum(1 for c in response if not c.isdigit()) / len(response) if response else 0.0
