"""Large-model readiness, before and after, side by side in one run, on a Qwen2.5-0.5B-shaped model.

    python bench/scale.py                      # every part, then bench/results/scale.json and scale.png
    python bench/scale.py --parts startup      # one part (the others keep their figures from scale.json)
    python bench/scale.py --smoke              # a small model and short runs, for CI (results elsewhere)
    python bench/scale.py --parts whole_run    # the whole run's peak per rank, as a user's processes reach it

The model is built from Qwen2.5-0.5B's config with random weights (vocabulary 151,936; no download) and saved
in bf16 as the real checkpoint is. "before" is today's code path, reproduced in bench/scale_worker.py; "after"
is the recipe's. Each figure runs in fresh processes (torchrun ranks on CPU, gloo).
"""
from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import sys
from pathlib import Path

from common import QUICKSTART, RESULTS, machine, rank_env, save_json, torchrun
from measure import QWEN05B, SMOKE, build_model, whole_run_peaks

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
GOALS = {"whole_run": "whole-run peak private memory per rank, default environment: <= 3.0x the fp32 model at "
                      "world 2, <= 5.0x at world 1",
         "startup": "at world 2, peak private memory per rank <= 0.6x the full fp32 model, falling as 1/world",
         "logprob": "peak memory of one micro-batch's log-prob forward and backward: after / before <= 0.5",
         "throughput": "training tokens/s, completion lengths uniform in 16..512: after / before >= 1.5",
         "vs_trl": "bench/vs_trl.py rerun: step time ours / TRL <= 0.70 (0.90 before this change)"}


# glibc keeps freed blocks below its (growing) mmap threshold in the heap, so RssAnon would count memory the
# code no longer holds; with a fixed threshold every block of 128 KiB or more goes back to the OS when freed.
MEASURE_ENV = {"MALLOC_MMAP_THRESHOLD_": "131072"}



def measured_at() -> dict:
    """When and on which commit a part was measured (parts of scale.json can come from different runs)."""
    import subprocess
    import time

    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True, text=True)
    return {"utc": time.strftime("%Y-%m-%d %H:%M", time.gmtime()), "commit": commit.stdout.strip() or None}


def run_ranks(nproc: int, args: list[str], log: Path, **extra_env) -> None:
    """bench/scale_worker.py ARGS as nproc CPU ranks under torchrun, its output in `log`."""
    import subprocess

    cmd = torchrun(nproc, ["bench/scale_worker.py", *args])
    log.parent.mkdir(parents=True, exist_ok=True)
    with open(log, "w") as f:
        proc = subprocess.run(cmd, cwd=REPO, env=rank_env(**extra_env), stdout=f, stderr=subprocess.STDOUT)
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed ({proc.returncode}); see {log}")


def ranks(out: Path, world: int) -> list[dict]:
    return [json.loads(Path(f"{out}.rank{r}").read_text()) for r in range(world)]


PARTS = ("whole_run", "startup", "logprob", "padding", "throughput")
# The whole-run part: the quickstart config on the model, short completions, two rollouts of two passes each (the
# second rollout generates after optimizer steps: Adam's state exists then; from the second micro-batch on, ZeRO-3
# has a recorded trace and prefetches), the final save; what issue #44 measured by hand, at mu = 2.
WHOLE_RUN_ARGS = ["--config", QUICKSTART, "--max_steps", "4", "--num_iterations", "2", "--max_completion_length", "4",
                  "--num_generations", "2", "--per_device_train_batch_size", "2", "--gradient_accumulation_steps", "1",
                  "--max_prompt_length", "16", "--save_steps", "0", "--disable_tqdm", "true"]
WHOLE_RUN_CASES = [  # (world, what, extra arguments)
    (1, "policy", []), (2, "policy", []), (2, "policy, per_layer generation", ["--hf_generation_gather", "per_layer"]),
    (2, "policy + reference (beta 0.04)", ["--beta", "0.04"]),
    (1, "LoRA", ["--config", "grpo_recipe/configs/quickstart_lora.yaml"]),
    (2, "LoRA", ["--config", "grpo_recipe/configs/quickstart_lora.yaml"])]


