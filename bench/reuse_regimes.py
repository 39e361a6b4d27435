"""When does reusing a rollout (mu > 1) pay? Time to reward thresholds for each mu across regimes.

A regime is a learning rate and a generation share (completion length, completions per step). In each
regime every variant (mu = 1, 2, 4, 8 and mu = 4 with adaptive reuse) trains for the same wall-clock
budget of training time (start-up excluded), one rank, ZeRO-3, the tiny hidden-64 Qwen2 model. Variants
rotate their order within each seed and `--jobs 2` runs two at once (one thread each), so load hits
every variant alike.

Thresholds (per regime): a fraction f in {0.5, 0.8, 0.9} of the way from the median first-rollout reward
to the best 4-rollout moving average reached by any run of that regime. Time to a threshold: the wall time
at which a run's moving average first reached it. Speed-up over mu = 1: per seed t(mu=1) / t(variant),
median over seeds; a run that never reaches a threshold counts as taking longer than its budget (so a
speed-up over a mu = 1 run that never got there is a lower bound, reported as budget / t).

    python bench/reuse_regimes.py --regimes short_lr3e-4 short_lr1e-4 long_lr1e-3 --variants 1 2 4 8 4+kl2e-3
    python bench/reuse_regimes.py --regimes trl_lr1e-3 --variants 1 2 4 8 4+kl5e-4 4+kl2e-3 --keep
    python bench/reuse_regimes.py --regimes long_g4_lr3e-4 --variants 1 2 4 4+kl5e-4 --keep
    python bench/reuse_regimes.py --regimes vowel_b16_lr3e-4 --variants 1 4 --keep
    python bench/reuse_regimes.py --regimes h128_short_lr3e-4 --variants 1 2 4 4+kl5e-4 --keep

(`--keep` adds to the existing result file, replacing only the regimes it runs; about 2 hours in all.)
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import textwrap
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from common import (QUICKSTART, REPO, RESULTS, MetricsTail, machine, per_generation, rank_env, read_metrics,
                    save_json, smoothed, time_to)

FRACTIONS = (0.5, 0.8, 0.9)
SMOOTH = 4
H64 = ["--model_name_or_path", "builtin:tiny-qwen2-h64", "--loss_type", "dapo"]
TINY = [*H64, "--num_generations", "8", "--reward_funcs", json.dumps([{"func": "length", "kwargs": {"target_chars": 60}}])]
# The regime TRL 1.16 was measured in (issue #8): 8 completions per prompt, 32 per optimizer step, 64 new
# tokens, lr 1e-3; then the same at lower learning rates; then long completions and small steps, where
# generation is most of a mu = 1 step.
SHORT = [*TINY, "--max_completion_length", "64", "--per_device_train_batch_size", "16",
         "--gradient_accumulation_steps", "2"]
LONG = [*TINY, "--max_completion_length", "256", "--per_device_train_batch_size", "8",
        "--gradient_accumulation_steps", "1"]
# Fewer completions per step shrink the training side only: decoding a small batch costs about the same.
LONG_G4 = [*LONG, "--num_generations", "4", "--per_device_train_batch_size", "4"]
# A length-neutral reward (bench/regime_rewards.py): completions stay long, so generation's share stays put
# (the length reward shortens them as it learns); 16 completions per step keep each rollout's gradient
# accurate enough for replays to be worth about a fresh step.
VOWEL = [*H64, "--reward_funcs", json.dumps(["bench/regime_rewards.py:vowel_share"]), "--num_generations", "4",
         "--max_completion_length", "256", "--per_device_train_batch_size", "16", "--gradient_accumulation_steps", "1"]
REGIMES = {
    "trl_lr1e-3": {"args": [*SHORT, "--learning_rate", "1e-3"], "budget_s": 45,
                   "about": "TRL-measured regime: 64 new tokens, 32 completions/step, lr 1e-3"},
    "short_lr3e-4": {"args": [*SHORT, "--learning_rate", "3e-4"], "budget_s": 45,
                     "about": "same, lr 3e-4"},
    "short_lr1e-4": {"args": [*SHORT, "--learning_rate", "1e-4"], "budget_s": 45,
                     "about": "same, lr 1e-4 (a step barely moves the policy)"},
    "long_lr1e-3": {"args": [*LONG, "--learning_rate", "1e-3"], "budget_s": 60,
                    "about": "long completions: 256 new tokens, 8 completions/step, lr 1e-3"},
    "long_g4_lr3e-4": {"args": [*LONG_G4, "--learning_rate", "3e-4"], "budget_s": 150,
                       "about": "generation-dominated: 256 new tokens, G = 4 and 4 completions/step, lr 3e-4"},
    "h128_short_lr3e-4": {"args": [*SHORT, "--model_name_or_path", "builtin:tiny-qwen2", "--learning_rate", "3e-4"],
                          "budget_s": 60, "about": "the bigger tiny model (hidden 128) in the short regime, lr 3e-4"},
    # stop_at: a run ends early once its moving average reaches the reward's ceiling (vowel share <= 1)
    "vowel_b16_lr3e-4": {"args": [*VOWEL, "--learning_rate", "3e-4"], "budget_s": 840, "stop_at": 0.99,
                         "about": "generation-dominated, length-neutral reward (vowel share): 256 new tokens, G = 4, "
                                  "16 completions/step, lr 3e-4"},
}
VARIANTS = {
    "1": ["--num_iterations", "1"],
    "2": ["--num_iterations", "2"],
    "4": ["--num_iterations", "4"],
    "8": ["--num_iterations", "8"],
    "4+kl5e-4": ["--num_iterations", "4", "--reuse_target_kl", "5e-4"],
    "4+kl2e-3": ["--num_iterations", "4", "--reuse_target_kl", "2e-3"],
}
RENAMED = {"4+kl": "4+kl2e-3"}  # variant names of earlier result files


def run(regime: str, variant: str, seed: int, root: Path) -> dict:
    """One training run, stopped once its summed step times pass the regime's budget."""
    out = root / regime / f"{variant}_seed{seed}"
    cmd = [sys.executable, "-m", "recipe.train", "--config", QUICKSTART, *REGIMES[regime]["args"],
           *VARIANTS[variant], "--seed", str(seed), "--max_steps", "100000", "--output_dir", str(out),
           "--save_steps", "0", "--overwrite_output_dir", "true", "--logging_steps", "1", "--disable_tqdm", "true"]
    env = rank_env()
    out.mkdir(parents=True, exist_ok=True)
    budget, stop_at = REGIMES[regime]["budget_s"], REGIMES[regime].get("stop_at")
    (out / "metrics.jsonl").unlink(missing_ok=True)
    tail = MetricsTail(out)  # polled while two runs share the cores: parse only what is new
    with open(out.with_suffix(".log"), "w") as log:
        proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT)
        while proc.poll() is None:
            time.sleep(0.5)
            recs = tail.read()
            if trained_seconds(recs) >= budget or at_ceiling(recs, stop_at):
                proc.kill()
                proc.wait()
                break
    recs = read_metrics(out)
    if not recs or (trained_seconds(recs) < budget and not at_ceiling(recs, stop_at)):
        raise RuntimeError(f"{regime} mu={variant} seed={seed} stopped early; see {out.with_suffix('.log')}")
    passes = [r["passes_used"] for r in recs if r["step"] == len(recs) or
              recs[r["step"]]["generation"] != r["generation"]]
    return {"regime": regime, "variant": variant, "seed": seed, "rows": per_generation(recs),
            "generation_share": sum(r["time_generate_s"] for r in recs) / sum(r["step_time_s"] for r in recs),
            "clip_ratio_region_mean": statistics.mean(r["clip_ratio_region"] for r in recs),
            "approx_kl_mean": statistics.mean(r["approx_kl"] for r in recs),
            "passes_used_mean": statistics.mean(passes), "steps": len(recs), "budget_s": budget}


