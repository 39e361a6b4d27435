"""The GPU check: what a first multi-GPU run needs, proven in one call on one device.

    bash bench/gpu_check.sh          # on a GPU machine: writes bench/results/gpu_check.json
    bash bench/gpu_check.sh --cpu    # the same steps with small models on CPU (CI's dry run)

Sections, each written to the results file as soon as it is done (a run cut short keeps what it measured):
- loop: the real training loop (`python -m grpo_recipe.train`, built-in tiny model) with every collective forced
  on at a world of one (GRPO_FORCE_COLLECTIVES=1: NCCL gets the recipe's own tensors as two GPUs would give it),
  a checkpoint and a resume against the uninterrupted run, and LoRA with beta > 0 (the reference forward);
- train: bf16 ZeRO-3 updates against fp32 on a Qwen2.5-0.5B-shaped model (random weights): log-probs, loss and
  gradient norm, peak allocated and reserved memory, step time, tokens/s and model FLOPs utilization;
- logprob_paths: the fused output head against the chunked logits path on the same tokens (values, seconds,
  memory);
- generation: HF generation in both gather modes (greedy tokens equal), tokens/s, memory;
- vllm: whether vLLM can be imported here (a GPU machine without network cannot install it).
"""
from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from pathlib import Path

import torch

BENCH = Path(__file__).resolve().parent
sys.path[:0] = [str(BENCH.parent), str(BENCH)]
from measure import update  # noqa: E402 -- after the path set-up

# dense bf16 peak of one device, TFLOP/s (vendor data sheets, SXM parts)
PEAK_TFLOPS = {"H200": 989.5, "H100": 989.5, "A100": 312.0, "L40S": 362.0, "A10G": 70.0}
SIZES = {"gpu": dict(samples=32, micro_batch=8, prompt=128, completion=512, gen_prompts=32, gen_tokens=256),
         "cpu": dict(samples=4, micro_batch=2, prompt=8, completion=16, gen_prompts=2, gen_tokens=8)}


class Memory:
    """Peak device memory (CUDA) or peak private host memory (CPU) of a phase, in bytes."""

    def __init__(self, cuda: bool):
        self.cuda = cuda

    def __enter__(self):
        if self.cuda:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
        else:
            from measure import PeakSampler

            self.sampler = PeakSampler()
        self.t0 = time.perf_counter()
        return self

    def __exit__(self, *exc):
        if self.cuda:
            torch.cuda.synchronize()
            self.peak = torch.cuda.max_memory_allocated()
            self.reserved = torch.cuda.max_memory_reserved()  # what the caching allocator held: the real footprint
        else:
            self.reserved = None
            self.sampler.mark("phase")
            self.peak = self.sampler.stop()["peak_bytes"] + self.sampler.base
        self.seconds = time.perf_counter() - self.t0


def ds_config_file(work: Path) -> str:
    """zero3.json with torch's AdamW: DeepSpeed's fused Adam would compile CUDA code, and the check brings no
    CUDA toolkit."""
    conf = json.loads((BENCH.parent / "ds_configs" / "zero3.json").read_text())
    conf["optimizer"]["params"]["torch_adam"] = True
    path = work / "zero3_torch_adam.json"
    path.write_text(json.dumps(conf))
    return str(path)


def rollout(cfg, size: dict, vocab: int, seed: int = 0):
    """Random prompts, completions of uniform random length 16..max (down to 1 in the small run), advantages."""
    from grpo_recipe.algo.buffer import RolloutBuffer

    g = torch.Generator().manual_seed(seed)
    n, p, c = size["samples"], size["prompt"], size["completion"]
    lengths = torch.randint(min(16, c), c + 1, (n,), generator=g)
    prompts = [torch.randint(1, vocab, (p,), generator=g).tolist() for _ in range(n)]
    comps = [torch.randint(1, vocab, (int(k),), generator=g).tolist() for k in lengths]
    mask = (torch.arange(c) < lengths.unsqueeze(1)).float()
    adv = torch.randn(n, generator=g)
    return RolloutBuffer.build(prompts, comps, adv, mask, pad_id=0, order_seed=seed)



