"""SmolLM2-135M-Instruct learns two-digit addition with GRPO (mu = 2): held-out greedy accuracy before and after.

    python bench/smollm2_arith.py            # every step below that has no output yet, then the summary
    python bench/smollm2_arith.py --summarize-only

Steps (each skipped when its output exists, so an interrupted run continues): prepare the model, build the
data, evaluate the untrained model, train with grpo_recipe/configs/smollm2_arith.yaml on 2 CPU ranks (wall time
recorded in OUTPUT_DIR/wall_time_s), evaluate OUTPUT_DIR/final. Then a confirmation set: 1000 more held-out
questions (eval rows 301-1300 of the same split: prepare_data is deterministic, so asking for 1300 eval rows
gives the first 300 again, then new ones), both models evaluated again. Writes bench/results/smollm2_arith.json
and smollm2_arith_reward.png. The gain is compared with the eval's noise: each accuracy's binomial standard
error sqrt(p (1 - p) / n), and a paired test (McNemar, exact) on the same eval questions.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import shlex
import subprocess
import sys
import time
from pathlib import Path

from common import REPO, moving_average, read_jsonl, read_metrics, save_json

CONFIG = "grpo_recipe/configs/smollm2_arith.yaml"
MODEL = "output/models/smollm2-135m-instruct"
DATA = "output/data/arith"
TASK_CONFIG = {"min_terms": 2, "max_terms": 2, "min_digits": 2, "max_digits": 2, "operators": ["+"],
               "allow_parentheses": False, "allow_negation": False}
RUN = "output/smollm2_arith"
LOGS = "output/smollm2_arith_bench"
MAX_NEW_TOKENS = 32  # = the config's max_completion_length

COMMANDS = {
    "prepare_model": [sys.executable, "-m", "grpo_recipe.tools.prepare_model", "--source", "smollm2", "--out", MODEL],
    "prepare_data": [sys.executable, "-m", "grpo_recipe.tools.prepare_data", "--task", "basic_arithmetic", "--out", DATA,
                     "--train-size", "2000", "--eval-size", "300", "--task-config", json.dumps(TASK_CONFIG)],
    "eval_before": [sys.executable, "-m", "grpo_recipe.tools.evaluate", "--model", MODEL, "--data", f"{DATA}/eval.jsonl",
                    "--max-new-tokens", str(MAX_NEW_TOKENS), "--out", f"{LOGS}/eval_before.json",
                    "--samples", f"{LOGS}/eval_before_samples.jsonl"],
    "train": ["bash", "launch/local.sh", "--config", CONFIG, "--disable_tqdm", "true"],
    "eval_after": [sys.executable, "-m", "grpo_recipe.tools.evaluate", "--model", f"{RUN}/final", "--data", f"{DATA}/eval.jsonl",
                   "--max-new-tokens", str(MAX_NEW_TOKENS), "--out", f"{LOGS}/eval_after.json",
                   "--samples", f"{LOGS}/eval_after_samples.jsonl"],
    "confirm_data": ["bash", "-c", f"{shlex.join([sys.executable, '-m', 'grpo_recipe.tools.prepare_data', '--task', 'basic_arithmetic', '--out', DATA + '_big', '--train-size', '2000', '--eval-size', '1300', '--task-config', json.dumps(TASK_CONFIG)])}"
                     f" && cmp {DATA}/train.jsonl {DATA}_big/train.jsonl && head -300 {DATA}_big/eval.jsonl | cmp - {DATA}/eval.jsonl"
                     f" && tail -n +301 {DATA}_big/eval.jsonl > {DATA}/confirm.jsonl"],
    "confirm_before": [sys.executable, "-m", "grpo_recipe.tools.evaluate", "--model", MODEL, "--data", f"{DATA}/confirm.jsonl",
                       "--max-new-tokens", str(MAX_NEW_TOKENS), "--out", f"{LOGS}/confirm_before.json",
                       "--samples", f"{LOGS}/confirm_before_samples.jsonl"],
    "confirm_after": [sys.executable, "-m", "grpo_recipe.tools.evaluate", "--model", f"{RUN}/final", "--data", f"{DATA}/confirm.jsonl",
                      "--max-new-tokens", str(MAX_NEW_TOKENS), "--out", f"{LOGS}/confirm_after.json",
                      "--samples", f"{LOGS}/confirm_after_samples.jsonl"],
}
DONE = {"prepare_model": f"{MODEL}/config.json", "prepare_data": f"{DATA}/eval.jsonl",
        "eval_before": f"{LOGS}/eval_before.json", "train": f"{RUN}/final/config.json",
        "eval_after": f"{LOGS}/eval_after.json", "confirm_data": f"{DATA}/confirm.jsonl",
        "confirm_before": f"{LOGS}/confirm_before.json", "confirm_after": f"{LOGS}/confirm_after.json"}


def run_steps(skip_confirm: bool = False) -> None:
    (REPO / LOGS).mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "PYTHONPATH": str(REPO), "TOKENIZERS_PARALLELISM": "false",
           "VENV_PY": os.environ.get("VENV_PY", sys.executable)}
    for name, cmd in COMMANDS.items():
        if (REPO / DONE[name]).exists() or (skip_confirm and name.startswith("confirm")):
            continue
        print(f"[{name}] {shlex.join(cmd)}", flush=True)
        t0 = time.perf_counter()
        with open(REPO / LOGS / f"{name}.log", "w") as log:
            subprocess.run(cmd, cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT, check=True)
        if name == "train":
            (REPO / RUN / "wall_time_s").write_text(f"{time.perf_counter() - t0:.1f}\n")


def mcnemar_exact_p(before: list[float], after: list[float]) -> tuple[int, int, float]:
    """Questions only the trained model got right (b), only the untrained one (c), two-sided exact p."""
    b = sum(1 for x, y in zip(before, after) if y == 1.0 and x != 1.0)
    c = sum(1 for x, y in zip(before, after) if x == 1.0 and y != 1.0)
    n, k = b + c, min(b, c)
    p = min(1.0, 2 * sum(math.comb(n, i) for i in range(k + 1)) / 2 ** n) if n else 1.0
    return b, c, p


def plot(records: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    first = [r for r in records if r["iteration"] == 0]  # one point per rollout
    xs = [r["generation"] for r in first]
    fig, ax = plt.subplots(figsize=(7, 4))
    for key, label in (("reward/correctness", "correctness"), ("reward/format_reward", "format")):
        ys = [r[key] for r in first]
        ax.plot(xs, ys, ".", alpha=0.35)
        w = 6
        ax.plot(xs, moving_average(ys, w), "-", color=ax.lines[-1].get_color(), label=f"{label} (mean of last {w} rollouts)")
    ax.set_xlabel("rollout (2 optimizer steps each, mu = 2)")
    ax.set_ylabel("mean reward of the rollout's 32 samples")
    ax.set_title("SmolLM2-135M-Instruct, GRPO on two-digit addition (2 CPU ranks, ZeRO-3)")
    ax.set_ylim(-0.02, 1.02)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def compare(prefix: str) -> dict:
    """Before/after accuracy on one eval file, its noise, and the paired test."""
    before = json.loads((REPO / LOGS / f"{prefix}_before.json").read_text())
    after = json.loads((REPO / LOGS / f"{prefix}_after.json").read_text())
    scores = {k: [x["score"] for x in read_jsonl(REPO / LOGS / f"{prefix}_{k}_samples.jsonl")]
              for k in ("before", "after")}
    b, c, p = mcnemar_exact_p(scores["before"], scores["after"])
    gain = after["accuracy"] - before["accuracy"]
    se_gain = math.sqrt(before["stderr"] ** 2 + after["stderr"] ** 2)  # as if independent: conservative when paired
    return {"data": before["data"], "n": before["n"], "accuracy_before": before["accuracy"],
            "stderr_before": before["stderr"], "accuracy_after": after["accuracy"], "stderr_after": after["stderr"],
            "gain": gain, "gain_stderr_unpaired": se_gain, "gain_in_stderrs": gain / se_gain if se_gain else None,
            "paired": {"only_after_right": b, "only_before_right": c, "mcnemar_exact_p": p}}


def summarize() -> dict:
    import yaml

    records = read_metrics(REPO / RUN)
    wall = REPO / RUN / "wall_time_s"
    quarter = max(1, len(records) // 4)
    out = {
        "what": "held-out greedy accuracy of SmolLM2-135M-Instruct on reasoning-gym basic_arithmetic "
                f"({TASK_CONFIG}), before and after GRPO with mu = 2",
        "eval_setup": {"questions": "held-out split (seed 0 + 1000000007), none of them in the train set; "
                                    "train and held-out questions come from the same distribution",
                       "decoding": f"greedy, {MAX_NEW_TOKENS} new tokens",
                       "right": "grpo_recipe.examples.arith_rewards:correctness == 1 (numeric match)",
                       "noise": "binomial standard error sqrt(p (1 - p) / n); paired McNemar exact test"},
        "eval": compare("eval"),
        "confirm": compare("confirm") if (REPO / LOGS / "confirm_after.json").exists() else None,
        "train": {"config": CONFIG, "command": shlex.join(COMMANDS["train"]),
                  "config_values": yaml.safe_load((REPO / CONFIG).read_text()),
                  "steps": len(records), "rollouts": len({r["generation"] for r in records}),
                  "wall_time_s": float(wall.read_text()) if wall.exists() else None,
                  "loop_time_s": round(sum(r["step_time_s"] for r in records), 1),
                  "reward_correctness_first_quarter": sum(r["reward/correctness"] for r in records[:quarter]) / quarter,
                  "reward_correctness_last_quarter": sum(r["reward/correctness"] for r in records[-quarter:]) / quarter,
                  "machine": "2 CPU cores, nothing else running, 2 ranks, 1 thread each, ZeRO-3 over gloo, fp32"},
        "notes": "The confirmation set (when run) is 1000 more held-out questions, none in train or in the first "
                 "300. Each rank samples 2 prompts x 8 completions per rollout at temperature 0.6 (closer to the "
                 "greedy answers the eval scores); groups whose 8 rewards are equal give no gradient.",
        "commands": {k: shlex.join(v).replace(sys.executable, "python") for k, v in COMMANDS.items()},
    }
    res_dir = REPO / "bench" / "results"
    save_json("smollm2_arith.json", out, res_dir)
    plot(records, res_dir / "smollm2_arith_reward.png")
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--summarize-only", action="store_true")
    p.add_argument("--skip-confirm", action="store_true", help="only the 300-question eval (saves ~20 min)")
    args = p.parse_args()
    if not args.summarize_only:
        run_steps(args.skip_confirm)
    out = summarize()
    for key in ("eval", "confirm"):
        r = out[key]
        if r:
            print(f"{key}: accuracy {r['accuracy_before']:.3f} +- {r['stderr_before']:.3f} -> {r['accuracy_after']:.3f} "
                  f"+- {r['stderr_after']:.3f} (n = {r['n']}); gain {r['gain']:+.3f} = {r['gain_in_stderrs']:.1f} s.e.; "
                  f"McNemar p = {r['paired']['mcnemar_exact_p']:.2g}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
