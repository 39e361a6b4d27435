"""Every policy-loss option TRL 1.16 has and this recipe takes equals TRL's own `GRPOTrainer._compute_loss` on the
same tensors (policy, old, sampling and reference log-probs, entropies, advantages, masks): the loss and its
gradient with respect to the log-probs and the entropies. One micro-batch is one optimizer step on one rank, where
TRL's per-micro-batch normalizers and the recipe's per-step ones coincide (tests/test_update.py: the recipe's
update does not depend on the split)."""
import math
import os
from collections import defaultdict
from types import SimpleNamespace

import pytest
import torch

from grpo_recipe.algo.entropy import EntropyControl
from grpo_recipe.algo.loss import (LossSpec, high_entropy_mask, loss_normalizers, policy_loss, quantile,
                                   sampler_is_weights)

trl = pytest.importorskip("trl", reason="trl not installed (bash launch/setup_venv.sh test,bench-trl)") \
    if not os.environ.get("GRPO_REQUIRE_TRL") else __import__("trl")
from trl.trainer.grpo_trainer import GRPOTrainer  # noqa: E402

B, T, L = 6, 7, 9  # sequences, completion tokens, max_completion_length


class Accelerator:
    """One process: what _compute_loss asks of accelerate."""
    num_processes = 1
    sync_gradients = True

    def gather(self, x):
        return x

    gather_for_metrics = gather

    def reduce(self, x, reduction="sum"):
        return x

    def pad_across_processes(self, x, dim=0, pad_index=0):
        return x


def tensors(seed=0, drift=0.3):
    g = torch.Generator().manual_seed(seed)
    mask = torch.ones(B, T)
    for i, n in enumerate([7, 5, 3, 7, 1, 6]):
        mask[i, n:] = 0
    old = torch.randn(B, T, generator=g) * 0.5 - 2.0
    logp = old + torch.randn(B, T, generator=g) * drift  # the policy has moved since sampling
    sampling = old + torch.randn(B, T, generator=g) * 0.4  # the sampler's own log-probs
    sampling[1, 2] = float("nan")  # a token the sampler could not score
    ref = old + torch.randn(B, T, generator=g) * 0.2
    entropy = torch.rand(B, T, generator=g) * 2.0
    adv = torch.tensor([1.2, -0.7, 0.4, -1.5, 0.9, -0.2])
    return dict(mask=mask, old=old, logp=logp, sampling=sampling, ref=ref, entropy=entropy, adv=adv)


def trl_ratio(old, sampling, mask, mode, lo, hi):
    """TRL 1.16's vLLM importance-sampling ratio (`_generate_and_score_completions`), written out."""
    diff = torch.nan_to_num((old - sampling) * mask, nan=0.0)
    if mode.startswith("sequence"):
        diff = diff.sum(dim=-1, keepdim=True)
    ratio = torch.exp(diff)
    if mode.endswith("truncate"):
        return torch.clamp(ratio, min=lo, max=hi)
    lo = -math.inf if lo is None else lo
    hi = math.inf if hi is None else hi
    return ratio.masked_fill((ratio < lo) | (ratio > hi), 0.0)