def with_tokenizer(model_dir: Path) -> Path:
    """The model folder plus the built-in tiny model's tokenizer files (ids below its vocabulary): a folder a run
    can start from (the shape's weights are linked, not copied)."""
    from grpo_recipe.model.tiny import ensure_builtin

    folder = model_dir.with_name(model_dir.name + "-with-tokenizer")
    folder.mkdir(exist_ok=True)
    for src in [*model_dir.iterdir(), *ensure_builtin("builtin:tiny-qwen2").glob("tokenizer*")]:
        dst = folder / src.name
        if src.name.startswith("tokenizer"):
            shutil.copy(src, dst)
        elif not dst.exists():
            dst.symlink_to(src)
    return folder


def part_whole_run(model_dir: Path, work: Path, cases: list) -> dict:
    """Each case as a user runs it: launch/local.sh with nothing set in the environment (no allocator setting, no
    baseline subtracted), each rank's private memory (RssAnon) sampled every 0.1 s from start to exit."""
    folder = with_tokenizer(model_dir)
    fp32 = 4 * sum(_numel(f) for f in model_dir.glob("*.safetensors"))  # the weights as trained, in fp32
    rows = []
    for world, what, extra in cases:
        out = work / f"whole_run_w{world}_{len(rows)}"
        shutil.rmtree(out, ignore_errors=True)
        work.mkdir(parents=True, exist_ok=True)
        env = {k: v for k, v in rank_env(None).items() if not k.startswith("MALLOC_")}
        env.update(NPROC=str(world), VENV_PY=sys.executable)
        env.pop("OMP_NUM_THREADS", None)  # local.sh sets it, as for a user
        args = [*WHOLE_RUN_ARGS, "--model_name_or_path", str(folder), "--output_dir", str(out), *extra]
        r = whole_run_peaks(["bash", "launch/local.sh", *args], env, REPO, log=out.with_suffix(".log"))
        if r["exit_code"] != 0:
            raise RuntimeError(f"whole run {what} at world {world} exited {r['exit_code']}: see {out}.log")
        records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
        row = {"world": world, "what": what, "args": extra, "peak_gib": [round(b / 2**30, 2) for b in r["peak_bytes"]],
               "peak_x_fp32": [round(b / fp32, 3) for b in r["peak_bytes"]], "wall_s": round(r["wall_s"], 1),
               "generate_s": [round(x.get("time_generate_s", 0.0), 2) for x in records],
               "train_s": [round(x.get("time_train_s", 0.0), 2) for x in records]}
        rows.append(row)
        print(json.dumps(row), flush=True)
    worst = {w: max(max(r["peak_x_fp32"]) for r in rows if r["world"] == w and r["what"] == "policy") for w in (1, 2)
             if any(r["world"] == w and r["what"] == "policy" for r in rows)}
    return {"unit": "peak private memory (RssAnon) per rank over the whole run, x the fp32 model's bytes",
            "environment": "default: launch/local.sh, nothing exported (the recipe sets its own allocator threshold)",
            "fp32_model_bytes": fp32, "rows": rows, "goal": GOALS["whole_run"],
            "default_policy_worst": worst,
            "goal_met": {str(w): x <= (3.0 if w == 2 else 5.0) for w, x in worst.items()}}


def _numel(path: Path) -> int:
    from safetensors import safe_open

    with safe_open(str(path), "pt") as f:
        return sum(math.prod(f.get_slice(k).get_shape()) for k in f.keys())


def part_startup(model_dir: Path, work: Path, worlds: list[int], whats: tuple) -> dict:
    """Per rank, in units of the full fp32 model: each phase's peak over its own starting level (what it
    adds), and the peak of the whole start-up. `reference` alone is its own start-up (a fresh process)."""
    rows = []
    for world in worlds:
        for what in whats:
            row = {"world": world, "models": what, "beta": 0.0 if what == "policy" else 0.04}
            for variant in ("before", "after"):
                out = work / f"startup_w{world}_{what}_{variant}.json"
                run_ranks(world, ["startup", str(model_dir), str(out), variant, what], out.with_suffix(".log"),
                         **MEASURE_ENV)
                per_rank = ranks(out, world)
                fp32 = per_rank[0]["model_numel"] * 4

                def x(b):
                    return round(b / fp32, 3)

                row[variant] = {"startup_peak": [x(r["peak_bytes"]) for r in per_rank],
                                **{f"{name}_added": [x(r["phases"][name]["peak_bytes"] - r["phases"][name]["start_bytes"])
                                                     for r in per_rank] for name in per_rank[0]["phases"]}}
            rows.append(row)
            print(json.dumps(row), flush=True)
    return {"unit": "x the full fp32 model's bytes, per rank (private memory: RssAnon)", "allocator": MEASURE_ENV,
            "rows": rows, "goal": GOALS["startup"], **startup_summary(rows)}


