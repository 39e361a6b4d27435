"""The multi-step GRPO reference experiment, scaled to this machine: reward vs wall-clock time for each mu.

Every run gets the same number of optimizer steps (so mu = 4 generates 4x fewer rollouts than mu = 1),
2 ranks, ZeRO-3, the quickstart's tiny model and length reward; runs alternate mu within each seed so load
drifts hit every mu alike. Time to a reward threshold is read from each run's own per-step timings (start-up
excluded). Threshold: a fraction f of the way from the median first-rollout reward to the best possible
reward (0 for the length reward); reported for f = 0.5 and 0.8.

    python bench/mu_sweep.py --mus 1 2 4 8 auto --seeds 0 1 2 --steps 160

`auto` is num_iterations: auto (mu decided per rollout), its steps counted like any mu's.
"""
from __future__ import annotations

import argparse
import os
import statistics
from pathlib import Path

from common import (
    QUICKSTART,
    RESULTS,
    launch,
    machine,
    passes_per_rollout,
    per_generation,
    read_metrics,
    save_json,
    smoothed,
    time_to,
)

FRACTIONS = (0.5, 0.8)
SMOOTH = 3  # rollouts in the reward's moving average


def mu_arg(value: str) -> int | str:
    """A fixed mu (an integer >= 1) or auto."""
    if value == "auto":
        return value
    if not value.isdigit() or int(value) < 1:
        raise argparse.ArgumentTypeError(f"mu must be an integer >= 1 or auto, got {value!r}")
    return int(value)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--mus", type=mu_arg, nargs="+", default=[1, 2, 4, 8, "auto"])
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    ap.add_argument("--steps", type=int, default=160, help="optimizer steps per run (same for every mu)")
    ap.add_argument("--nproc", type=int, default=2)
    ap.add_argument("--extra", nargs=argparse.REMAINDER, default=[], help="more recipe overrides")
    args = ap.parse_args()
    if 1 not in args.mus:
        ap.error("--mus must include 1, the baseline of every speed-up")

    runs = []
    for i, seed in enumerate(args.seeds):
        order = args.mus[i % len(args.mus):] + args.mus[:i % len(args.mus)]  # rotate who runs first
        for mu in order:
            out = RESULTS / "tmp" / "mu_sweep" / f"mu{mu}_seed{seed}"
            wall = launch(args.nproc, ["-m", "grpo_recipe.train"],
                          ["--config", QUICKSTART, "--num_iterations", str(mu), "--max_steps", str(args.steps),
                           "--seed", str(seed), "--output_dir", str(out), "--save_steps", "0",
                           "--overwrite_output_dir", "true", "--disable_tqdm", "true", *args.extra], out.with_suffix(".log"))
            recs = read_metrics(out)
            rows = per_generation(recs)
            gen_share = sum(r["time_generate_s"] for r in recs) / sum(r["step_time_s"] for r in recs)
            runs.append({"mu": mu, "seed": seed, "wall_s": wall, "rows": rows, "generation_share": gen_share,
                         "clip_ratio_region_mean": statistics.mean(r["clip_ratio_region"] for r in recs),
                         "passes_used_mean": statistics.mean(passes_per_rollout(recs))})
            print(f"mu={mu} seed={seed}: {len(rows)} rollouts, {wall:.0f}s, final reward {rows[-1]['reward']:.2f}",
                  flush=True)

    thresholds, summary = summarize(runs, args.mus, args.seeds)
    main_f = str(FRACTIONS[0])
    result = {
        "experiment": "length reward, tiny Qwen2, 2 ranks ZeRO-3 on CPU, same optimizer steps for every mu",
        "command": "python bench/mu_sweep.py " + " ".join(
            [f"--mus {' '.join(map(str, args.mus))}", f"--seeds {' '.join(map(str, args.seeds))}",
             f"--steps {args.steps}"]),
        "threshold_rule": "fraction f of the way from the median first-rollout reward to 0 (the best possible "
                          "length reward), on a 3-rollout moving average; time = sum of per-step wall times "
                          "(start-up excluded) until that rollout's reward was known",
        "threshold": thresholds[FRACTIONS[0]], "threshold_fraction": FRACTIONS[0],
        "speedup_vs_mu1": {mu: v["median"] for mu, v in summary[main_f]["speedup_vs_mu1"].items()},
        "summary": summary, "runs": runs, "machine": machine(load_average_at_end=os.getloadavg()),
    }
    path = save_json("mu_sweep.json", result)
    plot(runs, args.mus, thresholds, RESULTS / "mu_sweep.png")
    print(f"wrote {path}; speed-up vs mu=1 at f={main_f}: {result['speedup_vs_mu1']}")


def summarize(runs: list[dict], mus: list[int], seeds: list[int]) -> tuple[dict, dict]:
    """Thresholds (per fraction f) and, per f, each mu's time to the threshold and speed-up over mu = 1."""
    start = statistics.median(r["rows"][0]["reward"] for r in runs)
    thresholds = {f: start + f * (0.0 - start) for f in FRACTIONS}
    summary: dict = {"thresholds": {str(f): t for f, t in thresholds.items()}}
    for f, thr in thresholds.items():
        per_mu = {}
        for mu in mus:
            times = [time_to(r["rows"], thr, SMOOTH) for r in runs if r["mu"] == mu]
            per_mu[mu] = times
        speedups = {}
        for mu in mus:
            ratios = []
            for seed in seeds:
                t1 = next(time_to(r["rows"], thr, SMOOTH) for r in runs if r["mu"] == 1 and r["seed"] == seed)
                tm = next(time_to(r["rows"], thr, SMOOTH) for r in runs if r["mu"] == mu and r["seed"] == seed)
                if tm is not None:
                    ratios.append(float("inf") if t1 is None else t1 / tm)
                else:
                    ratios.append(0.0 if t1 is not None else None)
            known = [x for x in ratios if x is not None]
            speedups[str(mu)] = {"median": statistics.median(known) if known else None,
                                 "min": min(known) if known else None, "max": max(known) if known else None,
                                 "per_seed": ratios}
        summary[str(f)] = {"time_to_threshold_s": {str(k): v for k, v in per_mu.items()}, "speedup_vs_mu1": speedups}
    return thresholds, summary


def plot(runs, mus, thresholds, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(12, 4.5))
    colors = dict(zip(mus, plt.cm.viridis([i / max(1, len(mus) - 1) for i in range(len(mus))])))
    for r in runs:
        label = f"mu={r['mu']}" if r["seed"] == runs[0]["seed"] else None
        avg = smoothed(r["rows"], SMOOTH)
        axes[0].plot([x["time_s"] for x in r["rows"]], avg, color=colors[r["mu"]], label=label)
        axes[1].plot([x["generation"] for x in r["rows"]], avg, color=colors[r["mu"]], label=label)
    for ax, xl in zip(axes, ("wall-clock seconds (start-up excluded)", "generations (rollouts)")):
        for f, t in thresholds.items():
            ax.axhline(t, ls="--", lw=0.8, color="gray")
        ax.set_xlabel(xl)
        ax.set_ylabel("reward (3-rollout moving average)")
        ax.legend()
    fig.suptitle("GRPO length reward: rollout reuse (mu) on 2 CPU ranks, ZeRO-3")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    main()
