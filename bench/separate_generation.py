"""Generation on its own ranks against the colocated layout, side by side in one invocation: the quickstart task
at mu = 1 (one optimizer step per rollout), the same seeds for every variant, alternating within each seed.

    colocated     2 ranks; each generates its share of a rollout, then trains on it
    separate_s0   2 training ranks + 1 generation rank, max_staleness 0 (it waits for the new weights)
    separate_s1   the same, max_staleness 1 (rollout k + 1 sampled while rollout k trains)

Per rollout (rank 0's metrics): wall time on the training ranks (the sum of its steps' step_time_s), the time
they waited for generation (time_generate_s), their training time (the rest: scoring, old log-probs, the steps,
the weight sync), the generation rank's busy time (generator_busy_s), the reward.

Hidden = (generation + training - rollout wall) / min(generation, training): the share of the shorter phase that
ran under the other. Here every process shares the same 2 CPU cores, so a separate layout competes with itself
and its wall-clock is not what separate devices give. The model, from the phase times measured in the
colocated runs (g: one rank's generation of its share, t: its training, per rollout; T training ranks, N
generation ranks, each serving T / N shares in turn, as remote.py does):
    colocated on T devices:                          g + t
    separate, staleness 0, on T + N devices:         g T / N + t
    separate, staleness 1, on T + N devices:         max(g T / N, t)
    colocated on T + N devices (perfect scaling):    (g + t) T / (T + N)
speedup_extra_devices = (g + t) / max(g T / N, t); speedup_same_devices = (g + t) T / (T + N) / max(g T / N, t).

    python bench/separate_generation.py [--seeds 0 1] [--steps 48]
"""
from __future__ import annotations

import argparse
import statistics
import sys

from common import QUICKSTART, RESULTS, launch, read_metrics, save_json

VARIANTS = {"colocated": (2, []),
            "separate_s0": (3, ["--generation_ranks", "1", "--max_staleness", "0"]),
            "separate_s1": (3, ["--generation_ranks", "1", "--max_staleness", "1"])}
TRAINERS, GENERATORS = 2, 1


def per_rollout(records: list[dict]) -> list[dict]:
    out: dict[int, dict] = {}
    for r in records:
        row = out.setdefault(r["generation"], {"rollout": r["generation"], "wall_s": 0.0, "wait_s": 0.0,
                                               "reward": r["reward_mean"], "busy_s": r.get("generator_busy_s"),
                                               "staleness_steps": r.get("staleness_steps", 0)})
        row["wall_s"] += r["step_time_s"]
        row["wait_s"] += r["time_generate_s"]
    for row in out.values():
        row["train_s"] = row["wall_s"] - row["wait_s"]
        gen = row["busy_s"] if row["busy_s"] is not None else row["wait_s"]
        shorter = min(gen, row["train_s"])
        row["hidden"] = (gen + row["train_s"] - row["wall_s"]) / shorter if shorter > 0 else 0.0
    return [out[k] for k in sorted(out)]


def summary(rows: list[dict]) -> dict:
    steady = rows[1:] or rows  # the first rollout includes nothing to overlap with
    half = rows[len(rows) // 2:]
    return {"rollout_s": statistics.median(r["wall_s"] for r in steady),
            "wait_s": statistics.median(r["wait_s"] for r in steady),
            "train_s": statistics.median(r["train_s"] for r in steady),
            "generator_busy_s": statistics.median(r["busy_s"] for r in steady) if steady[0]["busy_s"] is not None
            else None,
            "hidden_fraction": statistics.median(r["hidden"] for r in steady),
            "reward_last_half": statistics.fmean(r["reward"] for r in half)}


def model(colocated: dict) -> dict:
    """The layout on devices of its own, from the colocated phase times (see the module docstring)."""
    g, t = colocated["wait_s"], colocated["train_s"]
    gen = g * TRAINERS / GENERATORS
    return {"g_s": g, "t_s": t, "colocated_s": g + t, "separate_s0_s": gen + t, "separate_s1_s": max(gen, t),
            "speedup_extra_devices": (g + t) / max(gen, t),
            "speedup_same_devices": (g + t) * TRAINERS / (TRAINERS + GENERATORS) / max(gen, t)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1])
    ap.add_argument("--steps", type=int, default=48)
    ap.add_argument("--out", default=str(RESULTS / "separate_generation.json"))
    args = ap.parse_args()
    runs = []
    for seed in args.seeds:
        for name, (nproc, extra) in VARIANTS.items():
            out = RESULTS / "tmp" / "separate_generation" / f"{name}-seed{seed}"
            wall = launch(nproc, ["-m", "grpo_recipe.train"],
                          ["--config", QUICKSTART, "--num_iterations", "1", "--max_steps", str(args.steps),
                           "--seed", str(seed), "--output_dir", str(out), "--save_steps", "0",
                           "--overwrite_output_dir", "true", "--disable_tqdm", "true", *extra], out / "run.log")
            rows = per_rollout(read_metrics(out))
            runs.append({"variant": name, "seed": seed, "wall_s": wall, "summary": summary(rows), "rollouts": rows})
            print(f"{name} seed {seed}: {runs[-1]['summary']}", file=sys.stderr, flush=True)
    variants = {}
    for name in VARIANTS:
        mine = [r["summary"] for r in runs if r["variant"] == name]
        variants[name] = {k: statistics.median(s[k] for s in mine) if mine[0][k] is not None else None
                          for k in mine[0]}
    s0, s1 = variants["separate_s0"], variants["separate_s1"]
    reward_spread = {name: [r["summary"]["reward_last_half"] for r in runs if r["variant"] == name]
                     for name in VARIANTS}
    result = {"setup": {"config": QUICKSTART, "num_iterations": 1, "steps": args.steps, "seeds": args.seeds,
                        "trainers": TRAINERS, "generators": GENERATORS},
              "variants": variants, "reward_last_half_per_seed": reward_spread,
              "measured_here": {"rollout_s_s1_over_s0": s1["rollout_s"] / s0["rollout_s"],
                                "rollout_s_s1_over_colocated": s1["rollout_s"] / variants["colocated"]["rollout_s"],
                                "hidden_fraction_s1": s1["hidden_fraction"]},
              "own_devices_model": model(variants["colocated"]),
              "runs": runs}
    path = save_json(args.out, result)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
