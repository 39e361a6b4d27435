"""A full GRPO update under ZeRO-3 on real gloo ranks vs an independent single-process PyTorch reference."""
import json

import pytest
import torch
from conftest import torchrun
from dist_update import BASE, fixed_rewards, local_buffer

from grpo_recipe.config.schema import Config

LOSS_TYPES = ("grpo", "step_token_mean", "dr_grpo", "dapo")
SCALES = ("group", "batch", "none")


def run_cases(tmp_path, nproc, cases, tag):
    out = tmp_path / f"{tag}.pt"
    torchrun(nproc, ["tests/dist_update.py", str(out), json.dumps(cases)])
    return torch.load(out, weights_only=True)


def ref_logps(model, buf, idx):
    ids, attn = buf.input_ids[idx], buf.attention_mask[idx]
    c = buf.completion_mask.shape[1]
    pos = (attn.cumsum(-1) - 1).clamp(min=0)
    logits = model(input_ids=ids, attention_mask=attn, position_ids=pos).logits[:, -c - 1:-1]
    return torch.log_softmax(logits.float(), -1).gather(-1, ids[:, -c:].unsqueeze(-1)).squeeze(-1)


def ref_entropy_sum(model, buf, idx, temperature):
    """Sum over the samples' completion tokens of the entropy of softmax(logits / T), in float64."""
    c = buf.completion_mask.shape[1]
    ids, attn = buf.input_ids[idx], buf.attention_mask[idx]
    with torch.no_grad():
        logits = model(input_ids=ids, attention_mask=attn, position_ids=(attn.cumsum(-1) - 1).clamp(min=0)).logits
    ent = torch.distributions.Categorical(logits=logits[:, -c - 1:-1].double() / temperature).entropy()
    return (ent * buf.completion_mask[idx]).sum().item()


def hf_scheduler(opt, cfg: Config):
    """transformers' own scheduler for the config's schedule (the recipe's must step exactly like it)."""
    from transformers import (
        get_constant_schedule_with_warmup,
        get_cosine_with_min_lr_schedule_with_warmup,
        get_linear_schedule_with_warmup,
    )

    if cfg.lr_scheduler_type == "cosine":
        return get_cosine_with_min_lr_schedule_with_warmup(opt, cfg.warmup_steps, cfg.max_steps,
                                                           min_lr_rate=cfg.min_lr_ratio)
    if cfg.lr_scheduler_type == "linear":
        return get_linear_schedule_with_warmup(opt, cfg.warmup_steps, cfg.max_steps)
    return get_constant_schedule_with_warmup(opt, cfg.warmup_steps)


def step_samples(bufs, cfg: Config, p: int, s: int, dropped):
    """Per rank, the samples optimizer step (p, s) trains. Without left-out samples: the buffer's schedule. With
    them (zero_std_filter): the pass's shuffled order without them, cut into optimizer_steps_per_pass even parts."""
    spg = cfg.optimizer_steps_per_pass
    if not cfg.zero_std_filter:
        return [torch.cat(b.schedule(p, spg, cfg.per_device_train_batch_size)[s]) for b in bufs]
    out = []
    for b, drop in zip(bufs, dropped):
        order = torch.randperm(len(b), generator=torch.Generator().manual_seed(b.order_seed * 1000 + p)).tolist()
        out.append(torch.tensor([i for i in order if not drop[i]], dtype=torch.long).tensor_split(spg)[s])
    return out


