"""The rollout-update protocol, owned by `train_on_rollout`: old log-probs, loss normalizers, and mu passes x
optimizer_steps_per_pass gradient-accumulated optimizer steps. The loop, the tests' workers and the benchmarks
all train through it.
"""
from __future__ import annotations

import contextlib
import dataclasses
import math
from collections.abc import Iterator
from dataclasses import dataclass

import torch
import torch.distributed as dist

from grpo_recipe.algo.buffer import RolloutBuffer
from grpo_recipe.algo.clock import Timer
from grpo_recipe.algo.entropy import EntropyControl
from grpo_recipe.algo.loss import (LossSpec, head_token_logps, high_entropy_mask, loss_normalizers, policy_loss,
                                   quantile, sampler_is_weights, tied_embedding, token_logps)
from grpo_recipe.algo.mlp import gated_down, gated_mlps
from grpo_recipe.config.schema import Config
from grpo_recipe.dist.collectives import all_gather_values, all_reduce, all_reduce_named, device

# per-rank sums of one optimizer step, all-reduced together (this order is the all-reduce's layout)
STEP_SUMS = ("loss", "clip_low", "clip_high", "clip_region", "tokens", "kl", "ratio", "approx_kl", "is_ratio",
             "entropy", "is_zeroed", "off_policy_masked", "sequences", "kept_entropy", "kept_tokens")


def loss_spec(cfg: Config) -> LossSpec:
    """The policy loss the config asks for, as data for algo/loss.py."""
    return LossSpec(cfg.loss_type, cfg.epsilon, cfg.eps_high, cfg.importance_sampling_level, cfg.delta,
                    cfg.sapo_temperature_pos, cfg.sapo_temperature_neg, cfg.off_policy_mask_threshold, cfg.beta,
                    cfg.use_bias_correction_kl, cfg.entropy_coef, cfg.vespo_k_pos, cfg.vespo_lambda_pos,
                    cfg.vespo_k_neg, cfg.vespo_lambda_neg)


@dataclass
class StepResult:
    """One optimizer step of a rollout's update."""
    pass_index: int  # which pass over the rollout (0 .. cfg.max_passes - 1)
    step_index: int  # which optimizer step of that pass (0 .. optimizer_steps_per_pass - 1)
    last_in_pass: bool
    stats: dict  # over all ranks: loss, clip ratios, ratio_mean, approx_kl, entropy, train_tokens, learning_rate,
    # [kl, is_ratio_*, grad_norm]
    old_logp_forwards: int  # no-grad micro-batch forwards spent on old log-probs just before this step
    applied: bool = True  # whether DeepSpeed updated the weights (it skips a step whose gradient norm is not finite)


class NonFiniteError(RuntimeError):
    """The loss or gradient norm stopped being finite; the message names the step."""


def check_finite(done: StepResult, step: int, skipped: int, allowed: int) -> bool:
    """Whether optimizer step `step` was non-finite and skipped (counted by the caller; `skipped` so far).
    Raises NonFiniteError when the run must stop: more such steps than `allowed`, or one whose update DeepSpeed
    applied anyway. The stats are all-reduced, so every rank decides the same."""
    bad = [f"{k} = {done.stats[k]}" for k in ("loss", "grad_norm") if k in done.stats
           and not math.isfinite(done.stats[k])]
    if not bad:
        return False
    where = f"optimizer step {step} (rollout pass {done.pass_index}, step {done.step_index} of the pass)"
    if done.applied:
        raise NonFiniteError(f"{' and '.join(bad)} at {where}, and the update was applied: the weights may be "
                             "broken; resume from the last checkpoint with a lower learning_rate")
    if skipped >= allowed:
        raise NonFiniteError(f"{' and '.join(bad)} at {where}: {skipped + 1} non-finite step(s), skip_nonfinite_steps "
                             f"allows {allowed}; the update was not applied and nothing was saved after it")
    return True


