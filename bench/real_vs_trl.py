"""Does reuse make a real model learn sooner? SmolLM2-135M-Instruct on two-digit addition, with TRL 1.16 beside.

    python bench/real_vs_trl.py --stage pilot      # the pilots: trl_mu1 and ours_mu1 on the pilot seeds, the gate
    python bench/real_vs_trl.py --stage compare    # the comparison (needs the gate met): 5 variants x 3 seeds
    python bench/real_vs_trl.py --summarize        # run nothing: the verdicts and figure from the runs kept
    python bench/real_vs_trl.py --smoke --out DIR  # every stage in minutes (CI): tiny budget, eval and completions

The design, declared before any run (the constants below; `selection` in the results records what the pilots
chose, after which nothing changes):
1. Stable learning first. Each SETTINGS entry, in order, runs trl_mu1 (TRL's GRPOTrainer) and ours_mu1 on
   PILOT_SEEDS, which the comparison does not use. The first setting where every pilot run gains at least
   GATE_GAIN held-out accuracy by the end of the budget and never falls below the untrained accuracy after the
   first quarter is frozen; the comparison runs only with it.
2. A budget in rollouts (BUDGET_ROLLOUTS per run, the same for every variant): held-out greedy accuracy on
   EVAL_N questions at EVAL_POINTS (snapshots, bench/budget.py), and each rollout's own sample accuracy (fresh
   prompts, before any update on them).
3. Variants with the same model folder, prompts in tokens, reward code, group size, batch shape, completion
   length, sampling, loss and ZeRO-3 config, 2 ranks: trl_mu1, ours_mu1, ours_mu2, ours_mu4 and ours_auto_g80
   (num_iterations: auto pricing replays as if generation were 80% of a step). Within a seed the recipe's
   variants see the same prompts in the same order (its epoch order is seeded); TRL draws its own seeded order
   from the same prompt file.
4. Three clocks: rollouts (and generated tokens); the measured wall-clock of this machine; a projected clock
   (a model, labelled so everywhere) for generation shares g = 0.5, 0.8, 0.9: each run's measured phases, with
   generation and weight sync multiplied by the one factor per g that gives ours_mu1's median step that share.
5. Verdicts by declared rules: parity (ours_mu1 vs trl_mu1: the paired difference of mean held-out accuracy over
   the evaluation points, against the spread between seeds); reuse (target = untrained + 0.75 x ours_mu1's
   median final gain; rollouts to it, interpolated, a run that never gets there counting as the budget, a bound;
   median over seeds, as a ratio to ours_mu1, and the speed-up on each clock); drift per pass (KL, clipping,
   entropy) beside the accuracy each pass bought.

Runs are kept in the results file as they finish: a later invocation continues where one stopped, and a recipe run
cut off midway resumes from its last checkpoint (saved every SAVE_STEPS steps; a resume repeats training bit for bit).
"""
from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

from common import REPO, RESULTS, machine, read_jsonl, save_figure, save_json

SMOLLM2 = "smollm2-135m-instruct"  # grpo_recipe.tools.prepare_model --source smollm2, in the recipe's cache
TASK = "basic_arithmetic"
TASK_CONFIG = {"min_terms": 2, "max_terms": 2, "min_digits": 2, "max_digits": 2, "operators": ["+"],
               "allow_parentheses": False, "allow_negation": False}  # untrained greedy accuracy 0.333 (n = 300)
CONFIG = "grpo_recipe/configs/smollm2_arith.yaml"
# Both sides follow the recipe config plus these. Completions may be 64 tokens: at 32 (the shipped example) a pilot
# run's completions grew into the cap and its reward fell (../shared/FACTS.md); the format term never fired there.
BASE = {"max_completion_length": 64, "temperature": 0.6, "num_generations": 8, "per_device_train_batch_size": 16,
        "gradient_accumulation_steps": 1, "optimizer_steps_per_pass": 1, "learning_rate": 2e-5, "loss_type": "dapo",
        "beta": 0.0, "max_prompt_length": 128, "save_steps": 0, "logging_steps": 1, "disable_tqdm": True,
        "reward_funcs": ["grpo_recipe.examples.arith_rewards:correctness"]}
# The candidate settings, tried in this order until one passes the gate (declared before the first pilot).
SETTINGS = {"A": {}, "B": {"learning_rate": 1e-5, "beta": 0.04}, "C": {"learning_rate": 1e-5, "beta": 0.04,
                                                                       "temperature": 0.8}}
BUDGET_ROLLOUTS = 48  # 4 prompts x 8 completions each (2 ranks x 16)
EVAL_POINTS = (8, 16, 24, 32, 40, 48)
EVAL_N, EVAL_MAX_NEW_TOKENS = 300, 64
PILOT_SEEDS, SEEDS = (101, 102), (0, 1, 2)
GATE_GAIN = 0.08
PILOT_VARIANTS = ("trl_mu1", "ours_mu1")
VARIANTS = {"trl_mu1": ("trl", 1), "ours_mu1": ("ours", 1), "ours_mu2": ("ours", 2), "ours_mu4": ("ours", 4),
            "ours_auto_g80": ("ours", "auto")}
AUTO_G, AUTO_MAX = 0.8, 8
SAVE_STEPS = 16  # a recipe run checkpoints every SAVE_STEPS steps, keeping the last (not part of the design): a
# run cut off at the end of a working session resumes from it
SHARES = (0.5, 0.8, 0.9)
TARGET_FRACTION = 0.75
SMOKE = {"hyper": {"max_completion_length": 8, "num_generations": 4, "per_device_train_batch_size": 4,
                   "max_prompt_length": 96},
         # the pilots' runs are the comparison's (seed 0): CI's minutes, no claim
         "budget": 2, "points": (1, 2), "eval_n": 6, "eval_max_new_tokens": 8, "pilot_seeds": (0,), "seeds": (0,),
         "settings": {"A": {}}, "variants": ("trl_mu1", "ours_mu1", "ours_mu2"),
         "gate_gain": -1.0,  # the smoke's pilots always pass: the comparison stage runs too (no claim)
         "save": (2, 0)}  # every checkpoint kept (steps 2 and 4 of mu = 2's): the test cuts a run back to one
