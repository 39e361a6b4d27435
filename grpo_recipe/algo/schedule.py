"""The learning-rate schedule: constant, linear or cosine (to a minimum ratio), after a linear warmup.

The names mean what they mean in transformers (and so in TRL): `constant` has no warmup (transformers ignores
one; here a warmup with it is refused), `constant_with_warmup` has one.

The formulas are transformers' (`get_constant_schedule_with_warmup`, `get_linear_schedule_with_warmup`,
`get_cosine_with_min_lr_schedule_with_warmup`), so a TRL config's schedule means the same here: the factor of
optimizer step k (0-based) is `lr_factor(k, ...)`; the first warmup step therefore runs at 0.

DeepSpeed owns the scheduler (`deepspeed.initialize(lr_scheduler=...)`): it steps it once per optimizer step, at
the gradient-accumulation boundary, and saves and restores it with its checkpoint.
"""
from __future__ import annotations

import math


def warmup_steps(cfg) -> int:
    """Warmup length in optimizer steps: `warmup_steps`, or `warmup_ratio` of `max_steps` rounded up (as in HF)."""
    return cfg.warmup_steps if cfg.warmup_steps > 0 else math.ceil(cfg.warmup_ratio * cfg.max_steps)


def lr_factor(step: int, kind: str, total: int, warmup: int, min_ratio: float = 0.0) -> float:
    """The learning rate of 0-based optimizer step `step`, as a fraction of `learning_rate`."""
    if step < warmup:
        return step / max(1, warmup)
    if kind in ("constant", "constant_with_warmup"):
        return 1.0
    progress = (step - warmup) / max(1, total - warmup)
    if kind == "linear":
        return max(0.0, 1.0 - progress)
    if kind == "cosine":
        return max(0.0, min_ratio + (1.0 - min_ratio) * 0.5 * (1.0 + math.cos(math.pi * progress)))
    raise ValueError(f"lr_scheduler_type: unknown {kind!r}")


def lr_scheduler(cfg):
    """For `deepspeed.initialize(lr_scheduler=...)`: a callable that builds the LambdaLR on DeepSpeed's optimizer.

    The lambda is rebuilt from the config on resume (a plain function is not pickled: the checkpoint keeps only the
    scheduler's position), which is why a resume may not change `max_steps` when the schedule depends on it.
    """
    import torch

    warmup = warmup_steps(cfg)

    def factor(step: int) -> float:
        return lr_factor(step, cfg.lr_scheduler_type, cfg.max_steps, warmup, cfg.min_lr_ratio)

    return lambda optimizer: torch.optim.lr_scheduler.LambdaLR(optimizer, factor)


def depends_on_max_steps(cfg) -> bool:
    """Whether the learning rate of a step depends on `max_steps` (a decay's length, or a warmup ratio)."""
    return cfg.lr_scheduler_type in ("linear", "cosine") or (cfg.warmup_steps == 0 and cfg.warmup_ratio > 0)
