"""The arithmetic example's rewards: answer extraction, numeric and task-scorer correctness, format."""
import json

import pytest

from grpo_recipe.examples.arith_rewards import correctness, extract_answer, format_reward
from grpo_recipe.rewards.funcs import load_reward_funcs, score


@pytest.mark.parametrize("text, expected", [
    ("5 + 40 = 45", "45"),
    ("First 3 + 4 = 7.\nAnswer: -12", "-12"),  # 'Answer:' wins over later or earlier numbers
    ("answer = 1,234 apples, not 5", "1234"),
    ("Answer: 7\nso maybe 8", "7"),
    ("The result is 2.50", "2.50"),
    ("no digits here", None),
])
def test_extract_answer(text, expected):
    assert extract_answer(text) == expected


def test_numeric_correctness_compares_values_not_strings():
    completions = ["10 - 2 = 8", "Answer: -38", "Answer: 38", "Answer: 8.0", "I don't know"]
    assert correctness(None, completions, answer=["8", "-38", "-38", "8", "1"]) == [1.0, 1.0, 0.0, 1.0, 0.0]


def test_task_scorer_uses_reasoning_gym():
    pytest.importorskip("reasoning_gym")
    meta = json.dumps({"source_dataset": "basic_arithmetic", "expression": "41 - 79"})
    out = correctness(None, ["Answer: -38", "Answer: 38"], answer=["-38", "-38"], scorer="task",
                      task=["basic_arithmetic"] * 2, metadata=[meta] * 2)
    assert out == [1.0, 0.0]


def test_format_reward_levels():
    completions = ["3 + 4 = 7\nAnswer: 7", "Answer: 7\nbecause 3 + 4 = 7", "3 + 4 = 7", "answer:-2."]
    assert format_reward(None, completions) == [1.0, 0.5, 0.0, 1.0]


def test_loads_from_yaml_style_specs_like_any_user_function():
    funcs = load_reward_funcs(["grpo_recipe.examples.arith_rewards:correctness",
                               {"func": "grpo_recipe.examples.arith_rewards:format_reward", "weight": 0.2}])
    total, per = score(funcs, ["q", "q"], ["Answer: 4", "4"], {"answer": ["4", "5"]})
    assert per["correctness"].tolist() == [1.0, 0.0]
    assert total.tolist() == pytest.approx([1.2, 0.0])