def reference_update(tiny_model_dir, cfg: Config, world: int, wrap=None, zero_std_groups=()):
    """Plain PyTorch: one model, one AdamW (and transformers' scheduler), each optimizer step's samples from all
    ranks in one batch; with zero_std_filter, the samples of `zero_std_groups` are simply not there.

    `wrap(model)` may replace the model (e.g. with a peft LoRA model); AdamW then gets its trainable parameters.
    """
    from dataclasses import replace

    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    if wrap is not None:
        model = wrap(model)
    ref_model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=cfg.learning_rate,
                            betas=(cfg.adam_beta1, cfg.adam_beta2), eps=cfg.adam_epsilon, weight_decay=cfg.weight_decay)
    sched = hf_scheduler(opt, cfg)
    # every sample in the buffers; the ones a filter leaves out are dropped here, by group
    bufs = [local_buffer(replace(cfg, zero_std_filter=False), r, world, zero_std_groups=zero_std_groups)
            for r in range(world)]
    n = cfg.completions_per_rollout
    dropped = [torch.isin((torch.arange(n) + r * n) // cfg.num_generations, torch.tensor(list(zero_std_groups),
                                                                                        dtype=torch.long))
               for r in range(world)]
    with torch.no_grad():
        old = [ref_logps(model, b, torch.arange(len(b))) for b in bufs]
    spg = cfg.optimizer_steps_per_pass
    kept = [~d if cfg.zero_std_filter else torch.ones_like(d) for d in dropped]
    rollout_tokens = sum(b.completion_mask[k].sum() for b, k in zip(bufs, kept))
    kls, clips, entropies, lrs = [], [], [], []
    for p in range(cfg.num_iterations):
        for s in range(spg):
            terms, n_seq, n_tok, stats, ent = [], 0, 0.0, [], 0.0
            lrs.append(opt.param_groups[0]["lr"])
            for r, (b, idx) in enumerate(zip(bufs, step_samples(bufs, cfg, p, s, dropped))):
                ent += ref_entropy_sum(model, b, idx, cfg.temperature)
                lp = ref_logps(model, b, idx)
                ratio = torch.exp(lp - old[r][idx])
                adv = b.advantages[idx].unsqueeze(-1)
                tok = -torch.min(ratio * adv, ratio.clamp(1 - cfg.epsilon, 1 + cfg.eps_high) * adv)
                if cfg.beta > 0:
                    with torch.no_grad():
                        rl = ref_logps(ref_model, b, idx)
                    kl = torch.exp(rl - lp) - (rl - lp) - 1
                    # TRL's use_bias_correction_kl (its default): the k3 term times the ratio
                    tok = tok + cfg.beta * (kl * ratio if cfg.use_bias_correction_kl else kl)
                m = b.completion_mask[idx]
                terms.append((tok, m))
                stats.append((ratio.detach(), m))
                n_seq += len(idx)
                n_tok += m.sum()
            if cfg.loss_type == "grpo":
                loss = sum(((t * m).sum(-1) / m.sum(-1)).sum() for t, m in terms) / n_seq
            elif cfg.loss_type == "dr_grpo":
                loss = sum((t * m).sum() for t, m in terms) / (n_seq * cfg.max_completion_length)
            elif cfg.loss_type == "step_token_mean":
                loss = sum((t * m).sum() for t, m in terms) / n_tok
            else:  # dapo: the rollout's tokens per step
                loss = sum((t * m).sum() for t, m in terms) / (rollout_tokens / spg)
            opt.zero_grad()
            loss.backward()
            opt.step()
            sched.step()
            entropies.append(ent / n_tok.item())
            # reuse statistics, straight from the definitions: k3 = r - 1 - log r, clipped = r outside the interval
            kls.append(sum(((r - 1 - torch.log(r)) * m).sum() for r, m in stats).item() / n_tok.item())
            clips.append(sum((((r < 1 - cfg.epsilon) | (r > 1 + cfg.eps_high)) * m).sum() for r, m in stats).item()
                         / n_tok.item())
    reference_update.stats = (kls, clips)
    reference_update.logged = {"entropy": entropies, "learning_rate": lrs}
    return model.state_dict(), old


def max_diff(a: dict, b: dict) -> float:
    return max((a[k].float() - b[k].float()).abs().max().item() for k in a)


