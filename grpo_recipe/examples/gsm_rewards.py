"""A reward function file, as you would write your own (the README's "Train your own model" example).

    reward_funcs:
      - math_accuracy                                                    # built-in: the final number is right
      - {func: grpo_recipe/examples/gsm_rewards.py:format_reward, weight: 0.2}

A reward function takes TRL's arguments and returns one float (or None: "does not apply") per completion:
`prompts` and `completions` (text, or [{"role": "assistant", "content": ...}] when the dataset's prompts are
chat messages), `completion_ids` (the sampled token ids), and every other dataset column by name (here
`answer`). Write it `async def` to have it run concurrently with the other async ones (e.g. a judge model
behind an HTTP endpoint).
"""
from __future__ import annotations

import re

FINAL_LINE = re.compile(r"####\s*-?[\d,]*\.?\d+\s*")


def _text(completion) -> str:
    return completion[-1]["content"] if isinstance(completion, list) else completion


def format_reward(prompts, completions, completion_ids, **columns) -> list[float]:
    """1.0 when the completion's last non-empty line is GSM8K's `#### <number>`, else 0.0."""
    out = []
    for completion in completions:
        lines = [line for line in _text(completion).strip().splitlines() if line.strip()]
        out.append(float(bool(lines) and FINAL_LINE.fullmatch(lines[-1].strip()) is not None))
    return out