GOALS = {"parity": "ours_mu1 and trl_mu1 learn alike (paired difference of mean held-out accuracy within the "
                   "spread between seeds)",
         "reuse": "ours_mu2 or ours_auto_g80 reaches the target in <= 0.6x ours_mu1's rollouts (median over seeds) "
                  "and >= 1.3x sooner on the projected clock at g = 0.8 (a model)"}


# ------------------------------------------------------------------------------------------
# the pieces: model, data, evaluation
# ------------------------------------------------------------------------------------------
def prepare_model() -> Path:
    from grpo_recipe.model.tiny import cache_root
    from grpo_recipe.tools.prepare_model import prepare

    folder = cache_root() / SMOLLM2
    if not (folder / "config.json").is_file():
        prepare("smollm2", folder)
    return folder


def prepare_task(folder: Path, eval_n: int) -> Path:
    from grpo_recipe.tools.prepare_data import build

    if not (folder / "eval.jsonl").is_file():
        build(TASK, folder, 2000, eval_n, 0, TASK_CONFIG)
    return folder


def evaluate(model: Path, data: Path, n: int, max_new_tokens: int, out: Path) -> dict:
    """Greedy held-out accuracy (grpo_recipe.tools.evaluate, its own process), with each question's result."""
    if not out.is_file():
        cmd = [sys.executable, "-m", "grpo_recipe.tools.evaluate", "--model", str(model), "--data", str(data),
               "--limit", str(n), "--max-new-tokens", str(max_new_tokens), "--batch-size", "64",
               "--out", str(out), "--samples", str(out.with_suffix(".samples.jsonl"))]
        subprocess.run(cmd, cwd=REPO, check=True, env={**os.environ, "OMP_NUM_THREADS": str(os.cpu_count())},
                       stdout=subprocess.DEVNULL)
    res = json.loads(out.read_text())
    samples = read_jsonl(out.with_suffix(".samples.jsonl"))
    return {"accuracy": res["accuracy"], "correct": res["correct"], "n": res["n"], "eval_s": res["seconds"],
            "right": "".join(str(int(s["score"] >= 1.0)) for s in samples),
            "mean_completion_chars": sum(len(s["completion"]) for s in samples) / max(len(samples), 1)}


def recipe_argv(model: Path, data: Path, hyper: dict, seed: int) -> list[str]:
    argv = ["--config", CONFIG, "--model_name_or_path", str(model), "--dataset_name", str(data / "train.jsonl"),
            "--seed", str(seed)]
    for k, v in hyper.items():
        argv += [f"--{k}", json.dumps(v) if not isinstance(v, str) else v]
    return argv


def chat_prompts(cfg, tokenizer, out: Path) -> None:
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


# ------------------------------------------------------------------------------------------
# one run: train to the budget with snapshots, evaluate them, read both sides' logs
# ------------------------------------------------------------------------------------------
def one_run(variant: str, seed: int, setting: str, ctx: dict) -> dict:
    from vs_trl import launch, trl_fields

    from grpo_recipe.dist.env import torchrun

    impl, mu = VARIANTS[variant]
    hyper = ctx["hyper"][setting]
    run_dir = ctx["work"] / setting / f"{variant}-seed{seed}"
    snaps = run_dir / "snapshots"
    points = list(ctx["points"])
    if not done_on_disk(snaps, points):
        resumes = resumed_launches(run_dir) if impl == "ours" else None
        if resumes is None:
            subprocess.run(["rm", "-rf", str(run_dir)], check=True)
            run_dir.mkdir(parents=True)
        steps = ctx["budget"] * (AUTO_MAX if mu == "auto" else mu) + 1
        env = {**ctx["env"], "BUDGET_SPEC": json.dumps({"rollouts": points, "dir": str(snaps)})}
        if impl == "ours":
            # checkpoints outside the design (they change no number a run trains to): a run cut off, at the end of
            # a working session, continues from its last one
            argv = recipe_argv(ctx["model"], ctx["data"], hyper, seed) + [
                "--output_dir", str(run_dir / "ours"), "--max_steps", str(steps), "--num_iterations", str(mu),
                "--save_steps", str(ctx["save"][0]), "--save_total_limit", str(ctx["save"][1])]
            if resumes is not None:
                argv += ["--resume_from_checkpoint", "auto"]
                (run_dir / "resumed.json").write_text(json.dumps(resumes + 1))
            if mu == "auto":
                argv += ["--reuse_generation_share", str(AUTO_G), "--reuse_max_iterations", str(AUTO_MAX)]
            cmd = torchrun(2, ["bench/ours_runner.py", *argv])
        else:
            from grpo_recipe.config.load import load_config

            cfg = load_config(recipe_argv(ctx["model"], ctx["data"], hyper, seed), world_size=2)
            spec = run_dir / "trl_spec.json"
            spec.write_text(json.dumps({"output_dir": str(run_dir / "trl"), "model": str(ctx["model"]),
                                        "prompts_file": str(ctx["trl_prompts"]),
                                        "deepspeed_config": str(ctx["trl_ds"][setting]),
                                        "reward_funcs": cfg.reward_funcs, "chat_prompts": True,
                                        "grpo_config": trl_fields(cfg, 1, steps, False) | {"seed": seed}}, indent=1))
            cmd = torchrun(2, ["bench/trl_runner.py", str(spec)])
        print(f"real_vs_trl: setting {setting}, {variant} seed {seed}"
              + (" (resumed from its last checkpoint)" if resumes is not None else ""), file=sys.stderr, flush=True)
        load = os.getloadavg()[0]
        launch(cmd, env, run_dir / ("run.log" if resumes is None else f"run.resumed{resumes + 1}.log"), 6 * 3600)
        (run_dir / "load.json").write_text(json.dumps([load, os.getloadavg()[0]]))
        for snap in snaps.glob("r*"):  # TRL saves no tokenizer with the weights
            for f in ctx["model"].glob("tokenizer*"):
                if snap.is_dir() and not (snap / f.name).exists():
                    subprocess.run(["cp", str(f), str(snap / f.name)], check=True)
    if ctx["save"][1]:  # trained to its budget: its last checkpoint (1.6 GB) can no longer serve a resume
        subprocess.run(["rm", "-rf", str(run_dir / "ours" / "checkpoints")], check=True)
    taken = json.loads((snaps / "snapshots.json").read_text())
    logs = read_ours(run_dir / "ours") if impl == "ours" else read_trl(run_dir / "trl")
    curve = [{"rollouts": 0, "step": 0, **{k: ctx["untrained"][k] for k in ("accuracy", "correct", "n")}}]
    for t in taken:
        r = evaluate(snaps / f"r{t['rollouts']}", ctx["data"] / "eval.jsonl", ctx["eval_n"],
                     ctx["eval_max_new_tokens"], snaps / f"r{t['rollouts']}.eval.json")
        subprocess.run(["rm", "-rf", str(snaps / f"r{t['rollouts']}")], check=True)  # evaluated: 0.5 GB less
        curve.append({"rollouts": t["rollouts"], "step": t["step"], "accuracy": r["accuracy"], "correct": r["correct"],
                      "n": r["n"], "mean_completion_chars": round(r["mean_completion_chars"], 1)})
        final_right = r["right"]
    # the snapshots' own save time is not training time: taken off the step in which each was saved
    saves = {t["step"] + 1: t["save_s"] for t in taken}
    logs["step_s"] = [s - saves.get(i + 1, 0.0) for i, s in enumerate(logs["step_s"])]
    load = json.loads((run_dir / "load.json").read_text()) if (run_dir / "load.json").is_file() else None
    resumed = json.loads((run_dir / "resumed.json").read_text()) if (run_dir / "resumed.json").is_file() else 0
    return {"variant": variant, "seed": seed, "setting": setting, "curve": curve, "final_right": final_right,
            "final_accuracy": curve[-1]["accuracy"], "load_1m": load, **logs, **({"resumed": resumed} if resumed else {})}


