"""GRPO loss math as pure functions of tensors (no DeepSpeed, no config objects).

Normalization contract (what makes a rollout's update independent of how it is split):
`reduce_loss` returns sum(units in this micro-batch) / normalizer, with `normalizer` from `loss_normalizers`
= (units in the whole optimizer step, all ranks) / world_size. DeepSpeed then sums micro-batches
(backward with scale_wrt_gas=False) and averages ranks, which gives sum(all units) / all units.
This module is the one place that knows each loss type's unit, denominator and surrogate, and each
importance-sampling mode: the loop hands it a `LossSpec` (data) and never branches on them.
"""
from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass

import torch

# a unit is a sequence; step_token_mean, dapo, cispo and vespo count tokens
SEQUENCE_LOSSES = ("grpo", "dr_grpo", "sapo", "luspo")
CLIPPED_LOSSES = ("grpo", "step_token_mean", "dr_grpo", "dapo", "luspo")  # PPO's clipped -min(r A, clip(r) A)


LOGPS_CHUNK_ELEMENTS = 1 << 20  # fp32 elements of logits handled at once (4 MiB: a chunk's temporaries stay in cache)
# On a GPU a chunk is a few kernels whatever its size: 4 MiB would be ~7 positions of a 152k vocabulary, thousands
# of launches per micro-batch. 256 MiB (about 440 such positions) keeps the launches few and the temporaries
# (a few times the chunk) far below what the gathered model and activations take.
GPU_CHUNK_ELEMENTS = 1 << 26


def chunk_elements(device: torch.device, cpu: int) -> int:
    """Logits elements a chunk handles at once on `device` (`cpu`: the CPU's figure, cache-sized)."""
    return GPU_CHUNK_ELEMENTS if device.type == "cuda" else cpu


@contextlib.contextmanager
def tf32_matmuls(enabled: bool):
    """fp32 matmuls at TF32 meanwhile (CUDA; nothing changes on CPU). For the fp32 gradient sums of a bf16 or fp16
    head: TF32 keeps 10 mantissa bits, more than the weights' own 8 (bf16), at the tensor cores' speed rather
    than fp32's (about 8x on an H100)."""
    if not enabled:
        yield
        return
    before = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = True
    try:
        yield
    finally:
        torch.backends.cuda.matmul.allow_tf32 = before