def trl_trainer(opts, logp, entropy, is_ratio=None):
    """A stand-in for TRL's trainer state that its own _compute_loss runs on."""
    spec = dict(loss_type="dapo", epsilon=0.2, epsilon_high=0.28, importance_sampling_level="token", delta=None,
                sapo_temperature_pos=1.0, sapo_temperature_neg=1.05, off_policy_mask_threshold=None, beta=0.0,
                use_bias_correction_kl=True, entropy_coef=0.0, vespo_k_pos=2.0, vespo_lambda_pos=3.0, vespo_k_neg=3.0,
                vespo_lambda_neg=2.0) | opts
    trl_loss_type = {"step_token_mean": "bnpo"}.get(spec["loss_type"], spec["loss_type"])
    me = SimpleNamespace(
        loss_type=trl_loss_type, epsilon_low=spec["epsilon"], epsilon_high=spec["epsilon_high"],
        importance_sampling_level=spec["importance_sampling_level"], beta=spec["beta"],
        off_policy_mask_threshold=spec["off_policy_mask_threshold"],
        top_entropy_quantile=spec.get("top_entropy_quantile", 1.0),
        use_vllm=is_ratio is not None, vllm_importance_sampling_correction=is_ratio is not None,
        args=SimpleNamespace(delta=spec["delta"], sapo_temperature_pos=spec["sapo_temperature_pos"],
                             sapo_temperature_neg=spec["sapo_temperature_neg"],
                             use_bias_correction_kl=spec["use_bias_correction_kl"], steps_per_generation=1,
                             entropy_target=spec.get("entropy_target", 0.2),
                             entropy_coef_delta=spec.get("entropy_coef_delta", 0.005),
                             entropy_coef_min=spec.get("entropy_coef_min", 0.0),
                             entropy_coef_max=spec.get("entropy_coef_max", 1.0),
                             **{k: spec[k] for k in ("vespo_k_pos", "vespo_lambda_pos", "vespo_k_neg",
                                                     "vespo_lambda_neg")}),
        get_gamma_weights=GRPOTrainer.get_gamma_weights,
        model=SimpleNamespace(training=True), current_gradient_accumulation_steps=1, accelerator=Accelerator(),
        max_completion_length=L, aux_loss_enabled=False, _metrics=defaultdict(lambda: defaultdict(list)),
        _entropy_bonus_enabled=spec["entropy_coef"] != 0.0 or spec.get("use_adaptive_entropy", False),
        entropy_coef=spec["entropy_coef"], use_adaptive_entropy=spec.get("use_adaptive_entropy", False),
        _last_world_entropy=math.inf, _entropy_window_stats=None, get_off_policy_mask=GRPOTrainer.get_off_policy_mask,
        _get_per_token_logps_and_entropies=lambda *a, **k: (me.logp, me.entropy, None))
    me.logp, me.entropy = logp, entropy
    me.get_high_entropy_mask = lambda *a: GRPOTrainer.get_high_entropy_mask(me, *a)
    return me


def trl_loss(t, opts, logp, entropy, is_ratio=None, with_sampling=False, me=None):
    """TRL's own _compute_loss on these tensors, called on a stand-in for the trainer's state (`me`: one kept
    across calls, for adaptive entropy)."""
    if me is None:
        me = trl_trainer(opts, logp, entropy, is_ratio)
    me.logp, me.entropy = logp, entropy
    inputs = {"prompt_ids": torch.zeros(B, 1, dtype=torch.long), "prompt_mask": torch.ones(B, 1),
              "completion_ids": torch.zeros(B, T, dtype=torch.long), "completion_mask": t["mask"],
              "advantages": t["adv"], "old_per_token_logps": t["old"], "ref_per_token_logps": t["ref"],
              "num_items_in_batch": (t["mask"] * t.get("tool", 1.0)).sum()}
    if "tool" in t:  # a multi-turn rollout: TRL takes the tool results out with its tool_mask
        inputs["tool_mask"] = t["tool"]
    if is_ratio is not None:
        inputs["importance_sampling_ratio"] = is_ratio
    if with_sampling:
        inputs["sampling_per_token_logps"] = t["sampling"]
    return GRPOTrainer._compute_loss(me, None, inputs)