def resumed_launches(run_dir: Path) -> int | None:
    """How often a recipe run cut off before its budget was spent has been resumed so far, when its folder holds a
    checkpoint to continue from (the recipe resumes bit for bit); None: start it afresh."""
    if not any((run_dir / "ours" / "checkpoints").glob("step-*")):
        return None
    done = run_dir / "resumed.json"
    return json.loads(done.read_text()) if done.is_file() else 0


def done_on_disk(snaps: Path, points: list[int]) -> bool:
    done = snaps / "snapshots.json"
    return done.is_file() and [t["rollouts"] for t in json.loads(done.read_text())] == points


def read_ours(out: Path) -> dict:
    """Per optimizer step: its rollout, pass, seconds (all of it; and of generation and weight sync), drift;
    per rollout: its samples' accuracy and mean completion length."""
    recs = [r for r in read_jsonl(out / "metrics.jsonl") if "step_time_s" in r]
    rollouts = {}
    for r in recs:
        rollouts.setdefault(r["generation"], (r.get("reward/correctness", r["reward_mean"]), r["completion_length_mean"]))
    return {"step_rollout": [r["generation"] for r in recs], "step_pass": [r["iteration"] for r in recs],
            "step_s": [r["step_time_s"] for r in recs],
            "step_gen_s": [r.get("time_generate_s", 0.0) + r.get("time_sync_s", 0.0) for r in recs],
            "step_kl": [r.get("approx_kl") for r in recs], "step_clip": [r.get("clip_ratio_region") for r in recs],
            "step_entropy": [r.get("entropy") for r in recs],
            "rollout_accuracy": [rollouts[k][0] for k in sorted(rollouts)],
            "rollout_length": [rollouts[k][1] for k in sorted(rollouts)]}


def read_trl(out: Path) -> dict:
    """The same from TRL's event log (bench/trl_runner.py) and log history; at mu = 1 step k is rollout k - 1."""
    events = read_jsonl(out / "events-rank0.jsonl")
    t = next(e["t"] for e in events if e["event"] == "train_begin")
    step_s, gen_s, gen = [], [], 0.0
    for e in events:
        if e["event"] == "generate":
            gen += e["seconds"]
        elif e["event"] == "step_end":
            step_s.append(e["t"] - t)
            gen_s.append(gen)
            t, gen = e["t"], 0.0
    logs = json.loads((out / "log_history.json").read_text()) if (out / "log_history.json").is_file() else []
    logs = [x for x in logs if "loss" in x]
    rewards = {}  # each rank's mean per call; a call is one rollout on that rank
    for rank in (0, 1):
        calls = [e["mean"] for e in read_jsonl(out / f"events-rank{rank}.jsonl") if e["event"] == "rewards"]
        for i, m in enumerate(calls):
            rewards.setdefault(i, []).append(m)
    n = len(step_s)
    pick = lambda key: [x.get(key) for x in logs][:n] + [None] * max(0, n - len(logs))  # noqa: E731
    return {"step_rollout": list(range(n)), "step_pass": [0] * n, "step_s": step_s, "step_gen_s": gen_s,
            "step_kl": [None] * n, "step_clip": pick("clip_ratio/region_mean"), "step_entropy": pick("entropy"),
            "rollout_accuracy": [statistics.mean(rewards[i]) for i in sorted(rewards)][:n],
            "rollout_length": pick("completions/mean_length")}


