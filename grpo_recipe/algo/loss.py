"""GRPO loss math as pure functions of tensors (no DeepSpeed, no config objects).

Normalization contract (what makes a rollout's update independent of how it is split):
`reduce_loss` returns sum(units in this micro-batch) / normalizer, with `normalizer` from `loss_normalizers`
= (units in the whole optimizer step, all ranks) / world_size. DeepSpeed then sums micro-batches
(backward with scale_wrt_gas=False) and averages ranks, which gives sum(all units) / all units.
This module is the one place that knows each loss type's unit and denominator.
"""
from __future__ import annotations

import torch

SEQUENCE_LOSSES = ("grpo", "dr_grpo")  # a unit is a sequence; step_token_mean and dapo count tokens


LOGPS_CHUNK_ELEMENTS = 1 << 24  # fp32 elements of logits handled at once (64 MiB)


def token_logps(logits: torch.Tensor, ids: torch.Tensor, temperature: float = 1.0, own_logits: bool = False,
                with_entropy: bool = False) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """fp32 log softmax(logits / T)[ids] per token: [B, C] from logits [B, L >= C, V] (position t predicts
    ids[:, t]; positions from C on are ignored and get no gradient).

    No fp32 copy of the whole [B, C, V] logits is made, forward or backward: both go a chunk of positions at
    a time (a custom autograd function that keeps only the logits, in their own dtype, and the per-token
    log-normalizers). The gradient goes into one tensor shaped like the logits; with `own_logits` (the caller
    has no other use for them) into the logits' own memory, which the backward then overwrites.
    `with_entropy` also returns each position's entropy of softmax(logits / T) (no gradient): a metric the
    training forward's logits give for one more read.
    """
    logps = _SelectiveLogSoftmax.apply(logits, ids, temperature, own_logits)
    if not with_entropy:
        return logps
    return logps, token_entropy(logits.detach(), ids.shape[1], temperature)


@torch.no_grad()
def token_entropy(logits: torch.Tensor, length: int, temperature: float = 1.0) -> torch.Tensor:
    """H = lse - sum(p * x), p = softmax(x), x = logits / T, at the first `length` positions, chunk by chunk."""
    out = torch.empty(logits.shape[0], length, dtype=torch.float32, device=logits.device)
    for b, s, e in _chunks(logits, length):
        x = logits[b, s:e].float() / temperature
        z = torch.logsumexp(x, dim=-1, keepdim=True)
        out[b, s:e] = (z - (torch.exp(x - z) * x).sum(-1, keepdim=True)).squeeze(-1)
    return out