def our_loss(t, opts, logp, entropy, is_weights=None, with_sampling=False, entropy_coef=None):
    spec = dict(loss_type="dapo", epsilon=0.2, epsilon_high=0.28) | opts
    if entropy_coef is not None:  # an adaptive coefficient's value at this step
        spec["entropy_coef"] = entropy_coef
    s = LossSpec(spec["loss_type"], spec["epsilon"], spec["epsilon_high"],
                 spec.get("importance_sampling_level", "token"), spec.get("delta"),
                 spec.get("sapo_temperature_pos", 1.0), spec.get("sapo_temperature_neg", 1.05),
                 spec.get("off_policy_mask_threshold"), spec.get("beta", 0.0),
                 spec.get("use_bias_correction_kl", True), spec.get("entropy_coef", 0.0),
                 *(spec.get(k, d) for k, d in (("vespo_k_pos", 2.0), ("vespo_lambda_pos", 3.0), ("vespo_k_neg", 3.0),
                                               ("vespo_lambda_neg", 2.0))))
    mask = t["mask"] * t.get("tool", 1.0)  # the rollout buffer's trained tokens (algo/buffer.py)
    seqs = (mask.sum(-1) > 0).sum().reshape(1, 1)
    norm = loss_normalizers(s.loss_type, mask.sum().reshape(1, 1), seqs, 1).item()
    tokens = loss_normalizers("step_token_mean", mask.sum().reshape(1, 1), seqs, 1).item()
    keep = None
    if spec.get("top_entropy_quantile", 1.0) < 1.0:  # as update.high_entropy_masks, on one rank
        threshold = quantile(entropy.detach()[mask.bool()], 1.0 - spec["top_entropy_quantile"])
        keep = high_entropy_mask(entropy.detach(), mask, threshold)
        tokens = keep.sum().clamp(min=1.0).item()
    loss, _ = policy_loss(logp, t["old"], t["adv"], mask, spec=s, normalizer=norm, max_completion_length=L,
                          ref_logp=t["ref"], is_weights=is_weights,
                          sampling_logp=t["sampling"] if with_sampling else None, entropy=entropy,
                          entropy_normalizer=tokens, entropy_mask=keep)
    return loss


def grad(x):
    """x's gradient; zeros where the loss does not depend on x (entropies without a bonus)."""
    return torch.zeros_like(x) if x.grad is None else x.grad


def both(opts, is_mode=None, with_sampling=False, seed=0, tool=False):
    """(TRL's loss, its gradients) and (ours, ours) on the same tensors; `tool`: some completions hold tool
    results (tokens 1-2 of row 0, 2-3 of row 3, 1 of row 5), which TRL's tool_mask and our buffer leave out."""
    t = tensors(seed)
    if tool:
        t["tool"] = torch.ones(B, T)
        t["tool"][0, 1:3], t["tool"][3, 2:4], t["tool"][5, 1] = 0.0, 0.0, 0.0
    trained = t["mask"] * t.get("tool", 1.0)
    out = []
    for side in ("trl", "ours"):
        logp = t["logp"].clone().requires_grad_(True)
        entropy = t["entropy"].clone().requires_grad_(True)
        if side == "trl":
            ratio = None if is_mode is None else trl_ratio(t["old"], t["sampling"], trained, *is_mode)
            loss = trl_loss(t, opts, logp, entropy, ratio, with_sampling)
        else:
            weights = None if is_mode is None else sampler_is_weights(t["old"], t["sampling"], trained, *is_mode)[0]
            loss = our_loss(t, opts, logp, entropy, weights, with_sampling)
        loss.backward()
        out.append((loss.detach(), grad(logp) * t["mask"], grad(entropy) * t["mask"]))
    return out


CASES = {
    "grpo": {"loss_type": "grpo"},
    "dr_grpo": {"loss_type": "dr_grpo"},
    "dapo": {},
    "step_token_mean=bnpo": {"loss_type": "step_token_mean"},
    "cispo": {"loss_type": "cispo", "epsilon_high": 5.0},
    "cispo_tight_cap": {"loss_type": "cispo", "epsilon_high": 1.1},
    "sapo": {"loss_type": "sapo"},
    "sapo_temperatures": {"loss_type": "sapo", "sapo_temperature_pos": 0.5, "sapo_temperature_neg": 2.0},
    "grpo_sequence": {"loss_type": "grpo", "importance_sampling_level": "sequence"},
    "sapo_sequence": {"loss_type": "sapo", "importance_sampling_level": "sequence"},
    "dapo_delta": {"delta": 1.3},
    "grpo_delta": {"loss_type": "grpo", "delta": 1.25},
    "dapo_entropy_bonus": {"entropy_coef": 0.03},
    "grpo_entropy_bonus": {"loss_type": "grpo", "entropy_coef": 0.1},
    "dapo_kl_bias_corrected": {"beta": 0.04, "use_bias_correction_kl": True},
    "dapo_kl_plain": {"beta": 0.04, "use_bias_correction_kl": False},
    "grpo_sequence_kl_bias_corrected": {"loss_type": "grpo", "importance_sampling_level": "sequence", "beta": 0.1},
    "dapo_off_policy_mask_old": {"off_policy_mask_threshold": 0.05},
    "luspo": {"loss_type": "luspo"},
    "luspo_sequence": {"loss_type": "luspo", "importance_sampling_level": "sequence"},
    "luspo_sequence_kl": {"loss_type": "luspo", "importance_sampling_level": "sequence", "beta": 0.05},
    "vespo": {"loss_type": "vespo"},
    "vespo_shapes": {"loss_type": "vespo", "vespo_k_pos": 1.0, "vespo_lambda_pos": 1.5, "vespo_k_neg": 4.0,
                     "vespo_lambda_neg": 0.5},
    "vespo_kl_entropy": {"loss_type": "vespo", "beta": 0.04, "entropy_coef": 0.02},
    "top_entropy_0.2": {"top_entropy_quantile": 0.2},
    "top_entropy_0.5_bonus": {"top_entropy_quantile": 0.5, "entropy_coef": 0.05},
    "top_entropy_0_grpo_kl": {"loss_type": "grpo", "top_entropy_quantile": 0.0, "beta": 0.04},
    "top_entropy_0.8_cispo": {"loss_type": "cispo", "epsilon_high": 5.0, "top_entropy_quantile": 0.8},
    "top_entropy_0.3_vespo": {"loss_type": "vespo", "top_entropy_quantile": 0.3, "entropy_coef": 0.02},
}