# ------------------------------------------------------------------------------------------
# the pilots' gate, the clocks, the verdicts
# ------------------------------------------------------------------------------------------
def gate(run: dict, budget: int, gain_needed: float) -> dict:
    untrained = run["curve"][0]["accuracy"]
    after_quarter = [c["accuracy"] for c in run["curve"][1:] if c["rollouts"] >= budget / 4]
    gain = run["final_accuracy"] - untrained
    return {"gain": gain, "min_after_first_quarter": min(after_quarter) if after_quarter else None,
            "passes": gain >= gain_needed and bool(after_quarter) and min(after_quarter) >= untrained}


def point_times(run: dict, factor: float = 1.0) -> list[float]:
    """Seconds of training up to each curve point (0 first), generation and sync scaled by `factor` (1: measured)."""
    cum, ends = 0.0, {0: 0.0}
    for i, (s, g) in enumerate(zip(run["step_s"], run["step_gen_s"])):
        cum += s - g + factor * g
        ends[i + 1] = cum
    return [ends.get(c["step"], cum) for c in run["curve"]]


def crossing(xs: list[float], ys: list[float], target: float) -> float | None:
    """The first x where the piecewise-linear curve reaches `target`; None when it never does."""
    for i in range(1, len(xs)):
        if ys[i] >= target:
            if ys[i - 1] >= target:
                return xs[i - 1]
            return xs[i - 1] + (xs[i] - xs[i - 1]) * (target - ys[i - 1]) / (ys[i] - ys[i - 1])
    return None


def share_factors(base_runs: list[dict]) -> dict[str, float]:
    """Per g: the factor on generation (and sync) time that gives ours_mu1's median step that generation share."""
    gen = statistics.median(sum(r["step_gen_s"]) / len(r["step_s"]) for r in base_runs)
    other = statistics.median((sum(r["step_s"]) - sum(r["step_gen_s"])) / len(r["step_s"]) for r in base_runs)
    return {str(g): g * other / ((1 - g) * gen) for g in SHARES}


def verdicts(runs: list[dict], budget: int) -> dict:
    by = {}
    for r in runs:
        by.setdefault(r["variant"], {})[r["seed"]] = r
    base = by.get("ours_mu1", {})
    if not base:
        return {}
    untrained = next(iter(base.values()))["curve"][0]["accuracy"]
    base_gain = statistics.median(r["final_accuracy"] - untrained for r in base.values())
    target = untrained + TARGET_FRACTION * base_gain
    factors = share_factors(list(base.values()))
    clocks = {"measured": 1.0, **{f"projected_g{g}": f for g, f in factors.items()}}
    out = {"target_accuracy": target, "untrained_accuracy": untrained, "projection_factors": factors,
           "projection_is_a_model": True, "rollouts_to_target": {}, "time_to_target_s": {},
           "rollouts_ratio_vs_ours_mu1": {}, "speedup_vs_ours_mu1": {}, "projected_speedup_vs_ours_mu1": {},
           "per_pass": {}}
    for v, seeds in by.items():
        xs = {s: [c["rollouts"] for c in r["curve"]] for s, r in seeds.items()}
        ys = {s: [c["accuracy"] for c in r["curve"]] for s, r in seeds.items()}
        reach = {s: crossing(xs[s], ys[s], target) for s in seeds}
        out["rollouts_to_target"][v] = {str(s): (budget if x is None else x) for s, x in reach.items()}
        out["rollouts_to_target"][v]["bound"] = [s for s, x in reach.items() if x is None]
        out["time_to_target_s"][v] = {}
        for clock, f in clocks.items():
            times = {}
            for s, r in seeds.items():
                t = point_times(r, f)
                times[str(s)] = crossing(t, ys[s], target)
                times[str(s)] = t[-1] if times[str(s)] is None else times[str(s)]
            out["time_to_target_s"][v][clock] = times
    med = lambda d: statistics.median(x for k, x in d.items() if k != "bound")  # noqa: E731
    ratio = lambda a, b: a / b if b > 0 else None  # noqa: E731
    out["target_defined"] = base_gain > 0  # a target at or below the untrained accuracy measures nothing
    for v in by:
        if not out["target_defined"]:
            break
        out["rollouts_ratio_vs_ours_mu1"][v] = ratio(med(out["rollouts_to_target"][v]),
                                                     med(out["rollouts_to_target"]["ours_mu1"]))
        out["speedup_vs_ours_mu1"][v] = ratio(med(out["time_to_target_s"]["ours_mu1"]["measured"]),
                                              med(out["time_to_target_s"][v]["measured"]))
        for g in factors:
            out["projected_speedup_vs_ours_mu1"].setdefault(g, {})[v] = ratio(
                med(out["time_to_target_s"]["ours_mu1"][f"projected_g{g}"]),
                med(out["time_to_target_s"][v][f"projected_g{g}"]))
    for v in by:
        passes = {}
        for r in by[v].values():
            for p, kl, clip, ent in zip(r["step_pass"], r["step_kl"], r["step_clip"], r["step_entropy"]):
                passes.setdefault(p, []).append((kl, clip, ent))
        out["per_pass"][v] = {str(p): {name: statistics.mean(x[i] for x in rows if x[i] is not None)
                                       if any(x[i] is not None for x in rows) else None
                                       for i, name in enumerate(("approx_kl", "clip_fraction", "entropy"))}
                              for p, rows in sorted(passes.items())}
        steps = statistics.median(len(r["step_s"]) for r in by[v].values())
        gain = statistics.median(r["final_accuracy"] - untrained for r in by[v].values())
        out["per_pass"][v]["gain_per_optimizer_step"] = gain / max(steps, 1)
    # the first crossing of the target hides a fall after it: the mean over the evaluation points shows one
    mean_acc = lambda r: statistics.mean(c["accuracy"] for c in r["curve"][1:])  # noqa: E731
    out["mean_accuracy"] = {v: statistics.median(mean_acc(r) for r in seeds.values()) for v, seeds in by.items()}
    out["replay_worth"] = {}
    for v, seeds in by.items():
        # a model: with m passes a rollout the target takes R x ours_mu1's rollouts, so R x (1 + (m - 1) w) = 1,
        # w a replay's worth in fresh passes; a replay pays where generation's share g of a step exceeds 1 - w
        m = statistics.median(len(r["step_pass"]) / max(len(set(r["step_rollout"])), 1) for r in seeds.values())
        ratio_v = out["rollouts_ratio_vs_ours_mu1"].get(v)
        if m > 1 and ratio_v:
            w = (1.0 / ratio_v - 1.0) / (m - 1.0)
            out["replay_worth"][v] = {"passes_per_rollout": m, "worth": w,
                                      "pays_above_share": None if w <= 0 else max(1.0 - w, 0.0),
                                      "worth_is_upper_bound": bool(out["rollouts_to_target"][v]["bound"])}
    if "trl_mu1" in by:
        paired = [s for s in base if s in by["trl_mu1"]]
        diffs = [mean_acc(base[s]) - mean_acc(by["trl_mu1"][s]) for s in paired]
        spread = statistics.stdev([mean_acc(r) for r in by["trl_mu1"].values()]) if len(by["trl_mu1"]) > 1 else None
        d = statistics.mean(diffs) if diffs else None
        half = 2 * statistics.stdev(diffs) / math.sqrt(len(diffs)) if len(diffs) > 1 else None
        out["parity"] = {"paired_seeds": paired, "mean_accuracy_difference": d, "interval_2se": half,
                         "seed_spread_trl_mu1": spread}
        out["parity_holds"] = bool(d is not None and spread is not None and abs(d) < spread)
    reuse = [v for v in ("ours_mu2", "ours_auto_g80") if v in by]
    out["reuse_goal_met"] = out["target_defined"] and any(
        (out["rollouts_ratio_vs_ours_mu1"].get(v) or 9) <= 0.6
        and (out["projected_speedup_vs_ours_mu1"].get("0.8", {}).get(v) or 0) >= 1.3 for v in reuse)
    return out


