"""Reading the two sides' logs for bench/vs_trl.py, and the summary and plot built from them.

All times are seconds since the run's training loop began (start-up excluded): the recipe's metrics.jsonl
gives them as step_time_s per step, TRL's runner (bench/trl_runner.py) as perf_counter events per rank.
"""
from __future__ import annotations

import json
import statistics
from pathlib import Path

from grpo_recipe.run.metrics import read_jsonl

REWARD_WINDOW = 3  # "reward after a budget" = mean reward of the last 3 rollouts scored within it
# where a step's time goes: generation, all of a rollout's preparation (generation included), forward + loss,
# backward + optimizer step
PHASES = ("generate", "prepare", "forward", "backward")


def steady_rates(step_ends: list[float], steps_per_rollout: int) -> tuple[float, float]:
    """Seconds per optimizer step and per rollout from step end times, the first rollout left out (warm-up)."""
    k, n = steps_per_rollout, len(step_ends)
    if n < 2 * k or n % k:
        raise ValueError(f"need whole rollouts and at least 2 of them: {n} steps, {k} per rollout")
    span = step_ends[-1] - step_ends[k - 1]
    return span / (n - k), span * k / (n - k)


def reward_at_budget(times: list[float], rewards: list[float], budget: float, window: int = REWARD_WINDOW):
    """Mean reward of the last `window` rollouts scored by `budget` seconds (None if none was)."""
    seen = [r for t, r in zip(times, rewards) if t <= budget]
    return statistics.fmean(seen[-window:]) if seen else None


def read_ours(run_dir: Path, steps_per_rollout: int) -> dict:
    """Step end times, per-rollout reward (timed at the end of the rollout's first step) and counts."""
    recs = read_jsonl(run_dir / "metrics.jsonl")
    ends, t = [], 0.0
    for r in recs:
        t += r["step_time_s"]
        ends.append(t)
    first = {}
    for r, end in zip(recs, ends):
        first.setdefault(r["generation"], (end, r["reward_mean"], r["time_generate_s"]))
    rollouts = [first[g] for g in sorted(first)]
    steady = [r for r in recs if r["generation"] > 0]  # the first rollout warms up
    phases = {"generate": sum(r["time_generate_s"] for r in steady),
              "prepare": sum(r["time_sync_s"] + r["time_generate_s"] + r["time_score_s"] + r["time_old_logp_s"]
                             for r in steady),
              "forward": sum(r["time_forward_s"] for r in steady),
              "backward": sum(r["time_backward_s"] + r["time_optimizer_s"] for r in steady)}
    return {"step_ends": ends, "rollout_times": [x[0] for x in rollouts], "rollout_rewards": [x[1] for x in rollouts],
            "generate_s": [x[2] for x in rollouts], "optimizer_steps": len(recs), "generations": len(first),
            "phases": per_step(phases, sum(r["step_time_s"] for r in steady), len(steady))}


def per_step(phases: dict[str, float], total: float, steps: int) -> dict[str, float]:
    """Seconds per optimizer step in each of PHASES, and the rest of the step as `other`."""
    out = {k: v / steps for k, v in phases.items()}
    return out | {"other": (total - phases["prepare"] - phases["forward"] - phases["backward"]) / steps,
                  "step": total / steps}


def read_trl(run_dir: Path, steps_per_rollout: int, world: int) -> dict:
    """The same quantities from the runner's event files (all ranks) and TRL's log history."""
    ranks = [read_jsonl(run_dir / f"events-rank{r}.jsonl") for r in range(world)]
    t0 = next(e["t"] for e in ranks[0] if e["event"] == "train_begin")
    ends = [e["t"] - t0 for e in ranks[0] if e["event"] == "step_end"]
    # One generation on a rank = one call of each reward function; global reward = weighted sum over functions
    # of the completion-weighted mean over ranks.
    per_gen: dict[int, dict] = {}
    for events in ranks:
        calls: dict[str, int] = {}
        for e in (x for x in events if x["event"] == "rewards"):
            g = calls[e["func"]] = calls.get(e["func"], -1) + 1
            slot = per_gen.setdefault(g, {}).setdefault(e["func"], [e["weight"], 0, 0.0])
            slot[1] += e["n"]
            slot[2] += e["n"] * e["mean"]
    gens = [per_gen[g] for g in sorted(per_gen)]
    rewards = [sum(w * s / n for w, n, s in funcs.values()) for funcs in gens]
    completions = [next(iter(funcs.values()))[1] for funcs in gens]
    times = [ends[g * steps_per_rollout] for g in range(len(gens)) if g * steps_per_rollout < len(ends)]
    generate = [e["seconds"] for e in ranks[0] if e["event"] == "generate"]
    history = json.loads((run_dir / "log_history.json").read_text())
    last_step = max((h.get("step", 0) for h in history), default=0)
    # rank 0's phases after the first rollout's steps (calls that started after its last step ended)
    since = ends[steps_per_rollout - 1] + t0
    phases = {k: sum(e["seconds"] for e in ranks[0] if e["event"] == k and e["t"] - e["seconds"] >= since)
              for k in PHASES}
    return {"step_ends": ends, "rollout_times": times, "rollout_rewards": rewards[:len(times)], "generate_s": generate,
            "optimizer_steps": len(ends), "trainer_global_step": last_step, "generations": len(gens),
            "completions_per_generation": sorted(set(completions)),
            "phases": per_step(phases, ends[-1] - ends[steps_per_rollout - 1], len(ends) - steps_per_rollout)}