def startup_summary(rows: list[dict]) -> dict:
    """The goal's figures at world 2: what loading one model adds per rank (policy, or the reference alone), and
    the peak of the whole start-up."""
    loading = [v for r in rows if r["world"] == 2 and r["models"] != "policy+reference"
               for k in ("policy_load_added", "reference_added") for v in r["after"].get(k, [])]
    peaks = [v for r in rows if r["world"] == 2 and r["models"] != "reference" for v in r["after"]["startup_peak"]]
    return {"loading_at_world_2_worst": max(loading, default=None),
            "goal_met_for_loading": bool(loading) and max(loading) <= 0.6,
            # the whole start-up includes DeepSpeed's optimizer set-up (training state: device memory on GPUs)
            "startup_peak_at_world_2_worst": max(peaks, default=None),
            "goal_met_for_startup_peak": bool(peaks) and max(peaks) <= 0.6}


def part_logprob(model_dir: Path, work: Path, sizes: list[int], cases: tuple) -> dict:
    """Each variant in a fresh process; cases are (gradient checkpointing, bf16)."""
    import subprocess

    rows = []
    for ckpt, bf16 in cases:
        row = {"gradient_checkpointing": bool(ckpt), "dtype": "bf16" if bf16 else "fp32"}
        for variant in ("before", "after"):
            out = work / f"logprob_{variant}_ckpt{ckpt}_bf16{bf16}.json"
            out.parent.mkdir(parents=True, exist_ok=True)
            subprocess.run([sys.executable, "bench/scale_worker.py", "logprob", str(model_dir), str(out), variant,
                            str(ckpt), str(bf16), *map(str, sizes)], cwd=REPO, check=True,
                           env=rank_env(**MEASURE_ENV))
            r = json.loads(out.read_text())
            row[variant] = {"peak_mib": round(r["peak_bytes"] / 2**20), "seconds": round(r["seconds"], 2)}
            row["shape"] = {k: r[k] for k in ("batch", "prompt", "completion")}
        rows.append(row)
        print(json.dumps(row), flush=True)
    return {"unit": "peak private memory (RssAnon) of one micro-batch's forward_logps + backward, over the "
                    "model's weights and gradients (MiB)", "allocator": MEASURE_ENV, "goal": GOALS["logprob"],
            **logprob_summary(rows)}


def logprob_summary(rows: list[dict]) -> dict:
    rows = [{**r, "after_over_before": round(r["after"]["peak_mib"] / r["before"]["peak_mib"], 3)} for r in rows]
    return {"rows": rows, "goal_met": {f"{r['dtype']}, checkpointing {r['gradient_checkpointing']}":
                                       r["after_over_before"] <= 0.5 for r in rows}}


def part_throughput(model_dir: Path, work: Path, samples: int, micro_batch: int, max_c: int) -> dict:
    """2 ranks, one optimizer step over each rank's rollout, each variant in fresh processes."""
    row = {"samples_per_rank": samples, "micro_batch": micro_batch, "gradient_checkpointing": True, "bf16": True,
           "stage3_max_live_parameters": 1e8}
    for variant in ("before", "after"):
        out = work / f"throughput_{variant}.json"
        run_ranks(2, ["throughput", str(model_dir), str(out), variant, str(samples), str(micro_batch), str(max_c)],
                 out.with_suffix(".log"))
        per_rank = ranks(out, 2)
        slowest = max(r["seconds"] for r in per_rank)  # the step ends when the last rank's does
        cpu = max(r["cpu_seconds"] for r in per_rank)
        row[variant] = {"seconds": round(slowest, 2), "tokens_per_s": round(per_rank[0]["train_tokens"] / slowest, 1),
                        "cpu_seconds": round(cpu, 2), "tokens_per_cpu_s": round(per_rank[0]["train_tokens"] / cpu, 1),
                        "loss": per_rank[0]["loss"], "grad_norm": per_rank[0]["grad_norm"]}
        row["train_tokens"] = per_rank[0]["train_tokens"]
        row["completion_lengths_per_rank"] = [r["completion_lengths"] for r in per_rank]
        row["prompt_lengths_per_rank"] = [r["prompt_lengths"] for r in per_rank]
    row["load_average_at_end"] = os.getloadavg()
    print(json.dumps(row), flush=True)
    return {"unit": "completion tokens (the loss's tokens, all ranks) per second of one optimizer step (wall clock; "
                    "and per CPU second of the busiest rank, one thread each)", "goal": GOALS["throughput"],
            **throughput_summary(row)}


