"""The DeepSpeed JSON config of a run: the deepspeed_config file with every batch, precision and optimizer field
filled from the recipe's config (one source of truth for each)."""
from __future__ import annotations

import json

import torch

from grpo_recipe.config.schema import Config, resolve_path
from grpo_recipe.dist.group import bf16_capable


def use_bf16(cfg: Config) -> bool:
    """bf16: auto is bf16 where this rank's GPU computes it natively, fp32 elsewhere (CPU, pre-Ampere GPUs)."""
    mode = str(cfg.bf16).lower()
    return bf16_capable() if mode == "auto" else mode == "true"


def ds_config(cfg: Config, world_size: int, hidden_size: int, train: bool = True) -> dict:
    """The JSON config with every batch, precision and optimizer field filled from the recipe's config."""
    conf = json.loads(resolve_path(cfg.deepspeed_config).read_text())
    conf["train_micro_batch_size_per_gpu"] = cfg.per_device_train_batch_size
    conf["gradient_accumulation_steps"] = cfg.gradient_accumulation_steps
    conf["train_batch_size"] = cfg.per_device_train_batch_size * cfg.gradient_accumulation_steps * world_size
    conf["gradient_clipping"] = cfg.max_grad_norm
    bf16 = use_bf16(cfg)
    conf["bf16"] = {**conf.get("bf16", {}), "enabled": bf16}
    conf["fp16"] = {**conf.get("fp16", {}), "enabled": False}
    zero = conf.setdefault("zero_optimization", {})
    # accelerate's sizes (hidden^2 buckets) where they are large; at least 2M elements per bucket, so a small
    # model's gradients and gathers are a few collectives, not one per layer (gloo: about 1.5 ms per call).
    bucket = max(1 << 21, hidden_size * hidden_size)
    # Parameters kept gathered between uses: ten buckets, not DeepSpeed's 1e9, which keeps a whole model under 1B
    # parameters gathered from a micro-batch's forward to its backward (+1.0x the model per rank at 0.5B).
    live = 10 * bucket
    auto = {"stage3_param_persistence_threshold": 10 * hidden_size, "stage3_prefetch_bucket_size": bucket,
            "reduce_bucket_size": bucket, "stage3_max_live_parameters": live, "stage3_max_reuse_distance": live,
            "allgather_bucket_size": hidden_size * hidden_size}  # ZeRO-2
    for key, value in auto.items():
        if zero.get(key) == "auto":
            zero[key] = value
    opt = conf.get("optimizer")
    if opt is not None:
        fill = {"lr": cfg.learning_rate, "betas": [cfg.adam_beta1, cfg.adam_beta2], "eps": cfg.adam_epsilon,
                "weight_decay": cfg.weight_decay}
        opt["params"] = {k: fill.get(k, v) if v == "auto" else v for k, v in opt.get("params", {}).items()}
        for k, v in fill.items():
            opt["params"].setdefault(k, v)
        # DeepSpeed's FusedAdam and CPUAdam are compiled at the first run (nvcc and CUDA_HOME on GPUs, every rank
        # racing for torch's extension lock; about a minute on CPU). torch's fused AdamW is as exact and compiles
        # nothing, on CUDA and CPU (an offloaded optimizer too); a config that names torch_adam keeps its choice.
        if opt.get("type", "").lower() in ("adam", "adamw") and "torch_adam" not in opt["params"]:
            opt["params"]["torch_adam"] = True
            opt["params"].setdefault("fused", True)  # no temporaries the size of the partition (foreach: several)
    if not train:
        for key in ("optimizer", "scheduler"):
            conf.pop(key, None)
        zero.pop("offload_optimizer", None)
        # ZeRO-1/2 shard optimizer state only and refuse a model without an optimizer: a frozen
        # reference model is then simply replicated (stage 0), as the policy's weights are.
        if zero.get("stage", 0) < 3:
            zero["stage"] = 0
    conf.setdefault("steps_per_print", 10**9)
    conf.setdefault("wall_clock_breakdown", False)
    return conf