def _chunks(logits: torch.Tensor, length: int):
    """(row, start, end) covering the first `length` positions of each row, about LOGPS_CHUNK_ELEMENTS each."""
    step = max(1, LOGPS_CHUNK_ELEMENTS // logits.shape[-1])
    for b in range(logits.shape[0]):
        for s in range(0, length, step):
            yield b, s, min(s + step, length)


class _SelectiveLogSoftmax(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, ids, temperature, own_logits):
        out = torch.empty(ids.shape, dtype=torch.float32, device=logits.device)
        lse = torch.empty_like(out)
        for b, s, e in _chunks(logits, ids.shape[1]):
            x = logits[b, s:e].float() / temperature
            lse[b, s:e] = torch.logsumexp(x, dim=-1)
            out[b, s:e] = x.gather(-1, ids[b, s:e].unsqueeze(-1)).squeeze(-1) - lse[b, s:e]
        ctx.save_for_backward(logits, ids, lse)
        ctx.temperature, ctx.own_logits = temperature, own_logits
        return out

    @staticmethod
    def backward(ctx, grad_out):
        logits, ids, lse = ctx.saved_tensors
        t = ctx.temperature
        grad = logits if ctx.own_logits else torch.empty_like(logits)
        for b, s, e in _chunks(logits, ids.shape[1]):
            g = grad_out[b, s:e].float().unsqueeze(-1)
            # d logp[id] / d x = onehot(id) - softmax(x), and x = logits / T
            x = torch.exp(logits[b, s:e].float() / t - lse[b, s:e].unsqueeze(-1)).mul_(-g)
            x.scatter_add_(-1, ids[b, s:e].unsqueeze(-1), g)
            grad[b, s:e] = x.div_(t)  # chunk by chunk, so each chunk is read before it is overwritten
        grad[:, ids.shape[1]:] = 0
        return grad, None, None, None


def zero_std_groups(rewards: torch.Tensor, group_size: int) -> torch.Tensor:
    """Per group: True when all its rewards are equal (its advantages are 0: it teaches nothing)."""
    grouped = rewards.view(-1, group_size)
    return (grouped == grouped[:, :1]).all(dim=1)


STD_EPS = 1e-4  # TRL's: advantages = centered / (std + 1e-4), so runs compare side by side


def group_advantages(rewards: torch.Tensor, group_size: int, scale: str = "group",
                     batch_std: float | None = None) -> torch.Tensor:
    """(r - group mean) / (std + 1e-4), std over the group, the whole batch, or not at all (TRL's formula).

    `batch` needs `batch_std`, the std of the whole batch over all ranks: a rank's own std would make the
    update depend on how many ranks share the batch. Groups whose rewards are all equal get advantage 0.
    """
    grouped = rewards.view(-1, group_size)
    centered = grouped - grouped.mean(dim=1, keepdim=True)
    if scale == "group":
        std = grouped.std(dim=1, keepdim=True)
    elif scale == "batch":
        if batch_std is None:
            raise ValueError("scale_rewards 'batch' needs batch_std, the std of the whole batch over all ranks")
        std = torch.full_like(grouped[:, :1], float(batch_std))
    elif scale == "none":
        return centered.flatten()
    else:
        raise ValueError(f"scale_rewards: unknown {scale!r}")
    return (centered / (std + STD_EPS)).flatten()


def clipped_surrogate(logp: torch.Tensor, old_logp: torch.Tensor, advantages: torch.Tensor,
                      eps_low: float, eps_high: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token -min(r A, clip(r, 1-eps_low, 1+eps_high) A), and the ratio r = exp(logp - old_logp)."""
    coef_1 = torch.exp(logp - old_logp)
    coef_2 = torch.clamp(coef_1, 1.0 - eps_low, 1.0 + eps_high)
    adv = advantages.unsqueeze(-1)
    return -torch.min(coef_1 * adv, coef_2 * adv), coef_1


def k3_kl(logp: torch.Tensor, ref_logp: torch.Tensor) -> torch.Tensor:
    """Schulman's k3 estimator of KL(pi || ref), per token: exp(ref - logp) - (ref - logp) - 1 >= 0."""
    d = ref_logp - logp
    return torch.exp(d) - d - 1.0


def reduce_loss(per_token: torch.Tensor, mask: torch.Tensor, loss_type: str, normalizer: float,
                max_completion_length: int) -> torch.Tensor:
    """Sum this micro-batch's loss units and divide by `normalizer` (see the module docstring).

    grpo: unit = a sequence's mean token loss; dr_grpo: a sequence's token-loss sum / max_completion_length;
    step_token_mean and dapo: unit = a token (they differ only in the normalizer the caller passes).
    """
    masked = per_token * mask
    if loss_type == "grpo":
        units = masked.sum(-1) / mask.sum(-1).clamp(min=1.0)
    elif loss_type == "dr_grpo":
        units = masked.sum(-1) / max_completion_length
    elif loss_type in ("step_token_mean", "dapo"):
        units = masked
    else:
        raise ValueError(f"loss_type: unknown {loss_type!r}")
    return units.sum() / normalizer


def loss_normalizers(loss_type: str, step_tokens: torch.Tensor, step_sequences: torch.Tensor,
                     world_size: int) -> torch.Tensor:
    """Per [pass, optimizer step]: `reduce_loss`'s normalizer, units in the whole step over all ranks / world_size.

    `step_tokens`, `step_sequences` [passes, steps]: active completion tokens and trained sequences of each step,
    summed over all ranks (known at rollout time; ranks may differ when zero_std_filter leaves groups out).
    grpo, dr_grpo: the step's sequences; step_token_mean: the step's tokens; dapo: the rollout's mean tokens per step,
    the same for every step of a pass.
    """
    passes, steps = step_tokens.shape
    if loss_type in SEQUENCE_LOSSES:
        return step_sequences.float().clamp(min=1.0) / world_size
    if loss_type == "dapo":
        step_tokens = step_tokens.sum(dim=1, keepdim=True).expand(passes, steps) / steps
    elif loss_type != "step_token_mean":
        raise ValueError(f"loss_type: unknown {loss_type!r}")
    return step_tokens.clamp(min=1.0) / world_size


def clip_counts(coef_1: torch.Tensor, advantages: torch.Tensor, mask: torch.Tensor,
                eps_low: float, eps_high: float) -> torch.Tensor:
    """Token counts [low, high, region, total] where clipping removed the gradient.

    low: A < 0 and r < 1 - eps_low; high: A > 0 and r > 1 + eps_high; region: r outside the interval.
    """
    adv = advantages.unsqueeze(-1)
    below, above = coef_1 < 1.0 - eps_low, coef_1 > 1.0 + eps_high
    m = mask.bool()
    return torch.stack([((below & (adv < 0)) & m).sum(), ((above & (adv > 0)) & m).sum(),
                        ((below | above) & m).sum(), m.sum()]).float()


def truncated_is_weights(old_logp: torch.Tensor, sampling_logp: torch.Tensor, mask: torch.Tensor,
                         cap: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Truncated importance sampling of the sampler's drift: min(exp(old_logp - sampling_logp), cap).

    The sampler (vLLM) drew the tokens from slightly different probabilities than the trainer's old policy
    computes; weighting each token's surrogate by that ratio keeps the gradient on-policy, and the cap bounds
    its variance. Returns (weights, raw ratios); both are 1 outside the mask (no padding can leak NaN/inf).
    """
    m = mask.bool()
    ratio = torch.where(m, torch.exp(old_logp - sampling_logp.nan_to_num(0.0)), torch.ones_like(old_logp))
    return ratio.clamp(max=cap).detach(), ratio.detach()


def policy_loss(logp: torch.Tensor, old_logp: torch.Tensor, advantages: torch.Tensor, mask: torch.Tensor, *,
                loss_type: str, eps_low: float, eps_high: float, normalizer: float, max_completion_length: int,
                beta: float = 0.0, ref_logp: torch.Tensor | None = None,
                is_weights: torch.Tensor | None = None) -> tuple[torch.Tensor, dict]:
    """The GRPO loss of one micro-batch, and detached statistics for logging.

    `is_weights` (per token, see `truncated_is_weights`) multiply the clipped surrogate, not the KL term.
    """
    per_token, coef_1 = clipped_surrogate(logp, old_logp, advantages, eps_low, eps_high)
    ratio, log_ratio = coef_1.detach(), logp.detach() - old_logp
    # k3 estimate of KL(old || current) from the same ratios: r - 1 - log r (>= 0, no extra forward)
    stats = {"clip_counts": clip_counts(ratio, advantages, mask, eps_low, eps_high),
             "ratio_sum": (ratio * mask).sum(), "approx_kl_sum": ((ratio - 1.0 - log_ratio) * mask).sum()}
    if is_weights is not None:
        per_token = per_token * is_weights
    if beta > 0.0:
        kl = k3_kl(logp, ref_logp)
        per_token = per_token + beta * kl
        stats["kl_sum"] = (kl.detach() * mask).sum()
    loss = reduce_loss(per_token, mask, loss_type, normalizer, max_completion_length)
    return loss, stats
