"""A full GRPO update under ZeRO-3 on real gloo ranks vs an independent single-process PyTorch reference."""
import json

import pytest
import torch

from conftest import torchrun
from dist_update import BASE, fixed_rewards, local_buffer
from recipe.config import Config

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


def reference_update(tiny_model_dir, cfg: Config, world: int, wrap=None):
    """Plain PyTorch: one model, one AdamW, each optimizer step's samples from all ranks in one batch.

    `wrap(model)` may replace the model (e.g. with a peft LoRA model); AdamW then gets its trainable parameters.
    """
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    if wrap is not None:
        model = wrap(model)
    ref_model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=cfg.learning_rate,
                            betas=(cfg.adam_beta1, cfg.adam_beta2), eps=cfg.adam_epsilon, weight_decay=cfg.weight_decay)
    bufs = [local_buffer(cfg, r, world) for r in range(world)]
    with torch.no_grad():
        old = [ref_logps(model, b, torch.arange(len(b))) for b in bufs]
    spg = cfg.optimizer_steps_per_pass
    rollout_tokens = sum(b.completion_mask.sum() for b in bufs)
    kls, clips = [], []
    for p in range(cfg.num_iterations):
        for s in range(spg):
            terms, n_seq, n_tok, stats = [], 0, 0.0, []
            for r, b in enumerate(bufs):
                idx = torch.cat(b.schedule(p, spg, cfg.per_device_train_batch_size)[s])
                lp = ref_logps(model, b, idx)
                ratio = torch.exp(lp - old[r][idx])
                adv = b.advantages[idx].unsqueeze(-1)
                tok = -torch.min(ratio * adv, ratio.clamp(1 - cfg.epsilon, 1 + cfg.eps_high) * adv)
                if cfg.beta > 0:
                    with torch.no_grad():
                        rl = ref_logps(ref_model, b, idx)
                    tok = tok + cfg.beta * (torch.exp(rl - lp) - (rl - lp) - 1)
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
            # reuse statistics, straight from the definitions: k3 = r - 1 - log r, clipped = r outside the interval
            kls.append(sum(((r - 1 - torch.log(r)) * m).sum() for r, m in stats).item() / n_tok.item())
            clips.append(sum((((r < 1 - cfg.epsilon) | (r > 1 + cfg.eps_high)) * m).sum() for r, m in stats).item()
                         / n_tok.item())
    reference_update.stats = (kls, clips)
    return model.state_dict(), old


def max_diff(a: dict, b: dict) -> float:
    return max((a[k].float() - b[k].float()).abs().max().item() for k in a)


@pytest.mark.slow
def test_zero3_two_ranks_mu2_equals_single_process_reference(tmp_path, tiny_model_dir):
    cases = [{"name": lt, "loss_type": lt, "num_iterations": 2, "optimizer_steps_per_pass": 2,
              "gradient_accumulation_steps": 2} for lt in LOSS_TYPES]
    cases.append({"name": "kl", "loss_type": "grpo", "num_iterations": 2, "optimizer_steps_per_pass": 2,
                  "gradient_accumulation_steps": 2, "beta": 0.1})
    got = run_cases(tmp_path, 2, [dict(c) for c in cases], "parity")
    for case in cases:
        name = case.pop("name")
        cfg = Config(**{**BASE, **case})
        expected, old = reference_update(tiny_model_dir, cfg, world=2)
        kls, clips = reference_update.stats
        # the adaptive-reuse statistics, logged per step, against the same quantities computed directly
        torch.testing.assert_close(got[name]["approx_kl"], torch.tensor(kls, dtype=torch.float64), atol=1e-6, rtol=1e-4)
        torch.testing.assert_close(got[name]["clip_ratio_region"], torch.tensor(clips, dtype=torch.float64),
                                   atol=1e-6, rtol=0)
        assert got[name]["approx_kl"][0] == 0 and got[name]["approx_kl"][-1] > 0
        initial = reference_update(tiny_model_dir, Config(**{**BASE, **case, "num_iterations": 1}), 2)[0]
        moved = max_diff(initial, expected)
        diff = max_diff(got[name]["state"], expected)
        assert moved > 1e-3, f"{name}: the update should move the weights (moved {moved})"
        assert diff < 1e-5, f"{name}: ZeRO-3 2-rank weights differ from the reference by {diff}"
        # Old log-probs: each sample's stored exactly once, equal to the pre-update policy's.
        assert got[name]["stores"].tolist() == [1] * len(got[name]["stores"])
        torch.testing.assert_close(got[name]["old_logps"].nan_to_num(0) * local_buffer(cfg, 0, 2).completion_mask,
                                   old[0] * local_buffer(cfg, 0, 2).completion_mask, atol=1e-5, rtol=1e-5)
        # optimizer_steps_per_pass = 2: the second step's half of the rollout needs a forward (gas micro-batches).
        assert got[name]["old_logp_forwards"] == cfg.gradient_accumulation_steps