def check(got, want):
    (tl, tg, te), (ol, og, oe) = want, got
    torch.testing.assert_close(ol, tl, atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(og, tg, atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(oe, te, atol=1e-6, rtol=1e-5)


@pytest.mark.parametrize("opts", CASES.values(), ids=CASES.keys())
def test_loss_and_gradient_equal_trls(opts):
    want, got = both(opts)
    check(got, want)
    assert want[1].abs().sum() > 0  # a gradient to compare


TOOL_CASES = ("grpo", "dr_grpo", "dapo", "cispo", "sapo", "grpo_sequence", "dapo_kl_bias_corrected", "luspo_sequence",
              "vespo_kl_entropy", "top_entropy_0.3_vespo", "dapo_entropy_bonus")


@pytest.mark.parametrize("opts", [CASES[k] for k in TOOL_CASES], ids=TOOL_CASES)
def test_tool_results_are_left_out_as_trls_tool_mask_leaves_them(opts):
    want, got = both(opts, tool=True)
    check(got, want)
    without = both(opts)[1]
    assert not torch.allclose(without[0], got[0]) or not torch.allclose(without[1], got[1]), \
        "the tool mask changed nothing on these tensors"


def test_drift_correction_over_the_models_tokens_only_equals_trls():
    want, got = both({}, is_mode=("sequence_mask", None, 3.0), with_sampling=True, tool=True)
    check(got, want)


@pytest.mark.parametrize("mode", ["token_truncate", "token_mask", "sequence_truncate", "sequence_mask"])
@pytest.mark.parametrize("bounds", [(None, 3.0), (0.5, 1.5)], ids=["trl_default_bounds", "both_bounds"])
@pytest.mark.parametrize("loss_type", ["dapo", "grpo", "luspo", "vespo"])
def test_vllm_drift_correction_equals_trls(mode, bounds, loss_type):
    if loss_type == "vespo" and mode.startswith("sequence"):
        return  # TRL refuses these (vespo weighs the sampler's token ratios itself); the config does too
    want, got = both({"loss_type": loss_type}, is_mode=(mode, *bounds))
    check(got, want)


def test_the_correction_modes_differ_from_each_other_and_from_none():
    """Each mode must do something on these tensors, or its equality with TRL would prove nothing."""
    losses = {mode: both({}, is_mode=(mode, 0.5, 1.5))[1][0].item()
              for mode in ("token_truncate", "token_mask", "sequence_truncate", "sequence_mask")}
    losses["none"] = both({})[1][0].item()
    assert len({round(v, 6) for v in losses.values()}) == len(losses), losses


def test_off_policy_mask_with_sampler_log_probs_equals_trls():
    want, got = both({"off_policy_mask_threshold": 0.05}, is_mode=("sequence_mask", None, 3.0), with_sampling=True)
    check(got, want)
    plain = both({}, is_mode=("sequence_mask", None, 3.0), with_sampling=True)[1][0]
    assert not torch.isclose(plain, got[0]), "the mask dropped nothing on these tensors"


@pytest.mark.parametrize("opts", [CASES["sapo"], CASES["cispo"], CASES["grpo_sequence"]], ids=["sapo", "cispo", "seq"])
def test_on_policy_step_equals_trls(opts):
    """At mu = 1 the old log-probs are the forward's own (TRL: old_per_token_logps None)."""
    t = tensors(3)
    t["old"] = t["logp"].clone()
    out = []
    for side in ("trl", "ours"):
        logp = t["logp"].clone().requires_grad_(True)
        entropy = t["entropy"].clone().requires_grad_(True)
        if side == "trl":
            loss = trl_loss({**t, "old": logp.detach()}, opts, logp, entropy)
        else:
            loss = our_loss({**t, "old": logp.detach()}, opts, logp, entropy)
        loss.backward()
        out.append((loss.detach(), grad(logp) * t["mask"], grad(entropy) * t["mask"]))
    check(out[1], out[0])


@pytest.mark.parametrize("opts", [
    {"use_adaptive_entropy": True, "entropy_coef": 0.01, "entropy_target": 1.0, "entropy_coef_delta": 0.02},
    {"use_adaptive_entropy": True, "entropy_coef": 0.0, "entropy_target": 1.2, "entropy_coef_max": 0.03,
     "entropy_coef_delta": 0.02, "top_entropy_quantile": 0.5},
], ids=["all_tokens", "top_half_capped"])
def test_adaptive_entropy_follows_trls_controller_step_by_step(opts):
    """Six optimizer steps whose entropies cross the target both ways: each step's loss and gradients, and the
    coefficient after it, equal TRL's (its trainer state kept across the steps)."""
    me, control = None, EntropyControl.from_config(SimpleNamespace(
        entropy_coef=opts["entropy_coef"], use_adaptive_entropy=True, entropy_target=opts["entropy_target"],
        entropy_coef_delta=opts["entropy_coef_delta"], entropy_coef_min=0.0,
        entropy_coef_max=opts.get("entropy_coef_max", 1.0)))
    applied = []
    for step, scale in enumerate([3.0, 0.5, 0.4, 2.5, 0.3, 0.6]):  # the tokens' entropies drift below and above
        t = tensors(step)
        t["entropy"] = t["entropy"] * scale
        out = []
        for side in ("trl", "ours"):
            logp = t["logp"].clone().requires_grad_(True)
            entropy = t["entropy"].clone().requires_grad_(True)
            if side == "trl":
                me = me or trl_trainer(opts, logp, entropy)
                loss = trl_loss(t, opts, logp, entropy, me=me)
            else:
                applied.append(control.applied())
                loss = our_loss(t, opts, logp, entropy, entropy_coef=control.applied())
                keep = t["mask"]
                if opts.get("top_entropy_quantile", 1.0) < 1.0:
                    keep = high_entropy_mask(t["entropy"], t["mask"],
                                             quantile(t["entropy"][t["mask"].bool()], 1 - opts["top_entropy_quantile"]))
                control.step_done(((t["entropy"] * keep).sum() / keep.sum()).item())
            loss.backward()
            out.append((loss.detach(), grad(logp) * t["mask"], grad(entropy) * t["mask"]))
        check(out[1], out[0])
        assert control.coef == pytest.approx(me.entropy_coef, abs=1e-12), step
        assert control.last_entropy == pytest.approx(me._last_world_entropy, rel=1e-6)
    assert 0.0 in applied and any(a > 0 for a in applied)  # the bonus was off on some steps and on on others


def test_quantile_equals_torchs_and_keeps_the_top_fraction():
    values = torch.rand(1001, generator=torch.Generator().manual_seed(3)) * 4.0
    for q in (0.0, 0.2, 0.5, 0.77, 0.999, 1.0):
        assert quantile(values, q).item() == torch.quantile(values, q).item()
    mask = torch.ones(1, 1001)
    kept = high_entropy_mask(values.unsqueeze(0), mask, quantile(values, 0.8))
    assert int(kept.sum()) == 201  # the top fifth, the threshold's own token included