@pytest.mark.slow
def test_zero3_two_ranks_mu2_equals_single_process_reference(tmp_path, tiny_model_dir):
    cases = [{"name": lt, "loss_type": lt, "num_iterations": 2, "optimizer_steps_per_pass": 2,
              "gradient_accumulation_steps": 2} for lt in LOSS_TYPES]
    shape = {"num_iterations": 2, "optimizer_steps_per_pass": 2, "gradient_accumulation_steps": 2}
    cases.append({"name": "kl", "loss_type": "grpo", **shape, "beta": 0.1})
    # zero_std_filter: global groups 1 and 2 (one on each rank) have all-equal rewards and are left out
    cases.append({"name": "filter_dapo", "loss_type": "dapo", **shape, "zero_std_filter": True,
                  "zero_std_groups": [1, 2]})
    # ... with a sequence-level loss, KL and a schedule, which DeepSpeed must step once per optimizer step (2
    # micro-batches each), as transformers' scheduler does in the reference
    cases.append({"name": "filter_grpo_kl_cosine", "loss_type": "grpo", **shape, "beta": 0.1, "zero_std_filter": True,
                  "zero_std_groups": [1, 2], "lr_scheduler_type": "cosine", "warmup_steps": 1, "max_steps": 4,
                  "min_lr_ratio": 0.1})
    # ... and with no such group, the filter changes nothing, to the bit
    cases.append({"name": "filter_dapo_none", "loss_type": "dapo", **shape, "zero_std_filter": True})
    got = run_cases(tmp_path, 2, [dict(c) for c in cases], "parity")
    assert all(torch.equal(got["dapo"]["state"][k], v) for k, v in got["filter_dapo_none"]["state"].items())
    for case in cases:
        name, zero_std_groups = case.pop("name"), case.pop("zero_std_groups", ())
        cfg = Config(**{**BASE, **case})
        expected, old = reference_update(tiny_model_dir, cfg, world=2, zero_std_groups=zero_std_groups)
        kls, clips = reference_update.stats
        logged = reference_update.logged
        # entropy from the training forward's own logits, and the learning rate each step used
        torch.testing.assert_close(got[name]["entropy"], torch.tensor(logged["entropy"], dtype=torch.float64),
                                   atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(got[name]["learning_rate"], torch.tensor(logged["learning_rate"],
                                                                            dtype=torch.float64), atol=0, rtol=1e-12)
        # the adaptive-reuse statistics, logged per step, against the same quantities computed directly
        torch.testing.assert_close(got[name]["approx_kl"], torch.tensor(kls, dtype=torch.float64), atol=1e-6, rtol=1e-4)
        torch.testing.assert_close(got[name]["clip_ratio_region"], torch.tensor(clips, dtype=torch.float64),
                                   atol=1e-6, rtol=0)
        assert got[name]["approx_kl"][0] == 0 and got[name]["approx_kl"][-1] > 0
        initial = reference_update(tiny_model_dir, Config(**{**BASE, **case, "num_iterations": 1}), 2,
                                   zero_std_groups=zero_std_groups)[0]
        moved = max_diff(initial, expected)
        diff = max_diff(got[name]["state"], expected)
        assert moved > 1e-3, f"{name}: the update should move the weights (moved {moved})"
        assert diff < 1e-5, f"{name}: ZeRO-3 2-rank weights differ from the reference by {diff}"
        # Old log-probs: each trained sample's stored exactly once, equal to the pre-update policy's.
        trained = torch.cat([local_buffer(cfg, r, 2, zero_std_groups=zero_std_groups).active for r in range(2)])
        assert got[name]["stores"][trained].tolist() == [1] * int(trained.sum())
        mask = local_buffer(cfg, 0, 2, zero_std_groups=zero_std_groups).completion_mask  # trained tokens
        torch.testing.assert_close(got[name]["old_logps"].nan_to_num(0) * mask, old[0] * mask, atol=1e-5, rtol=1e-5)
        # optimizer_steps_per_pass = 2: the second step's half of the rollout needs a forward (gas micro-batches).
        assert got[name]["old_logp_forwards"] == cfg.gradient_accumulation_steps


@pytest.mark.slow
def test_same_update_on_1x4_and_2x2_micro_batch_splits(tmp_path):
    """The rollout of 8 completions: 1 rank x 4 micro-batches vs 2 ranks x 2 micro-batches, per loss type; with
    advantages computed from rewards as train.py does, per reward scaling (`batch`: the std of the whole batch,
    over all ranks); and with zero_std_filter leaving group 0 out, which on 2 ranks is all of rank 0's samples
    (it trains fillers only)."""
    filtered = {"dapo_filter": {"loss_type": "dapo", "zero_std_filter": True, "zero_std_groups": [0]}}
    variants = {lt: {"loss_type": lt} for lt in LOSS_TYPES} | filtered
    variants = {n: {**v, "num_iterations": 2} for n, v in variants.items()}
    variants |= {f"scale_{s}": {"scale_rewards": s, "from_rewards": True} for s in SCALES}
    one = [{"name": n, **v, "gradient_accumulation_steps": 4} for n, v in variants.items()]
    two = [{"name": n, **v, "gradient_accumulation_steps": 2} for n, v in variants.items()]
    for c in one + two:
        c["per_device_train_batch_size"] = 2
    got1 = run_cases(tmp_path, 1, one, "one")
    got2 = run_cases(tmp_path, 2, two, "two")
    for name in variants:
        diff = max_diff(got1[name]["state"], got2[name]["state"])
        assert diff < 1e-5, f"{name}: 1x4 vs 2x2 split differ by {diff}"
        # spg = 1: old log-probs are captured from the first pass's forward, never a separate forward.
        assert got1[name]["old_logp_forwards"] == 0 and got2[name]["old_logp_forwards"] == 0
        if not variants[name].get("from_rewards"):  # mu = 2: each trained sample's old log-probs stored once
            assert got2[name]["stores"][4 * (name in filtered):].tolist() == [1] * (8 - 4 * (name in filtered))
    assert max_diff(got1["dapo"]["state"], got1["dapo_filter"]["state"]) > 1e-4  # leaving the group out changed it
    rewards = fixed_rewards(8)
    for s in SCALES:
        name = f"scale_{s}"
        # rank 0 holds the first group on 2 ranks: its advantages must be those of the whole batch
        torch.testing.assert_close(got2[name]["advantages"], got1[name]["advantages"][:4], atol=1e-6, rtol=1e-6)
        if s == "batch":
            g0 = rewards[:4]
            torch.testing.assert_close(got2[name]["advantages"], (g0 - g0.mean()) / (rewards.std() + 1e-4))


# TRL 1.16's loss options, each a case of the update (tests/test_loss_trl.py: the same loss as TRL's on tensors)
LOSS_OPTIONS = {
    "cispo": {"loss_type": "cispo", "epsilon_high": 5.0},
    "sapo": {"loss_type": "sapo"},
    "grpo_sequence": {"loss_type": "grpo", "importance_sampling_level": "sequence"},
    "sapo_sequence": {"loss_type": "sapo", "importance_sampling_level": "sequence"},
    "dapo_delta": {"delta": 1.3, "learning_rate": 0.05},  # a step large enough for ratios past delta
    "dapo_off_policy_mask": {"off_policy_mask_threshold": 1e-4, "sampling_logps": True,
                             "generation_backend": "vllm", "vllm_importance_sampling_correction": False},
    "dapo_entropy_bonus": {"entropy_coef": 0.05},
    "grpo_kl_bias_corrected": {"loss_type": "grpo", "beta": 0.1, "use_bias_correction_kl": True},
    "luspo_sequence": {"loss_type": "luspo", "importance_sampling_level": "sequence"},
    "vespo": {"loss_type": "vespo", "learning_rate": 0.05},  # a step large enough for w to leave 1
    "dapo_top_entropy": {"top_entropy_quantile": 0.3},
    # a multi-turn rollout: tool results in the completions, attended to and never trained (with vLLM's drift)
    "dapo_tool_results": {"tool_tokens": True},
    "dapo_tool_results_sequence_mask": {"tool_tokens": True, "generation_backend": "vllm", "sampling_logps": True,
                                        "vllm_importance_sampling_mode": "sequence_mask",
                                        "vllm_importance_sampling_clip_min": 0.5},
    "dapo_top_entropy_bonus": {"top_entropy_quantile": 0.6, "entropy_coef": 0.05},
    # a target above any entropy: the bonus applies from the second step on, growing by delta
    "dapo_adaptive_entropy": {"use_adaptive_entropy": True, "entropy_coef": 0.05, "entropy_target": 100.0,
                              "entropy_coef_delta": 0.05},
    **{f"dapo_{mode}": {"generation_backend": "vllm", "vllm_importance_sampling_mode": mode, "sampling_logps": True,
                        "vllm_importance_sampling_clip_min": 0.5}
       for mode in ("token_truncate", "token_mask", "sequence_truncate", "sequence_mask")},
}


# At ratio 1 (a rollout's first pass, on-policy) these have exactly dapo's gradient, -A grad logp, and its normalizer.
SAME_ON_POLICY = ("cispo", "dapo_delta", "vespo")  # vespo: phi(1) = 1
SAME_AT_ONE_STEP = SAME_ON_POLICY + ("dapo_adaptive_entropy",)  # adaptive: no entropy measured before step 1


@pytest.mark.slow
@pytest.mark.parametrize("mu", [1, 2])
def test_trl_loss_options_give_the_same_update_on_1x4_and_2x2_splits(tmp_path, mu):
    """Every loss option of TRL 1.16 the recipe has: 1 rank x 4 micro-batches vs 2 ranks x 2, at mu = 1 and 2.
    Each option must also change the update (against plain dapo), or the case would test nothing."""
    variants = {"dapo": {}, "dapo_fast": {"learning_rate": 0.05}, **LOSS_OPTIONS}
    one = [{"name": n, **v, "num_iterations": mu, "gradient_accumulation_steps": 4} for n, v in variants.items()]
    two = [{"name": n, **v, "num_iterations": mu, "gradient_accumulation_steps": 2} for n, v in variants.items()]
    got1 = run_cases(tmp_path, 1, one, "one")
    got2 = run_cases(tmp_path, 2, two, "two")
    for name in variants:
        diff = max_diff(got1[name]["state"], got2[name]["state"])
        tol = 1e-5 * max(1.0, variants[name].get("learning_rate", 0.0) / 1e-2)  # float noise scales with Adam's step
        assert diff < tol, f"{name} (mu = {mu}): 1x4 vs 2x2 split differ by {diff}"
        torch.testing.assert_close(got1[name]["loss"], got2[name]["loss"], atol=1e-5, rtol=1e-4)
        for key, a in got1[name]["extra"].items():
            torch.testing.assert_close(a, got2[name]["extra"][key], atol=1e-5, rtol=1e-4, equal_nan=True)
    for name in LOSS_OPTIONS:
        base = "dapo_fast" if "learning_rate" in LOSS_OPTIONS[name] else "dapo"
        moved = max_diff(got1[name]["state"], got1[base]["state"])
        if mu == 1 and name in SAME_AT_ONE_STEP:
            assert moved < 1e-6, f"{name}: at one step its gradient is dapo's, yet the update differs by {moved}"
        else:
            assert moved > 1e-6, f"{name} (mu = {mu}) trained exactly as plain dapo: the option did nothing"
    assert (got1["dapo_token_mask"]["extra"]["is_zeroed_fraction"] > 0).all()
    assert (got1["dapo_token_truncate"]["extra"]["is_zeroed_fraction"] == 0).all()
    assert (got1["dapo_off_policy_mask"]["extra"]["off_policy_masked_fraction"] > 0).all()
    kept = got1["dapo_top_entropy"]["extra"]["high_entropy_fraction"]
    assert ((kept > 0.25) & (kept < 0.4)).all(), kept  # about the top 30% of the step's tokens (ties aside)
    coef = got1["dapo_adaptive_entropy"]["extra"]["entropy_coef"]
    torch.testing.assert_close(coef, torch.tensor([0.05 * (k + 2) for k in range(mu)], dtype=torch.float64))


@pytest.mark.slow
def test_mu1_never_computes_or_stores_old_logps(tmp_path):
    got = run_cases(tmp_path, 2, [{"name": "mu1", "num_iterations": 1, "gradient_accumulation_steps": 2}], "mu1")
    assert got["mu1"]["old_logp_forwards"] == 0
    assert got["mu1"]["stores"].sum().item() == 0
    assert torch.isnan(got["mu1"]["old_logps"]).all()


def test_non_finite_steps_are_skipped_within_the_allowance_then_stop():
    from grpo_recipe.algo.update import NonFiniteError, StepResult, check_finite

    ok = StepResult(0, 0, True, {"loss": 0.1, "grad_norm": 1.0}, 0, applied=True)
    skipped = StepResult(1, 0, True, {"loss": float("nan"), "grad_norm": float("inf")}, 0, applied=False)
    assert not check_finite(ok, 5, skipped=0, allowed=0)
    assert check_finite(skipped, 5, skipped=0, allowed=1)  # DeepSpeed did not apply it: one skip allowed
    with pytest.raises(NonFiniteError, match=r"loss = nan and grad_norm = inf at optimizer step 6 \(rollout pass 1, "
                                             r"step 0 of the pass\): 2 non-finite step\(s\), skip_nonfinite_steps "
                                             r"allows 1"):
        check_finite(skipped, 6, skipped=1, allowed=1)
    applied = StepResult(0, 0, True, {"loss": float("inf")}, 0, applied=True)
    with pytest.raises(NonFiniteError, match="the update was applied: the weights may be broken"):
        check_finite(applied, 7, skipped=0, allowed=5)  # cannot be skipped: stop whatever the allowance


def test_the_head_returns_log_probs_and_they_equal_the_logits_path_with_gradients(tiny_model_dir):
    """forward_logps through the fused head (the tiny Qwen2, tied head: the lookup completes the head's gradient)
    against log_softmax of the model's own logits: values, entropy and every parameter's gradient; and the head's
    output is [B, C] log-probs, no logits."""
    from transformers import AutoModelForCausalLM

    from grpo_recipe.algo.update import forward_logps, fused_head

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    assert fused_head(model) is model.lm_head
    ids = torch.randint(1, model.config.vocab_size, (3, 12))
    attn = torch.ones_like(ids)
    attn[0, :4], ids[0, :4] = 0, model.config.pad_token_id  # left padding: the embedding's padding row
    assert model.get_input_embeddings().padding_idx == model.config.pad_token_id
    shapes = []
    hook = model.lm_head.register_forward_hook(lambda m, i, o: shapes.append(tuple(o[0].shape)))
    logp, entropy = forward_logps(model, ids, attn, 5, 0.7, with_entropy=True)
    hook.remove()
    assert shapes == [(3, 5)]
    assert "forward" not in vars(model.lm_head) and "forward" not in vars(model.get_input_embeddings())  # back
    assert not any("forward" in vars(m) for m in model.modules())  # the MLPs' too
    (logp * torch.linspace(-1, 1, 15).view(3, 5)).sum().backward()
    got = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad()
    pos = (attn.cumsum(-1) - 1).clamp(min=0)
    x = model(input_ids=ids, attention_mask=attn, position_ids=pos).logits[:, -6:-1].float() / 0.7
    want = torch.log_softmax(x, -1).gather(-1, ids[:, -5:].unsqueeze(-1)).squeeze(-1)
    (want * torch.linspace(-1, 1, 15).view(3, 5)).sum().backward()
    torch.testing.assert_close(logp, want, atol=1e-5, rtol=0)
    torch.testing.assert_close(entropy, torch.distributions.Categorical(logits=x.detach()).entropy(), atol=1e-5,
                               rtol=0)
    for n, p in model.named_parameters():
        torch.testing.assert_close(got[n], p.grad, atol=1e-6, rtol=1e-4, msg=n)


def test_a_head_that_is_not_a_plain_linear_of_a_listed_architecture_keeps_the_logits_path(tiny_model_dir):
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    from grpo_recipe.algo.update import fused_head

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    lora_elsewhere = get_peft_model(model, LoraConfig(r=2, target_modules=["q_proj"]))
    assert fused_head(lora_elsewhere) is lora_elsewhere.get_output_embeddings()  # through peft's wrapper
    lora_on_head = get_peft_model(AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32),
                                  LoraConfig(r=2, target_modules=["lm_head"]))
    assert fused_head(lora_on_head) is None  # W + BA: the head is peft's layer
    model.config.model_type = "gemma2"  # its forward caps the logits after the head
    assert fused_head(model) is None