def summarize_run(parsed: dict, steps_per_rollout: int) -> dict:
    step_s, rollout_s = steady_rates(parsed["step_ends"], steps_per_rollout)
    return {"sec_per_step": step_s, "sec_per_rollout": rollout_s,
            "generate_s_median": statistics.median(parsed["generate_s"][1:] or parsed["generate_s"]),
            "train_span_s": parsed["step_ends"][-1], "phases_s_per_step": parsed["phases"]}


# ------------------------------------------------------------------------------------------
# summary and plot
# ------------------------------------------------------------------------------------------
def median_ratio(pairs: list[tuple[float, float]]) -> float:
    return statistics.median(a / b for a, b in pairs)


def median_or_none(values) -> float | None:
    """The median of the values that exist; None when none does (a side scored no rollout within the budget)."""
    kept = [v for v in values if v is not None]
    return statistics.median(kept) if kept else None


def summarize(runs: list[dict], mus: list[int]) -> dict:
    """Per mu: medians of each side and the median of the paired ratios (ours / TRL, adjacent runs)."""
    out: dict = {"by_mu": {}}
    all_pairs: dict[str, list] = {"sec_per_step": [], "sec_per_rollout": [], "generate_s_median": []}
    for mu in mus:
        ours = {r["rep"]: r for r in runs if r["mu"] == mu and r["impl"] == "ours"}
        trl = {r["rep"]: r for r in runs if r["mu"] == mu and r["impl"] == "trl"}
        reps = sorted(set(ours) & set(trl))
        entry = {}
        for key in all_pairs:
            pairs = [(ours[i][key], trl[i][key]) for i in reps]
            all_pairs[key] += pairs
            entry[key] = {"ours": statistics.median(a for a, _ in pairs), "trl": statistics.median(b for _, b in pairs),
                          "ratio": median_ratio(pairs)}
        base = statistics.fmean([r["rollout_rewards"][0] for r in (*ours.values(), *trl.values())])
        # A short run can end before the other side scored its first rollout (a budget under TRL's first step):
        # such a pair has no ratio, and a summary of only such pairs says None rather than failing.
        rew = [(ours[i]["reward_at_budget"], trl[i]["reward_at_budget"]) for i in reps]
        both = [(a, b) for a, b in rew if a is not None and b is not None]
        entry["reward_at_budget"] = {
            "budget_s": statistics.median(ours[i]["budget_s"] for i in reps),
            "ours": median_or_none(a for a, _ in rew), "trl": median_or_none(b for _, b in rew),
            "ratio": median_or_none(a / b for a, b in both), "difference": median_or_none(a - b for a, b in both),
            "first_rollout_reward": base}
        # Progress per rollout, whatever the clock: the last rollouts of whole runs (same rollout count on both).
        last = [(statistics.fmean(ours[i]["rollout_rewards"][-REWARD_WINDOW:]),
                 statistics.fmean(trl[i]["rollout_rewards"][-REWARD_WINDOW:])) for i in reps]
        entry["reward_last_rollouts"] = {"rollouts": len(ours[reps[0]]["rollout_rewards"]),
                                         "ours": statistics.median(a for a, _ in last),
                                         "trl": statistics.median(b for _, b in last)}
        if all("phases_s_per_step" in r for r in (*ours.values(), *trl.values())):  # where a step's time goes
            entry["phases_s_per_step"] = {
                side: {k: statistics.median(runs_[i]["phases_s_per_step"][k] for i in reps)
                       for k in runs_[reps[0]]["phases_s_per_step"]}
                for side, runs_ in (("ours", ours), ("trl", trl))}
        out["by_mu"][str(mu)] = entry
    for key, name in (("sec_per_step", "step_time_ratio"), ("sec_per_rollout", "rollout_time_ratio"),
                      ("generate_s_median", "generate_time_ratio")):
        out[name] = median_ratio(all_pairs[key])
    return out


