"""When does reusing a rollout (mu > 1) pay? Time to reward thresholds for each mu across regimes.

A regime is a learning rate and a generation share (completion length, completions per step), plus reward and
model width for the regimes added to test the default. In each regime every variant (fixed mu = 1, 2, 4, 8, mu = 4
with a fixed KL target, `num_iterations: auto`, and earlier forms of it) trains for the same budget
of training time (start-up excluded; process CPU seconds by default, so other jobs on the machine do not decide
it), one rank, ZeRO-3, a tiny Qwen2 model. Variants rotate their order within each seed and `--jobs 2` runs two at once.

Thresholds (per regime): a fraction f in {0.5, 0.8, 0.9} of the way from the median first-rollout reward
to the best 4-rollout moving average reached by any run of that regime. Time to a threshold: the training time
at which a run's moving average first reached it. Speed-up over mu = 1: per seed t(mu=1) / t(variant),
median over seeds; a run that never reaches a threshold counts as taking longer than its budget (so a
speed-up over a mu = 1 run that never got there is a lower bound, reported as budget / t). Verdict per regime
with auto: its speed-up to 80% against 1.0 and against 0.9 x the best fixed mu's.

    python bench/reuse_regimes.py --regimes noe_b4_lr1e-3 --variants 1 2 4 8 auto --seeds 0 1 2 3 4 5 --keep

(`--keep` adds to the existing result file, replacing only the (regime, variant, seed) runs it runs.) The
invocations that made bench/results/reuse_regimes.json, in the order they ran: its `commands`, and bench/README.md.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from common import (
    QUICKSTART,
    REPO,
    RESULTS,
    MetricsTail,
    cost_clock,
    fit_prices,
    machine,
    passes_per_rollout,
    per_generation,
    rank_env,
    read_metrics,
    save_json,
    smoothed,
    time_to,
)
from reuse_report import FRACTIONS, SMOOTH, medians, plot, tables
from reuse_store import load_runs, merge, save_runs

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
# The map num_iterations: auto was designed on: its first constant (kappa) was read off trl_lr1e-3 and
# long_g4_lr3e-4, and its bounded form (reuse_max_kl) was chosen after long_g4_lr3e-4 failed the first.
# The regimes below were added afterwards, to test the rule where it was not tuned.
DESIGNED_ON = set(REGIMES)
SPACE = [*H64, "--reward_funcs", json.dumps(["bench/regime_rewards.py:space_share"]), "--num_generations", "4",
         "--max_completion_length", "128", "--per_device_train_batch_size", "16", "--gradient_accumulation_steps", "1"]
NOE = [*H64, "--reward_funcs", json.dumps(["bench/regime_rewards.py:no_e_share"]), "--num_generations", "4",
       "--max_completion_length", "256", "--per_device_train_batch_size", "4", "--gradient_accumulation_steps", "1"]
REGIMES.update({
    # a different reward (length-neutral, on word boundaries), shorter completions
    "space_b16_lr1e-3": {"args": [*SPACE, "--learning_rate", "1e-3"], "budget_s": 180, "stop_at": 0.95,
                         "about": "new reward (space share), 128 new tokens, G = 4, 16 completions/step, lr 1e-3"},
    # a different width and learning rate with long completions
    "h128_long_lr6e-4": {"args": [*LONG, "--model_name_or_path", "builtin:tiny-qwen2", "--learning_rate", "6e-4"],
                         "budget_s": 60, "about": "hidden 128, 256 new tokens, 8 completions/step, lr 6e-4"},
    # a learning rate and a completion length between the map's: 128 new tokens, 16 completions/step in 2 micro-batches
    "mid_lr6e-4": {"args": [*TINY, "--max_completion_length", "128", "--per_device_train_batch_size", "8",
                            "--gradient_accumulation_steps", "2", "--learning_rate", "6e-4"], "budget_s": 60,
                   "about": "128 new tokens, 16 completions/step (2 micro-batches), lr 6e-4"},
    # the >= 4x target's first regime, with a length-neutral reward at lr 3e-4: 8 completions per step
    # (decoding costs about the same per token step whatever the batch, training halves), mu up to 8
    "vowel_b8_lr3e-4": {"args": [*VOWEL, "--per_device_train_batch_size", "8", "--learning_rate", "3e-4"],
                        "budget_s": 1000, "stop_at": 0.95,
                        "about": "generation-dominated, vowel share: 256 new tokens, G = 4, 8 completions/step, lr 3e-4"},
    # past the 0.85: G = 4 and one prompt per step (4 completions), the training side's least; lr 1e-3
    # makes so small a step learn within minutes (at lr 3e-4 it barely moved in 250 rollouts; 512 new tokens
    # instead of 4 completions per step left g at 0.83: training grows with the tokens as decoding does)
    "vowel_b4_lr1e-3": {"args": [*VOWEL, "--per_device_train_batch_size", "4", "--learning_rate", "1e-3"],
                        "budget_s": 400, "stop_at": 0.95,
                        "about": "generation-dominated, g 0.86 (the map's highest, with noe_b4_lr1e-3): vowel share, "
                                 "256 new tokens, G = 4, 4 completions/step, lr 1e-3"},
    # the same shape with a reward whose ceiling needs no collapse (bench/regime_rewards.py:no_e_share): the vowel
    # regimes' verdicts turned on whether a seed fell into the 2/3 trap; this one measures reuse
    "noe_b4_lr1e-3": {"args": [*NOE, "--learning_rate", "1e-3"],
                      "budget_s": 400, "stop_at": 0.99,
                      "about": "vowel_b4_lr1e-3's shape, a trap-free reward (share of characters not an e): "
                               "256 new tokens, G = 4, 4 completions/step, lr 1e-3"},
    # and vowel_b16_lr3e-4's shape (where auto failed at 0.74 of mu = 4) with the same trap-free reward
    "noe_b16_lr3e-4": {"args": [*NOE, "--per_device_train_batch_size", "16", "--learning_rate", "3e-4"],
                       "budget_s": 840, "stop_at": 0.99,
                       "about": "vowel_b16_lr3e-4's shape, a trap-free reward (share of characters not an e): "
                                "256 new tokens, G = 4, 16 completions/step, lr 3e-4"},
    # the >= 4x target's regime: the same with ZeRO-3 generation gathering layer by layer (what a model too large
    # to gather whole takes) slows decoding about 3x and leaves training put: g = 0.92 with 16 completions per step
    "noe_b16_gather_lr3e-4": {"args": [*NOE, "--per_device_train_batch_size", "16", "--learning_rate", "3e-4",
                                       "--hf_generation_gather", "per_layer"], "budget_s": 1500, "stop_at": 0.99,
                              "about": "noe_b16_lr3e-4 with ZeRO-3 generation gathering layer by layer (g 0.92)"},
    # at half the learning rate a pass moves the policy half as far: built for >= 4x, where passes 5-8 pay
    "noe_b16_gather_lr1.5e-4": {"args": [*NOE, "--per_device_train_batch_size", "16", "--learning_rate", "1.5e-4",
                                         "--hf_generation_gather", "per_layer"], "budget_s": 3000, "stop_at": 0.99,
                                "about": "noe_b16_gather_lr3e-4 at half the learning rate (g 0.92)"},
})
# the default's cap of 4 passes was read off the fixed mu = 4 and 8 columns, mid_lr6e-4's among them
DESIGNED_ON.add("mid_lr6e-4")
# the cap of 8 replaced it after the default failed noe_b16_gather_lr1.5e-4 and auto_cap8 was measured in both
DESIGNED_ON.update({"noe_b16_gather_lr3e-4", "noe_b16_gather_lr1.5e-4"})
VARIANTS = {
    "1": ["--num_iterations", "1"],
    "2": ["--num_iterations", "2"],
    "4": ["--num_iterations", "4"],
    "8": ["--num_iterations", "8"],
    "4+kl5e-4": ["--num_iterations", "4", "--reuse_target_kl", "5e-4"],
    "4+kl2e-3": ["--num_iterations", "4", "--reuse_target_kl", "2e-3"],
    "auto": ["--num_iterations", "auto"],  # mu decided per rollout, at most 8, KL_max 3.6e-3 (grpo_recipe/algo/reuse.py)
    # the default until 2026-12-04 (at most 4 passes); its runs were the map's `auto` until then
    "auto_cap4": ["--num_iterations", "auto", "--reuse_max_iterations", "4"],
    # the default until KL_max doubled: set while the cap was 8, to stop passes 5-8, it cut passes 2-4 at the cap of 4
    "auto_maxkl1.8e-3": ["--num_iterations", "auto", "--reuse_max_kl", "1.8e-3", "--reuse_max_iterations", "4"],
    "auto8": ["--num_iterations", "auto", "--reuse_max_iterations", "8", "--reuse_max_kl", "1.8e-3"],  # the first default
    # the screen's name for the cap-4 default (bench/results/reuse_screen_maxkl_priced.json)
    "auto_maxkl3.6e-3": ["--num_iterations", "auto", "--reuse_max_kl", "3.6e-3", "--reuse_max_iterations", "4"],
    # a candidate: the drift rate averaged over recent passes (about 10), so strong-signal rollouts keep their replays
    "auto_smooth0.1": ["--num_iterations", "auto", "--reuse_drift_smoothing", "0.1", "--reuse_max_kl", "1.8e-3",
                       "--reuse_max_iterations", "4"],
}
CLOCKS = {"cpu_s": "step_cpu_s", "time_s": "step_time_s"}  # a budget's clock: the metrics key it sums
# The verdicts' clock: each run's work priced alike (price_runs). A 2-core VM's speed drifts: the same seed's
# identical mu = 1 run took 1.6x the CPU seconds in one pair of runs as in another, so CPU seconds ranked
# variants by when they ran; counts priced at one fitted rate per regime do not.
SUMMARY_CLOCK = "cost_s"


def run(regime: str, variant: str, seed: int, root: Path, clock: str) -> dict:
    """One training run, stopped once its summed step times (on `clock`) pass the regime's budget."""
    out = root / regime / f"{variant}_seed{seed}"
    cmd = [sys.executable, "-m", "grpo_recipe.train", "--config", QUICKSTART, *REGIMES[regime]["args"],
           *VARIANTS[variant], "--seed", str(seed), "--max_steps", "100000", "--output_dir", str(out),
           "--save_steps", "0", "--overwrite_output_dir", "true", "--logging_steps", "1", "--disable_tqdm", "true"]
    env = rank_env()
    out.mkdir(parents=True, exist_ok=True)
    budget, stop_at = REGIMES[regime]["budget_s"], REGIMES[regime].get("stop_at")
    (out / "metrics.jsonl").unlink(missing_ok=True)
    tail, loads = MetricsTail(out), []  # polled while two runs share the cores: parse only what is new
    with open(out.with_suffix(".log"), "w") as log:
        proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT)
        while proc.poll() is None:
            time.sleep(0.5)
            recs = tail.read()
            loads.append(os.getloadavg()[0])
            if trained_seconds(recs, clock) >= budget or at_ceiling(recs, stop_at):
                proc.kill()
                proc.wait()
                break
    recs = read_metrics(out)
    if not recs or (trained_seconds(recs, clock) < budget and not at_ceiling(recs, stop_at)):
        raise RuntimeError(f"{regime} mu={variant} seed={seed} stopped early; see {out.with_suffix('.log')}")
    passes = passes_per_rollout(recs)
    return {"regime": regime, "variant": variant, "seed": seed, "rows": per_generation(recs),
            "generation_share": sum(r["time_generate_s"] for r in recs) / sum(r["step_time_s"] for r in recs),
            "clip_ratio_region_mean": statistics.mean(r["clip_ratio_region"] for r in recs),
            "approx_kl_mean": statistics.mean(r["approx_kl"] for r in recs),
            "passes_used_mean": statistics.mean(passes), "steps": len(recs), "budget_s": budget,
            "budget_clock": clock, "trained": {c: trained_seconds(recs, c) for c in CLOCKS},
            "frozen_generation_share": recs[-1].get("reuse_generation_share"),
            "frozen_cost_ratio": frozen_cost_ratio(recs[-1]),
            "load_1m_mean": statistics.mean(loads) if loads else os.getloadavg()[0]}