def token_logps(logits: torch.Tensor, ids: torch.Tensor, temperature: float = 1.0, own_logits: bool = False,
                with_entropy: bool = False, entropy_grad: bool = False
                ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """fp32 log softmax(logits / T)[ids] per token: [B, C] from logits [B, L >= C, V] (position t predicts
    ids[:, t]; positions from C on are ignored and get no gradient).

    No fp32 copy of the whole [B, C, V] logits is made, forward or backward: both go a chunk of positions at
    a time (a custom autograd function that keeps only the logits, in their own dtype, and the per-token
    log-normalizers). The gradient goes into one tensor shaped like the logits; with `own_logits` (the caller
    has no other use for them) into the logits' own memory, which the backward then overwrites.
    `with_entropy` also returns each position's entropy of softmax(logits / T) from the same logits: a metric
    (no gradient), or with `entropy_grad` a term of the loss (an entropy bonus), differentiated in the same
    chunked backward.
    """
    if with_entropy and entropy_grad:
        return _SelectiveLogSoftmax.apply(logits, ids, temperature, own_logits, True)
    logps = _SelectiveLogSoftmax.apply(logits, ids, temperature, own_logits, False)
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
    step = max(1, chunk_elements(logits.device, LOGPS_CHUNK_ELEMENTS) // logits.shape[-1])
    for b in range(logits.shape[0]):
        for s in range(0, length, step):
            yield b, s, min(s + step, length)


def _chunk_logps(x: torch.Tensor, ids: torch.Tensor, entropy: bool):
    """One chunk of x = logits / T (fp32): its log-normalizers, log softmax(x)[ids], and H = lse - E_p[x]."""
    lse = torch.logsumexp(x, dim=-1)
    logp = x.gather(-1, ids.unsqueeze(-1)).squeeze(-1) - lse
    return lse, logp, lse - (torch.exp(x - lse.unsqueeze(-1)) * x).sum(-1) if entropy else None


def _logits_grad(x: torch.Tensor, lse: torch.Tensor, ids: torch.Tensor, g: torch.Tensor, t: float,
                 h: torch.Tensor | None) -> torch.Tensor:
    """The gradient on one chunk's logits of g * logp[ids] (+ h * H), x = logits / T in fp32 (overwritten)."""
    g = g.float().unsqueeze(-1)
    p = torch.exp(x - lse.unsqueeze(-1))
    # d H / d x = -p (x - E_p[x]); computed before p is reused below
    dx = p * (x - (p * x).sum(-1, keepdim=True)) * -h.float().unsqueeze(-1) if h is not None else None
    x = p.mul_(-g)  # d logp[id] / d x = onehot(id) - softmax(x), and x = logits / T
    x.scatter_add_(-1, ids.unsqueeze(-1), g)
    if dx is not None:
        x.add_(dx)
    return x.div_(t)


class _SelectiveLogSoftmax(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, ids, temperature, own_logits, entropy):
        out = torch.empty(ids.shape, dtype=torch.float32, device=logits.device)
        lse = torch.empty_like(out)
        ent = torch.empty_like(out) if entropy else None
        for b, s, e in _chunks(logits, ids.shape[1]):
            lse[b, s:e], out[b, s:e], h = _chunk_logps(logits[b, s:e].float() / temperature, ids[b, s:e], entropy)
            if entropy:
                ent[b, s:e] = h
        ctx.save_for_backward(logits, ids, lse)
        ctx.temperature, ctx.own_logits, ctx.entropy = temperature, own_logits, entropy
        return (out, ent) if entropy else out

    @staticmethod
    def backward(ctx, grad_out, grad_ent=None):
        logits, ids, lse = ctx.saved_tensors
        t = ctx.temperature
        grad = logits if ctx.own_logits else torch.empty_like(logits)
        if grad_out is None:
            grad_out = torch.zeros_like(lse)
        for b, s, e in _chunks(logits, ids.shape[1]):
            h = grad_ent[b, s:e] if ctx.entropy and grad_ent is not None else None
            # chunk by chunk, so each chunk is read before it is overwritten
            grad[b, s:e] = _logits_grad(logits[b, s:e].float() / t, lse[b, s:e], ids[b, s:e], grad_out[b, s:e], t, h)
        grad[:, ids.shape[1]:] = 0
        return grad, None, None, None, None


HEAD_CHUNK_ELEMENTS = 1 << 24  # fp32 logits a chunk of the fused head computes at once (64 MiB)


def head_token_logps(hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, ids: torch.Tensor,
                     temperature: float = 1.0, with_entropy: bool = False, entropy_grad: bool = False,
                     deferred: dict | None = None):
    """`token_logps` of the logits `hidden @ weight.T + bias`, without those logits: hidden [B, L >= C, H] (position
    t predicts ids[:, t]), weight [V, H]. A chunk of positions at a time goes through the output head and the log
    softmax, forward and again in the backward (one more matmul of the head), so no [B, C, V] tensor, logits or
    their gradient, exists at once. Returns what `token_logps` returns, to float rounding.

    `deferred` (a head tied to the input embedding, looked up through `tied_embedding` with the same dict): the
    weight's gradient is left there, in fp32, for the lookup's backward to add its rows to in place and return
    as the shared weight's one gradient. Returned here, autograd would hold it until the lookup's own [V, H]
    gradient arrives and then sum the two."""
    b, c = ids.shape
    rows = hidden[:, :c].reshape(b * c, hidden.shape[-1])
    out = _HeadLogSoftmax.apply(rows, weight, bias, ids.reshape(-1), temperature, with_entropy, entropy_grad,
                                deferred)
    if not with_entropy:
        return out[0].view(b, c)
    return out[0].view(b, c), out[1].view(b, c)


def _row_chunks(n: int, vocab: int, device: torch.device):
    step = max(1, chunk_elements(device, HEAD_CHUNK_ELEMENTS) // vocab)
    for s in range(0, n, step):
        yield s, min(s + step, n)


class _HeadLogSoftmax(torch.autograd.Function):
    @staticmethod
    def forward(ctx, rows, weight, bias, ids, temperature, entropy, entropy_grad, deferred):
        out = torch.empty(ids.shape, dtype=torch.float32, device=rows.device)
        lse = torch.empty_like(out)
        ent = torch.empty_like(out) if entropy else None
        for s, e in _row_chunks(rows.shape[0], weight.shape[0], rows.device):
            x = torch.nn.functional.linear(rows[s:e], weight, bias).float() / temperature
            lse[s:e], out[s:e], h = _chunk_logps(x, ids[s:e], entropy)
            if entropy:
                ent[s:e] = h
        ctx.save_for_backward(rows, weight, bias, ids, lse)
        ctx.temperature, ctx.entropy_grad, ctx.deferred = temperature, entropy and entropy_grad, deferred
        if not ctx.entropy_grad:
            ctx.mark_non_differentiable(*(t for t in (ent,) if t is not None))
        return out, ent

    @staticmethod
    def backward(ctx, grad_out, grad_ent=None):
        rows, weight, bias, ids, lse = ctx.saved_tensors
        t = ctx.temperature
        need_rows, need_w, need_b = ctx.needs_input_grad[:3]
        grad_rows = torch.empty_like(rows) if need_rows else None
        # fp32 sums over chunks (for a bf16 head, one rounding at the end, as a single matmul would do)
        grad_w = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device) if need_w else None
        grad_b = torch.zeros(bias.shape, dtype=torch.float32, device=bias.device) if need_b else None
        if grad_out is None:
            grad_out = torch.zeros_like(lse)
        for s, e in _row_chunks(rows.shape[0], weight.shape[0], rows.device):
            h = grad_ent[s:e] if ctx.entropy_grad and grad_ent is not None else None
            x = _logits_grad(torch.nn.functional.linear(rows[s:e], weight, bias).float() / t, lse[s:e], ids[s:e],
                             grad_out[s:e], t, h)
            if need_rows:
                grad_rows[s:e] = x.to(weight.dtype) @ weight
            if need_w:
                with tf32_matmuls(weight.dtype != torch.float32):
                    grad_w.addmm_(x.t(), rows[s:e].float())
            if need_b:
                grad_b += x.sum(0)
        if need_w and ctx.deferred is not None:
            ctx.deferred["grad"], grad_w = grad_w, None
        return (grad_rows, grad_w.to(weight.dtype) if grad_w is not None else None,
                grad_b.to(bias.dtype) if need_b else None, None, None, None, None, None)


def tied_embedding(ids: torch.Tensor, weight: torch.Tensor, padding_idx: int | None, deferred: dict) -> torch.Tensor:
    """F.embedding(ids, weight, padding_idx) whose backward adds its rows, in place, to the head's gradient that
    `head_token_logps` left in `deferred` (zeros when there is none) and returns the sum as the weight's."""
    return _TiedEmbedding.apply(ids, weight, padding_idx, deferred)


class _TiedEmbedding(torch.autograd.Function):
    @staticmethod
    def forward(ctx, ids, weight, padding_idx, deferred):
        ctx.save_for_backward(ids)
        ctx.padding_idx, ctx.deferred, ctx.shape, ctx.dtype = padding_idx, deferred, weight.shape, weight.dtype
        return torch.nn.functional.embedding(ids, weight, padding_idx)

    @staticmethod
    def backward(ctx, grad_out):
        (ids,) = ctx.saved_tensors
        grad = ctx.deferred.pop("grad", None)
        if grad is None:
            grad = torch.zeros(ctx.shape, dtype=torch.float32, device=grad_out.device)
        ids, rows = ids.reshape(-1), grad_out.reshape(-1, ctx.shape[1])
        if ctx.padding_idx is not None:  # the padding row gets no gradient from the lookup
            keep = ids != ctx.padding_idx
            ids, rows = ids[keep], rows[keep]
        grad.index_add_(0, ids, rows.to(grad.dtype))
        return None, grad.to(ctx.dtype), None, None


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


def normalized_sum(per_func: torch.Tensor, weights: torch.Tensor, group_size: int) -> torch.Tensor:
    """GDPO's reward per completion (`multi_objective_aggregation: normalize_then_sum`): each function's values
    [N, K] (NaN where it does not apply) centered and divided by (std + 1e-4) within each group, over the
    completions it applies to (sample std; 0 for one), then weighted and summed over the functions (NaN skipped)."""
    grouped = per_func.view(-1, group_size, per_func.shape[-1]).double()
    n = (~grouped.isnan()).sum(dim=1, keepdim=True)
    mean = grouped.nansum(dim=1, keepdim=True) / n.clamp(min=1)
    var = ((grouped - mean) ** 2).nansum(dim=1, keepdim=True) / (n - 1).clamp(min=1)
    z = (grouped - mean) / (var.sqrt() + STD_EPS)
    return (z * weights.double()).nansum(dim=-1).flatten().float()


def batch_normalized(values: torch.Tensor, mean: float, std: float) -> torch.Tensor:
    """(x - mean) / (std + 1e-4), with the mean and std of the whole batch over all ranks (GDPO's advantages)."""
    return (values - mean) / (std + STD_EPS)


@dataclass(frozen=True)
class LossSpec:
    """What the policy loss is, as data: the loss type and every option that shapes it (TRL's names)."""
    loss_type: str = "dapo"
    eps_low: float = 0.2
    eps_high: float = 0.2
    importance_sampling_level: str = "token"  # token: a ratio per token; sequence (GSPO): one per sequence
    delta: float | None = None  # two-sided clipping: r is also capped at delta (INTELLECT-2)
    sapo_temperature_pos: float = 1.0
    sapo_temperature_neg: float = 1.05
    off_policy_mask_threshold: float | None = None  # drop A < 0 sequences whose mean KL to the sampler exceeds it
    beta: float = 0.0
    use_bias_correction_kl: bool = False  # the k3 term times the ratio (unbiased reverse-KL gradient)
    entropy_coef: float = 0.0
    vespo_k_pos: float = 2.0  # vespo: the gamma weight's shape (k) and rate (lambda), by the advantage's sign
    vespo_lambda_pos: float = 3.0
    vespo_k_neg: float = 3.0
    vespo_lambda_neg: float = 2.0


def importance_ratio(logp: torch.Tensor, old_logp: torch.Tensor, mask: torch.Tensor, level: str) -> torch.Tensor:
    """exp(logp - old_logp) per token [B, C], or (sequence) exp of its masked mean per sequence [B, 1]."""
    log_ratio = logp - old_logp
    if level == "sequence":
        log_ratio = ((log_ratio * mask).sum(-1) / mask.sum(-1).clamp(min=1.0)).unsqueeze(-1)
    elif level != "token":
        raise ValueError(f"importance_sampling_level: unknown {level!r}")
    return torch.exp(log_ratio)


def surrogate(coef_1: torch.Tensor, logp: torch.Tensor, advantages: torch.Tensor, spec: LossSpec) -> torch.Tensor:
    """Per-token policy loss before masking and aggregation ([B, C], or [B, 1] for a sequence-level clipped or
    sapo loss: it broadcasts over the sequence's tokens).

    grpo, step_token_mean, dr_grpo, dapo: -min(r A, clip(r, 1 - eps_low, 1 + eps_high) A), r capped at `delta`
    when set; cispo: -sg(min(r, eps_high)) A logp (the ratio only weights the policy gradient); sapo:
    -sigmoid(t (r - 1)) 4 / t A, t the temperature of A's sign (a soft trust region)."""
    adv = advantages.unsqueeze(-1)
    if spec.loss_type in CLIPPED_LOSSES:
        coef_2 = torch.clamp(coef_1, 1.0 - spec.eps_low, 1.0 + spec.eps_high)
        if spec.delta is not None:
            coef_1 = torch.clamp(coef_1, max=spec.delta)
        return -torch.min(coef_1 * adv, coef_2 * adv)
    if spec.loss_type == "cispo":
        return -torch.clamp(coef_1, max=spec.eps_high).detach() * adv * logp
    if spec.loss_type == "sapo":
        t = torch.where(adv > 0, spec.sapo_temperature_pos, spec.sapo_temperature_neg)
        return -torch.sigmoid(t * (coef_1 - 1.0)) * 4.0 / t * adv
    raise ValueError(f"loss_type: unknown {spec.loss_type!r}")


LOG_1E_8 = math.log(1e-8)


@torch.no_grad()
def vespo_weights(log_ratio: torch.Tensor, mask: torch.Tensor, advantages: torch.Tensor,
                  is_weights: torch.Tensor | None, spec: LossSpec) -> torch.Tensor:
    """VESPO's sequence weight phi(w) = exp(lambda + k log w - lambda w) [B, 1] (phi(1) = 1), detached: w is the
    sequence's importance ratio, the sum of its clamped token log-ratios to the old policy plus, with a sampler
    correction, the log of its token weights to the sampler (clamped at log 1e-8); k and lambda by A's sign."""
    seq = (log_ratio.clamp(-20.0, 20.0) * mask).sum(-1, keepdim=True)
    if is_weights is not None:
        seq = seq + is_weights.log().clamp(LOG_1E_8, 20.0).sum(-1, keepdim=True)
    log_w = seq.clamp(LOG_1E_8, 20.0)
    pos = advantages.unsqueeze(-1) >= 0
    k = torch.where(pos, spec.vespo_k_pos, spec.vespo_k_neg)
    lam = torch.where(pos, spec.vespo_lambda_pos, spec.vespo_lambda_neg).clamp(min=1e-4)
    return torch.exp(lam + k * log_w - lam * torch.exp(log_w)).nan_to_num(nan=0.0, posinf=0.0, neginf=0.0)


def clipped_surrogate(logp: torch.Tensor, old_logp: torch.Tensor, advantages: torch.Tensor,
                      eps_low: float, eps_high: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token -min(r A, clip(r, 1-eps_low, 1+eps_high) A), and the ratio r = exp(logp - old_logp)."""
    coef_1 = torch.exp(logp - old_logp)
    return surrogate(coef_1, logp, advantages, LossSpec("dapo", eps_low, eps_high)), coef_1


def off_policy_mask(advantages: torch.Tensor, logp: torch.Tensor, sampling_logp: torch.Tensor, mask: torch.Tensor,
                    threshold: float) -> torch.Tensor:
    """DeepSeek-V3.2's off-policy sequence mask [B, 1]: keep a sequence when A >= 0 or its mean per-token KL
    (sampling_logp - logp, tokens without a sampling log-prob count 0) is at most `threshold`."""
    kl = torch.nan_to_num(sampling_logp - logp.detach(), nan=0.0)
    mean_kl = (kl * mask).sum(-1, keepdim=True) / mask.sum(-1, keepdim=True).clamp(min=1.0)
    return ((advantages.unsqueeze(-1) >= 0) | (mean_kl <= threshold)).to(mask.dtype)


def quantile(values: torch.Tensor, q: float) -> torch.Tensor:
    """torch.quantile's linear interpolation for a 1-D tensor of any size (torch.quantile stops at 2^24
    elements: fewer than the completion tokens of one large optimizer step over all ranks)."""
    v = values.float().sort().values
    rank = torch.tensor(q, dtype=v.dtype) * (v.numel() - 1)  # in the values' dtype, as torch.quantile computes it
    below = int(rank.floor().item())
    return torch.lerp(v[below], v[min(below + 1, v.numel() - 1)], rank - below)


def high_entropy_mask(entropy: torch.Tensor, mask: torch.Tensor, threshold: torch.Tensor | float) -> torch.Tensor:
    """[B, C] float mask of the completion tokens whose entropy is at least `threshold` (top_entropy_quantile:
    only these tokens carry the policy loss and the entropy bonus; "Beyond the 80/20 Rule")."""
    return ((entropy * mask >= threshold) & mask.bool()).to(mask.dtype)


def k3_kl(logp: torch.Tensor, ref_logp: torch.Tensor) -> torch.Tensor:
    """Schulman's k3 estimator of KL(pi || ref), per token: exp(ref - logp) - (ref - logp) - 1 >= 0."""
    d = ref_logp - logp
    return torch.exp(d) - d - 1.0


def reduce_loss(per_token: torch.Tensor, mask: torch.Tensor, loss_type: str, normalizer: float,
                max_completion_length: int) -> torch.Tensor:
    """Sum this micro-batch's loss units and divide by `normalizer` (see the module docstring).

    grpo, sapo: unit = a sequence's mean token loss; dr_grpo: a sequence's token-loss sum / max_completion_length;
    luspo: a sequence's token-loss sum; step_token_mean, dapo, cispo and vespo: unit = a token (they differ only in
    the normalizer the caller passes).
    """
    masked = per_token * mask
    if loss_type in ("grpo", "sapo"):
        units = masked.sum(-1) / mask.sum(-1).clamp(min=1.0)
    elif loss_type == "dr_grpo":
        units = masked.sum(-1) / max_completion_length
    elif loss_type == "luspo":
        units = masked.sum(-1)
    elif loss_type in ("step_token_mean", "dapo", "cispo", "vespo"):
        units = masked
    else:
        raise ValueError(f"loss_type: unknown {loss_type!r}")
    return units.sum() / normalizer


def loss_normalizers(loss_type: str, step_tokens: torch.Tensor, step_sequences: torch.Tensor,
                     world_size: int) -> torch.Tensor:
    """Per [pass, optimizer step]: `reduce_loss`'s normalizer, units in the whole step over all ranks / world_size.

    `step_tokens`, `step_sequences` [passes, steps]: active completion tokens and trained sequences of each step,
    summed over all ranks (known at rollout time; ranks may differ when zero_std_filter leaves groups out).
    grpo, dr_grpo, sapo, luspo: the step's sequences; step_token_mean: the step's tokens; dapo, cispo, vespo: the
    rollout's mean tokens per step, the same for every step of a pass.
    """
    passes, steps = step_tokens.shape
    if loss_type in SEQUENCE_LOSSES:
        return step_sequences.float().clamp(min=1.0) / world_size
    if loss_type in ("dapo", "cispo", "vespo"):
        step_tokens = step_tokens.sum(dim=1, keepdim=True).expand(passes, steps) / steps
    elif loss_type != "step_token_mean":
        raise ValueError(f"loss_type: unknown {loss_type!r}")
    return step_tokens.clamp(min=1.0) / world_size


def clip_counts(coef_1: torch.Tensor, advantages: torch.Tensor, mask: torch.Tensor, spec: LossSpec) -> torch.Tensor:
    """Token counts [low, high, region, total] where the loss cut the ratio's gradient.

    Clipped losses: low: A < 0 and r < 1 - eps_low; high: A > 0 and r > 1 + eps_high; region: r outside the
    interval. cispo: high and region where r > eps_high (its cap); sapo: none (no hard clip). A sequence-level
    ratio counts for each of its tokens.
    """
    adv = advantages.unsqueeze(-1)
    m = mask.bool()
    if spec.loss_type in CLIPPED_LOSSES:
        below, above = coef_1 < 1.0 - spec.eps_low, coef_1 > 1.0 + spec.eps_high
    elif spec.loss_type == "cispo":
        below, above = torch.zeros_like(coef_1, dtype=torch.bool), coef_1 > spec.eps_high
    else:
        below = above = torch.zeros_like(coef_1, dtype=torch.bool)
    below, above = below.expand_as(m), above.expand_as(m)
    return torch.stack([((below & (adv < 0)) & m).sum(), ((above & (adv > 0)) & m).sum(),
                        ((below | above) & m).sum(), m.sum()]).float()


def sampler_is_weights(old_logp: torch.Tensor, sampling_logp: torch.Tensor, mask: torch.Tensor, mode: str,
                       clip_min: float | None, clip_max: float | None) -> tuple[torch.Tensor, torch.Tensor]:
    """Importance weights of the sampler's drift (vLLM drew the tokens from slightly different probabilities than
    the trainer's old policy computes): exp(old_logp - sampling_logp), per token or (sequence_*) summed over a
    sequence's tokens into one weight; *_truncate clamps it to [clip_min, clip_max], *_mask sets it to 0 outside.
    Tokens without a sampling log-prob count as no drift. Returns (weights [B, C] or [B, 1], detached; the raw
    per-token ratios [B, C], 1 outside the mask, for metrics)."""
    diff = torch.nan_to_num((old_logp - sampling_logp) * mask, nan=0.0)
    token_ratio = torch.where(mask.bool(), torch.exp(diff), torch.ones_like(diff)).detach()
    level, _, constraint = mode.partition("_")
    if level not in ("token", "sequence") or constraint not in ("truncate", "mask"):
        raise ValueError(f"vllm_importance_sampling_mode: unknown {mode!r}")
    ratio = torch.exp(diff.sum(-1, keepdim=True)) if level == "sequence" else torch.exp(diff)
    lo = -float("inf") if clip_min is None else clip_min
    hi = float("inf") if clip_max is None else clip_max
    if constraint == "truncate":
        weights = ratio.clamp(min=lo, max=hi)
    else:
        weights = ratio.masked_fill((ratio < lo) | (ratio > hi), 0.0)
    return weights.detach(), token_ratio


def truncated_is_weights(old_logp: torch.Tensor, sampling_logp: torch.Tensor, mask: torch.Tensor,
                         cap: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token truncated importance sampling, min(exp(old_logp - sampling_logp), cap): `token_truncate`."""
    weights, ratio = sampler_is_weights(old_logp, sampling_logp, mask, "token_truncate", None, cap)
    return torch.where(mask.bool(), weights, torch.ones_like(weights)), ratio


def policy_loss(logp: torch.Tensor, old_logp: torch.Tensor, advantages: torch.Tensor, mask: torch.Tensor, *,
                normalizer: float, max_completion_length: int, spec: LossSpec | None = None,
                loss_type: str | None = None, eps_low: float = 0.2, eps_high: float = 0.2, beta: float = 0.0,
                ref_logp: torch.Tensor | None = None, is_weights: torch.Tensor | None = None,
                sampling_logp: torch.Tensor | None = None, entropy: torch.Tensor | None = None,
                entropy_normalizer: float | None = None,
                entropy_mask: torch.Tensor | None = None) -> tuple[torch.Tensor, dict]:
    """The GRPO loss of one micro-batch, and detached statistics for logging (TRL's `_compute_loss` order).

    `spec` says which loss (or the loose `loss_type`, `eps_*`, `beta` of a plain clipped loss). The surrogate is
    multiplied by the off-policy mask (needs `sampling_logp`, the sampler's log-probs; `old_logp` stands in where it
    has none), then by `entropy_mask` (`high_entropy_mask`), then by `is_weights` (see `sampler_is_weights`), then
    the k3 term is added, then aggregated per the loss type. With `spec.entropy_coef`, `entropy` (with its
    gradient) enters as -coef x the step's mean token entropy over the tokens `entropy_mask` keeps: sum over this
    micro-batch / `entropy_normalizer` (those tokens in the step, all ranks, / world size).
    The statistics come from per-token ratios whatever the importance-sampling level: the reuse rule's KL.
    """
    if spec is None:
        spec = LossSpec(loss_type or "dapo", eps_low, eps_high, beta=beta)
    coef_1 = importance_ratio(logp, old_logp, mask, spec.importance_sampling_level)
    if spec.loss_type == "vespo":  # the sampler's weights enter its sequence weight, not the product below
        per_token = -vespo_weights(logp.detach() - old_logp, mask, advantages, is_weights, spec) \
            * advantages.unsqueeze(-1) * logp
    else:
        per_token = surrogate(coef_1, logp, advantages, spec)
    token_ratio = torch.exp(logp.detach() - old_logp)
    log_ratio = logp.detach() - old_logp
    # k3 estimate of KL(old || current) from the token ratios: r - 1 - log r (>= 0, no extra forward)
    stats = {"clip_counts": clip_counts(coef_1.detach(), advantages, mask, spec),
             "ratio_sum": (token_ratio * mask).sum(), "approx_kl_sum": ((token_ratio - 1.0 - log_ratio) * mask).sum()}
    if spec.off_policy_mask_threshold is not None:
        keep = off_policy_mask(advantages, logp, old_logp if sampling_logp is None else sampling_logp, mask,
                               spec.off_policy_mask_threshold)
        per_token = per_token * keep
        stats["off_policy_masked"] = ((1.0 - keep) * (mask.sum(-1, keepdim=True) > 0)).sum()
    if entropy_mask is not None:
        per_token = per_token * entropy_mask
    if is_weights is not None and spec.loss_type != "vespo":
        per_token = per_token * is_weights
    if spec.beta > 0.0:
        kl = k3_kl(logp, ref_logp)
        stats["kl_sum"] = (kl.detach() * mask).sum()
        if spec.use_bias_correction_kl:
            kl = kl * coef_1
        per_token = per_token + spec.beta * kl
    loss = reduce_loss(per_token, mask, spec.loss_type, normalizer, max_completion_length)
    if spec.entropy_coef != 0.0:
        kept = mask if entropy_mask is None else mask * entropy_mask
        loss = loss - spec.entropy_coef * (entropy * kept).sum() / entropy_normalizer
    return loss, stats
