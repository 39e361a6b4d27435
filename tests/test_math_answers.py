"""Final-answer extraction and numeric comparison (the math_accuracy reward) on a table of answer formats."""
import pytest

from grpo_recipe.rewards.math_answers import answers_match, completion_answer, last_boxed, reference_answer, to_number


@pytest.mark.parametrize("completion, answer, right", [
    ("Natalia sold 48 + 24 = 72 clips.\n#### 72", "She sold 48/2 = <<48/2=24>>24 in May.\n#### 72", 1),
    ("so the total is \\boxed{72}.", "#### 72", 1),
    ("$\\boxed{\\$1,234.00}$", "1234", 1),
    ("The answer is 72.", "72", 1),
    ("Answer: 18 dollars", "#### 18", 1),
    ("3 + 4 = 7, then 7 * 2 = 14", "14", 1),  # the last number
    ("3 + 4 = 7, then 7 * 2 = 14", "7", 0),
    ("\\boxed{72} and then 5", "72", 1),  # a box wins over later numbers
    ("\\boxed{\\frac{3}{4}}", "0.75", 1),
    ("It is 3/4 of the cake. The answer is 3/4", "#### 0.75", 1),
    ("\\boxed{-5}", "−5", 1),
    ("\\boxed{50\\%}", "50", 1),
    ("\\boxed{x + 1}", "\\boxed{x+1}", 1),  # not numbers: compared as text
    ("\\boxed{72", "72", 1),  # a cut box: the last number
    ("no idea", "72", 0),
    ("", "72", 0),
    ("The answer is 71.9999999", "72", 1),
    ("The answer is 72.1", "72", 0),
])
def test_answer_formats(completion, answer, right):
    assert answers_match(completion_answer(completion), reference_answer(answer)) == bool(right)


def test_pieces():
    assert last_boxed("a \\boxed{\\frac{1}{2}} b \\boxed{3}") == "3"
    assert last_boxed("\\boxed{\\frac{1}{2}}") == "\\frac{1}{2}"
    assert reference_answer("steps\n#### 1,000\n") == "1,000"
    assert to_number("1,000") == 1000.0 and to_number("\\$18.50") == 18.5 and to_number("x+1") is None
    assert completion_answer("nothing here") is None