def frozen_cost_ratio(record: dict) -> float | None:
    """num_iterations: auto's clock input, seconds per decoding step over seconds per trained token, measured on
    rollouts 1-3 and frozen (grpo_recipe/algo/reuse.py); read back from the g it gives the record's rollout (the
    generation share itself follows the rollout's size, so runs that end on other lengths show other g)."""
    g = record.get("reuse_generation_share")
    return None if not g or g >= 1 else g / (1 - g) * record["rollout_tokens"] / max(record["decode_steps"], 1)


def trained_seconds(records: list[dict], clock: str) -> float:
    return sum(r[CLOCKS[clock]] for r in records)


def at_ceiling(records: list[dict], stop_at: float | None) -> bool:
    return stop_at is not None and bool(records) and max(smoothed(per_generation(records), SMOOTH)) >= stop_at


def speedup(t1: float | None, tv: float | None, end1: float) -> float | None:
    """t(mu=1) / t(variant); a missing time is 'after mu = 1 stopped at end1' (then a bound, None if both
    missing)."""
    if tv is None:
        return None if t1 is None else 0.0
    return (t1 if t1 is not None else end1) / tv


def run_clock(runs: list[dict], clock: str) -> str:
    """The clock a regime is summarized on: the first of `clock`, cpu_s and time_s that every run has (runs from
    before the work counts: no cost_s; from before step_cpu_s: wall only)."""
    return next(c for c in dict.fromkeys((clock, "cpu_s", "time_s")) if all(c in r["rows"][0] for r in runs))