def train_flops(hf_config, buf) -> float:
    """Model FLOPs of one pass over the rollout, forward and backward: 6 x (non-embedding parameters) per
    token, 6 x V x H per completion token for the output head, and causal attention 6 x L x H x s^2."""
    h, layers, v = hf_config.hidden_size, hf_config.num_hidden_layers, hf_config.vocab_size
    kv = h // hf_config.num_attention_heads * hf_config.num_key_value_heads
    body = layers * (2 * h * h + 2 * h * kv + 3 * h * hf_config.intermediate_size)
    seq = buf.attention_mask.sum(-1).double()
    return float(6 * body * seq.sum() + 6 * v * h * buf.completion_mask.sum() + 6 * layers * h * (seq ** 2).sum())


def train_run(precision: str, folder: str, ds_file: str, size: dict, cuda: bool, hf_config) -> tuple[dict, object]:
    from grpo_recipe.config.schema import Config
    from grpo_recipe.model import engine as eng
    from grpo_recipe.model.load import load_model

    cfg = Config(model_name_or_path=folder, deepspeed_config=ds_file, bf16=precision == "bf16",
                 per_device_train_batch_size=size["micro_batch"], num_generations=2,
                 gradient_accumulation_steps=size["samples"] // size["micro_batch"], num_iterations=2,
                 max_completion_length=size["completion"], learning_rate=1e-5, max_grad_norm=1.0)
    with Memory(cuda) as load:
        engine = eng.init_engine(load_model(folder, cfg, 1), cfg, 1)
    update(engine, rollout(cfg, size, hf_config.vocab_size, seed=1), cfg)  # warm-up: kernels, ZeRO-3 trace
    buf = rollout(cfg, size, hf_config.vocab_size)
    with Memory(cuda) as step:
        outs = update(engine, buf, cfg)
    tokens = float(buf.completion_mask.sum()) * cfg.num_iterations
    flops = train_flops(hf_config, buf) * cfg.num_iterations
    res = {"param_dtype": str(next(engine.module.parameters()).dtype), "load_peak_bytes": load.peak,
           "losses": [o["loss"] for o in outs], "grad_norms": [o.get("grad_norm") for o in outs],
           "step_seconds": step.seconds / len(outs), "train_peak_bytes": step.peak,
           "train_peak_reserved_bytes": step.reserved,
           "completion_tokens_per_s": tokens / step.seconds,
           "all_tokens_per_s": float(buf.attention_mask.sum()) * cfg.num_iterations / step.seconds,
           "model_tflops_per_s": flops / step.seconds / 1e12, "old_logps": buf.old_logps, "mask": buf.completion_mask}
    return res, engine


