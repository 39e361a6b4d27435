"""Optimizer-state memory per rank: LoRA vs full fine-tuning of the same model under ZeRO-3.

    python bench/lora_memory.py [--nproc 2] [--models tiny,bigger] [--out bench/results/lora_memory.json]

For each model and mode, a fresh `torchrun --nproc_per_node N` builds the recipe's engine (engine.init_engine,
with grpo_recipe.model.lora.wrap for LoRA), runs one optimizer step so that Adam's state exists, and each rank reports the
bytes of the tensors the DeepSpeed ZeRO-3 optimizer really holds: Adam moments, a separate fp32 master copy (none
in fp32 training), the gradient partition buffer, and its parameter shards; plus the process's peak RSS.
Models: `tiny` is builtin:tiny-qwen2 (hidden 128, 2 layers); `bigger` is a Qwen2 of hidden 1024, 8 layers
(about 94M parameters, random weights, same tokenizer vocabulary).
"""
from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))  # run from bench/ as well
BIGGER = dict(hidden_size=1024, intermediate_size=2816, num_hidden_layers=8, num_attention_heads=16,
              num_key_value_heads=8)
LORA = dict(lora_r=16, lora_alpha=32)


def tensor_bytes(tensors) -> int:
    seen, total = set(), 0
    for t in tensors:
        if t is None or not hasattr(t, "untyped_storage") or t.data_ptr() in seen:
            continue
        seen.add(t.data_ptr())
        total += t.numel() * t.element_size()
    return total


def build_model(name: str, cfg):
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from grpo_recipe.model import lora
    from grpo_recipe.model.load import load_model
    from grpo_recipe.model.source import model_path

    path = model_path(cfg)
    if name == "tiny":
        return load_model(path, cfg)
    tiny = AutoConfig.from_pretrained(path)  # the tiny one's vocabulary and special tokens, bigger shapes
    config = type(tiny)(vocab_size=tiny.vocab_size, eos_token_id=tiny.eos_token_id, bos_token_id=tiny.bos_token_id,
                        pad_token_id=tiny.pad_token_id, tie_word_embeddings=tiny.tie_word_embeddings,
                        max_position_embeddings=tiny.max_position_embeddings, **BIGGER)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    return lora.wrap(model, cfg) if cfg.use_peft else model


def worker(model_name: str, mode: str, out: str) -> None:
    import torch
    import torch.distributed as dist

    from grpo_recipe.config.schema import Config
    from grpo_recipe.dist.group import init_distributed
    from grpo_recipe.model import engine as eng

    rank, world = init_distributed()
    cfg = Config(use_peft=mode == "lora", learning_rate=1e-4, per_device_train_batch_size=2, num_iterations=1,
                 **(LORA if mode == "lora" else {}))
    model = build_model(model_name, cfg)
    total = sum(p.numel() for p in model.parameters())
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    engine = eng.init_engine(model, cfg, world)
    ids = torch.randint(1, 500, (2, 32), generator=torch.Generator().manual_seed(rank))
    loss = engine(input_ids=ids, use_cache=False).logits.float().logsumexp(-1).mean()
    engine.backward(loss)
    engine.step()
    opt = engine.optimizer
    state = [v for s in opt.optimizer.state.values() for v in s.values() if torch.is_tensor(v)]
    params = {p.data_ptr() for p in opt.fp16_partitioned_groups_flat}
    masters = [t for t in opt.fp32_partitioned_groups_flat if t.data_ptr() not in params]
    row = {"rank": rank, "params_total": total, "params_trainable": trainable,
           "adam_state_bytes": tensor_bytes(state), "fp32_master_copy_bytes": tensor_bytes(masters),
           "grad_partition_bytes": tensor_bytes([opt.grad_partitions_flat_buffer]),
           "param_shard_bytes": tensor_bytes(p.ds_tensor for p in engine.module.parameters()),
           "peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024}
    row["optimizer_state_bytes"] = row["adam_state_bytes"] + row["fp32_master_copy_bytes"]
    rows = [None] * world
    dist.all_gather_object(rows, row)
    if rank == 0:
        Path(out).write_text(json.dumps(rows))
    dist.barrier()


def run(model_name: str, mode: str, nproc: int) -> list[dict]:
    from grpo_recipe.dist.env import rank_env, torchrun

    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "rows.json"
        env = rank_env(os.environ.get("DS_ACCELERATOR", "cpu"))  # CPU ranks unless told otherwise
        cmd = torchrun(nproc, [__file__, "--worker", model_name, mode, str(out)])
        proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True)
        if proc.returncode != 0:
            raise SystemExit(f"{model_name}/{mode} failed:\n{proc.stderr[-4000:]}")
        return json.loads(out.read_text())


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "--worker":
        from grpo_recipe.dist import liveness

        return liveness.run_and_exit(lambda: worker(*sys.argv[2:5]))  # no gloo/DeepSpeed teardown
    sys.path.insert(0, str(REPO / "bench"))
    from common import save_json  # first: it notes the code this run starts from

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--nproc", type=int, default=2, help="ranks (CPU processes or GPUs)")
    ap.add_argument("--models", default="tiny,bigger", help="comma-separated: tiny, bigger")
    ap.add_argument("--out", default=str(REPO / "bench/results/lora_memory.json"))
    args = ap.parse_args()
    results = {"nproc": args.nproc, "lora": LORA, "bigger_config": BIGGER, "models": {}}
    for name in args.models.split(","):
        per_mode = {mode: run(name, mode, args.nproc) for mode in ("full", "lora")}
        full, lora = per_mode["full"][0], per_mode["lora"][0]
        ratio = {k: lora[k] / full[k] for k in ("optimizer_state_bytes", "adam_state_bytes", "grad_partition_bytes",
                                                "peak_rss_bytes") if full[k]}
        results["models"][name] = {**per_mode, "lora_over_full_rank0": ratio}
        mib = 1 << 20
        print(f"{name}: params {full['params_total']:,}, trainable full {full['params_trainable']:,} / "
              f"lora {lora['params_trainable']:,}")
        for r_full, r_lora in zip(per_mode["full"], per_mode["lora"]):
            print(f"  rank {r_full['rank']}: optimizer state {r_full['optimizer_state_bytes'] / mib:8.2f} MiB full, "
                  f"{r_lora['optimizer_state_bytes'] / mib:7.3f} MiB lora "
                  f"(x{r_lora['optimizer_state_bytes'] / r_full['optimizer_state_bytes']:.4f}); grads "
                  f"{r_full['grad_partition_bytes'] / mib:.2f} vs {r_lora['grad_partition_bytes'] / mib:.3f} MiB; "
                  f"peak RSS {r_full['peak_rss_bytes'] / mib:.0f} vs {r_lora['peak_rss_bytes'] / mib:.0f} MiB")
    save_json(Path(args.out).resolve(), results)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