def price_runs(runs: list[dict]) -> dict[str, dict[str, float]]:
    """The priced clock, cost_s, on the rows of each regime whose runs all count their work: CPU seconds per unit
    of work fitted on that regime's runs together (common.fit_prices), so all are priced alike. Returns the
    prices per regime."""
    prices = {}
    for regime in dict.fromkeys(r["regime"] for r in runs):
        rr = [r for r in runs if r["regime"] == regime]
        if not all("decode_steps" in r["rows"][0] and "cpu_s" in r["rows"][0] for r in rr):
            continue
        prices[regime] = fit_prices([r["rows"] for r in rr])
        for r in rr:
            for row, t in zip(r["rows"], cost_clock(r["rows"], prices[regime])):
                row["cost_s"] = t
            r["trained"]["cost_s"] = r["rows"][-1]["cost_s"]  # by its last rollout: a lower bound of its end
    return prices


def summarize(runs: list[dict], clock: str = "cpu_s") -> dict:
    out = {}
    for regime in dict.fromkeys(r["regime"] for r in runs):
        rr = [r for r in runs if r["regime"] == regime]
        key = run_clock(rr, clock)
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
                t1 = {s: time_to(base[s]["rows"], thr, SMOOTH, key) for s in seeds if s in base}
                tv = {s: time_to(vr[s]["rows"], thr, SMOOTH, key) for s in seeds if s in vr}
                # mu = 1 never got there: it trained for its budget (or, on the other clock, what that took)
                end1 = {s: base[s]["trained"][key] if "trained" in base[s] else base[s]["budget_s"] for s in base}
                per_seed = [speedup(t1[s], tv[s], end1[s]) for s in seeds if s in vr and s in base]
                known = [x for x in per_seed if x is not None]
                # mu = 1 never got there but the variant did: end / t, a lower bound of the speed-up
                bound = [t1[s] is None and tv[s] is not None for s in seeds if s in vr and s in base]
                row[f] = {"median": statistics.median(known) if known else None, "per_seed": per_seed,
                          "per_seed_is_lower_bound": bound,
                          "time_s": [tv[s] for s in seeds if s in vr]}
            g = statistics.median(r["generation_share"] for r in base.values())
            if variant.isdigit() and variant != "1":  # plain mu: the perfect-reuse bound and the replay efficiency
                mu, s08 = int(variant), row["0.8"]["median"]
                row["perfect_reuse_bound"] = mu / (g + mu * (1 - g))
                row["replay_efficiency_0.8"] = None if not s08 else (s08 * (g + mu * (1 - g)) - 1) / (mu - 1)
            # clock-free: rollouts from the 50% to the 80% threshold (a stall between them shows here on any machine)
            row["rollouts_0.5_to_0.8"] = [rollouts_between(vr[s]["rows"], thresholds["0.5"], thresholds["0.8"])
                                          for s in seeds if s in vr]
            row["passes_used_mean"] = statistics.mean(r["passes_used_mean"] for r in vr.values())
            row["clip_ratio_region_mean"] = statistics.mean(r["clip_ratio_region_mean"] for r in vr.values())
            shares = [r["frozen_generation_share"] for r in vr.values() if r.get("frozen_generation_share")]
            if shares:  # num_iterations: auto: the g of each run's last rollout, and the cost ratio it froze
                row["frozen_generation_share"] = shares
            if ratios := [r["frozen_cost_ratio"] for r in vr.values() if r.get("frozen_cost_ratio")]:
                row["frozen_cost_ratio"] = ratios
            table[variant] = row
        out[regime] = {"about": REGIMES[regime]["about"], "designed_on": regime in DESIGNED_ON,
                       "clock": key, "budget_s": rr[0]["budget_s"],
                       "generation_share_mu1": statistics.median(r["generation_share"] for r in base.values()),
                       "first_reward": start, "best_reward": best, "thresholds": thresholds, "variants": table}
        if "auto" in table:
            out[regime]["verdict"] = verdict(table)
    return out