def trained_seconds(records: list[dict]) -> float:
    return sum(r["step_time_s"] for r in records)


def at_ceiling(records: list[dict], stop_at: float | None) -> bool:
    return stop_at is not None and bool(records) and max(smoothed(per_generation(records), SMOOTH)) >= stop_at


def speedup(t1: float | None, tv: float | None, budget: float) -> float | None:
    """t(mu=1) / t(variant); a missing time is 'after the budget' (then a bound, None if both missing)."""
    if tv is None:
        return None if t1 is None else 0.0
    return (t1 if t1 is not None else budget) / tv


def summarize(runs: list[dict]) -> dict:
    out = {}
    for regime in dict.fromkeys(r["regime"] for r in runs):
        rr = [r for r in runs if r["regime"] == regime]
        start = statistics.median(r["rows"][0]["reward"] for r in rr)
        best = max(max(smoothed(r["rows"], SMOOTH)) for r in rr)
        thresholds = {str(f): start + f * (best - start) for f in FRACTIONS}
        seeds = sorted({r["seed"] for r in rr})
        base = {r["seed"]: r for r in rr if r["variant"] == "1"}
        table: dict = {}
        for variant in dict.fromkeys(r["variant"] for r in rr):
            vr = {r["seed"]: r for r in rr if r["variant"] == variant}
            row = {}
            for f, thr in thresholds.items():
                t1 = {s: time_to(base[s]["rows"], thr, SMOOTH) for s in seeds if s in base}
                tv = {s: time_to(vr[s]["rows"], thr, SMOOTH) for s in seeds if s in vr}
                per_seed = [speedup(t1[s], tv[s], base[s]["budget_s"]) for s in seeds if s in vr and s in base]
                known = [x for x in per_seed if x is not None]
                # mu = 1 never got there but the variant did: budget / t, a lower bound of the speed-up
                bound = [t1[s] is None and tv[s] is not None for s in seeds if s in vr and s in base]
                row[f] = {"median": statistics.median(known) if known else None, "per_seed": per_seed,
                          "per_seed_is_lower_bound": bound,
                          "time_s": [tv[s] for s in seeds if s in vr]}
            g = statistics.median(r["generation_share"] for r in base.values())
            if variant.isdigit() and variant != "1":  # plain mu: the perfect-reuse bound and the replay efficiency
                mu, s08 = int(variant), row["0.8"]["median"]
                row["perfect_reuse_bound"] = mu / (g + mu * (1 - g))
                row["replay_efficiency_0.8"] = None if not s08 else (s08 * (g + mu * (1 - g)) - 1) / (mu - 1)
            row["passes_used_mean"] = statistics.mean(r["passes_used_mean"] for r in vr.values())
            row["clip_ratio_region_mean"] = statistics.mean(r["clip_ratio_region_mean"] for r in vr.values())
            table[variant] = row
        out[regime] = {"about": REGIMES[regime]["about"], "budget_s": rr[0]["budget_s"],
                       "generation_share_mu1": statistics.median(r["generation_share"] for r in base.values()),
                       "first_reward": start, "best_reward": best, "thresholds": thresholds, "variants": table}
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--regimes", nargs="+", default=list(REGIMES), choices=list(REGIMES))
    ap.add_argument("--variants", nargs="+", default=["1", "2", "4", "8", "4+kl5e-4"], choices=list(VARIANTS))
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    ap.add_argument("--jobs", type=int, default=2, help="runs at once (one thread each)")
    ap.add_argument("--budget_scale", type=float, default=1.0, help="multiply every regime's time budget")
    ap.add_argument("--keep", action="store_true",
                    help="keep the other regimes' runs from the existing reuse_regimes.json (rerun only --regimes)")
    args = ap.parse_args()
    if "1" not in args.variants:
        ap.error("--variants must include 1 (the baseline)")
    for r in REGIMES.values():
        r["budget_s"] *= args.budget_scale

    root = RESULTS / "tmp" / "reuse_regimes"
    plan = []
    for i, seed in enumerate(args.seeds):
        for regime in args.regimes:
            k = i % len(args.variants)
            plan += [(regime, v, seed) for v in args.variants[k:] + args.variants[:k]]  # rotate who goes first
    t0 = time.perf_counter()
    with ThreadPoolExecutor(args.jobs) as pool:
        runs = list(pool.map(lambda p: report(run(*p, root)), plan))
    commands = [None]
    if args.keep and (RESULTS / "reuse_regimes.json").exists():
        old = json.loads((RESULTS / "reuse_regimes.json").read_text())
        kept = [r for r in old["runs"] if r["regime"] not in args.regimes]
        for r in kept:
            r.setdefault("budget_s", old["regimes"][r["regime"]]["budget_s"])
            r["variant"] = RENAMED.get(r["variant"], r["variant"])
        runs, commands = kept + runs, (old.get("commands") or [old["command"]]) + commands
    summary = summarize(runs)
    commands[-1] = "python bench/reuse_regimes.py " + " ".join(
            [f"--regimes {' '.join(args.regimes)}", f"--variants {' '.join(args.variants)}",
             f"--seeds {' '.join(map(str, args.seeds))}", f"--jobs {args.jobs}",
             f"--budget_scale {args.budget_scale}"] + (["--keep"] if args.keep else []))
    result = {
        "commands": commands,
        "threshold_rule": f"fraction f of the way from the median first-rollout reward to the best {SMOOTH}-rollout "
                          "moving average of any run in the regime; time = summed step times (start-up excluded) "
                          "until that rollout's reward was known",
        "threshold_fractions": list(FRACTIONS),
        "speedup_rule": "per seed t(mu=1)/t(variant), median over seeds; a run that never reached the threshold "
                        "counts as the budget (a bound) or 0.0 when the variant never reached it",
        "variants": {k: " ".join(v) for k, v in VARIANTS.items()},
        "speedup_vs_mu1": {reg: {v: {f: row[f]["median"] for f in map(str, FRACTIONS)}
                                 for v, row in s["variants"].items()} for reg, s in summary.items()},
        "regimes": summary, "runs": runs, "total_wall_s": time.perf_counter() - t0,
        "machine": machine(load_average_at_end=os.getloadavg()),
    }
    path = save_json("reuse_regimes.json", result)
    for regime in summary:
        plot(regime, [r for r in runs if r["regime"] == regime], summary[regime], RESULTS / f"reuse_{regime}.png")
    print(f"wrote {path}")
    for reg, s in summary.items():
        print(f"{reg} (generation share {s['generation_share_mu1']:.2f}):",
              {v: {f: None if row[f]["median"] is None else round(row[f]["median"], 2) for f in map(str, FRACTIONS)}
               for v, row in s["variants"].items()})


