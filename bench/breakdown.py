"""Where each step's time goes, for one config, and how step time grows with length, group size and mu.

Phases: generate, score (reward functions), old log-probs, forward, backward, optimizer (DeepSpeed's step,
which includes ZeRO-3's gradient reduce-scatter on the boundary), and everything else (our loop's own
overhead: batching, buffer, loss math, statistics, logging). Every phase is the loop's own timer, summed over
the steps of rank 0's metrics.jsonl (time_<phase>_s). overhead_share = everything else / total step time.

    python bench/breakdown.py            # base = the quickstart config, 24 steps
"""
from __future__ import annotations

import argparse
import json
import os

from common import QUICKSTART, RESULTS, launch, machine, read_metrics, save_json

PHASES = ("generate", "score", "old_logp", "forward", "backward", "optimizer")


def run(name: str, overrides: list[str], steps: int, nproc: int) -> dict:
    out = RESULTS / "tmp" / "breakdown" / name
    out.mkdir(parents=True, exist_ok=True)
    launch(nproc, ["-m", "grpo_recipe.train"],
           ["--config", QUICKSTART, "--max_steps", str(steps), "--output_dir", str(out), "--save_steps", "0",
            "--overwrite_output_dir", "true", "--disable_tqdm", "true", *overrides], out / "run.log")
    recs = read_metrics(out)
    total = sum(r["step_time_s"] for r in recs)
    phases = {k: sum(r[f"time_{k}_s"] for r in recs) for k in PHASES}
    phases["everything_else"] = total - sum(phases.values())
    return {"name": name, "overrides": overrides, "steps": steps, "total_s": total,
            "step_time_s": total / len(recs), "phases_s": phases,
            "shares": {k: v / total for k, v in phases.items()},
            "overhead_share": phases["everything_else"] / total}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=24)
    ap.add_argument("--nproc", type=int, default=2)
    ap.add_argument("--no-grid", action="store_true", help="only the base config")
    args = ap.parse_args()
    base = run("base", ["--num_iterations", "4"], args.steps, args.nproc)  # the quickstart at a fixed mu
    print(json.dumps(base["shares"], indent=1), flush=True)
    grid = []
    if not args.no_grid:
        for name, ov in [("len16", ["--max_completion_length", "16"]), ("len64", ["--max_completion_length", "64"]),
                         ("G4", ["--num_generations", "4"]), ("G16", ["--num_generations", "16"]),
                         ("mu1", ["--num_iterations", "1"]), ("mu2", ["--num_iterations", "2"])]:
            grid.append(run(name, ov, args.steps, args.nproc))
            print(name, f"{grid[-1]['step_time_s']:.3f}s/step", flush=True)
    result = {"config": QUICKSTART, "command": "python bench/breakdown.py" + (" --no-grid" if args.no_grid else ""),
              "base": base, "overhead_share": base["overhead_share"], "grid": grid, "machine": machine(load_average_at_end=os.getloadavg())}
    path = save_json("breakdown.json", result)
    plot(base, grid)
    print(f"wrote {path}; overhead_share {base['overhead_share']:.3f}")


def plot(base: dict, grid: list[dict]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [base, *grid]
    fig, ax = plt.subplots(figsize=(9, 4.5))
    bottom = [0.0] * len(rows)
    for phase in base["phases_s"]:
        vals = [r["phases_s"][phase] / r["steps"] for r in rows]
        ax.bar([r["name"] for r in rows], vals, bottom=bottom, label=phase)
        bottom = [b + v for b, v in zip(bottom, vals)]
    ax.set_ylabel("seconds per optimizer step")
    ax.set_title("Step time by phase (base = quickstart: L=32, G=8, mu=4; 2 CPU ranks, ZeRO-3)")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(RESULTS / "breakdown.png", dpi=110)


if __name__ == "__main__":
    main()
