"""LoRA into vLLM: `vllm_lora_sync: merged` vs `adapter`, per sync (bytes, seconds) and per rollout (generation).

    python bench/lora_vllm.py [--models tiny qwen05b] [--rollouts N] [--reps 2] [--out bench/results/lora_vllm.json]

For each model, each mode runs as its own `torchrun --nproc_per_node 2` job (a vLLM engine is built for one mode),
the modes alternating within each repetition. A job builds everything with the recipe's own setup (ZeRO-3 LoRA
engine, colocated vLLM engine per rank, the prompt stream), then per rollout: new adapter values (random B
matrices, set on rank 0 and broadcast: a stand-in for the optimizer step, which the measured quantities do not
depend on), one sync (timed; the bytes handed to vLLM counted), one rollout of sampling (timed, tokens counted).
Models: `tiny` is the LoRA quickstart (builtin:tiny-qwen2, its adapter on every linear and the tied output head);
`qwen05b` is a model shaped like Qwen2.5-0.5B (hidden 896, 24 layers, 14 heads, 2 KV heads, vocabulary 151936,
tied embeddings; 494M parameters, 2 GB in fp32), built from a config with random weights (no download) and
saved once under ~/.cache/grpo_recipe/lora-vllm-qwen2.5-0.5b-shape, with a rank-16 adapter on every linear
(`all-linear`).
"""
from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "bench"))

MODES = ("merged", "adapter")
QWEN05B = dict(hidden_size=896, intermediate_size=4864, num_hidden_layers=24, num_attention_heads=14,
               num_key_value_heads=2, vocab_size=151936, max_position_embeddings=32768, tie_word_embeddings=True,
               rope_parameters={"rope_theta": 1000000.0, "rope_type": "default"}, rms_norm_eps=1e-6)
MODELS = {  # recipe overrides per model (on top of grpo_recipe/configs/quickstart_lora.yaml), measured rollouts per job
    "tiny": ([], 6),
    "qwen05b": (["--lora_target_modules", "[all-linear]", "--max_completion_length", "64"], 2),
}