# Architectures whose causal-LM forward returns the output head's result as the logits, untouched (no logit
# scale, cap or mask after the head): their head can compute the log-probs itself (loss.head_token_logps).
FUSED_HEAD_MODELS = frozenset({"llama", "mistral", "qwen2", "qwen3", "qwen2_moe", "qwen3_moe", "phi3", "olmo2",
                               "gemma", "smollm3"})


def fused_head(model) -> torch.nn.Linear | None:
    """The model's output head when it can return log-probs in place of logits: a plain Linear (not a LoRA
    layer) of an architecture in FUSED_HEAD_MODELS; else None."""
    inner = getattr(model, "module", model)  # a DeepSpeed engine's model
    if getattr(getattr(inner, "config", None), "model_type", None) not in FUSED_HEAD_MODELS:
        return None
    head = inner.get_output_embeddings()
    return head if type(head) is torch.nn.Linear else None


def tied_embedding_of(model, head: torch.nn.Linear) -> torch.nn.Embedding | None:
    """The input embedding that shares the head's weight, when it is a plain lookup (no max_norm, no frequency
    scaling, dense gradient): its backward then completes the head's gradient in place (loss.tied_embedding)."""
    emb = getattr(model, "module", model).get_input_embeddings()
    if type(emb) is not torch.nn.Embedding or emb.weight is not head.weight:
        return None
    return emb if emb.max_norm is None and not emb.scale_grad_by_freq and not emb.sparse else None


def forward_logps(model, input_ids: torch.Tensor, attention_mask: torch.Tensor, completion_len: int,
                  temperature: float, with_entropy: bool = False, entropy_grad: bool = False):
    """Per-token log-probs (fp32) of the completion part under the sampling temperature (and with `with_entropy`,
    each position's entropy from the same logits: (logps, entropy)).

    Position ids follow the attention mask, as in `generate`, so left padding does not shift them. The model
    computes logits only where they predict a completion token (logits_to_keep: the prompt's positions would
    cost a [B, P, V] slice for nothing), the last one included and ignored. Where the head allows it
    (`fused_head`), the head itself returns the log-probs, chunk by chunk, and no [B, C, V] logits exist; it is
    called as the model's own module, so ZeRO-3 gathers its weights for it, forward and backward. A tied input
    embedding's lookup then completes the head's weight gradient in place: one [V, H] gradient, not two. Gated
    MLPs (`gated_mlps`) keep two of their four [B, T, I] activations, unless gradient checkpointing keeps none.
    """
    position_ids = (attention_mask.cumsum(-1) - 1).clamp(min=0)
    ids = input_ids[:, -completion_len:]
    head = fused_head(model)
    # With gradient checkpointing a layer keeps no activations; its recompute runs the model's own forward.
    checkpointing = getattr(getattr(model, "module", model), "is_gradient_checkpointing", False)
    swaps = [] if checkpointing else [s for mlp in gated_mlps(model) for s in _gated_mlp(mlp)]

    def call():
        with _swapped_forwards(swaps):
            return model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                         use_cache=False, logits_to_keep=completion_len + 1).logits

    if head is None:
        return token_logps(call(), ids, temperature, own_logits=True, with_entropy=with_entropy,
                           entropy_grad=entropy_grad)
    emb = tied_embedding_of(model, head)
    deferred = {} if emb is not None and torch.is_grad_enabled() and head.weight.requires_grad else None
    swaps.append((head, lambda hidden: head_token_logps(hidden, head.weight, head.bias, ids, temperature,
                                                         with_entropy, entropy_grad, deferred)))
    if deferred is not None:
        swaps.append((emb, lambda x: tied_embedding(x, emb.weight, emb.padding_idx, deferred)))
    return call()


def _gated_mlp(mlp) -> list:
    """The MLP's forward and its down projection's, so that `gated_down` takes gate and up (algo/mlp.py)."""
    down = mlp.down_proj
    return [(mlp, lambda x: down(mlp.gate_proj(x), mlp.up_proj(x))),
            (down, lambda gate, up: gated_down(gate, up, down.weight, down.bias))]


