"""Rewards for the arithmetic example: ordinary reward functions, as any user could write them.

    reward_funcs:
      - grpo_recipe.examples.arith_rewards:correctness
      - {func: grpo_recipe.examples.arith_rewards:format_reward, weight: 0.2}

Each has the recipe's signature `fn(prompts, completions, **columns) -> list[float]`; `answer` (and, for
`scorer: task`, `task` and `metadata`) are columns written by `grpo_recipe.tools.prepare_data`.
"""
from __future__ import annotations

import json
import re

NUMBER = r"[-+]?\d[\d,]*(?:\.\d+)?"
ANSWER_LINE = re.compile(rf"answer\s*[:=]\s*\$?\s*({NUMBER})", re.IGNORECASE)
ANY_NUMBER = re.compile(NUMBER)
FORMAT_LINE = re.compile(rf"answer\s*:\s*{NUMBER}\.?", re.IGNORECASE)


def extract_answer(completion: str) -> str | None:
    """The number after the last 'Answer:', else the last number in the text, else None."""
    found = ANSWER_LINE.findall(completion)
    if not found:
        found = ANY_NUMBER.findall(completion)
    return found[-1].replace(",", "") if found else None


def numbers_equal(predicted: str | None, answer: str) -> bool:
    if predicted is None:
        return False
    try:
        return abs(float(predicted) - float(str(answer).replace(",", ""))) < 1e-6
    except ValueError:
        return predicted.strip() == str(answer).strip()


def _task_score(completion: str, answer: str, task: str, metadata: str) -> float:
    import reasoning_gym

    predicted = extract_answer(completion)
    if predicted is None:
        return 0.0
    score = reasoning_gym.get_score_answer_fn(task)
    return float(score(predicted, {"answer": answer, "metadata": json.loads(metadata)}))


def correctness(prompts, completions, answer, scorer: str = "numeric", **columns) -> list[float]:
    """1.0 when the extracted final answer is right, else 0.0.

    scorer: `numeric` (exact numeric match) or `task` (reasoning-gym's own scorer for the row's task; may give
    partial credit).
    """
    if scorer == "task":
        return [_task_score(c, a, t, m) for c, a, t, m in zip(completions, answer, columns["task"], columns["metadata"])]
    if scorer != "numeric":
        raise ValueError(f"scorer must be 'numeric' or 'task', got {scorer!r}")
    return [float(numbers_equal(extract_answer(c), a)) for c, a in zip(completions, answer)]


def format_reward(prompts, completions, **_) -> list[float]:
    """1.0 when the last non-empty line is exactly 'Answer: <number>', 0.5 when such a line appears elsewhere."""
    out = []
    for c in completions:
        lines = [line.strip() for line in c.strip().splitlines() if line.strip()]
        if lines and FORMAT_LINE.fullmatch(lines[-1]):
            out.append(1.0)
        elif any(FORMAT_LINE.fullmatch(line) for line in lines):
            out.append(0.5)
        else:
            out.append(0.0)
    return out
