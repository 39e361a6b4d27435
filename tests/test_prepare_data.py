"""reasoning-gym task data: rows, a held-out split that shares no question with train, named errors."""
import json
import subprocess
import sys

import pytest
from conftest import REPO

from grpo_recipe.dist.env import rank_env
from grpo_recipe.run.metrics import read_jsonl

pytest.importorskip("reasoning_gym")
from grpo_recipe.tools.prepare_data import INSTRUCTION, build  # noqa: E402

SMALL = {"min_terms": 2, "max_terms": 2, "min_digits": 1, "max_digits": 1, "operators": ["+"],
         "allow_parentheses": False, "allow_negation": False}


def test_rows_and_split(tmp_path):
    counts = build("basic_arithmetic", tmp_path, train_size=40, eval_size=10, seed=3, task_config=SMALL)
    train, evals = read_jsonl(tmp_path / "train.jsonl"), read_jsonl(tmp_path / "eval.jsonl")
    assert counts == {"train": 40, "eval": 10} and len(train) == 40 and len(evals) == 10
    row = train[0]
    assert set(row) == {"prompt", "answer", "task", "question", "metadata"}
    assert row["prompt"] == f"{row['question']}\n{INSTRUCTION}"
    # the answer is right: a + b with one-digit terms
    a, b = json.loads(row["metadata"])["expression"].split(" + ")
    assert int(row["answer"]) == int(a) + int(b)
    train_q = {r["question"] for r in train}
    assert not train_q & {r["question"] for r in evals}  # held out
    assert len({r["question"] for r in evals}) == 10  # no repeats either
    # same seed, same data
    build("basic_arithmetic", tmp_path / "again", train_size=40, eval_size=10, seed=3, task_config=SMALL)
    assert read_jsonl(tmp_path / "again" / "train.jsonl") == train


def test_cli_errors_name_the_problem(tmp_path):
    def run(*args):
        return subprocess.run([sys.executable, "-m", "grpo_recipe.tools.prepare_data", "--out", str(tmp_path), *args],
                              cwd=REPO, env=rank_env(), capture_output=True, text=True, timeout=120)

    proc = run("--task", "no_such_task")
    assert proc.returncode == 2 and "no_such_task" in proc.stderr
    proc = run("--task", "basic_arithmetic", "--task-config", '{"max_terms": 0}')
    assert proc.returncode == 2 and "--task-config" in proc.stderr
    proc = run("--task", "basic_arithmetic", "--task-config", "[1]")
    assert proc.returncode == 2 and "JSON object" in proc.stderr
