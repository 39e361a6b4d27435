"""The committed benchmark results follow from their own raw data under the current summarizing code: each
summary in bench/results/*.json, recomputed from the runs stored beside it, comes out the same."""
import json
import math
import sys

import pytest
from conftest import REPO

sys.path.insert(0, str(REPO / "bench"))
RESULTS = REPO / "bench" / "results"


def load(name: str) -> dict:
    return json.loads((RESULTS / name).read_text())


def as_json(x):
    """What json.dump of x reads back as (int keys become strings, tuples lists, inf Infinity)."""
    return json.loads(json.dumps(x))


def close(a, b, rel=1e-9) -> bool:
    """Equal up to float rounding: least-squares prices differ in the last bits between numpy/BLAS builds."""
    if isinstance(a, float) and isinstance(b, float):
        return math.isclose(a, b, rel_tol=rel, abs_tol=1e-12)
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(close(a[k], b[k], rel) for k in a)
    if isinstance(a, list) and isinstance(b, list):
        return len(a) == len(b) and all(close(x, y, rel) for x, y in zip(a, b))
    return a == b


def test_mu_sweep_summary():
    import mu_sweep

    r = load("mu_sweep.json")
    seeds = list(dict.fromkeys(run["seed"] for run in r["runs"]))
    mus = [run["mu"] for run in r["runs"] if run["seed"] == seeds[0]]  # the first seed runs them unrotated
    thresholds, summary = mu_sweep.summarize(r["runs"], mus, seeds)
    f = mu_sweep.FRACTIONS[0]
    assert as_json(summary) == r["summary"]
    assert thresholds[f] == r["threshold"] and r["threshold_fraction"] == f
    assert as_json({mu: v["median"] for mu, v in summary[str(f)]["speedup_vs_mu1"].items()}) == r["speedup_vs_mu1"]


def test_reuse_regimes_summary():
    import reuse_regimes
    from reuse_store import load_runs

    r = load("reuse_regimes.json")
    r["runs"] = load_runs(r, RESULTS / "reuse_regimes")
    runs = json.loads(json.dumps(r["runs"]))  # priced again from the stored counts and CPU seconds
    assert close(as_json(reuse_regimes.price_runs(runs)), r.get("prices", {})) and close(runs, r["runs"])
    summary = reuse_regimes.summarize(runs, r.get("summary_clock", r["clock"]))
    assert close(as_json(summary), r["regimes"])
    speedups = {reg: {v: {f: row[f]["median"] for f in map(str, reuse_regimes.FRACTIONS)}
                      for v, row in s["variants"].items()} for reg, s in summary.items()}
    assert close(as_json(speedups), r["speedup_vs_mu1"])
    assert close(as_json(reuse_regimes.medians(reuse_regimes.summarize(r["runs"], "time_s"))), r["speedup_vs_mu1_wall"])
    for reg, v in r["verdicts"].items():  # the default against mu = 1 and the best fixed mu, to the 80% threshold
        fixed = [x["0.8"] for mu, x in r["speedup_vs_mu1"][reg].items() if mu.isdigit() and x["0.8"] is not None]
        assert v["auto"] == r["speedup_vs_mu1"][reg]["auto"]["0.8"] and v["best_fixed"] == max(fixed, default=None)


def test_reuse_map_default_verdicts_are_the_readmes():
    """The README's verdict, kept true of the committed map: `auto` (the variant that sets no reuse_* field, so the
    defaults) reaches 80% no later than mu = 1 and within 10% of the best fixed mu in every regime."""
    import reuse_regimes

    r = load("reuse_regimes.json")
    assert reuse_regimes.VARIANTS["auto"] == ["--num_iterations", "auto"]
    assert set(r["verdicts"]) == set(reuse_regimes.REGIMES)
    assert all(v["no_later_than_mu1"] for v in r["verdicts"].values())
    assert [reg for reg, v in r["verdicts"].items() if not v["within_10pct_of_best"]] == []
    n = len(reuse_regimes.REGIMES)  # the README's sentence is generated from the file (bench/docs_blocks.py)
    assert f"Both bars pass in {n} of {n} regimes on the clock the map prices" in (REPO / "README.md").read_text()


def test_vs_trl_summary():
    import vs_trl_logs

    r = load("vs_trl.json")
    summary = vs_trl_logs.summarize(r["runs"], r["config"]["mus"])
    assert as_json(summary["by_mu"]) == r["by_mu"]
    for key in ("step_time_ratio", "rollout_time_ratio", "generate_time_ratio"):
        assert summary[key] == r[key]


