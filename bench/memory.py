"""Peak memory per rank against world size (1, 2) and mu, at a fixed per-rank batch.

The old log-probs live in each rank's own rollout buffer and are never gathered, so their bytes per rank
stay constant when ranks double at a fixed per-rank batch (and the global batch doubles).

    python bench/memory.py            # runs, then memory.json and memory.png
    python bench/memory.py --replot   # memory.png again from the existing memory.json
"""
from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

from common import QUICKSTART, RESULTS, launch, machine, save_json


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--worlds", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--mus", type=int, nargs="+", default=[1, 4])
    ap.add_argument("--replot", action="store_true", help="only redraw memory.png from memory.json")
    args = ap.parse_args()
    if args.replot:
        plot(json.loads((RESULTS / "memory.json").read_text())["rows"], RESULTS / "memory.png")
        return
    rows = []
    for world in args.worlds:
        for mu in args.mus:
            out = RESULTS / "tmp" / "memory" / f"w{world}_mu{mu}"
            out.mkdir(parents=True, exist_ok=True)
            launch(world, ["bench/instrumented.py", str(out / "memory")],
                   ["--config", QUICKSTART, "--num_iterations", str(mu), "--max_steps", str(args.steps),
                    "--output_dir", str(out), "--save_steps", "0", "--overwrite_output_dir", "true",
                    "--disable_tqdm", "true"], out / "run.log")
            ranks = [json.loads((out / f"memory.rank{r}.json").read_text()) for r in range(world)]
            rows.append({"world_size": world, "mu": mu,
                         "peak_rss_mib_per_rank": [r["peak_rss_mib"] for r in ranks],
                         "old_logp_bytes_per_rank": [r["old_logp_bytes"] for r in ranks],
                         "rollout_buffer_bytes_per_rank": [r["buffer_bytes"] for r in ranks]})
            print(rows[-1], flush=True)
    old = {(r["world_size"], r["mu"]): max(r["old_logp_bytes_per_rank"]) for r in rows}
    constant = all(old[(w, m)] == old[(args.worlds[0], m)] for w in args.worlds for m in args.mus)
    result = {"config": QUICKSTART, "command": "python bench/memory.py", "rows": rows,
              "old_logp_bytes_constant_per_rank_across_world_sizes": constant,
              "note": "peak RSS covers the whole process (Python, torch, DeepSpeed, model shards, optimizer "
                      "state, KV cache of generate); the old log-probs are [completions per rank x completion "
                      "length] float32 on each rank", "machine": machine(load_average_at_end=os.getloadavg())}
    path = save_json("memory.json", result)
    plot(rows, RESULTS / "memory.png")
    print(f"wrote {path}; old log-prob bytes per rank constant across world sizes: {constant}")


def plot(rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(10, 4))
    panels = (("peak_rss_mib_per_rank", 1.0, "peak RSS per rank (MiB)"),
              ("old_logp_bytes_per_rank", 1024.0, "old log-probs per rank (KiB)"))
    for ax, (key, scale, label) in zip(axes, panels):
        for mu in sorted({r["mu"] for r in rows}):
            pts = sorted((r["world_size"], max(r[key]) / scale) for r in rows if r["mu"] == mu)
            ax.plot([w for w, _ in pts], [v for _, v in pts], "o-", label=f"mu={mu}")
        ax.set_xlabel("world size (ranks), fixed per-rank batch")
        ax.set_ylabel(label)
        ax.set_xticks(sorted({r["world_size"] for r in rows}))
        ax.set_ylim(bottom=0)
        ax.legend()
    fig.suptitle("Memory per rank: old log-probs stay sharded on the rank that generated them")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


if __name__ == "__main__":
    main()
