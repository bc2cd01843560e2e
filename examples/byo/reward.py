"""The example's reward: `hflow-plan search … --reward-function examples/byo/reward.py:exact_match`."""


def exact_match(prompt, response: str, answer: str, **_) -> float:
    """1 when the response is the answer (surrounding spaces ignored), else 0. `prompt` is the row's
    prompt as the data holds it (here chat messages); `answer` is the row's answer column."""
    return float(response.strip() == answer.strip())