@contextlib.contextmanager
def _swapped_forwards(swaps: list):
    """Each (module, forward) pair's forward in place of the module's own meanwhile. The module is still called as
    itself, so its hooks run: ZeRO-3 gathers its weights for the forward and again for the backward."""
    for module, forward in swaps:
        module.forward = forward
    try:
        yield
    finally:
        for module, _ in swaps:
            del module.forward


def _to_device(mb: dict) -> dict:
    dev = device()
    return {k: v.to(dev) for k, v in mb.items()}


def train_on_rollout(engine, ref, buf: RolloutBuffer, cfg: Config, after: tuple[int, int] | None = None,
                     timer: Timer | None = None, entropy: EntropyControl | None = None) -> Iterator[StepResult]:
    """Every optimizer step this rollout feeds: mu passes, each split into optimizer_steps_per_pass steps.

    A fresh rollout (`after` None) first gets the old log-probs that its first pass cannot capture for itself
    (see buffer.py); `after` = (pass, step) of the last step done resumes a rollout mid-cycle, whose buffer
    already holds them. A caller that stops iterating (adaptive reuse) skips the remaining steps. Timer names:
    old_logp, train, and inside train: forward, backward, optimizer. `entropy`: the entropy bonus's coefficient,
    updated in place by each step (a fixed entropy_coef when None).
    """
    timer, entropy = timer or Timer(), entropy or EntropyControl.from_config(cfg)
    plan = buf.plan(cfg.max_passes, cfg.optimizer_steps_per_pass, cfg.per_device_train_batch_size)
    forwards = 0
    if after is None:
        with timer("old_logp"):
            forwards = compute_old_logps(engine, buf, [idx for step in plan[0][1:] for idx in step], cfg.temperature)
    norms = normalizers(buf, plan, cfg)
    for p, steps in enumerate(plan):
        for s, micro_batches in enumerate(steps):
            if after is not None and (p, s) <= tuple(after):
                continue
            with timer("train"):
                # Samples of the first step of the first pass see the policy that sampled them: their old
                # log-probs are that step's own forward, captured for the later passes.
                stats = optimizer_step(engine, ref, buf, micro_batches, norms[p, s].tolist(), cfg,
                                       capture_old_logps=cfg.needs_old_logps and (p, s) == (0, 0), timer=timer,
                                       entropy_control=entropy)
            yield StepResult(p, s, s == len(steps) - 1, stats, forwards, applied=engine.was_step_applied())
            forwards = 0


@torch.no_grad()
def compute_old_logps(engine, buf: RolloutBuffer, micro_batches: list[torch.Tensor], temperature: float) -> int:
    """No-grad forwards for samples whose old log-probs cannot be captured for free: those of the first pass's
    later optimizer steps (optimizer_steps_per_pass > 1), by which time the policy has moved. Returns the forwards."""
    for idx in micro_batches:
        mb = _to_device(buf.micro_batch(idx))
        logp = forward_logps(engine, mb["input_ids"], mb["attention_mask"], mb["completion_mask"].shape[1], temperature)
        buf.store_old_logps(idx, logp)
    return len(micro_batches)


def normalizers(buf: RolloutBuffer, plan: list, cfg: Config) -> torch.Tensor:
    """Per [pass, step]: the loss normalizer. The global token and sequence counts are known at rollout time: one
    all-reduce."""
    counts = all_reduce_named({"tokens": buf.token_counts(plan).to(device()),
                               "sequences": buf.sequence_counts(plan).to(device())})
    world = dist.get_world_size()
    policy = loss_normalizers(cfg.loss_type, counts["tokens"].cpu(), counts["sequences"].cpu(), world)
    tokens = loss_normalizers("step_token_mean", counts["tokens"].cpu(), counts["sequences"].cpu(), world)
    return torch.stack([policy, tokens], dim=-1)  # [passes, steps, 2]: the policy loss's, the entropy bonus's


