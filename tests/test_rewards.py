"""Rewards: built-ins, user functions by module or file, weights, TRL's calling convention, async functions,
None as "not applicable", and named errors on bad output."""
import math

import pytest
import torch

import tests.reward_fixtures as fixtures
from grpo_recipe.rewards.funcs import RewardError, check_answer_columns, length, load_reward_funcs, score


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
    ("has_inf", "reward 'has_inf' returned inf at sample 1: rewards must be finite"),
    ("always_none", "no reward function applies to sample 0"),
    ("not_a_list", "reward 'not_a_list' returned float"),
])
def test_bad_reward_output_names_function_and_sample(fn, message):
    funcs = load_reward_funcs([f"tests.reward_fixtures:{fn}"])
    with pytest.raises(RewardError) as e:
        score(funcs, ["p"] * 3, ["a", "b", "c"], {})
    assert message in str(e.value)


def test_accuracy_without_answer_column():
    funcs = load_reward_funcs(["accuracy"])
    with pytest.raises(RewardError, match="^reward 'accuracy': dataset has no column 'answer'"):
        check_answer_columns(funcs, ["prompt", "reference"])  # before any work: setup checks the columns
    check_answer_columns(funcs, ["prompt", "solution"])
    with pytest.raises(RewardError, match="no column 'answer'"):
        score(funcs, ["p"], ["a"], {"reference": ["a"]})
    assert score(funcs, ["p"], ["a"], {"solution": ["a"]})[0].tolist() == [1.0]  # TRL's column name
    funcs = load_reward_funcs([{"func": "accuracy", "kwargs": {"answer_column": "reference"}}])
    assert score(funcs, ["p"], ["a"], {"reference": ["a"]})[0].tolist() == [1.0]


def test_trl_calling_convention_plain_and_conversational():
    fixtures.RECEIVED.clear()
    funcs = load_reward_funcs(["tests.reward_fixtures:echo_inputs", "length"])
    score(funcs, ["p1", "p2"], ["a", "bb"], {"answer": ["1", "2"]}, completion_ids=[[5, 0], [6, 7, 0]])
    chat = [[{"role": "user", "content": "p1"}]] * 2
    total, per = score(funcs, chat, ["a", "bb"], {"answer": ["1", "2"]}, completion_ids=[[5, 0], [6, 7, 0]])
    plain, conv = fixtures.RECEIVED
    assert plain == {"prompts": ["p1", "p2"], "completions": ["a", "bb"], "completion_ids": [[5, 0], [6, 7, 0]],
                     "answer": ["1", "2"]}
    assert conv["prompts"] == chat
    assert conv["completions"] == [[{"role": "assistant", "content": "a"}], [{"role": "assistant", "content": "bb"}]]
    assert per["length"].tolist() == [-59.0, -58.0]  # built-ins read a message's content


def test_values_trl_takes_are_taken_and_nan_means_not_applicable():
    funcs = load_reward_funcs(["tests.reward_fixtures:trl_values", {"func": "length", "kwargs": {"target_chars": 0}}])
    total, per = score(funcs, ["p"] * 5, ["a"] * 5, {})
    got = per["trl_values"].tolist()
    assert got[:3] == [1.0, 0.5, 2.0] and math.isnan(got[3]) and got[4] == 3.0
    assert total.tolist() == [0.0, -0.5, 1.0, -1.0, 2.0]  # the NaN sample: only length applies
    (f,) = load_reward_funcs(["tests.reward_fixtures:has_nan"])
    assert math.isnan(score([f, *load_reward_funcs(["length"])], ["p"] * 2, ["a", "b"], {})[1]["has_nan"][1].item())


def test_none_means_not_applicable():
    funcs = load_reward_funcs([{"func": "tests.reward_fixtures:none_for_odd", "weight": 2.0},
                               {"func": "length", "weight": 0.5, "kwargs": {"target_chars": 0}}])
    total, per = score(funcs, ["p"] * 4, ["a", "bb", "ccc", "dddd"], {})
    assert per["none_for_odd"][0].item() == 10.0 and math.isnan(per["none_for_odd"][1].item())
    # even samples: both apply; odd samples: only length's weighted value
    assert total.tolist() == [20.0 - 0.5, -1.0, 20.0 - 1.5, -2.0]


def test_async_rewards_run_concurrently():
    """Each of the two waits until the other has started: awaited one after the other, the first times out."""
    fixtures._STARTED.clear()
    funcs = load_reward_funcs(["tests.reward_fixtures:async_a", "tests.reward_fixtures:async_b", "length"])
    total, per = score(funcs, ["p"] * 2, ["x", "y"], {})
    assert per["async_a"].tolist() == [1.0, 1.0] and per["async_b"].tolist() == [1.0, 1.0]
    with pytest.raises(RewardError, match="reward 'async_raises' raised KeyError"):
        score(load_reward_funcs(["tests.reward_fixtures:async_raises"]), ["p"], ["x"], {})