def qwen05b_folder() -> Path:
    """The Qwen2.5-0.5B-shaped model (random weights, the tiny model's tokenizer), built and saved once."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    from grpo_recipe.model.tiny import ensure_builtin

    folder = Path(os.path.expanduser("~/.cache/grpo_recipe/lora-vllm-qwen2.5-0.5b-shape"))
    if (folder / "tokenizer_config.json").is_file():  # written last, and the folder appears only when complete
        return folder
    tiny = ensure_builtin("builtin:tiny-qwen2")
    base = AutoConfig.from_pretrained(tiny)
    config = type(base)(bos_token_id=base.bos_token_id, eos_token_id=base.eos_token_id,
                        pad_token_id=base.pad_token_id, **QWEN05B)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    tmp = folder.with_name(folder.name + f".tmp{os.getpid()}")
    model.save_pretrained(tmp)
    AutoTokenizer.from_pretrained(tiny).save_pretrained(tmp)
    os.replace(tmp, folder)  # complete or absent
    return folder


# ------------------------------------------------------------------------------------------
# one job: one model, one mode, 2 ranks
# ------------------------------------------------------------------------------------------
def new_adapter_values(engine, rank: int, step: int) -> None:
    import deepspeed
    import torch

    lora_b = [p for n, p in engine.module.named_parameters() if ".lora_B." in n]
    with deepspeed.zero.GatheredParameters(lora_b, modifier_rank=0):
        if rank == 0:
            g = torch.Generator().manual_seed(step)
            for p in lora_b:
                p.data.copy_(torch.randn(p.shape, generator=g) * 0.01)
    engine.global_steps += 1  # as an optimizer step does: the generator syncs weights newer than it holds


def worker(model: str, mode: str, rollouts: int, out: str) -> None:
    import torch
    import torch.distributed as dist

    from grpo_recipe import train
    from grpo_recipe.config.load import load_config
    from grpo_recipe.generation import rollout_seed
    from grpo_recipe.run.preflight import preflight

    extra = MODELS[model][0] + (["--model_name_or_path", str(qwen05b_folder())] if model == "qwen05b" else [])
    cfg = load_config(["--config", "grpo_recipe/configs/quickstart_lora.yaml", "--generation_backend", "vllm",
                       "--vllm_lora_sync", mode, "--output_dir", tempfile.mkdtemp(prefix="bench_lora_vllm_"), *extra])
    preflight(cfg)  # as grpo_recipe.train.main: before the process group starts
    t0 = time.perf_counter()
    run, _ = train.setup(cfg)  # engine, prompt stream and the vLLM generator, exactly as the recipe builds them
    startup = time.perf_counter() - t0
    sync_s, gen_s, tokens, sync_bytes, syncs_before = [], [], 0.0, 0, run.generator.syncs
    for r in range(rollouts + 1):  # rollout 0 warms up and is not counted
        new_adapter_values(run.engine, run.rank, r)
        dist.barrier()
        t = time.perf_counter()
        run.generator.sync(run.engine)
        dt_sync = time.perf_counter() - t
        batch = run.stream.batch(r)
        dist.barrier()
        t = time.perf_counter()
        comp = run.generator.generate(batch.prompt_ids, seed=rollout_seed(cfg.seed, r, run.rank, run.world))
        dt_gen = time.perf_counter() - t
        if r > 0:
            sync_s.append(dt_sync)
            gen_s.append(dt_gen)
            tokens += comp.mask.sum().item()
            sync_bytes = run.generator.last_sync_bytes
    # the ranks run side by side: seconds are the slowest rank's, tokens the sum
    peak_rss_mib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    secs = torch.tensor([sum(sync_s), sum(gen_s), startup, peak_rss_mib], dtype=torch.float64)
    dist.all_reduce(secs, op=dist.ReduceOp.MAX)
    tok = torch.tensor([tokens], dtype=torch.float64)
    dist.all_reduce(tok)
    result = {"model": model, "mode": mode, "rollouts": rollouts, "ranks": run.world,
              "sync_bytes_per_rank": sync_bytes, "sync_s": secs[0].item() / rollouts,
              "generate_s": secs[1].item() / rollouts, "tokens_per_rollout": tok.item() / rollouts,
              "tokens_per_s": tok.item() / secs[1].item(), "startup_s": secs[2].item(),
              "peak_rss_mib_per_rank": secs[3].item(),
              "rollout_s": (secs[0].item() + secs[1].item()) / rollouts,
              "completions_per_rank": cfg.completions_per_rollout, "max_completion_length": cfg.max_completion_length,
              "lora_r": cfg.lora_r, "lora_target_modules": cfg.lora_target_modules,
              "syncs": run.generator.syncs - syncs_before}  # one per rollout, the warm-up's included
    if run.rank == 0:
        Path(out).write_text(json.dumps(result) + "\n")
    dist.barrier()
    run.generator.close()  # last: vLLM's shutdown tears the process group down


# ------------------------------------------------------------------------------------------
# the comparison
# ------------------------------------------------------------------------------------------
def summarize(runs: list[dict]) -> dict:
    """Medians over repetitions per model and mode, and adapter / merged ratios (< 1: adapter is cheaper)."""
    keys = ("sync_bytes_per_rank", "sync_s", "generate_s", "tokens_per_s", "rollout_s", "startup_s",
            "peak_rss_mib_per_rank")
    out = {}
    for model in dict.fromkeys(r["model"] for r in runs):
        modes = {m: {k: statistics.median(r[k] for r in runs if r["model"] == model and r["mode"] == m)
                     for k in keys} for m in MODES}
        ratio = {k: modes["adapter"][k] / modes["merged"][k] for k in keys if modes["merged"][k]}
        # Rollout time ~ sync + tokens x seconds per token: adapter mode wins below this many tokens per rollout.
        tokens = statistics.median(r["tokens_per_rollout"] for r in runs if r["model"] == model)
        per_token = {m: modes[m]["generate_s"] / tokens for m in MODES}
        extra = per_token["adapter"] - per_token["merged"]
        saved = modes["merged"]["sync_s"] - modes["adapter"]["sync_s"]
        out[model] = {**modes, "adapter_over_merged": ratio, "tokens_per_rollout": tokens,
                      "adapter_faster_below_tokens_per_rollout": saved / extra if extra > 0 else None,
                      "faster_per_rollout": "adapter" if ratio["rollout_s"] < 1 else "merged"}
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], epilog=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--models", nargs="+", default=list(MODELS), choices=list(MODELS))
    p.add_argument("--rollouts", type=int, default=None,
                   help="measured rollouts per job, after one warm-up (default: tiny 6, qwen05b 2)")
    p.add_argument("--reps", type=int, default=2, help="jobs per model and mode (the modes alternate)")
    p.add_argument("--out", default=None, help="result JSON (default: bench/results/lora_vllm.json)")
    p.add_argument("--worker", nargs=3, metavar=("MODEL", "MODE", "OUT"), help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.worker:
        return worker(args.worker[0], args.worker[1], args.rollouts, args.worker[2])
    from common import launch, machine, save_json

    if "qwen05b" in args.models:
        qwen05b_folder()  # once, before any rank needs it
    runs, logs = [], Path(tempfile.mkdtemp(prefix="lora_vllm_logs_"))
    for model in args.models:
        for rep in range(args.reps):
            for mode in (MODES if rep % 2 == 0 else MODES[::-1]):
                out = logs / f"{model}_{mode}_{rep}.json"
                rollouts = args.rollouts or MODELS[model][1]
                launch(2, [str(REPO / "bench" / "lora_vllm.py"), "--rollouts", str(rollouts)],
                       ["--worker", model, mode, str(out)], logs / f"{model}_{mode}_{rep}.log")
                runs.append({**json.loads(out.read_text()), "rep": rep})
                print(json.dumps(runs[-1]), flush=True)
    import vllm

    report = {"what": "LoRA into vLLM per sync (bytes, s) and per rollout (generation tokens/s, sync + generation s): "
                      "vllm_lora_sync merged vs adapter",
              "command": "python bench/lora_vllm.py " + " ".join(sys.argv[1:]),
              "machine": {**machine(), "vllm": vllm.__version__, "ranks": 2, "vllm_tensor_parallel_size": 1},
              "summary": summarize(runs), "runs": runs}
    save_json(Path(args.out).resolve() if args.out else "lora_vllm.json", report)
    print(json.dumps(report["summary"], indent=1))


if __name__ == "__main__":
    main()