def generation(engine, folder: str, size: dict, cuda: bool, vocab: int) -> dict:
    from grpo_recipe.config.schema import Config
    from grpo_recipe.generation import build_generator
    from grpo_recipe.model.load import load_tokenizer
    from grpo_recipe.model.tiny import ensure_builtin

    tok = load_tokenizer(str(ensure_builtin("builtin:tiny-qwen2")))  # ids only; decoded text is unused
    g = torch.Generator().manual_seed(2)
    prompts = [torch.randint(1, vocab, (size["prompt"],), generator=g).tolist() for _ in range(size["gen_prompts"])]
    res = {}
    for mode in ("full", "per_layer"):
        cfg = Config(model_name_or_path=folder, num_generations=2, per_device_train_batch_size=2,
                     max_completion_length=size["gen_tokens"], hf_generation_gather=mode)
        gen = build_generator(cfg, engine, tok)
        gen.gen_config.do_sample = False
        gen.generate(prompts[:2], seed=0)  # warm-up
        with Memory(cuda) as m:
            out = gen.generate(prompts[:size["gen_prompts"] // 2], seed=0)
        tokens = float(out.mask.sum())
        res[mode] = {"sequences": len(out.ids), "tokens": tokens, "seconds": m.seconds, "tokens_per_s": tokens / m.seconds,
                     "peak_bytes": m.peak, "peak_reserved_bytes": m.reserved, "ids": out.ids}
    res["greedy_equal"] = res["full"].pop("ids") == res["per_layer"].pop("ids")
    return res


LOOP_ARGS = ["--config", "grpo_recipe/configs/quickstart.yaml", "--num_iterations", "2", "--per_device_train_batch_size",
             "8", "--gradient_accumulation_steps", "1", "--max_completion_length", "16", "--disable_tqdm", "true",
             "--save_total_limit", "3"]


def loop(work: Path, cuda: bool) -> dict:
    """The recipe's own loop, as a user starts it (a world of one, every collective forced on): 4 steps with a
    checkpoint at step 2; 2 steps, then a resume to 4 from that checkpoint (final weights compared with the
    uninterrupted run's); LoRA with beta > 0 (the adapter-off reference forward) for 2 steps; TRL's menu with
    collectives of its own (the top-entropy threshold's gather, adaptive entropy, the reference's mix) for 2."""
    import subprocess

    from safetensors.torch import load_file

    from grpo_recipe.dist.collectives import FORCE_ENV
    from grpo_recipe.dist.env import rank_env
    from grpo_recipe.run.metrics import read_jsonl

    env = rank_env(**{FORCE_ENV: "1"})
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(k, None)  # a plain process: the recipe makes its own world of one

    def train(name: str, *args: str) -> dict:
        out = work / name
        t0 = time.perf_counter()
        proc = subprocess.run([sys.executable, "-m", "grpo_recipe.train", *LOOP_ARGS, "--output_dir", str(out), *args],
                              cwd=BENCH.parent, env=env, capture_output=True, text=True, timeout=240)
        recs = [r for r in read_jsonl(out / "metrics.jsonl") if "loss" in r] if (out / "metrics.jsonl").is_file() else []
        return {"exit_code": proc.returncode, "seconds": time.perf_counter() - t0, "steps": len(recs),
                "losses": [r["loss"] for r in recs], "rewards": [r["reward_mean"] for r in recs],
                "kl": [r.get("kl") for r in recs], "stderr_tail": proc.stderr[-1500:] if proc.returncode else ""}

    def weights(name: str) -> dict:
        return {k: v.float() for f in sorted((work / name / "final").glob("*.safetensors")) for k, v in load_file(f).items()}

    # a GPU's kernels are deterministic only when asked (the tied embedding's index_add_, attention's backward):
    # both sides of the resume comparison run with full_determinism, as a user who needs bit-exact resumes would
    exact = ("--full_determinism", "true")
    res = {"full": train("full", "--max_steps", "4", "--save_steps", "2", "--overwrite_output_dir", "true", *exact)}
    res["first_half"] = train("resumed", "--max_steps", "2", "--save_steps", "2", "--overwrite_output_dir", "true",
                              *exact)
    res["resumed"] = train("resumed", "--max_steps", "4", "--save_steps", "2", "--resume_from_checkpoint", "auto",
                           *exact)
    res["lora_beta"] = train("lora", "--use_peft", "true", "--beta", "0.04", "--learning_rate", "1e-3", "--max_steps",
                             "2", "--save_steps", "0", "--overwrite_output_dir", "true")
    res["trl_menu"] = train("menu", "--beta", "0.04", "--sync_ref_model", "true", "--ref_model_sync_steps", "1",
                            "--top_entropy_quantile", "0.5", "--use_adaptive_entropy", "true", "--entropy_target",
                            "100", "--max_steps", "2", "--save_steps", "0", "--overwrite_output_dir", "true")
    ok = all(r["exit_code"] == 0 for r in res.values())
    if ok:
        a, b = weights("full"), weights("resumed")
        res["resume_max_abs_diff"] = max((a[k] - b[k]).abs().max().item() for k in a)
        res["resume_bit_exact"] = res["resume_max_abs_diff"] == 0.0
        res["resume_same_losses"] = res["full"]["losses"] == res["resumed"]["losses"]  # its metrics keep steps 1-2
    finite = all(math.isfinite(x) for r in res.values() if isinstance(r, dict) for x in r.get("losses", []))
    res["passed"] = ok and finite and res["full"]["steps"] == 4 and res["lora_beta"]["steps"] == 2 \
        and all(k is not None for k in res["lora_beta"]["kl"]) and res["trl_menu"]["steps"] == 2
    return res


def logprob_paths(engine, hf_config, size: dict, cuda: bool) -> dict:
    """The fused head (log-probs chunk by chunk from the head itself) against the chunked logits path, on one
    micro-batch of the same tokens: values, seconds and memory of forward + backward."""
    from grpo_recipe.algo import update as upd

    buf = rollout(None, size, hf_config.vocab_size, seed=3)
    mb = slice(0, size["micro_batch"])
    ids, attn, width = buf.input_ids[mb], buf.attention_mask[mb], buf.completion_mask.shape[1]
    dev = next(engine.module.parameters()).device
    ids, attn = ids.to(dev), attn.to(dev)
    res, values = {}, {}
    saved = upd.FUSED_HEAD_MODELS
    try:
        for path, models in (("fused", saved), ("chunked", frozenset())):
            upd.FUSED_HEAD_MODELS = models
            assert (upd.fused_head(engine) is not None) == (path == "fused")
            engine.backward(upd.forward_logps(engine, ids, attn, width, 1.0).sum())  # warm-up (no optimizer step)
            with Memory(cuda) as m:
                lp = upd.forward_logps(engine, ids, attn, width, 1.0)
                engine.backward(lp.sum())
            values[path] = lp.detach().float().cpu()
            res[path] = {"seconds": m.seconds, "peak_bytes": m.peak, "peak_reserved_bytes": m.reserved}
    finally:
        upd.FUSED_HEAD_MODELS = saved
    known = buf.completion_mask[mb].bool()
    res["max_abs_diff"] = (values["fused"] - values["chunked"])[known].abs().max().item()
    res["mean_abs_logp"] = values["chunked"][known].abs().mean().item()
    res["agree"] = res["max_abs_diff"] <= 0.02 * max(res["mean_abs_logp"], 1e-6) + 1e-3
    return res


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--cpu", action="store_true", help="small models on CPU (the dry run)")
    ap.add_argument("--out", default=None, help="default: bench/results/gpu_check.json (GPU) or gpu_check_cpu.json")
    args = ap.parse_args()
    t_start = time.perf_counter()
    from common import RESULTS, machine
    from measure import QWEN05B, SMOKE, build_model

    from grpo_recipe.dist.collectives import FORCE_ENV
    from grpo_recipe.dist.group import init_distributed
    from grpo_recipe.model.tiny import cache_root

    cuda = torch.cuda.is_available() and not args.cpu
    if not cuda and not args.cpu:
        raise SystemExit("gpu_check: no GPU here; run with --cpu for the dry run")
    size = SIZES["gpu" if cuda else "cpu"]
    out = Path(args.out) if args.out else RESULTS / ("gpu_check.json" if cuda else "gpu_check_cpu.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    work = RESULTS / "tmp" / "gpu_check"
    work.mkdir(parents=True, exist_ok=True)
    name = torch.cuda.get_device_name() if cuda else "cpu"
    import deepspeed
    import peft
    import transformers

    result = {"command": "bash bench/gpu_check.sh" + (" --cpu" if not cuda else ""), "device": name, "sizes": size,
              "machine": machine(cuda=torch.version.cuda, transformers=transformers.__version__, peft=peft.__version__,
                                 deepspeed=deepspeed.__version__,
                                 deepspeed_from=str(Path(deepspeed.__file__).parent.parent)),
              "sections_done": []}

    def done(section: str, value) -> None:  # written at once: a check cut short keeps what it measured
        result[section] = value
        result["sections_done"].append(section)
        result["wall_s"] = time.perf_counter() - t_start
        out.write_text(json.dumps(result, indent=1, default=str) + "\n")
        print(f"gpu_check: {section} done at {result['wall_s']:.0f} s", file=sys.stderr, flush=True)

    done("loop", loop(work / "loop", cuda))
    os.environ[FORCE_ENV] = "1"  # this process's own collectives (the update's statistics) run at a world of one too
    init_distributed()
    folder = str(build_model(QWEN05B if cuda else SMOKE,
                             cache_root() / ("bench-qwen2.5-0.5b-shape" if cuda else "bench-smoke-shape")))
    from transformers import AutoConfig

    hf_config = AutoConfig.from_pretrained(folder)
    result["model_shape"] = {k: getattr(hf_config, k) for k in ("vocab_size", "hidden_size", "intermediate_size",
                                                                "num_hidden_layers", "num_attention_heads")}
    ds_file = ds_config_file(work)
    fp32, engine = train_run("fp32", folder, ds_file, size, cuda, hf_config)
    engine.destroy()
    del engine
    if cuda:
        torch.cuda.empty_cache()
    bf16, engine = train_run("bf16", folder, ds_file, size, cuda, hf_config)
    known = fp32.pop("mask").bool()
    a, b = fp32.pop("old_logps")[known], bf16.pop("old_logps")[known]
    bf16.pop("mask")
    rel = lambda x, y: abs(x - y) / max(abs(y), 1e-12)  # noqa: E731
    comparison = {"old_logp_mean_abs_diff": (a - b).abs().mean().item(), "old_logp_max_abs_diff": (a - b).abs().max().item(),
                  "old_logp_mean_abs": a.abs().mean().item(),
                  "step2_loss_rel_diff": rel(bf16["losses"][1], fp32["losses"][1]),
                  "step1_grad_norm_rel_diff": rel(bf16["grad_norms"][0], fp32["grad_norms"][0])}
    # bf16 keeps 8 bits of mantissa (relative rounding 2^-9): per-token log-probs and step statistics stay
    # within about a percent of fp32; these bounds are loose enough for a random model's flat distributions.
    comparison["within_bf16_tolerance"] = bool(
        comparison["old_logp_mean_abs_diff"] <= 0.01 * comparison["old_logp_mean_abs"]
        and comparison["step2_loss_rel_diff"] <= 0.05 and comparison["step1_grad_norm_rel_diff"] <= 0.05)
    peak = next((v for k, v in PEAK_TFLOPS.items() if k in name), None)
    result.update(peak_tflops_bf16_dense=peak, mfu_bf16=bf16["model_tflops_per_s"] / peak if peak else None,
                  train_fp32=fp32, bf16_vs_fp32=comparison)
    done("train_bf16", bf16)
    done("generation", generation(engine, folder, size, cuda, hf_config.vocab_size))
    done("logprob_paths", logprob_paths(engine, hf_config, size, cuda))
    try:
        import vllm

        done("vllm", {"importable": True, "version": vllm.__version__})
    except ImportError as e:
        done("vllm", {"importable": False, "why": str(e)[:200]})
    checks = {"loop": result["loop"]["passed"], "resume_bit_exact": result["loop"].get("resume_bit_exact", False),
              "bf16_vs_fp32": comparison["within_bf16_tolerance"],
              "generation_greedy_equal": result["generation"]["greedy_equal"],
              "logprob_paths_agree": result["logprob_paths"]["agree"]}
    done("checks", checks)
    print(json.dumps({k: result[k] for k in ("device", "checks", "mfu_bf16", "wall_s")}, indent=1))
    print(f"gpu_check: wrote {out}")
    return 0 if all(checks.values()) else 1


if __name__ == "__main__":
    from grpo_recipe.dist import liveness

    liveness.run_and_exit(main)  # no gloo/DeepSpeed teardown (see grpo_recipe.dist.liveness)
