"""Rewards: built-ins, user functions by module or file, weights, and named errors on bad output."""

import pytest
import torch

from recipe.rewards import RewardError, length, load_reward_funcs, score


def test_length_reward_formula():
    assert length(["p"] * 3, ["abc", "a" * 60, "a" * 70], target_chars=60) == [-57, 0, -10]


def test_weighted_sum_and_per_function_values(tmp_path):
    f = tmp_path / "my_rewards.py"
    f.write_text("def shout(prompts, completions, **kw):\n    return [float(c.isupper()) for c in completions]\n")
    funcs = load_reward_funcs([{"func": "length", "weight": 0.5, "kwargs": {"target_chars": 2}},
                               f"{f}:shout", {"func": "accuracy", "weight": 2.0}])
    total, per = score(funcs, ["q"] * 3, ["AB", "abc", "X"], {"answer": ["AB", "x", "Y"]})
    assert per["length"].tolist() == [0.0, -1.0, -1.0]
    assert per["shout"].tolist() == [1.0, 0.0, 1.0]
    assert per["accuracy"].tolist() == [1.0, 0.0, 0.0]
    torch.testing.assert_close(total, 0.5 * per["length"] + per["shout"] + 2.0 * per["accuracy"])


def test_module_function_and_numpy_or_tensor_outputs():
    (f,) = load_reward_funcs(["tests.reward_fixtures:numpy_ones"])
    total, _ = score([f], ["a", "b"], ["x", "y"], {})
    assert total.tolist() == [1.0, 1.0]
    (f,) = load_reward_funcs(["tests.reward_fixtures:tensor_twos"])
    assert score([f], ["a"], ["x"], {})[0].tolist() == [2.0]


@pytest.mark.parametrize("fn, message", [
    ("raises", "reward 'raises' raised ZeroDivisionError"),
    ("wrong_count", "reward 'wrong_count' returned 1 values for 3 completions"),
    ("has_nan", "reward 'has_nan' returned nan at sample 1"),
    ("has_none", "reward 'has_none' returned None at sample 2"),
    ("not_a_list", "reward 'not_a_list' returned float"),
])
def test_bad_reward_output_names_function_and_sample(fn, message):
    funcs = load_reward_funcs([f"tests.reward_fixtures:{fn}"])
    with pytest.raises(RewardError) as e:
        score(funcs, ["p"] * 3, ["a", "b", "c"], {})
    assert message in str(e.value)


def test_accuracy_without_answer_column():
    funcs = load_reward_funcs(["accuracy"])
    with pytest.raises(RewardError, match="no column 'answer'"):
        score(funcs, ["p"], ["a"], {"solution": ["a"]})


@pytest.mark.parametrize("spec, message", [
    ("nope", "is not a built-in"),
    ("missing_file.py:f", "file not found"),
    ("tests.reward_fixtures:absent", "has no function 'absent'"),
    ({"func": "length", "weight": "x"}, "weight of 'length' must be a finite number"),
    ({"func": "length", "oops": 1}, "unknown key"),
    ({"weight": 1.0}, "mapping with 'func'"),
])
def test_bad_specs(spec, message):
    with pytest.raises(RewardError, match=message):
        load_reward_funcs([spec])


def test_duplicate_names_need_distinct_name():
    with pytest.raises(RewardError, match="duplicate"):
        load_reward_funcs(["length", "length"])
    funcs = load_reward_funcs(["length", {"func": "length", "name": "length_short", "kwargs": {"target_chars": 5}}])
    assert [f.name for f in funcs] == ["length", "length_short"]
