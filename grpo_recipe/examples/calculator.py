"""The calculator example: multi-term arithmetic that a 135M model cannot do in its head, and a tool that can.

    python -m grpo_recipe.examples.calculator --out output/data/calculator    # train, eval and warm-up files

`calculator` is the tool (arithmetic only: the expression is parsed, never executed); `correct_final_answer`
scores the last assistant turn's answer against the `answer` column. SmolLM2-135M-Instruct's own chat template
ignores tools, so the example uses the shipped ChatML pair (grpo_recipe/assets/chatml_tools.*); the model does not
call tools in that format on its own, so a short supervised warm-up on `demos` comes first
(`python -m grpo_recipe.tools.sft`). bench/smollm2_tools.py runs the whole example and records the figures.
"""
from __future__ import annotations

import argparse
import ast
import json
import operator
import random
from pathlib import Path

from grpo_recipe.examples.arith_rewards import extract_answer, numbers_equal

OPS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul}


def _value(node):
    if isinstance(node, ast.Constant) and isinstance(node.value, int) and not isinstance(node.value, bool):
        return node.value
    if isinstance(node, ast.BinOp) and type(node.op) in OPS:
        return OPS[type(node.op)](_value(node.left), _value(node.right))
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub):
        return -_value(node.operand)
    raise ValueError("only integers, +, - and * are allowed")


def calculator(expression: str) -> str:
    """Evaluate an arithmetic expression of integers with +, - and *.

    Args:
        expression: the expression, e.g. 37 * 41 + 19
    """
    return str(_value(ast.parse(expression.replace("×", "*"), mode="eval").body))


def correct_final_answer(prompts, completions, answer, **_) -> list[float]:
    """1.0 when the last assistant turn's number is the answer, else 0.0."""
    out = []
    for turns, a in zip(completions, answer):
        final = turns[-1] if isinstance(turns, list) else {"role": "assistant", "content": turns}
        text = str(final.get("content") or "") if final.get("role") == "assistant" else ""
        out.append(float(numbers_equal(extract_answer(text), a)))
    return out


def question(rng: random.Random) -> tuple[str, str]:
    """Three terms of one or two digits with +, - and * (so that a product is among them mostly)."""
    terms = [str(rng.randint(2, 99)) for _ in range(3)]
    ops = [rng.choice(["+", "-", "*"]) for _ in range(2)]
    expression = f"{terms[0]} {ops[0]} {terms[1]} {ops[1]} {terms[2]}"
    return expression, calculator(expression)


def demos(rng: random.Random, n: int) -> list[dict]:
    """The warm-up's data: half the conversations call the calculator and answer with its result, half answer
    at once (rightly: a demonstration is right, but the model cannot do it in its head). The warm-up teaches the
    format; when to call is what GRPO learns."""
    from transformers.utils import get_json_schema

    schema = get_json_schema(calculator)
    rows = []
    for i in range(n):
        expression, value = question(rng)
        call = [{"role": "assistant", "content": "", "tool_calls": [
                    {"type": "function", "function": {"name": "calculator", "arguments": {"expression": expression}}}]},
                {"role": "tool", "name": "calculator", "content": value}] if i % 2 == 0 else []
        rows.append({"tools": [schema], "messages": [{"role": "user", "content": f"Calculate {expression}."}, *call,
                                                     {"role": "assistant", "content": f"Answer: {value}"}]})
    return rows


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True)
    parser.add_argument("--train-size", type=int, default=400)
    parser.add_argument("--eval-size", type=int, default=60)
    parser.add_argument("--demos", type=int, default=200)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    rng = random.Random(args.seed)
    seen: set[str] = set()
    for name, size in (("eval", args.eval_size), ("train", args.train_size)):  # eval first: never trained on
        rows = []
        while len(rows) < size:
            expression, value = question(rng)
            if expression not in seen:
                seen.add(expression)
                rows.append({"prompt": f"Calculate {expression}.", "answer": value})
        (out / f"{name}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    warm = [d for d in demos(rng, args.demos * 2) if d["messages"][0]["content"][10:-1] not in seen][:args.demos]
    (out / "demos.jsonl").write_text("".join(json.dumps(r) + "\n" for r in warm))
    print(f"wrote {out}/train.jsonl ({args.train_size}), eval.jsonl ({args.eval_size}), demos.jsonl ({len(warm)})")


if __name__ == "__main__":
    main()
