"""Build prompt/answer jsonl sets from reasoning-gym tasks, with a train/eval split by seed.

    python -m grpo_recipe.tools.prepare_data --task basic_arithmetic --train-size 2000 --eval-size 200 \
        --task-config '{"max_terms": 2, "max_digits": 2}' --out data/arith

writes OUT/train.jsonl (seed S) and OUT/eval.jsonl (seed S + EVAL_SEED_OFFSET, with every question that is also
in the train set dropped, so the held-out split is truly held out). Each row: `prompt` (the task's question plus
INSTRUCTION), `answer`, `task`, `question` and `metadata` (JSON text, for the task's own scorer). The recipe
reads them like any file (`dataset_name: OUT/train.jsonl`, `prompt_column: prompt`); the chat template is
applied by the recipe (`chat_template: auto`). Needs `pip install reasoning-gym`.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

# Asks for a last line the rewards can find; a 135M model follows this more often than XML tags.
# Many reasoning-gym tasks seed item i with Random(seed + i): seeds S and S + 1 give shifted copies of the same
# items. The eval seed therefore lies far beyond any train index.
EVAL_SEED_OFFSET = 1_000_000_007
INSTRUCTION = "Put the final answer on the last line as: Answer: <number>"


class PrepareDataError(ValueError):
    """Bad task name or task config; the message says which."""


def make_rows(task: str, size: int, seed: int, task_config: dict, instruction: str) -> list[dict]:
    try:
        import reasoning_gym
    except ImportError:
        raise PrepareDataError("reasoning-gym is not installed: `pip install reasoning-gym`") from None
    try:
        ds = reasoning_gym.create_dataset(task, size=size, seed=seed, **task_config)
    except (ValueError, TypeError, AssertionError) as e:
        raise PrepareDataError(f"--task {task} --task-config {json.dumps(task_config)}: {type(e).__name__}: {e}") from e
    rows = []
    for entry in ds:
        question = entry["question"].strip()
        rows.append({"prompt": f"{question}\n{instruction}" if instruction else question,
                     "answer": str(entry["answer"]), "task": task, "question": question,
                     "metadata": json.dumps(entry.get("metadata", {}), default=str)})
    return rows


def build(task: str, out: Path, train_size: int, eval_size: int, seed: int = 0, task_config: dict | None = None,
          instruction: str = INSTRUCTION) -> dict:
    """Write train.jsonl and eval.jsonl; returns the counts."""
    if train_size < 1 or eval_size < 1:
        raise PrepareDataError(f"--train-size and --eval-size must be >= 1, got {train_size} and {eval_size}")
    task_config = task_config or {}
    train = make_rows(task, train_size, seed, task_config, instruction)
    seen = {r["question"] for r in train}
    # Oversample the eval seed so that dropping repeats and train overlaps still leaves eval_size rows when possible.
    held = [r for r in make_rows(task, 5 * eval_size + 64, seed + EVAL_SEED_OFFSET, task_config, instruction) if r["question"] not in seen]
    unique, qs = [], set()
    for r in held:
        if r["question"] not in qs:
            qs.add(r["question"])
            unique.append(r)
    evals = unique[:eval_size]
    if not evals:  # a task this small repeats its train questions: there is nothing to hold out
        raise PrepareDataError(f"--task {task} --task-config {json.dumps(task_config)}: every eval question is also "
                               f"in the train set ({train_size} rows): widen the task's range or lower --train-size")
    if len(evals) < eval_size:
        print(f"warning: only {len(evals)} eval questions are not in the train set (asked for {eval_size})",
              file=sys.stderr)
    out.mkdir(parents=True, exist_ok=True)
    for name, rows in (("train", train), ("eval", evals)):
        with open(out / f"{name}.jsonl", "w") as f:
            for r in rows:
                f.write(json.dumps(r) + "\n")
    return {"train": len(train), "eval": len(evals)}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--task", required=True, help="a reasoning-gym task, e.g. basic_arithmetic, chain_sum, gsm_symbolic")
    p.add_argument("--out", required=True, help="folder for train.jsonl and eval.jsonl")
    p.add_argument("--train-size", type=int, default=2000)
    p.add_argument("--eval-size", type=int, default=200)
    p.add_argument("--seed", type=int, default=0, help="train uses SEED, eval SEED + %d" % EVAL_SEED_OFFSET)
    p.add_argument("--task-config", default="{}", help="JSON of the task's config fields (difficulty)")
    p.add_argument("--instruction", default=INSTRUCTION, help="appended to each question ('' for none)")
    args = p.parse_args(argv)
    try:
        try:
            task_config = json.loads(args.task_config)
        except json.JSONDecodeError as e:
            raise PrepareDataError(f"--task-config is not valid JSON: {e}") from None
        if not isinstance(task_config, dict):
            raise PrepareDataError("--task-config must be a JSON object")
        counts = build(args.task, Path(args.out), args.train_size, args.eval_size, args.seed, task_config,
                       args.instruction)
    except PrepareDataError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(f"wrote {counts['train']} train and {counts['eval']} eval rows to {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