def throughput_summary(row: dict) -> dict:
    b, a = row["before"], row["after"]
    row = {**row, "speedup": round(a["tokens_per_s"] / b["tokens_per_s"], 3),
           # one thread per rank: CPU seconds are the work itself, whatever else shares the cores meanwhile
           "speedup_cpu_time": round(a["tokens_per_cpu_s"] / b["tokens_per_cpu_s"], 3),
           "same_update": {"loss_abs_diff": abs(a["loss"] - b["loss"]),
                           "grad_norm_rel_diff": abs(a["grad_norm"] / b["grad_norm"] - 1)}}
    return {"row": row, "goal_met": row["speedup"] >= 1.5, "goal_met_cpu_time": row["speedup_cpu_time"] >= 1.5}


def part_padding(shape: dict, samples: int, micro_batch: int, max_c: int) -> dict:
    """No model, no timing: the positions each variant computes for the throughput part's exact rollouts and
    micro-batches (both ranks), and the model FLOPs they cost (6 x non-embedding parameters per position
    through the layers, 6 x V x H per position through the output layer; attention's s^2 term left out)."""
    from scale_worker import todays_batching, varied_rollout

    from grpo_recipe.algo.buffer import RolloutBuffer

    h, v, inter = shape["hidden_size"], shape["vocab_size"], shape["intermediate_size"]
    kv = h // shape["num_attention_heads"] * shape["num_key_value_heads"]
    body = shape["num_hidden_layers"] * (2 * h * h + 2 * h * kv + 3 * h * inter)
    row = {"samples_per_rank": samples, "micro_batch": micro_batch, "max_completion_length": max_c, "ranks": 2}
    for variant, cls in (("before", todays_batching()), ("after", RolloutBuffer)):
        layers = head = 0
        for rank in range(2):  # as bench/scale_worker.py's throughput builds them
            prompts, comps, adv, mask = varied_rollout(samples, v, seed=rank, completion=(min(16, max_c), max_c))
            buf = cls.build(prompts, comps, adv, mask, pad_id=0, order_seed=rank)
            for idx in buf.schedule(0, 1, micro_batch)[0]:
                mb = buf.micro_batch(idx)
                n, width = mb["input_ids"].shape
                layers += n * width
                # before: every position's logits; after: the completion positions' (logits_to_keep = C + 1)
                head += n * (width if variant == "before" else mb["completion_mask"].shape[1] + 1)
        row[variant] = {"positions_through_layers": layers, "positions_through_output_layer": head,
                        "model_flops": 6 * body * layers + 6 * v * h * head}
    row["trained_tokens"] = int(sum(len(c) for r in range(2) for c in
                                    varied_rollout(samples, v, seed=r, completion=(min(16, max_c), max_c))[1]))
    row["before_over_after_flops"] = round(row["before"]["model_flops"] / row["after"]["model_flops"], 3)
    print(json.dumps(row), flush=True)
    return {"unit": "positions computed and model FLOPs of one optimizer step over both ranks' rollouts (counted, "
                    "not timed): an estimate of the throughput part's speed-up", "row": row}


