"""The math-answer reward (runtime/tasks/math_answer.py, math-verify): `\\boxed{}` and plain numbers alike, compared
as mathematics."""

import pytest

pytest.importorskip("math_verify")

from hybridflow.runtime.tasks.math_answer import math_answer  # noqa: E402


@pytest.mark.parametrize("response, answer, score", [
    ("so the answer is \\boxed{42}", "42", 1.0),
    ("42", "42", 1.0),
    ("Natalia sold 48 + 24 = 72 clips.", "72", 1.0),  # the last number of a worked answer
    ("The total is 1,234.", "1234", 1.0),
    ("\\boxed{\\frac{1}{2}}", "0.5", 1.0),
    ("half: 1/2", "\\frac{1}{2}", 1.0),
    ("\\boxed{41}", "42", 0.0),
    ("41", "42", 0.0),
    ("I do not know", "3", 0.0),
    ("", "3", 0.0),
])
def test_math_answers_boxed_and_plain(response, answer, score):
    assert math_answer("q", response, answer) == score


def test_the_check_before_a_run_accepts_it(tmp_path):
    from hybridflow.runtime.tasks.user_functions import check_on_row, load_function

    fn = load_function("hybridflow.runtime.tasks.math_answer:math_answer")
    check_on_row(fn, "reward function", [{"prompt": "what is 6 times 7?", "answer": "42"}], "data.jsonl")
