"""Policy forwards and one gradient-accumulated optimizer step over micro-batches of a rollout."""
from __future__ import annotations

import torch
import torch.distributed as dist

from recipe.buffer import RolloutBuffer
from recipe.config import Config
from recipe.engine import device
from recipe.loss import SEQUENCE_LOSSES, policy_loss, token_logps, truncated_is_weights


def forward_logps(model, input_ids: torch.Tensor, attention_mask: torch.Tensor, completion_len: int,
                  temperature: float) -> torch.Tensor:
    """Per-token log-probs of the completion part under the sampling temperature.

    Position ids follow the attention mask, as in `generate`, so left padding does not shift them.
    """
    position_ids = (attention_mask.cumsum(-1) - 1).clamp(min=0)
    logits = model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                   use_cache=False).logits
    return token_logps(logits[:, -completion_len - 1:-1], input_ids[:, -completion_len:], temperature)


def _to_device(mb: dict) -> dict:
    dev = device()
    return {k: v.to(dev) for k, v in mb.items()}


@torch.no_grad()
def compute_old_logps(engine, buf: RolloutBuffer, cfg: Config) -> int:
    """No-grad forwards for the samples whose old log-probs cannot be captured for free.

    Those are the samples of the first pass's later optimizer steps (steps_per_generation > 1): by then the
    policy has moved. Returns the number of micro-batch forwards spent.
    """
    steps = buf.schedule(0, cfg.steps_per_generation, cfg.per_device_train_batch_size)
    forwards = 0
    for mbs in steps[1:]:
        for idx in mbs:
            mb = _to_device(buf.micro_batch(idx))
            logp = forward_logps(engine, mb["input_ids"], mb["attention_mask"], mb["completion_mask"].shape[1],
                                 cfg.temperature)
            buf.store_old_logps(idx, logp)
            forwards += 1
    return forwards


def normalizers(buf: RolloutBuffer, cfg: Config, world_size: int) -> torch.Tensor:
    """Per [pass, step]: the loss normalizer (units in the whole step over all ranks / world size).

    Token-level losses need the global token count, known at rollout time: one all-reduce per rollout.
    """
    passes, steps, mbs = cfg.num_iterations, cfg.steps_per_generation, cfg.per_device_train_batch_size
    if cfg.loss_type in SEQUENCE_LOSSES:
        return torch.full((passes, steps), float(mbs * cfg.gradient_accumulation_steps))
    counts = buf.token_counts(passes, steps, mbs).to(device())
    if world_size > 1:
        dist.all_reduce(counts)
    counts = counts.cpu()
    if cfg.loss_type == "dapo":  # the rollout's mean tokens per step, the same for every step
        counts = counts.sum(dim=1, keepdim=True).expand(passes, steps) / steps
    return counts.clamp(min=1.0) / world_size


def train_step(engine, ref, buf: RolloutBuffer, micro_batches: list[torch.Tensor], normalizer: float,
               cfg: Config, capture_old_logps: bool) -> dict:
    """Backward over each micro-batch, then one optimizer step. Returns step statistics over all ranks."""
    # loss, clip low/high/region/tokens, kl sum, ratio sum, approx-kl sum, IS ratio sum
    acc = torch.zeros(9, device=device())
    is_max = torch.zeros(1, device=device())
    cap = cfg.vllm_importance_sampling_cap
    for idx in micro_batches:
        mb = _to_device(buf.micro_batch(idx))
        mask, c_len = mb["completion_mask"], mb["completion_mask"].shape[1]
        logp = forward_logps(engine, mb["input_ids"], mb["attention_mask"], c_len, cfg.temperature)
        # Samples the policy has not been updated on yet: their old log-probs are this very forward.
        fresh = ~mb["has_old_logps"]
        old = torch.where(fresh.unsqueeze(-1), logp.detach(), mb["old_logps"])
        if capture_old_logps and bool(fresh.any()):
            buf.store_old_logps(idx[fresh.cpu()], logp[fresh])
        ref_logp = None
        if cfg.beta > 0.0:
            with torch.no_grad():
                ref_logp = forward_logps(ref, mb["input_ids"], mb["attention_mask"], c_len, cfg.temperature)
        is_weights = None
        if cap is not None:  # the sampler's drift from the old policy, corrected per token
            is_weights, is_ratio = truncated_is_weights(old, mb["sampling_logps"], mask, cap)
            acc[8] += (is_ratio * mask).sum()
            is_max = torch.maximum(is_max, (is_ratio * mask).max().reshape(1))
        loss, stats = policy_loss(logp, old, mb["advantages"], mask, loss_type=cfg.loss_type,
                                  eps_low=cfg.epsilon, eps_high=cfg.eps_high, normalizer=normalizer,
                                  max_completion_length=cfg.max_completion_length, beta=cfg.beta,
                                  ref_logp=ref_logp, is_weights=is_weights)
        engine.backward(loss, scale_wrt_gas=False)  # the normalizer already accounts for accumulation
        engine.step()
        acc[0] += loss.detach()
        acc[1:5] += stats["clip_counts"]
        acc[5] += stats.get("kl_sum", 0.0)
        acc[6] += stats["ratio_sum"]
        acc[7] += stats["approx_kl_sum"]
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(acc)
        if cap is not None:
            dist.all_reduce(is_max, op=dist.ReduceOp.MAX)
    world = dist.get_world_size() if dist.is_initialized() else 1
    tokens = acc[4].clamp(min=1.0)
    out = {"loss": (acc[0] / world).item(), "clip_ratio_low": (acc[1] / tokens).item(),
           "clip_ratio_high": (acc[2] / tokens).item(), "clip_ratio_region": (acc[3] / tokens).item(),
           "ratio_mean": (acc[6] / tokens).item(), "approx_kl": (acc[7] / tokens).item(),
           "train_tokens": int(acc[4].item())}
    if cfg.beta > 0.0:
        out["kl"] = (acc[5] / tokens).item()
    if cap is not None:  # before the cap: how far the sampler drifted from the trainer
        out["is_ratio_mean"], out["is_ratio_max"] = (acc[8] / tokens).item(), is_max.item()
    grad_norm = engine.get_global_grad_norm()
    if grad_norm is not None:
        out["grad_norm"] = float(grad_norm)
    return out