@pytest.mark.slow
def test_same_update_on_1x4_and_2x2_micro_batch_splits(tmp_path):
    """The rollout of 8 completions: 1 rank x 4 micro-batches vs 2 ranks x 2 micro-batches, per loss type, and
    with advantages computed from rewards as train.py does, per reward scaling (`batch`: the std of the whole
    batch, over all ranks)."""
    one = [{"name": lt, "loss_type": lt, "num_iterations": 2, "gradient_accumulation_steps": 4} for lt in LOSS_TYPES]
    two = [{"name": lt, "loss_type": lt, "num_iterations": 2, "gradient_accumulation_steps": 2} for lt in LOSS_TYPES]
    one += [{"name": f"scale_{s}", "scale_rewards": s, "from_rewards": True, "gradient_accumulation_steps": 4}
            for s in SCALES]
    two += [{"name": f"scale_{s}", "scale_rewards": s, "from_rewards": True, "gradient_accumulation_steps": 2}
            for s in SCALES]
    for c in one + two:
        c["per_device_train_batch_size"] = 2
    got1 = run_cases(tmp_path, 1, one, "one")
    got2 = run_cases(tmp_path, 2, two, "two")
    for lt in LOSS_TYPES:
        diff = max_diff(got1[lt]["state"], got2[lt]["state"])
        assert diff < 1e-5, f"{lt}: 1x4 vs 2x2 split differ by {diff}"
        # spg = 1: old log-probs are captured from the first pass's forward, never a separate forward.
        assert got1[lt]["old_logp_forwards"] == 0 and got2[lt]["old_logp_forwards"] == 0
        assert got2[lt]["stores"].tolist() == [1] * 8
    rewards = fixed_rewards(8)
    for s in SCALES:
        name = f"scale_{s}"
        # rank 0 holds the first group on 2 ranks: its advantages must be those of the whole batch
        torch.testing.assert_close(got2[name]["advantages"], got1[name]["advantages"][:4], atol=1e-6, rtol=1e-6)
        if s == "batch":
            g0 = rewards[:4]
            torch.testing.assert_close(got2[name]["advantages"], (g0 - g0.mean()) / (rewards.std() + 1e-4))
        diff = max_diff(got1[name]["state"], got2[name]["state"])
        assert diff < 1e-5, f"scale_rewards {s}: 1 vs 2 ranks differ by {diff}"


@pytest.mark.slow
def test_mu1_never_computes_or_stores_old_logps(tmp_path):
    got = run_cases(tmp_path, 2, [{"name": "mu1", "num_iterations": 1, "gradient_accumulation_steps": 2}], "mu1")
    assert got["mu1"]["old_logp_forwards"] == 0
    assert got["mu1"]["stores"].sum().item() == 0
    assert torch.isnan(got["mu1"]["old_logps"]).all()


def test_non_finite_steps_are_skipped_within_the_allowance_then_stop():
    from recipe.update import NonFiniteError, StepResult, check_finite

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