def plot(runs: list[dict], summary: dict, mus: list[int], path: Path) -> None:
    """Top: seconds per optimizer step and reward against training seconds; bottom: generation seconds and
    reward against rollouts (the same algorithm should progress alike per rollout)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    colors, names = {"ours": "tab:blue", "trl": "tab:orange"}, {"ours": "this recipe", "trl": "TRL GRPOTrainer"}
    fig, axes = plt.subplots(2, 1 + len(mus), figsize=(5 * (1 + len(mus)), 8), squeeze=False)
    for ax, key, label in ((axes[0][0], "sec_per_step", "seconds per optimizer step"),
                           (axes[1][0], "generate_s_median", "seconds per generate call")):
        for j, impl in enumerate(("ours", "trl")):
            xs = [i + (j - 0.5) * 0.38 for i in range(len(mus))]
            ax.bar(xs, [summary["by_mu"][str(mu)][key][impl] for mu in mus], width=0.36, color=colors[impl],
                   label=names[impl])
            for x, mu in zip(xs, mus):
                pts = [r[key] for r in runs if r["mu"] == mu and r["impl"] == impl]
                ax.scatter([x] * len(pts), pts, color="black", s=10, zorder=3)
        ax.set_xticks(range(len(mus)), [f"mu={mu}\nours/TRL {summary['by_mu'][str(mu)][key]['ratio']:.2f}"
                                        for mu in mus])
        ax.set_ylabel(f"{label} (bars: median, dots: runs)")
        ax.legend()
    for j, mu in enumerate(mus, start=1):
        for r in (r for r in runs if r["mu"] == mu):
            style = dict(marker=".", color=colors[r["impl"]], alpha=0.8, label=f"{names[r['impl']]} rep {r['rep']}")
            axes[0][j].plot(r["rollout_times"], r["rollout_rewards"], **style)
            axes[1][j].plot(range(len(r["rollout_rewards"])), r["rollout_rewards"], **style)
        axes[0][j].set_xlabel("training wall-clock seconds (start-up excluded)")
        axes[1][j].set_xlabel("rollout")
        for ax in (axes[0][j], axes[1][j]):
            ax.set_title(f"mu = {mu}")
            ax.set_ylabel("rollout mean reward")
            ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=100)


def num(x: float | None, spec: str = ".2f") -> str:
    return "n/a" if x is None else format(x, spec)


def markdown_table(summary: dict) -> str:
    """The README table: medians per mu, ours / TRL."""
    rows = ["| mu | s/step ours | s/step TRL | ratio | s/rollout ours | s/rollout TRL | ratio | generate s ours | "
            "generate s TRL | ratio | budget s | reward ours | reward TRL | ratio | ours - TRL |",
            "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for mu, e in summary["by_mu"].items():
        s, r, g, w = e["sec_per_step"], e["sec_per_rollout"], e["generate_s_median"], e["reward_at_budget"]
        rows.append(f"| {mu} | {s['ours']:.2f} | {s['trl']:.2f} | {s['ratio']:.2f} | {r['ours']:.2f} | {r['trl']:.2f} | "
                    f"{r['ratio']:.2f} | {g['ours']:.2f} | {g['trl']:.2f} | {g['ratio']:.2f} | {w['budget_s']:.0f} | "
                    f"{num(w['ours'])} | {num(w['trl'])} | {num(w['ratio'])} | {num(w['difference'], '+.2f')} |")
    if all("phases_s_per_step" in e for e in summary["by_mu"].values()):
        rows += ["\nWhere a step's time goes (s per optimizer step after the first rollout, rank 0; prepare = "
                 "generation + rewards + old log-probs, backward includes the optimizer step):\n",
                 "| mu | side | prepare | of it generation | forward + loss | backward + optimizer | other | step |",
                 "|---|---|---|---|---|---|---|---|"]
        for mu, e in summary["by_mu"].items():
            for side, p in e["phases_s_per_step"].items():
                rows.append(f"| {mu} | {side} | {p['prepare']:.3f} | {p['generate']:.3f} | {p['forward']:.3f} | "
                            f"{p['backward']:.3f} | {p['other']:.3f} | {p['step']:.3f} |")
    rows.append(f"\nstep_time_ratio (ours / TRL, median over all pairs): {summary['step_time_ratio']:.2f}; "
                f"rollout_time_ratio {summary['rollout_time_ratio']:.2f}; generate_time_ratio "
                f"{summary['generate_time_ratio']:.2f}")
    return "\n".join(rows)