def rollouts_between(rows: list[dict], low: float, high: float) -> int | None:
    """Rollouts from the moving average first reaching `low` to it first reaching `high` (None: never both)."""
    first = [time_to(rows, t, SMOOTH, "generation") for t in (low, high)]  # rollouts are numbered 0, 1, ...
    return None if None in first else first[1] - first[0]


def verdict(table: dict, f: str = "0.8") -> dict:
    """The default against mu = 1 and against the best fixed mu of the regime, to the threshold f (medians)."""
    fixed = {v: row[f]["median"] for v, row in table.items() if v.isdigit()}
    best = max(fixed, key=lambda v: -1.0 if fixed[v] is None else fixed[v])
    auto, top = table["auto"][f]["median"], fixed[best]
    return {"threshold": f, "auto": auto, "best_fixed_mu": best, "best_fixed": top,
            "auto_over_best": None if not (auto and top) else auto / top,
            "no_later_than_mu1": auto is not None and auto >= 1.0,
            "within_10pct_of_best": auto is not None and (top is None or auto >= 0.9 * top)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--regimes", nargs="+", default=list(REGIMES), choices=list(REGIMES))
    ap.add_argument("--variants", nargs="+", default=["1", "2", "4", "8", "auto"], choices=list(VARIANTS))
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    ap.add_argument("--jobs", type=int, default=2, help="runs at once (one thread each)")
    ap.add_argument("--budget_scale", type=float, default=1.0, help="multiply every regime's time budget")
    ap.add_argument("--clock", choices=list(CLOCKS), default="cpu_s",
                    help="budgets and the verdict on process CPU seconds (cpu_s: robust to other jobs on the machine) "
                         "or wall seconds (time_s); the other clock is reported too")
    ap.add_argument("--keep", action="store_true",
                    help="keep the stored runs of reuse_regimes.json, replacing only the (regime, variant, seed) runs run now")
    ap.add_argument("--resummarize", action="store_true", help="run nothing: summarize and plot the stored runs again")
    ap.add_argument("--tables", action="store_true", help="run nothing: print bench/README.md's tables of the stored runs")
    args = ap.parse_args()
    if "1" not in args.variants and not args.keep:
        ap.error("--variants must include 1 (the baseline), or --keep the stored mu = 1 runs")
    for r in REGIMES.values():
        r["budget_s"] *= args.budget_scale

    path, runs_dir = RESULTS / "reuse_regimes.json", RESULTS / "reuse_regimes"

    def stored() -> dict:  # the stored result with its runs read back
        old = json.loads(path.read_text())
        return {**old, "runs": load_runs(old, runs_dir)}

    if args.tables:
        old = json.loads(path.read_text())
        return print(tables({k: v for k, v in old["regimes"].items() if k in args.regimes}, old.get("verdicts_cpu_s")))
    if args.resummarize:  # the stored runs summarized and plotted again (after a change to the summary's rules)
        old = stored()
        return write(old["runs"], old["commands"], old.get("clock", args.clock), old["total_wall_s"], old["machine"])
    if "1" not in args.variants:  # checked before any run: the stored baseline must be there
        have = {(r["regime"], r["variant"]) for r in stored()["runs"]} if path.exists() else set()
        if missing := [reg for reg in args.regimes if (reg, "1") not in have]:
            ap.error(f"--variants lacks 1 and {path} has no mu = 1 runs of {', '.join(missing)}")
    root = RESULTS / "tmp" / "reuse_regimes"
    plan = []
    for i, seed in enumerate(args.seeds):
        for regime in args.regimes:
            k = i % len(args.variants)
            plan += [(regime, v, seed) for v in args.variants[k:] + args.variants[:k]]  # rotate who goes first
    t0 = time.perf_counter()
    with ThreadPoolExecutor(args.jobs) as pool:
        runs = list(pool.map(lambda p: report(run(*p, root, args.clock)), plan))
    commands = ["python bench/reuse_regimes.py " + " ".join(
        [f"--regimes {' '.join(args.regimes)}", f"--variants {' '.join(args.variants)}",
         f"--seeds {' '.join(map(str, args.seeds))}", f"--jobs {args.jobs}", f"--budget_scale {args.budget_scale}",
         f"--clock {args.clock}"] + (["--keep"] if args.keep else []))]
    if args.keep and path.exists():
        runs, commands = merge(stored(), runs, commands, list(REGIMES))
    write(runs, commands, args.clock, time.perf_counter() - t0)


def write(runs: list[dict], commands: list[str], clock: str, total_wall_s: float, where: dict | None = None) -> None:
    prices = price_runs(runs)
    summary, cpu, wall = summarize(runs, SUMMARY_CLOCK), summarize(runs, "cpu_s"), summarize(runs, "time_s")
    result = {
        "commands": commands,
        "threshold_rule": f"fraction f of the way from the median first-rollout reward to the best {SMOOTH}-rollout "
                          "moving average of any run in the regime; time = summed step times (start-up excluded) "
                          "until that rollout's reward was known, on each regime's clock (regimes[...]['clock']: "
                          "cost_s = the work done by then (decoding steps, trained tokens, optimizer steps, rollouts) "
                          "at the CPU-second prices fitted on all of the regime's runs (prices), cpu_s = the run's "
                          "process CPU seconds, time_s = wall seconds)",
        "clock": clock, "summary_clock": SUMMARY_CLOCK, "prices": prices,
        "threshold_fractions": list(FRACTIONS),
        "speedup_rule": "per seed t(mu=1)/t(variant), median over seeds; a run that never reached the threshold "
                        "counts as the time mu = 1 trained (a bound) or 0.0 when the variant never reached it",
        "variants": {k: " ".join(v) for k, v in VARIANTS.items()},
        "speedup_vs_mu1": medians(summary), "speedup_vs_mu1_cpu": medians(cpu), "speedup_vs_mu1_wall": medians(wall),
        "verdicts": {reg: s["verdict"] for reg, s in summary.items() if "verdict" in s},
        "verdicts_cpu_s": {reg: s["verdict"] for reg, s in cpu.items() if "verdict" in s},
        "load_1m_during_runs": {reg: [f(r["load_1m_mean"] for r in runs if r["regime"] == reg and "load_1m_mean" in r)
                                      for f in (min, statistics.median, max)]
                                for reg in summary if any("load_1m_mean" in r for r in runs if r["regime"] == reg)},
        "regimes": summary, "runs_files": save_runs(runs, RESULTS / "reuse_regimes"), "total_wall_s": total_wall_s,
        "machine": where or machine(load_average_at_end=os.getloadavg()),
    }
    path = save_json("reuse_regimes.json", result)
    for regime in summary:
        plot(regime, [r for r in runs if r["regime"] == regime], summary[regime], RESULTS / f"reuse_{regime}.png")
    print(f"wrote {path}")
    for reg, s in summary.items():
        print(f"{reg} (generation share {s['generation_share_mu1']:.2f}, {s['clock']}):",
              {v: {f: None if x is None else round(x, 2) for f, x in row.items()} for v, row in medians(summary)[reg].items()},
              s.get("verdict", ""))


def report(r: dict) -> dict:
    print(f"{r['regime']} mu={r['variant']} seed={r['seed']}: {len(r['rows'])} rollouts, {r['steps']} steps, "
          f"last reward {r['rows'][-1]['reward']:.2f}", flush=True)
    return r


if __name__ == "__main__":
    main()