@torch.no_grad()
def high_entropy_masks(engine, buf: RolloutBuffer, micro_batches: list[torch.Tensor], cfg: Config) -> list:
    """top_entropy_quantile: per micro-batch, the mask of the completion tokens whose entropy under the current
    policy is in the top quantile of the whole optimizer step's tokens over all ranks. One no-grad forward per
    micro-batch (the weights do not change within a step: these are the entropies the step's own forwards see).
    The threshold does not depend on the micro-batch split; TRL's is taken per micro-batch."""
    entropies = []
    for idx in micro_batches:
        mb = _to_device(buf.micro_batch(idx))
        mask = mb["completion_mask"]
        entropies.append((forward_logps(engine, mb["input_ids"], mb["attention_mask"], mask.shape[1],
                                        cfg.temperature, with_entropy=True)[1], mask))
    mine = [h[m.bool()].float() for h, m in entropies]
    every = all_gather_values(torch.cat(mine) if mine else torch.zeros(0, device=device()))
    if every.numel() == 0:
        return [torch.zeros_like(m) for _, m in entropies]
    threshold = quantile(every, 1.0 - cfg.top_entropy_quantile)
    return [high_entropy_mask(h, m, threshold) for h, m in entropies]


def optimizer_step(engine, ref, buf: RolloutBuffer, micro_batches: list[torch.Tensor], normalizers: list[float],
                   cfg: Config, capture_old_logps: bool, timer: Timer, entropy_control: EntropyControl) -> dict:
    """Backward over each micro-batch, then one optimizer step. Returns step statistics over all ranks.
    `normalizers`: the step's (policy loss, entropy bonus) normalizers; `entropy_control`: the bonus's
    coefficient (updated after the step)."""
    sums = {name: torch.zeros((), device=device()) for name in STEP_SUMS}
    is_max = torch.zeros(1, device=device())
    control = entropy_control
    spec, correct = dataclasses.replace(loss_spec(cfg), entropy_coef=control.applied()), cfg.corrects_sampler
    lr = engine.get_lr()[0]  # what this step's update uses (the scheduler steps at its accumulation boundary)
    keep, bonus_normalizer = [None] * len(micro_batches), normalizers[1]
    if cfg.top_entropy_quantile < 1.0:
        with timer("forward"):
            keep = high_entropy_masks(engine, buf, micro_batches, cfg)
        # the bonus is a mean over the tokens kept, in the whole step over all ranks
        kept_count = all_reduce(sum((k.sum() for k in keep), torch.zeros((), device=device())).reshape(1))
        bonus_normalizer = kept_count.clamp(min=1.0).item() / dist.get_world_size()
    for idx, entropy_mask in zip(micro_batches, keep):
        mb = _to_device(buf.micro_batch(idx))
        mask, c_len = mb["completion_mask"], mb["completion_mask"].shape[1]
        with timer("forward"):
            logp, entropy = forward_logps(engine, mb["input_ids"], mb["attention_mask"], c_len, cfg.temperature,
                                          with_entropy=True, entropy_grad=spec.entropy_coef != 0.0)
        kept = mask if entropy_mask is None else mask * entropy_mask
        sums["entropy"] += (entropy.detach() * mask).sum()
        sums["kept_entropy"] += (entropy.detach() * kept).sum()
        sums["kept_tokens"] += kept.sum()
        # Samples the policy has not been updated on yet: their old log-probs are this very forward.
        fresh = ~mb["has_old_logps"]
        old = torch.where(fresh.unsqueeze(-1), logp.detach(), mb["old_logps"])
        if capture_old_logps and bool(fresh.any()):
            buf.store_old_logps(idx[fresh.cpu()], logp[fresh])
        ref_logp = None
        if cfg.beta > 0.0:
            with torch.no_grad():
                ref_logp = forward_logps(ref, mb["input_ids"], mb["attention_mask"], c_len, cfg.temperature)
        is_weights, sampling = None, mb["sampling_logps"] if cfg.sampler_is_apart else None
        if correct:  # the sampler's drift from the old policy
            is_weights, is_ratio = sampler_is_weights(old, sampling, mask, cfg.vllm_importance_sampling_mode,
                                                      cfg.vllm_importance_sampling_clip_min,
                                                      cfg.vllm_importance_sampling_clip_max)
            sums["is_ratio"] += (is_ratio * mask).sum()
            sums["is_zeroed"] += ((is_weights == 0).expand_as(mask) * mask).sum()
            is_max = torch.maximum(is_max, (is_ratio * mask).max().reshape(1))
        loss, stats = policy_loss(logp, old, mb["advantages"], mask, spec=spec, normalizer=normalizers[0],
                                  max_completion_length=cfg.max_completion_length, ref_logp=ref_logp,
                                  is_weights=is_weights, sampling_logp=sampling, entropy=entropy,
                                  entropy_normalizer=bonus_normalizer, entropy_mask=entropy_mask)
        with timer("backward"):
            engine.backward(loss, scale_wrt_gas=False)  # the normalizer already accounts for accumulation
        with timer("optimizer"):
            engine.step()  # DeepSpeed steps at the accumulation boundary only
        sums["loss"] += loss.detach()
        for name, count in zip(("clip_low", "clip_high", "clip_region", "tokens"), stats["clip_counts"]):
            sums[name] += count
        if "kl_sum" in stats:
            sums["kl"] += stats["kl_sum"]
        if "off_policy_masked" in stats:
            sums["off_policy_masked"] += stats["off_policy_masked"]
        sums["sequences"] += (mask.sum(-1) > 0).sum()
        sums["ratio"] += stats["ratio_sum"]
        sums["approx_kl"] += stats["approx_kl_sum"]
    sums = all_reduce_named(sums)
    if correct:
        is_max = all_reduce(is_max, "max")
    world = dist.get_world_size()
    tokens = sums["tokens"].clamp(min=1.0)
    out = {"loss": (sums["loss"] / world).item(), "clip_ratio_low": (sums["clip_low"] / tokens).item(),
           "clip_ratio_high": (sums["clip_high"] / tokens).item(),
           "clip_ratio_region": (sums["clip_region"] / tokens).item(),
           "ratio_mean": (sums["ratio"] / tokens).item(), "approx_kl": (sums["approx_kl"] / tokens).item(),
           "entropy": (sums["entropy"] / tokens).item(), "train_tokens": int(sums["tokens"].item()),
           "learning_rate": lr}
    if cfg.beta > 0.0:
        out["kl"] = (sums["kl"] / tokens).item()
    if cfg.top_entropy_quantile < 1.0:  # the tokens that carried the policy loss
        out["high_entropy_fraction"] = (sums["kept_tokens"] / tokens).item()
    # adaptive entropy: this step's entropy over the tokens the loss kept decides the next step's coefficient
    control.step_done((sums["kept_entropy"] / sums["kept_tokens"].clamp(min=1.0)).item())
    if control.enabled:
        out["entropy_coef"] = control.coef
    if correct:  # before truncation or masking: how far the sampler drifted from the trainer, per token
        out["is_ratio_mean"], out["is_ratio_max"] = (sums["is_ratio"] / tokens).item(), is_max.item()
        out["is_zeroed_fraction"] = (sums["is_zeroed"] / tokens).item()  # *_mask modes: tokens given weight 0
    if cfg.off_policy_mask_threshold is not None:
        out["off_policy_masked_fraction"] = (sums["off_policy_masked"] / sums["sequences"].clamp(min=1.0)).item()
    grad_norm = engine.get_global_grad_norm()
    if grad_norm is not None:
        out["grad_norm"] = float(grad_norm)
    return out