def test_breakdown_shares():
    r = load("breakdown.json")
    for run in [r["base"], *r["grid"]]:
        total = run["total_s"]
        assert sum(run["phases_s"].values()) == pytest.approx(total, rel=1e-12)
        assert run["shares"] == {k: v / total for k, v in run["phases_s"].items()}
        assert run["overhead_share"] == run["phases_s"]["everything_else"] / total
    assert r["overhead_share"] == r["base"]["overhead_share"]


def test_memory_and_lora_memory_summaries():
    r = load("memory.json")
    old = {(row["world_size"], row["mu"]): max(row["old_logp_bytes_per_rank"]) for row in r["rows"]}
    worlds, mus = sorted({w for w, _ in old}), sorted({m for _, m in old})
    constant = all(old[(w, m)] == old[(worlds[0], m)] for w in worlds for m in mus)
    assert constant == r["old_logp_bytes_constant_per_rank_across_world_sizes"]
    for model in load("lora_memory.json")["models"].values():
        full, lora = model["full"][0], model["lora"][0]
        assert model["lora_over_full_rank0"] == {k: lora[k] / full[k] for k in model["lora_over_full_rank0"]}


def test_vllm_vs_hf_ratios():
    for name in ("vllm_vs_hf.json", "vllm_vs_hf_long.json"):
        r = load(name)
        for backend in ("hf", "vllm"):
            assert r[backend]["tokens_per_s"] == r[backend]["tokens"] / r[backend]["seconds"]
        assert r["vllm_speedup"] == r["vllm"]["tokens_per_s"] / r["hf"]["tokens_per_s"]


def test_smollm2_arith_gains():
    r = load("smollm2_arith.json")
    for key in ("eval", "confirm"):
        e = r[key]
        assert e["gain"] == e["accuracy_after"] - e["accuracy_before"]
        assert e["gain_stderr_unpaired"] == math.sqrt(e["stderr_before"] ** 2 + e["stderr_after"] ** 2)
        b, c = e["paired"]["only_after_right"], e["paired"]["only_before_right"]
        n, k = b + c, min(b, c)
        assert e["paired"]["mcnemar_exact_p"] == min(1.0, 2 * sum(math.comb(n, i) for i in range(k + 1)) / 2 ** n)


def test_lora_vllm_summary():
    import lora_vllm

    r = load("lora_vllm.json")
    assert as_json(lora_vllm.summarize(r["runs"])) == r["summary"]


def test_scale_summary():
    import scale

    r = load("scale.json")
    assert as_json(scale.startup_summary(r["startup"]["rows"])) == {
        k: r["startup"][k] for k in ("loading_at_world_2_worst", "goal_met_for_loading",
                                     "startup_peak_at_world_2_worst", "goal_met_for_startup_peak")}
    assert as_json(scale.logprob_summary(r["logprob"]["rows"])) == {k: r["logprob"][k] for k in ("rows", "goal_met")}
    # counted, not timed: the current code counts the same positions and FLOPs
    row = r["padding"]["row"]
    counted = scale.part_padding(r["model_shape"], row["samples_per_rank"], row["micro_batch"],
                                 row["max_completion_length"])
    assert as_json(counted) == r["padding"]
    assert as_json(scale.throughput_summary(r["throughput"]["row"])) == {
        k: r["throughput"][k] for k in ("row", "goal_met", "goal_met_cpu_time")}
    # the same update before and after: the counted positions are the rollouts the throughput part trained on
    assert r["throughput"]["row"]["train_tokens"] == row["trained_tokens"]
    # the whole run's peaks, as the part summarizes its rows
    w = r["whole_run"]
    worst = {str(world): max(max(x["peak_x_fp32"]) for x in w["rows"] if x["world"] == world and x["what"] == "policy")
             for world in (1, 2)}
    assert {str(k): v for k, v in w["default_policy_worst"].items()} == worst
    assert w["goal_met"] == {"1": worst["1"] <= 5.0, "2": worst["2"] <= 3.0}
    assert set(r) <= {*scale.PARTS, "measured_at", "command", "model_shape", "goals", "machine", "provenance"}