def plot(runs: list[dict], result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    factor = result.get("verdicts", {}).get("projection_factors", {}).get("0.8")
    panels = [("rollouts", "rollouts trained on"), ("measured", "measured seconds (this machine)")]
    if factor:
        panels.append(("projected", "projected seconds at g = 0.8 (a model)"))
    fig, axes = plt.subplots(1, len(panels), figsize=(5.2 * len(panels), 4), squeeze=False)
    by = {}
    for r in sorted(runs, key=lambda r: (r["variant"], r["seed"])):
        by.setdefault((r["variant"], r["setting"]), []).append(r)
    for i, ((variant, setting), group) in enumerate(sorted(by.items())):
        c = f"C{i}"
        curves = []
        for r in group:  # each seed thin; the median over seeds, point by point, thick
            xs = {"rollouts": [p["rollouts"] for p in r["curve"]], "measured": point_times(r),
                  "projected": point_times(r, factor or 1.0)}
            curves.append((xs, [p["accuracy"] for p in r["curve"]]))
            for ax, (key, _) in zip(axes[0], panels):
                ax.plot(xs[key], curves[-1][1], color=c, alpha=0.3, linewidth=0.8)
        n = min(len(y) for _, y in curves)
        label = f"{variant} ({setting}, {len(group)} seed{'s' if len(group) > 1 else ''})"
        for ax, (key, axis) in zip(axes[0], panels):
            mx = [statistics.median(x[key][j] for x, _ in curves) for j in range(n)]
            my = [statistics.median(y[j] for _, y in curves) for j in range(n)]
            ax.plot(mx, my, color=c, linewidth=2, marker=".", label=label)
            ax.set_xlabel(axis)
    target = result.get("verdicts", {}).get("target_accuracy")
    for ax in axes[0]:
        ax.set_ylabel("held-out greedy accuracy")
        if target is not None:
            ax.axhline(target, color="gray", linestyle="--", linewidth=0.8)
    axes[0][0].legend(fontsize=8)
    fig.tight_layout()
    save_figure(fig, path)
    plt.close(fig)


# ------------------------------------------------------------------------------------------
# the README's section: generated from the results file (tests/test_bench_results.py checks it is)
# ------------------------------------------------------------------------------------------
BEGIN, END = "<!-- real_vs_trl:begin (python bench/real_vs_trl.py --docs) -->", "<!-- real_vs_trl:end -->"
FIGURE, FINDINGS = "bench/results/real_vs_trl.png", "docs/findings-reuse-default.md"
DOCS = {"README.md": True, "bench/README.md": False}  # page: short (the README's verdicts in one paragraph)


def render(r: dict | None, page: str = "README.md", short: bool = False) -> str:
    """The study's state and verdicts in prose and tables, from a results file (None: there is none yet), with the
    figure below them, links relative to `page`; `short`: the pilots in one line instead of a table."""
    if r is None:
        return "No run of the study has finished yet (`bench/results/real_vs_trl.json` does not exist)."
    link = lambda target: os.path.relpath(REPO / target, (REPO / page).parent)  # noqa: E731
    d, sel, v = r["design"], r["selection"], r.get("verdicts") or {}
    f = lambda x, spec=".3f": "-" if x is None else format(x, spec)  # noqa: E731
    lines = [f"SmolLM2-135M-Instruct on two-digit addition (held-out greedy accuracy on {d['eval_n']} questions, "
             f"untrained {f(r['untrained']['accuracy'])}), {d['budget_rollouts']} rollouts a run, 2 CPU ranks "
             f"(`bench/real_vs_trl.py`, design in its docstring). **Stage: "
             + ("comparison complete" if r["complete"] else "comparison running" if sel["pilot_gate_met"]
                else "pilots (stable learning first)") + ".**", ""]
    gate_text = (f"the gate: every pilot run gains >= {d['gate_gain']:g} and never falls below the untrained accuracy "
                 f"after the first quarter")
    if short:
        done = ", ".join(f"{p['variant']} seed {p['seed']} {f(p['gain'], '+.3f')} ({'passes' if p['passes'] else 'fails'})"
                         for p in sorted(sel["pilots"], key=lambda p: (p["setting"], p["seed"], p["variant"])))
        lines += [f"Pilots ({gate_text}): {done or 'none finished yet'}."]
    else:
        lines += [f"Pilots (seeds {', '.join(map(str, d['pilot_seeds']))}; {gate_text}):", "",
                  "| setting | changes | variant | seed | final accuracy | gain | lowest after the first quarter | gate |",
                  "|---|---|---|---|---|---|---|---|"]
    for p in [] if short else sorted(sel["pilots"], key=lambda p: (p["setting"], p["seed"], p["variant"])):
        changes = ", ".join(f"{k} {x}" for k, x in d["settings"][p["setting"]].items()) or "none (the base)"
        lines.append(f"| {p['setting']} | {changes} | {p['variant']} | {p['seed']} | {f(p['final_accuracy'])} | "
                     f"{f(p['gain'], '+.3f')} | {f(p['min_after_first_quarter'])} | "
                     f"{'passes' if p['passes'] else 'fails'} |")
    if not sel["pilots"] and not short:
        lines.append("| (no pilot has finished yet) | | | | | | | |")
    gate_line = (f"Setting {sel['chosen_setting']} passed the gate and is frozen for the comparison."
                 if sel["pilot_gate_met"] else "No setting has passed the gate yet: the comparison waits for one.")
    if short:  # the pilots' paragraph goes on: the README stays short
        lines[-1] += " " + gate_line
    else:
        lines += ["", gate_line]
    if v:
        counts = ", ".join(f"{k}: {len(x['seeds'])} seed{'s' * (len(x['seeds']) != 1)}" for k, x in r["variants"].items())
        lines += ["", f"Verdicts ({counts}{'' if r['complete'] else '; interim until every run has finished'}):", ""]
        first_verdict = len(lines)
        par = v.get("parity")
        if par:
            lines.append(f"- Parity: ours_mu1 - trl_mu1 mean held-out accuracy {f(par['mean_accuracy_difference'], '+.3f')}"
                         f" (2 s.e. {f(par['interval_2se'])}; spread between trl_mu1's seeds {f(par['seed_spread_trl_mu1'])}):"
                         f" **{('holds' if v['parity_holds'] else 'not shown') + ('' if r['complete'] else ' so far')}**.")
        if v.get("target_defined"):
            lines.append(f"- Reuse: target {f(v['target_accuracy'])}; rollouts to it over ours_mu1's (median over "
                         f"seeds): " + ", ".join(f"{k} {f(x, '.2f')}" for k, x in v["rollouts_ratio_vs_ours_mu1"].items())
                         + "; sooner than ours_mu1 on the projected clock at g = 0.8 (a model): "
                         + ", ".join(f"{k} {f(x, '.2f')}x" for k, x in v["projected_speedup_vs_ours_mu1"].get("0.8", {}).items())
                         + f"; measured here: " + ", ".join(f"{k} {f(x, '.2f')}x" for k, x in v["speedup_vs_ours_mu1"].items())
                         + f". Goal met: **{'yes' if v['reuse_goal_met'] else 'no' if r['complete'] else 'not yet'}**.")
        else:
            lines.append("- Reuse: ours_mu1 gained nothing at its median, so no target can be set.")
        lines += bought(r, f, link(FINDINGS))
    if v and short:  # one paragraph: the README stays short
        lines[first_verdict - 2:] = [" ".join([lines[first_verdict - 2]] + [x.lstrip("- ") for x in lines[first_verdict:]])]
    lines += ["", f"![Held-out accuracy against rollouts, measured and projected seconds]({link(FIGURE)})"]
    return "\n".join(lines)


def bought(r: dict, f, findings: str) -> list[str]:
    """The verdicts' last sentences: what a replay bought (its worth in fresh passes, a model, beside its drift,
    clipping and entropy, and the mean accuracy that shows a fall after the target), what that means for `auto`
    (the drift its replays ran at against the bound its rule holds them to), and when to turn reuse on; with the
    default the recipe ships."""
    from grpo_recipe.config.schema import Config

    v, worth = r["verdicts"], r["verdicts"].get("replay_worth", {})
    if not worth:
        return []
    parts = []
    for name, x in worth.items():
        passes = v["per_pass"][name]
        replays = [passes[p] for p in sorted((p for p in passes if p.isdigit() and p != "0"), key=int)]
        drift = "/".join(f(p["approx_kl"]) for p in replays)
        clip = "/".join(f(100 * p["clip_fraction"], ".1f") for p in replays)
        entropy = "/".join(f(p["entropy"]) for p in [passes["0"], *replays])
        parts.append(f"{name} ({f(x['passes_per_rollout'], '.2f')} passes a rollout): a replay worth "
                     f"{'at most ' if x['worth_is_upper_bound'] else ''}{f(x['worth'], '+.2f')} of a fresh pass, "
                     f"run at KL {drift}, {clip}% of tokens clipped, entropy by pass {entropy}")
    means = ", ".join(f"{k} {f(x)}" for k, x in v["mean_accuracy"].items())
    best = max(worth, key=lambda k: worth[k]["worth"])
    share = worth[best]["pays_above_share"]
    default = Config().num_iterations
    when = ("here every replay variant's replays are worth less than nothing (" + ", ".join(
                f"{name} {f(x['worth'], '+.2f')}" for name, x in worth.items()) + "), so at no share"
            if all(x["worth"] < 0 for x in worth.values()) else f"here the best replay variant, {best}, is worth {f(worth[best]['worth'], '+.2f')}, so at no share"
            if share is None else f"here {best}'s replays pay at any share" if share == 0
            else f"here {best}'s replays pay above g = {f(share, '.2f')}")
    when += "" if r["complete"] else " (so far)"
    auto = []
    if "ours_auto_g80" in worth and (drift := auto_replay_drift(r)) is not None:
        kl, bound, g = drift
        auto = [f"- What it means for `auto`: its replays ran at KL {f(kl)}, {kl / bound:.0f}x the drift its rule "
                f"allows at g = {g:g} (g x reuse_max_kl = {bound:.2g}): it declines every replay it can price, but a "
                f"rollout's first replay it cannot (the first pass runs on-policy, at KL 0) and takes "
                f"([findings]({findings}#known-limits))."]
    return [f"- What a replay bought (a model: a variant with m passes a rollout that takes R x ours_mu1's rollouts "
            f"to the target has replays worth w = (1/R - 1)/(m - 1) of a fresh pass): " + "; ".join(parts)
            + f". Mean held-out accuracy over the evaluation points (median over seeds; the target counts a run's "
            f"first crossing; a fall after it shows here): {means}.",
            f"- When to turn reuse on: where generation's share of a mu = 1 step, time_generate_s / (time_generate_s"
            f" + time_train_s) in the metrics, exceeds 1 - w for your model and learning rate; {when}. The shipped "
            f"default is num_iterations: {default}" + (", as in TRL." if default == 1 else ".")] + auto


def auto_replay_drift(r: dict) -> tuple[float, float, float] | None:
    """`auto`'s replays: their mean KL (the verdicts' per-pass mean), the bound its rule holds them to (g x
    reuse_max_kl, the code's default) and g; None before it has a replay."""
    from grpo_recipe.config.schema import Config

    first = r["verdicts"]["per_pass"].get("ours_auto_g80", {}).get("1")
    if first is None:
        return None
    g = r["design"]["auto"]["reuse_generation_share"]
    return first["approx_kl"], g * Config().reuse_max_kl, g


def write_docs(result: dict) -> list[Path]:
    """Replace the marked block of each page in DOCS with `render(result)`; returns the pages changed."""
    changed = []
    for name, short in DOCS.items():
        page = REPO / name
        text = page.read_text()
        head, _, rest = text.partition(BEGIN)
        _, _, tail = rest.partition(END)
        new = f"{head}{BEGIN}\n{render(result, name, short)}\n{END}{tail}"
        if new != text:
            page.write_text(new)
            changed.append(page)
    return changed


# ------------------------------------------------------------------------------------------
def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--stage", choices=("pilot", "compare", "all"), default="all")
    ap.add_argument("--smoke", action="store_true", help="tiny budget, eval and completions: every stage, no claim")
    ap.add_argument("--out", default=None, help="folder for real_vs_trl.json and .png (default: bench/results)")
    ap.add_argument("--workdir", default=None, help="runs, snapshots and evaluations (default: output/real_vs_trl)")
    ap.add_argument("--summarize", action="store_true", help="train nothing: summarize the runs kept in the results "
                                                             "file and those finished in the work folder")
    ap.add_argument("--seeds", type=int, nargs="+", default=None, help="run only these seeds now")
    ap.add_argument("--variants", nargs="+", choices=tuple(VARIANTS), default=None,
                    help="run only these variants now (e.g. the shorter runs, where a session has less time left)")
    ap.add_argument("--docs", action="store_true", help="rewrite README's and bench/README's section from the "
                                                        "results file, and stop")
    args = ap.parse_args(argv)
    os.chdir(REPO)
    if args.docs:
        path = (Path(args.out) if args.out else RESULTS) / "real_vs_trl.json"
        changed = write_docs(json.loads(path.read_text()) if path.is_file() else None)
        print(f"real_vs_trl: rewrote {', '.join(str(p.relative_to(REPO)) for p in changed) or 'nothing'}")
        return 0
    from transformers import AutoConfig
    from vs_trl import run_env, trl_ds_config, trl_version

    from grpo_recipe.config.load import load_config
    from grpo_recipe.model.ds_config import ds_config
    from grpo_recipe.model.load import load_tokenizer

    smoke = SMOKE if args.smoke else {}
    settings = smoke.get("settings", SETTINGS)
    hyper = {name: {**BASE, **smoke.get("hyper", {}), **over} for name, over in settings.items()}
    budget, points = smoke.get("budget", BUDGET_ROLLOUTS), smoke.get("points", EVAL_POINTS)
    eval_n, eval_tokens = smoke.get("eval_n", EVAL_N), smoke.get("eval_max_new_tokens", EVAL_MAX_NEW_TOKENS)
    variants = smoke.get("variants", tuple(VARIANTS))
    work = Path(args.workdir).resolve() if args.workdir else REPO / "output" / ("real_vs_trl_smoke" if args.smoke
                                                                               else "real_vs_trl")
    out = Path(args.out).resolve() if args.out else RESULTS
    work.mkdir(parents=True, exist_ok=True)
    t_start, load_start = time.perf_counter(), os.getloadavg()
    model = prepare_model()
    data = prepare_task(work / "data", eval_n)
    tok = load_tokenizer(str(model))
    trl_ds = {}
    for name, h in hyper.items():
        cfg = load_config(recipe_argv(model, data, h, 0), world_size=2)
        trl_ds[name] = work / f"ds_config_trl_{name}.json"
        trl_ds[name].write_text(json.dumps(trl_ds_config(cfg, False, ds_config(cfg, 2, AutoConfig.from_pretrained(
            model).hidden_size)), indent=1))
    trl_prompts = work / "trl_prompts.jsonl"
    chat_prompts(load_config(recipe_argv(model, data, hyper[next(iter(hyper))], 0), world_size=2), tok, trl_prompts)
    untrained = evaluate(model, data / "eval.jsonl", eval_n, eval_tokens, work / "untrained.eval.json")
    design = {"smoke": args.smoke, "task": {"name": TASK, "config": TASK_CONFIG}, "config": CONFIG, "base": BASE,
              "settings": settings, "budget_rollouts": budget, "eval_points": list(points), "eval_n": eval_n,
              "eval_max_new_tokens": eval_tokens, "pilot_seeds": list(smoke.get("pilot_seeds", PILOT_SEEDS)),
              "seeds": list(smoke.get("seeds", SEEDS)), "variants": list(variants), "gate_gain": smoke.get("gate_gain", GATE_GAIN),
              "auto": {"reuse_generation_share": AUTO_G, "reuse_max_iterations": AUTO_MAX},
              "target_fraction": TARGET_FRACTION, "trl_version": trl_version(sys.executable),
              "completions_per_rollout": 2 * next(iter(hyper.values()))["per_device_train_batch_size"]}
    ctx = {"work": work, "model": model, "data": data, "hyper": hyper, "trl_prompts": trl_prompts, "trl_ds": trl_ds,
           "env": run_env(), "budget": budget, "points": points, "eval_n": eval_n, "eval_max_new_tokens": eval_tokens,
           "untrained": untrained, "save": smoke.get("save", (SAVE_STEPS, 1))}
    path = out / "real_vs_trl.json"
    old = json.loads(path.read_text()) if path.is_file() else {}
    kept = {(r["setting"], r["variant"], r["seed"]): r for r in old.get("runs", [])} if old.get("design") == design else {}
    if old and not kept and old.get("runs"):
        print(f"real_vs_trl: {path} is of another design; none of its runs is kept", file=sys.stderr)
    state = {"runs": kept, "argv": argv if argv is not None else sys.argv[1:]}

    def run(setting, variant, seed):
        key = (setting, variant, seed)
        on_disk = done_on_disk(work / setting / f"{variant}-seed{seed}" / "snapshots", list(points))
        now = (not args.seeds or seed in args.seeds) and (not args.variants or variant in args.variants)
        if key not in state["runs"] and (on_disk or not args.summarize) and now:
            state["runs"][key] = one_run(variant, seed, setting, ctx)
            write(out, design, state, untrained, t_start, load_start)
        return state["runs"].get(key)

    chosen = None
    if args.stage in ("pilot", "all") or args.summarize:
        for name in settings:  # in the declared order, until one passes
            pilots = [run(name, v, s) for s in design["pilot_seeds"] for v in PILOT_VARIANTS]
            if None in pilots:
                break
            if all(gate(p, budget, design["gate_gain"])["passes"] for p in pilots):
                chosen = name
                break
    else:
        chosen = selected(state, design, budget)
    if chosen is not None and (args.stage in ("compare", "all") or args.summarize):
        for i, seed in enumerate(design["seeds"]):
            order = list(variants)
            for v in order[i % len(order):] + order[:i % len(order)]:  # rotated: load drifts hit every variant
                run(chosen, v, seed)
    elif args.stage == "compare":
        print("real_vs_trl: no setting has passed the pilot gate; run --stage pilot first", file=sys.stderr)
    write(out, design, state, untrained, t_start, load_start)
    return 0


def selected(state: dict, design: dict, budget: int) -> str | None:
    for name in design["settings"]:
        pilots = [state["runs"].get((name, v, s)) for s in design["pilot_seeds"] for v in PILOT_VARIANTS]
        if None in pilots:
            return None
        if all(gate(p, budget, design["gate_gain"])["passes"] for p in pilots):
            return name
    return None


def write(out: Path, design: dict, state: dict, untrained: dict, t_start: float, load_start) -> None:
    from vs_trl import versions

    runs = list(state["runs"].values())
    budget = design["budget_rollouts"]
    pilots = [{"setting": r["setting"], "variant": r["variant"], "seed": r["seed"], **gate(r, budget, design["gate_gain"]),
               "final_accuracy": r["final_accuracy"]}
              for r in runs if r["seed"] in design["pilot_seeds"] and r["variant"] in PILOT_VARIANTS]
    chosen = selected(state, design, budget)
    compare = [r for r in runs if r["seed"] in design["seeds"] and r["setting"] == chosen]
    found = verdicts(compare, budget) if compare else {}
    factors = found.get("projection_factors", {})
    per_rollout = design["completions_per_rollout"]
    variants = {}
    for r in sorted(compare, key=lambda r: (r["variant"], r["seed"])):
        v = variants.setdefault(r["variant"], {"seeds": [], "curves": {}, "rollout_accuracy": {}})
        v["seeds"].append(r["seed"])
        clocks = {"measured_s": point_times(r), **{f"projected_g{g}_s": point_times(r, f) for g, f in factors.items()}}
        tokens = [per_rollout * sum(x or 0 for x in r["rollout_length"][:c["rollouts"]]) for c in r["curve"]]
        v["curves"][str(r["seed"])] = [{**c, "generated_tokens": round(n), **{k: t[i] for k, t in clocks.items()}}
                                       for i, (c, n) in enumerate(zip(r["curve"], tokens))]
        v["rollout_accuracy"][str(r["seed"])] = r["rollout_accuracy"]
    result = {"benchmark": "real_vs_trl", "design": design, "goals": GOALS,
              "untrained": {k: untrained[k] for k in ("accuracy", "correct", "n")},
              "selection": {"pilot_gate_met": chosen is not None, "chosen_setting": chosen,
                            "settings_tried": sorted({p["setting"] for p in pilots}), "pilots": pilots},
              "variants": variants, "verdicts": found,
              "complete": bool(chosen) and all(len(variants.get(v, {}).get("seeds", [])) == len(design["seeds"])
                                               for v in design["variants"]),
              "versions": versions(sys.executable),
              "machine": machine(load_average_at_start=load_start, load_average_at_end=os.getloadavg()),
              "commands": {"benchmark": "python bench/real_vs_trl.py " + " ".join(state["argv"]),
                           "env": "OMP_NUM_THREADS=1 DS_ACCELERATOR=cpu per rank (2 ranks, torchrun)"},
              "this_invocation_wall_s": time.perf_counter() - t_start, "runs": runs}
    save_json("real_vs_trl.json", result, out)
    plot(compare or runs, result, out / "real_vs_trl.png")
    print(f"real_vs_trl: wrote {out / 'real_vs_trl.json'} ({len(runs)} runs; gate met: {chosen is not None})",
          file=sys.stderr, flush=True)


if __name__ == "__main__":
    sys.exit(main())
