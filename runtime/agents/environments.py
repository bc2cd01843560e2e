"""Interactive environments: the model's turn is an action, the environment answers with an observation
(appended as a user turn), a reward for that turn and whether the episode is over.

    class MyEnv(Environment):
        def reset(self, row: dict, seed: int) -> str: ...          # the first observation
        def step(self, action: str) -> tuple[str, float, bool]: ...   # observation, reward, done

Rewards are per turn (each lands on the last token the model generated in that turn) or only final (0
until the last step): the sum is the episode's score. A user's environment is a class named
`module:Class` or `path/to/file.py:Class`, built with no arguments for each conversation; the shipped
one is `guess-number`. Torch-free.
"""

from __future__ import annotations

import random
import re
from abc import ABC, abstractmethod

from hybridflow.runtime.tasks.user_functions import load_function
from hybridflow.simulator.errors import HflowError


class Environment(ABC):
    @abstractmethod
    def reset(self, row: dict, seed: int) -> str:
        """Start an episode for a data row; the first observation (the conversation's first user turn)."""

    @abstractmethod
    def step(self, action: str) -> tuple[str, float, bool]:
        """The model's turn (its text) → (observation, reward for this turn, episode over)."""


class GuessNumber(Environment):
    """Guess a secret number in 1…`high` (`high` from the row, default 16): each guess is told `higher`
    or `lower`; a correct guess scores 1 and ends the episode (a final reward: 0 for every other turn)."""

    def reset(self, row: dict, seed: int) -> str:
        self.high = int(row.get("high", 16))
        self.secret = int(row["secret"]) if "secret" in row else random.Random(seed).randint(1, self.high)
        return f"Guess my number between 1 and {self.high}. Answer with one number."

    def step(self, action: str) -> tuple[str, float, bool]:
        numbers = re.findall(r"-?\d+", action)
        if not numbers:
            return "Answer with one number.", 0.0, False
        guess = int(numbers[-1])
        if guess == self.secret:
            return "Correct!", 1.0, True
        return ("higher" if guess < self.secret else "lower"), 0.0, False


BUILTIN_ENVIRONMENTS = {"guess-number": GuessNumber}


def no_reward(prompt, response: str, **_) -> float:
    """The reward function of a run whose environment gives every reward (its per-turn rewards are added)."""
    return 0.0


def load_environment(spec: str) -> type[Environment]:
    """The environment class of `guess-number`, `module:Class` or `file.py:Class` (one line if not one)."""
    if spec.lower() in BUILTIN_ENVIRONMENTS:
        return BUILTIN_ENVIRONMENTS[spec.lower()]
    if ":" not in spec:
        raise HflowError(f"environment '{spec}' is not a built-in one ({', '.join(BUILTIN_ENVIRONMENTS)}) nor "
                         "'module:Class' / 'path/to/file.py:Class'")
    cls = load_function(spec, what="environment")
    if not (isinstance(cls, type) and all(callable(getattr(cls, m, None)) for m in ("reset", "step"))):
        raise HflowError(f"environment '{spec}' must be a class with reset(row, seed) and step(action) "
                         "(subclass hybridflow.runtime.agents.environments.Environment)")
    return cls