def test_math_accuracy_reads_gsm8k_solutions_and_messages():
    funcs = load_reward_funcs(["math_accuracy"])
    chat = [[{"role": "user", "content": "q"}]] * 3
    total, _ = score(funcs, chat, ["so \\boxed{72}", "#### 71", "It is 72."],
                     {"answer": ["48/2 = <<48/2=24>>24.\n#### 72"] * 3})
    assert total.tolist() == [1.0, 0.0, 1.0]


@pytest.mark.parametrize("spec, message", [
    ("nope", "is not a built-in"),
    ("accuracy_reward", r"'path/file.py:function' \(TRL's accuracy_reward is math_accuracy here\)"),
    ("missing_file.py:f", "file not found"),
    ("tests.reward_fixtures:absent", "has no function 'absent'"),
    ({"func": "length", "weight": "x"}, "weight of 'length' must be a finite number"),
    ({"func": "length", "oops": 1}, "unknown key"),
    ({"weight": 1.0}, "mapping with 'func'"),
])
def test_bad_specs(spec, message):
    with pytest.raises(RewardError, match=message):
        load_reward_funcs([spec])


@pytest.mark.parametrize("spec, message", [
    ({"func": "length", "kwargs": {"target_char": 5}}, "'length' has no argument 'target_char' (did you mean "
                                                       "'target_chars'? it takes target_chars)"),
    ({"func": "accuracy", "kwargs": {"answer_colum": "a"}}, "'accuracy' has no argument 'answer_colum'"),
    ({"func": "tests.reward_fixtures:wrong_count", "kwargs": {"scale": 2}}, None),  # **kw: may want anything
])
def test_kwargs_must_name_an_argument(spec, message):
    if message is None:
        assert load_reward_funcs([spec])[0].kwargs == {"scale": 2}
    else:
        with pytest.raises(RewardError) as e:
            load_reward_funcs([spec])
        assert message in str(e.value)


def test_a_user_function_without_kwargs_is_checked_too(tmp_path):
    f = tmp_path / "r.py"
    f.write_text("def exact(prompts, completions, target=1):\n    return [0.0] * len(completions)\n")
    assert load_reward_funcs([{"func": f"{f}:exact", "kwargs": {"target": 2}}])[0].kwargs == {"target": 2}
    with pytest.raises(RewardError, match="'exact' has no argument 'traget' \\(did you mean 'target'"):
        load_reward_funcs([{"func": f"{f}:exact", "kwargs": {"traget": 2}}])


def test_values_beyond_float32_and_overflowing_sums_are_named():
    (f,) = load_reward_funcs(["tests.reward_fixtures:huge"])
    with pytest.raises(RewardError, match=r"reward 'huge' returned 1e\+308 at sample 1, which overflows float32"):
        score([f], ["p"] * 3, ["a", "b", "c"], {})
    funcs = load_reward_funcs([{"func": "length", "weight": 1e38}, {"func": "length", "name": "again", "weight": 1e38}])
    with pytest.raises(RewardError, match=r"weighted sum of the rewards \(length x 1e\+38, again x 1e\+38\) "
                                          r"overflows float32 at sample 0"):
        score(funcs, ["p"], ["a"], {})


def test_sys_exit_and_base_exceptions_become_named_errors(tmp_path):
    f = tmp_path / "r.py"
    f.write_text("import sys\nclass Stop(BaseException):\n    pass\n"
                 "def leave(prompts, completions, **kw):\n    sys.exit(3)\n"
                 "def stop(prompts, completions, **kw):\n    raise Stop('now')\n"
                 "def interrupt(prompts, completions, **kw):\n    raise KeyboardInterrupt\n")
    for name, message in (("leave", "reward 'leave' called sys.exit(3)"), ("stop", "reward 'stop' raised Stop: now")):
        with pytest.raises(RewardError) as e:
            score(load_reward_funcs([f"{f}:{name}"]), ["p"], ["a"], {})
        assert str(e.value) == message
    with pytest.raises(KeyboardInterrupt):  # Ctrl-C still stops the run
        score(load_reward_funcs([f"{f}:interrupt"]), ["p"], ["a"], {})


def test_duplicate_names_need_distinct_name():
    with pytest.raises(RewardError, match="duplicate"):
        load_reward_funcs(["length", "length"])
    funcs = load_reward_funcs(["length", {"func": "length", "name": "length_short", "kwargs": {"target_chars": 5}}])
    assert [f.name for f in funcs] == ["length", "length_short"]