def plot(result: dict, path: Path) -> None:
    """Before/after bars for every figure in `result` (parts that were not run are left out)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = []
    if "startup" in result:
        rows = result["startup"]["rows"]
        panels.append(("start-up, per rank (x fp32 model)",
                       [(f"w{r['world']} {r['models']}\n{k.removesuffix('_added').replace('_', ' ')}",
                         max(r["before"][k]), max(r["after"][k])) for r in rows
                        for k in ("policy_load_added", "reference_added", "startup_peak")
                        if k in r["before"] and not (k == "startup_peak" and r["models"] == "reference")]))
    if "logprob" in result:
        panels.append(("log-prob fwd+bwd peak (MiB)", [(f"{r['dtype']}, checkpointing "
                                                        f"{'on' if r['gradient_checkpointing'] else 'off'}",
                                                       r["before"]["peak_mib"], r["after"]["peak_mib"])
                                                      for r in result["logprob"]["rows"]]))
    if "padding" in result:
        r = result["padding"]["row"]
        panels.append(("step model TFLOPs (counted)", [("lengths 16..512", r["before"]["model_flops"] / 1e12,
                                                         r["after"]["model_flops"] / 1e12)]))
    if "row" in result.get("throughput", {}):  # a part not measured has no row
        r = result["throughput"]["row"]
        panels.append(("training tokens/s", [("lengths 16..512", r["before"]["tokens_per_s"],
                                              r["after"]["tokens_per_s"])]))
    if not panels:
        return
    fig, axes = plt.subplots(1, len(panels), figsize=(6 * len(panels), 4.5), squeeze=False,
                             gridspec_kw={"width_ratios": [max(2, len(p[1])) for p in panels]})
    for ax, (title, bars) in zip(axes[0], panels):
        xs = range(len(bars))
        ax.bar([x - 0.2 for x in xs], [b for _, b, _ in bars], 0.4, label="before")
        ax.bar([x + 0.2 for x in xs], [a for _, _, a in bars], 0.4, label="after")
        ax.set_xticks(list(xs), [n for n, _, _ in bars], fontsize=7, rotation=30, ha="right")
        ax.set_title(title)
        ax.legend()
    fig.suptitle("Qwen2.5-0.5B-shaped model, 2 CPU ranks (ZeRO-3, gloo): before and after")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--parts", nargs="+", default=list(PARTS), choices=list(PARTS))
    ap.add_argument("--smoke", action="store_true")
    ap.add_argument("--replot", action="store_true", help="only redraw scale.png from scale.json")
    args = ap.parse_args()
    if args.replot:
        plot(json.loads((RESULTS / "scale.json").read_text()), RESULTS / "scale.png")
        return
    from grpo_recipe.model.tiny import cache_root

    shape = SMOKE if args.smoke else QWEN05B
    model_dir = build_model(shape, cache_root() / ("bench-smoke-shape" if args.smoke else "bench-qwen2.5-0.5b-shape"))
    work = RESULTS / "tmp" / "scale"
    path = RESULTS / "scale.json"
    # the parts measured earlier stay (each with when and on which commit); anything else is not this script's
    old = json.loads(path.read_text()) if path.exists() and not args.smoke else {}
    result = {k: v for k, v in old.items() if k in (*PARTS, "measured_at")}
    result["measured_at"] = {k: v for k, v in result.get("measured_at", {}).items() if k in PARTS}

    def save(part: str, figures: dict) -> None:  # after each part: a later part's failure keeps the earlier ones
        result[part] = figures
        result.setdefault("measured_at", {})[part] = measured_at()
        result.update(command="python bench/scale.py", model_shape=shape, goals=GOALS, machine=machine())
        save_json("scale.json", result)

    if "whole_run" in args.parts:
        save("whole_run", part_whole_run(model_dir, work, WHOLE_RUN_CASES[:2] if args.smoke else WHOLE_RUN_CASES))
    if "startup" in args.parts:
        save("startup", part_startup(model_dir, work, [2], ("policy+reference",)) if args.smoke else
             part_startup(model_dir, work, [1, 2], ("policy", "policy+reference", "reference")))
    if "logprob" in args.parts:
        save("logprob", part_logprob(model_dir, work, [2, 8, 32], ((0, 0),)) if args.smoke else
             part_logprob(model_dir, work, [2, 64, 512], ((0, 0), (1, 0), (1, 1))))
    if "padding" in args.parts:
        save("padding", part_padding(shape, *((4, 2, 32) if args.smoke else (8, 1, 512))))
    if "throughput" in args.parts:
        save("throughput", part_throughput(model_dir, work, *((4, 2, 32) if args.smoke else (8, 1, 512))))
    plot(result, RESULTS / "scale.png")


if __name__ == "__main__":
    main()
