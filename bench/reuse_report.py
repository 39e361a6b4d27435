"""The regime map's reports (bench/reuse_regimes.py): bench/README.md's tables, per-regime figures, medians."""
from __future__ import annotations

import textwrap
from pathlib import Path

from common import save_figure, smoothed

FRACTIONS = (0.5, 0.8, 0.9)
SMOOTH = 4


def against(v: dict) -> str:
    """The default against the best fixed mu of a verdict, or that none got there."""
    if v["best_fixed"] is None:
        return "no fixed mu got there"
    return f"{v['auto_over_best'] or 0:.2f} of the best fixed mu (mu = {v['best_fixed_mu']}, {v['best_fixed']:.2f}x)"


def tables(summary: dict, verdicts_cpu_s: dict | None = None) -> str:
    """bench/README.md's tables, one per regime, from the summary (`--tables`); on the priced clock, the verdict on
    CPU seconds beside it."""
    def cell(row: dict, f: str) -> str:
        m = row[f]["median"]
        if m is None:
            return "-"
        # a lower bound at or below the median could raise it: then the median is a bound too
        bound = any(b and x is not None and x <= m for x, b in zip(row[f]["per_seed"], row[f]["per_seed_is_lower_bound"]))
        return ("≥" if bound else "") + f"{m:.2f}"

    def seeds(row: dict) -> str:
        return ", ".join("-" if x is None else ("≥" if b else "") + f"{x:.2f}"
                         for x, b in zip(row["0.8"]["per_seed"], row["0.8"]["per_seed_is_lower_bound"]))

    def stall(row: dict) -> str:
        return ", ".join("-" if n is None else str(n) for n in row.get("rollouts_0.5_to_0.8", []))

    out = []
    for regime, r in summary.items():
        unit = {"cpu_s": "CPU s", "time_s": "s", "cost_s": "CPU s"}[r["clock"]]  # budgets: CPU s or wall s
        design = "; designed on" if r["designed_on"] else "; not used to design the rule"
        clock = {"cpu_s": "", "time_s": "; wall seconds", "cost_s": "; work priced in CPU s"}[r["clock"]]
        out += [f"**{regime}** ({r['about']}{clock}; generation share at mu = 1: {r['generation_share_mu1']:.2f}; budget "
                f"{r['budget_s']:g} {unit}; reward {r['first_reward']:.3g} -> best {r['best_reward']:.3g}{design})", "",
                "| variant | to 50% | to 80% | to 90% | per seed, to 80% | passes/rollout | tokens clipped | "
                "replay efficiency (80%) | rollouts 50% -> 80%, per seed |", "|---|---|---|---|---|---|---|---|---|"]
        for v, row in r["variants"].items():
            e = row.get("replay_efficiency_0.8")
            out.append(f"| {v} | {cell(row, '0.5')} | {cell(row, '0.8')} | {cell(row, '0.9')} | {seeds(row)} | "
                       f"{row['passes_used_mean']:.2f} | {row['clip_ratio_region_mean']:.3f} | "
                       f"{'' if e is None else f'{e:.2f}'} | {stall(row)} |")
        if "verdict" in r:
            v = r["verdict"]
            out.append(f"\nauto to 80%: {v['auto'] or 0:.2f}x mu = 1, {against(v)}: no later than mu = 1 "
                       f"{'yes' if v['no_later_than_mu1'] else 'NO'}, within 10% of the best "
                       f"{'yes' if v['within_10pct_of_best'] else 'NO'}")
            if r["clock"] == "cost_s" and regime in (verdicts_cpu_s or {}):
                c = verdicts_cpu_s[regime]
                out[-1] += f" (on CPU seconds: {c['auto'] or 0:.2f}x mu = 1, {against(c)})"
        out.append("")
    return "\n".join(out)


def medians(summary: dict) -> dict:
    return {reg: {v: {f: row[f]["median"] for f in map(str, FRACTIONS)} for v, row in s["variants"].items()}
            for reg, s in summary.items()}


def plot(regime: str, runs: list[dict], summary: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    variants = list(dict.fromkeys(r["variant"] for r in runs))
    colors = dict(zip(variants, plt.cm.viridis([i / max(1, len(variants) - 1) for i in range(len(variants))])))
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for r in runs:
        label = f"mu={r['variant']}" if r["seed"] == runs[0]["seed"] else None
        ax.plot([x[summary["clock"]] for x in r["rows"]], smoothed(r["rows"], SMOOTH), color=colors[r["variant"]],
                label=label, lw=1.2 if r["variant"] in ("1", "auto") or "+" in r["variant"] else 0.7)
    for f, t in summary["thresholds"].items():
        ax.axhline(t, ls="--", lw=0.8, color="gray")
    ax.set_xlabel({"cpu_s": "process CPU seconds of training", "time_s": "wall-clock training seconds",
                   "cost_s": "training work priced in CPU seconds"}[summary["clock"]]
                  + " (start-up excluded)")
    ax.set_ylabel(f"reward ({SMOOTH}-rollout moving average)")
    title = textwrap.fill(f"{regime}: {summary['about']}", 100)
    ax.set_title(f"{title}\ngeneration share at mu=1: {summary['generation_share_mu1']:.2f}", fontsize=9)
    ax.legend(fontsize=8)
    fig.tight_layout()
    save_figure(fig, path)
    plt.close(fig)
