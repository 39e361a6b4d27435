"""Large-model readiness, before and after, side by side in one run, on a Qwen2.5-0.5B-shaped model.

    python bench/scale.py                      # every part, then bench/results/scale.json and scale.png
    python bench/scale.py --parts startup      # one part (the others keep their figures from scale.json)
    python bench/scale.py --smoke              # a small model and short runs, for CI (results elsewhere)

The model is built from Qwen2.5-0.5B's config with random weights (vocabulary 151,936; no download) and saved
in bf16 as the real checkpoint is. "before" is today's code path, reproduced in bench/scale_worker.py; "after"
is the recipe's. Each figure runs in fresh processes (torchrun ranks on CPU, gloo).
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
from pathlib import Path

from common import RESULTS, free_port, machine, save_json

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
# Qwen2.5-0.5B's shape (config.json of the released model), random weights
QWEN05B = dict(vocab_size=151936, hidden_size=896, intermediate_size=4864, num_hidden_layers=24, num_attention_heads=14,
               num_key_value_heads=2, max_position_embeddings=32768, rope_theta=1000000.0, rms_norm_eps=1e-6,
               tie_word_embeddings=True)
SMOKE = dict(QWEN05B, vocab_size=4096, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
             num_attention_heads=4, num_key_value_heads=2)
GOALS = {"startup": "at world 2, peak private memory per rank <= 0.6x the full fp32 model, falling as 1/world",
         "logprob": "peak memory of one micro-batch's log-prob forward and backward: after / before <= 0.5",
         "throughput": "training tokens/s, completion lengths uniform in 16..512: after / before >= 1.5"}


def build_model(shape: dict, folder: Path) -> Path:
    """A Qwen2 of `shape` with random weights (seed 0), saved in bf16 as the released checkpoints are."""
    from recipe.buildlock import exclusive
    from recipe.tiny import missing_files, save_model

    def complete() -> bool:
        return not [m for m in missing_files(folder) if not m.startswith("tokenizer")]

    if complete():
        return folder
    with exclusive(folder.with_name(folder.name + ".lock"), f"the build of {folder}"):
        if not complete():
            import torch
            from transformers import AutoModelForCausalLM, Qwen2Config

            torch.manual_seed(0)
            model = AutoModelForCausalLM.from_config(Qwen2Config(**shape), dtype=torch.bfloat16)
            tmp = folder.with_name(folder.name + ".tmp")
            shutil.rmtree(tmp, ignore_errors=True)
            tmp.mkdir(parents=True)
            save_model(model, tmp)
            shutil.rmtree(folder, ignore_errors=True)
            os.rename(tmp, folder)  # complete or absent
    return folder


def torchrun(nproc: int, args: list[str], log: Path) -> None:
    import subprocess

    env = dict(os.environ, DS_ACCELERATOR="cpu", OMP_NUM_THREADS="1", PYTHONPATH=str(REPO),
               TOKENIZERS_PARALLELISM="false")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "1", "--nproc_per_node", str(nproc),
           "--master_addr", "127.0.0.1", "--master_port", str(free_port()), "bench/scale_worker.py", *args]
    log.parent.mkdir(parents=True, exist_ok=True)
    with open(log, "w") as f:
        proc = subprocess.run(cmd, cwd=REPO, env=env, stdout=f, stderr=subprocess.STDOUT)
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed ({proc.returncode}); see {log}")


def ranks(out: Path, world: int) -> list[dict]:
    return [json.loads(Path(f"{out}.rank{r}").read_text()) for r in range(world)]


def part_startup(model_dir: Path, work: Path, worlds: list[int], betas: list[float]) -> dict:
    """Per rank, in units of the full fp32 model: the peak of each phase over its own starting level (what
    loading adds: policy_load, reference) and the peak of the whole start-up."""
    rows = []
    for world in worlds:
        for beta in betas:
            row = {"world": world, "beta": beta}
            for variant in ("before", "after"):
                out = work / f"startup_w{world}_b{beta}_{variant}.json"
                torchrun(world, ["startup", str(model_dir), str(out), variant, str(beta)], out.with_suffix(".log"))
                per_rank = ranks(out, world)
                fp32 = per_rank[0]["model_numel"] * 4

                def x(b):
                    return round(b / fp32, 3)

                row[variant] = {"startup_peak": [x(r["peak_bytes"]) for r in per_rank],
                                **{f"{name}_added": [x(r["phases"][name]["peak_bytes"] - r["phases"][name]["start_bytes"])
                                                     for r in per_rank] for name in per_rank[0]["phases"]}}
            rows.append(row)
            print(json.dumps(row), flush=True)
    at2 = [r for r in rows if r["world"] == 2]
    worst = max(v for r in at2 for k in ("policy_load_added", "reference_added") for v in r["after"].get(k, []))
    return {"unit": "x the full fp32 model's bytes, per rank (private memory: RssAnon)", "rows": rows,
            "goal": GOALS["startup"], "loading_at_world_2_worst": worst, "goal_met_for_loading": worst <= 0.6}


def part_logprob(model_dir: Path, work: Path, sizes: list[int]) -> dict:
    """Each variant in a fresh process, with and without gradient checkpointing."""
    import subprocess

    rows = []
    for checkpointing in (0, 1):
        row = {"gradient_checkpointing": bool(checkpointing)}
        for variant in ("before", "after"):
            out = work / f"logprob_{variant}_ckpt{checkpointing}.json"
            out.parent.mkdir(parents=True, exist_ok=True)
            subprocess.run([sys.executable, "bench/scale_worker.py", "logprob", str(model_dir), str(out), variant,
                            str(checkpointing), *map(str, sizes)], cwd=REPO, check=True,
                           env=dict(os.environ, PYTHONPATH=str(REPO), OMP_NUM_THREADS="1"))
            r = json.loads(out.read_text())
            row[variant] = {"peak_mib": round(r["peak_bytes"] / 2**20), "seconds": round(r["seconds"], 2)}
            row["shape"] = {k: r[k] for k in ("batch", "prompt", "completion")}
        row["after_over_before"] = round(row["after"]["peak_mib"] / row["before"]["peak_mib"], 3)
        rows.append(row)
        print(json.dumps(row), flush=True)
    return {"unit": "peak private memory (RssAnon) of one micro-batch's forward_logps + backward, over the "
                    "model's weights and gradients (MiB)", "rows": rows, "goal": GOALS["logprob"],
            "goal_met": all(r["after_over_before"] <= 0.5 for r in rows)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--parts", nargs="+", default=["startup", "logprob", "throughput"])
    ap.add_argument("--smoke", action="store_true")
    args = ap.parse_args()
    from recipe.tiny import cache_root

    shape = SMOKE if args.smoke else QWEN05B
    model_dir = build_model(shape, cache_root() / ("bench-smoke-shape" if args.smoke else "bench-qwen2.5-0.5b-shape"))
    work = RESULTS / "tmp" / "scale"
    path = RESULTS / "scale.json"
    result = json.loads(path.read_text()) if path.exists() else {}
    if "startup" in args.parts:
        result["startup"] = part_startup(model_dir, work, [1, 2], [0.0, 0.04])
    if "logprob" in args.parts:
        result["logprob"] = part_logprob(model_dir, work, [2, 8, 32] if args.smoke else [2, 64, 512])
    result.update(command="python bench/scale.py", model_shape=shape, goals=GOALS, machine=machine())
    save_json("scale.json", result)


if __name__ == "__main__":
    main()
