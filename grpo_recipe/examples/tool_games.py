"""The multi-turn quickstarts' tool, environment and rewards: user code, as any user could write it.

quickstart_tools.yaml: the model may call `secret_word()`; `said_the_secret` pays 1 when the final answer is the
word the tool returned (without a call it cannot know it). quickstart_env.yaml: a `Lamp` environment per
completion, switched by its `switch()` method; `get_reward` pays 1 when the lamp ends on (an odd number of
switches). Both start from `builtin:tiny-qwen2-tools`, a tiny model taught their turn format by a short
supervised warm-up on `demos()` (grpo_recipe/assets/tool_demos.jsonl), which it follows only loosely: the runs
learn when to call and how often.

    python -m grpo_recipe.examples.tool_games demos > grpo_recipe/assets/tool_demos.jsonl   # the warm-up's data
    python -m grpo_recipe.examples.tool_games prompts > grpo_recipe/assets/tool_prompts.jsonl  # the runs' prompts
"""
from __future__ import annotations

import json
import random
import sys

SECRET = "swordfish"
WORDS = ["apple", "river", "stone", "cloud", "tiger", "piano", "candle", "mirror"]


def secret_word() -> str:
    """The secret word of the day."""
    return SECRET


def said_the_secret(prompts, completions, **_) -> list[float]:
    """1 when the last message is the word a `secret_word` call returned in this completion, else 0."""
    out = []
    for turns in completions:
        results = [m["content"] for m in turns if m.get("role") == "tool" and m.get("name") == "secret_word"]
        final = str(turns[-1].get("content") or "").strip().rstrip(".") if turns[-1].get("role") == "assistant" else ""
        out.append(1.0 if results and final == results[-1] else 0.0)
    return out


class Lamp:
    """A lamp, off at the start of each completion."""

    def reset(self, **row) -> None:
        self.on = False

    def switch(self) -> str:
        """Flip the lamp's switch."""
        self.on = not self.on
        return "on" if self.on else "off"

    def get_reward(self) -> float:
        return 1.0 if self.on else 0.0


def _call(name: str) -> dict:
    return {"role": "assistant", "content": "", "tool_calls": [{"type": "function",
                                                                 "function": {"name": name, "arguments": {}}}]}


def _schema(fn) -> dict:
    from transformers.utils import get_json_schema

    return get_json_schema(fn)


def demos(n: int = 400, seed: int = 0) -> list[dict]:
    """Conversations in both games' format, {messages, tools}, half of them doing the wrong thing (no call, or
    an even number of switches), so a warm-started model calls sometimes and learns the rest from rewards."""
    rng = random.Random(seed)
    secret, switch = _schema(secret_word), _schema(Lamp().switch)
    out = []
    for i in range(n):
        if i % 2 == 0:
            messages = [{"role": "user", "content": rng.choice(SECRET_ASKS[:3])}]
            if rng.random() < 0.5:
                messages += [_call("secret_word"), {"role": "tool", "name": "secret_word", "content": SECRET},
                             {"role": "assistant", "content": SECRET}]
            else:
                messages += [{"role": "assistant", "content": rng.choice(WORDS)}]
            out.append({"messages": messages, "tools": [secret]})
        else:
            messages = [{"role": "user", "content": rng.choice(LAMP_ASKS[:3])}]
            on = False
            for _ in range(rng.choice([0, 1, 1, 2, 2, 3])):
                on = not on
                messages += [_call("switch"), {"role": "tool", "name": "switch", "content": "on" if on else "off"}]
            messages += [{"role": "assistant", "content": "Done."}]
            out.append({"messages": messages, "tools": [switch]})
    return out


SECRET_ASKS = ["What is the secret word?", "Tell me the secret.", "Say the secret word.", "Which word is secret?"]
LAMP_ASKS = ["Turn the lamp on.", "Light the lamp.", "Switch on the lamp.", "Make the lamp shine."]


def prompts() -> list[dict]:
    """Both games' requests; `game` says which (quickstart_env.yaml trains on the lamp's, quickstart_tools.yaml on
    the secret's, each through dataset_split)."""
    return [{"prompt": ask, "game": "secret"} for ask in SECRET_ASKS * 4] + \
        [{"prompt": ask, "game": "lamp"} for ask in LAMP_ASKS * 4]


if __name__ == "__main__":
    rows = {"demos": demos, "prompts": prompts}[sys.argv[1]]()
    sys.stdout.write("".join(json.dumps(row) + "\n" for row in rows))