def report(r: dict) -> dict:
    print(f"{r['regime']} mu={r['variant']} seed={r['seed']}: {len(r['rows'])} rollouts, {r['steps']} steps, "
          f"last reward {r['rows'][-1]['reward']:.2f}", flush=True)
    return r


def plot(regime: str, runs: list[dict], summary: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    variants = list(dict.fromkeys(r["variant"] for r in runs))
    colors = dict(zip(variants, plt.cm.viridis([i / max(1, len(variants) - 1) for i in range(len(variants))])))
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for r in runs:
        label = f"mu={r['variant']}" if r["seed"] == runs[0]["seed"] else None
        ax.plot([x["time_s"] for x in r["rows"]], smoothed(r["rows"], SMOOTH), color=colors[r["variant"]],
                label=label, lw=1.2 if r["variant"] == "1" or "+" in r["variant"] else 0.7)
    for f, t in summary["thresholds"].items():
        ax.axhline(t, ls="--", lw=0.8, color="gray")
    ax.set_xlabel("wall-clock training seconds (start-up excluded)")
    ax.set_ylabel(f"reward ({SMOOTH}-rollout moving average)")
    title = textwrap.fill(f"{regime}: {summary['about']}", 100)
    ax.set_title(f"{title}\ngeneration share at mu=1: {summary['generation_share_mu1']:.2f}", fontsize=9)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


if __name__ == "__main__":
    main()