def test_every_results_file_says_who_wrote_it():
    """Command, commit (as the run started), time, machine and load, written by common.save_json; the per-regime
    runs under reuse_regimes/ are the raw rows of reuse_regimes.json, which lists them."""
    missing = set()
    for path in sorted(RESULTS.glob("*.json")):
        prov = json.loads(path.read_text()).get("provenance")
        if prov is None:
            missing.add(path.name)
            continue
        assert {"command", "commit", "uncommitted_changes", "written_at", "machine", "load_average"} <= prov.keys(), path
        assert prov["command"].startswith("python ") and prov["machine"]["cpus"] >= 1, path
    assert not missing, f"without provenance: {sorted(missing)}"
    listed = set(load("reuse_regimes.json")["runs_files"])
    assert {p.name for p in (RESULTS / "reuse_regimes").glob("*")} == listed



def test_vs_trl_real_summary_follows_from_its_runs_and_the_sides_train_alike():
    """vs_trl_real.json's per-shape ratios are its runs' under the current summarizing code, and every side of a
    (shape, mu, repetition) trains on about the same completion tokens per optimizer step: one fixed policy samples
    them all (a reader that miscounts one side's tokens shows here)."""
    from vs_trl_real import summaries

    r = load("vs_trl_real.json")
    assert not r["smoke"] and close(as_json(summaries(r["runs"])), r["shapes"])
    ours = {(x["shape"], x["mu"], x["rep"]): x["train_tokens_per_step"] for x in r["runs"] if x["side"] == "ours"}
    for x in r["runs"]:
        key = (x["shape"], x["mu"], x["rep"])
        if x["side"] != "ours" and key in ours:
            assert 0.75 < x["train_tokens_per_step"] / ours[key] < 1.33, (x["side"], key)


def test_vs_trl_real_pilot_projection_follows_from_its_runs():
    """vs_trl_real_pilot.json's projected hours are its runs' under the current model, and a side it stopped for
    memory held more than the machine had free."""
    from vs_trl_real import project

    r = load("vs_trl_real_pilot.json")
    assert close(as_json(project(r["runs"])), r["projection"])
    for x in r["runs"]:
        if x.get("stopped") == "memory":
            assert x["exit_code"] != 0 and sum(x["peak_bytes"]) > x["memory_limit"], x["side"]


def test_real_vs_trl_selection_verdicts_and_docs_follow_from_its_runs():
    """The gate of every pilot, the chosen setting and the verdicts follow from the committed runs by the declared
    rules; README's and bench/README's sections are `real_vs_trl.py --docs` of the committed file."""
    from real_vs_trl import BEGIN, DOCS, END, gate, render, verdicts

    if not (RESULTS / "real_vs_trl.json").is_file():  # no run has finished: the pages say so
        for name in DOCS:
            block = (REPO / name).read_text().split(BEGIN, 1)[1].split(END, 1)[0]
            assert block.strip() == render(None), f"{name}: rerun python bench/real_vs_trl.py --docs"
        return
    r = load("real_vs_trl.json")
    d = r["design"]
    assert not d["smoke"] and len(json.dumps(r)) < 2 * 2**20
    pilots = [x for x in r["runs"] if x["seed"] in d["pilot_seeds"]]
    for p in r["selection"]["pilots"]:
        run = next(x for x in pilots if (x["setting"], x["variant"], x["seed"]) == (p["setting"], p["variant"], p["seed"]))
        assert as_json(gate(run, d["budget_rollouts"], d["gate_gain"])) == {k: p[k] for k in ("gain",
                                                                        "min_after_first_quarter", "passes")}
    chosen = r["selection"]["chosen_setting"]
    assert r["selection"]["pilot_gate_met"] == (chosen is not None)
    compare = [x for x in r["runs"] if x["seed"] in d["seeds"] and x["setting"] == chosen]
    assert as_json(verdicts(compare, d["budget_rollouts"]) if compare else {}) == r["verdicts"]
    for name, short in DOCS.items():
        block = (REPO / name).read_text().split(BEGIN, 1)[1].split(END, 1)[0]
        assert block.strip() == render(r, name, short).strip(), f"{name}: rerun python bench/real_vs_trl.py --docs"


def test_a_shipped_configs_quoted_figures_are_its_results_files():
    """A config's header quotes what its example reached: the figures must be the results file's."""
    import re

    r = load("smollm2_arith.json")["eval"]
    header = (REPO / "grpo_recipe" / "configs" / "smollm2_arith.yaml").read_text()
    before, after = re.search(r"greedy accuracy (\d\.\d+) -> (\d\.\d+) \(bench/results/smollm2_arith\.json\)",
                              " ".join(line.lstrip("# ") for line in header.splitlines())).groups()
    assert (before, after) == (f"{r['accuracy_before']:.3f}", f"{r['accuracy_after']:.3f}")
