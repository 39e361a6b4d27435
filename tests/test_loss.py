"""Loss math against direct formulas (no DeepSpeed)."""
import math

import pytest
import torch

from grpo_recipe.algo.loss import (
    LossSpec,
    clip_counts,
    group_advantages,
    head_token_logps,
    tied_embedding,
    k3_kl,
    loss_normalizers,
    policy_loss,
    reduce_loss,
    token_logps,
    truncated_is_weights,
    zero_std_groups,
)

LOSS_TYPES = ("grpo", "step_token_mean", "dr_grpo", "dapo")


def _batch(seed=0, b=4, t=6):
    g = torch.Generator().manual_seed(seed)
    logp = -torch.rand(b, t, generator=g) * 3
    old = logp + 0.3 * torch.randn(b, t, generator=g)
    adv = torch.randn(b, generator=g)
    mask = torch.ones(b, t)
    mask[0, 4:] = 0
    mask[2, 2:] = 0
    return logp, old, adv, mask


def direct_loss(logp, old, adv, mask, loss_type, normalizer, max_len, eps_lo=0.2, eps_hi=0.28, beta=0.0, ref=None,
                w=None):
    """Element by element, straight from the definitions."""
    b, t = logp.shape
    per_seq, total = [], 0.0
    for i in range(b):
        row = []
        for j in range(t):
            r = math.exp(logp[i, j] - old[i, j])
            a = adv[i].item()
            val = -min(r * a, min(max(r, 1 - eps_lo), 1 + eps_hi) * a)
            if w is not None:  # the IS weight scales the surrogate only
                val *= w[i][j]
            if beta:
                d = (ref[i, j] - logp[i, j]).item()
                val += beta * (math.exp(d) - d - 1)
            if mask[i, j]:
                row.append(val)
        per_seq.append(row)
    if loss_type == "grpo":
        total = sum(sum(r) / max(len(r), 1) for r in per_seq)
    elif loss_type == "dr_grpo":
        total = sum(sum(r) / max_len for r in per_seq)
    else:
        total = sum(sum(r) for r in per_seq)
    return total / normalizer


@pytest.mark.parametrize("loss_type", LOSS_TYPES)
@pytest.mark.parametrize("beta", [0.0, 0.05])
def test_policy_loss_matches_direct_formula(loss_type, beta):
    logp, old, adv, mask = _batch()
    ref = logp - 0.2
    loss, _ = policy_loss(logp, old, adv, mask, loss_type=loss_type, eps_low=0.2, eps_high=0.28,
                          normalizer=3.5, max_completion_length=10, beta=beta, ref_logp=ref)
    expected = direct_loss(logp, old, adv, mask, loss_type, 3.5, 10, beta=beta, ref=ref)
    assert loss.item() == pytest.approx(expected, rel=1e-5, abs=1e-6)


@pytest.mark.parametrize("loss_type", LOSS_TYPES)
def test_mu1_gradient_is_plain_policy_gradient(loss_type):
    """With old = logp.detach() the ratio is 1 and the gradient is that of -A * logp, same normalization."""
    logits = torch.randn(3, 5, 11, requires_grad=True)
    ids = torch.randint(0, 11, (3, 5))
    mask = torch.tensor([[1, 1, 1, 0, 0], [1, 1, 1, 1, 1], [1, 0, 0, 0, 0]], dtype=torch.float)
    adv = torch.tensor([0.7, -1.2, 0.4])
    logp = token_logps(logits, ids)
    loss, _ = policy_loss(logp, logp.detach(), adv, mask, loss_type=loss_type, eps_low=0.2, eps_high=0.2,
                          normalizer=2.0, max_completion_length=5)
    (g,) = torch.autograd.grad(loss, logits)

    logits2 = logits.detach().clone().requires_grad_(True)
    lp = torch.log_softmax(logits2, -1).gather(-1, ids.unsqueeze(-1)).squeeze(-1)
    pg = -adv.unsqueeze(-1) * lp * mask
    if loss_type == "grpo":
        ref = (pg.sum(-1) / mask.sum(-1)).sum() / 2.0
    elif loss_type == "dr_grpo":
        ref = (pg.sum(-1) / 5).sum() / 2.0
    else:
        ref = pg.sum() / 2.0
    (g_ref,) = torch.autograd.grad(ref, logits2)
    torch.testing.assert_close(g, g_ref, rtol=1e-5, atol=1e-7)


def test_clipping_zeroes_gradient_exactly_where_it_should():
    eps_lo, eps_hi = 0.2, 0.3
    ratios = torch.tensor([[0.5, 0.9, 1.0, 1.2, 1.6], [0.5, 0.9, 1.0, 1.2, 1.6]])
    adv = torch.tensor([1.0, -1.0])
    old = torch.zeros(2, 5)
    logp = torch.log(ratios).requires_grad_(True)
    mask = torch.ones(2, 5)
    loss, stats = policy_loss(logp, old, adv, mask, loss_type="step_token_mean", eps_low=eps_lo, eps_high=eps_hi,
                              normalizer=1.0, max_completion_length=5)
    (g,) = torch.autograd.grad(loss, logp)
    # A > 0: only r > 1 + eps_hi (1.6) is clipped; A < 0: only r < 1 - eps_lo (0.5) is clipped.
    expected_zero = torch.tensor([[False, False, False, False, True], [True, False, False, False, False]])
    assert torch.equal(g == 0, expected_zero)
    assert torch.all(g[~expected_zero].abs() > 0)
    # pessimistic side keeps the gradient: A > 0, r = 0.5 and A < 0, r = 1.6 still train
    low, high, region, total = stats["clip_counts"].tolist()
    assert (low, high, region, total) == (1, 1, 4, 10)


def test_reduce_loss_units_and_mask():
    per_token = torch.tensor([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0]])
    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 1.0, 1.0]])
    assert reduce_loss(per_token, mask, "grpo", 2.0, 3).item() == pytest.approx((1.5 + 5.0) / 2)
    assert reduce_loss(per_token, mask, "dr_grpo", 2.0, 3).item() == pytest.approx((3 / 3 + 15 / 3) / 2)
    assert reduce_loss(per_token, mask, "step_token_mean", 5.0, 3).item() == pytest.approx(18 / 5)
    with pytest.raises(ValueError, match="loss_type"):
        reduce_loss(per_token, mask, "ppo", 1.0, 3)


def test_group_advantages_use_trls_formula():
    r = torch.tensor([1.0, 2.0, 3.0, 4.0, 5.0, 5.0, 5.0, 5.0])
    a = group_advantages(r, 4, "group")
    g0 = torch.tensor([1.0, 2.0, 3.0, 4.0])
    torch.testing.assert_close(a[:4], (g0 - g0.mean()) / (g0.std() + 1e-4))  # TRL: std + 1e-4, not a floor
    assert torch.equal(a[4:], torch.zeros(4))  # zero-std group: zero advantage, never NaN
    b = group_advantages(r, 4, "batch", batch_std=2.5)  # the caller's std of the whole batch, all ranks
    torch.testing.assert_close(b[:4], (g0 - g0.mean()) / (2.5 + 1e-4))
    with pytest.raises(ValueError, match="needs batch_std"):  # a rank's own std would depend on the rank count
        group_advantages(r, 4, "batch")
    n = group_advantages(r, 4, "none")
    torch.testing.assert_close(n[:4], g0 - g0.mean())
    assert not torch.isnan(group_advantages(torch.ones(8), 4, "batch", batch_std=0.0)).any()
    small = torch.tensor([0.0, 0.001, 0.002, 0.003])  # small spread: the formulas differ most here
    torch.testing.assert_close(group_advantages(small, 4), (small - small.mean()) / (small.std() + 1e-4))


def test_token_logps_and_k3():
    logits = torch.randn(2, 3, 7)
    ids = torch.randint(0, 7, (2, 3))
    expected = torch.log_softmax(logits / 0.7, -1).gather(-1, ids.unsqueeze(-1)).squeeze(-1)
    torch.testing.assert_close(token_logps(logits, ids, 0.7), expected)
    lp, ref = torch.tensor([-1.0, -2.0]), torch.tensor([-1.0, -1.5])
    kl = k3_kl(lp, ref)
    assert kl[0].item() == 0.0 and kl[1].item() == pytest.approx(math.exp(0.5) - 0.5 - 1)


def test_ratio_and_approx_kl_stats_match_direct_sums():
    """The replay statistics (mean ratio, k3 KL of the rollout's policy from the current one) come from the
    loss's own ratios; element by element they are r and r - 1 - log r over the masked tokens."""
    logp, old, adv, mask = _batch(seed=3)
    _, stats = policy_loss(logp, old, adv, mask, loss_type="dapo", eps_low=0.2, eps_high=0.28, normalizer=1.0,
                           max_completion_length=6)
    ratios = [math.exp(logp[i, j] - old[i, j]) for i in range(4) for j in range(6) if mask[i, j]]
    assert stats["ratio_sum"].item() == pytest.approx(sum(ratios), rel=1e-5)
    assert stats["approx_kl_sum"].item() == pytest.approx(sum(r - 1 - math.log(r) for r in ratios), rel=1e-4)
    _, same = policy_loss(old, old, adv, mask, loss_type="dapo", eps_low=0.2, eps_high=0.28, normalizer=1.0,
                          max_completion_length=6)
    assert same["approx_kl_sum"].item() == 0.0 and same["ratio_sum"].item() == mask.sum().item()


def test_clip_counts_respects_mask():
    coef = torch.tensor([[0.1, 5.0]])
    counts = clip_counts(coef, torch.tensor([1.0]), torch.tensor([[1.0, 0.0]]), LossSpec(eps_low=0.2, eps_high=0.2))
    assert counts.tolist() == [0.0, 0.0, 1.0, 1.0]


def test_truncated_is_weights_match_direct_formula():
    logp, old, _, mask = _batch(seed=3)
    sampling = old + 0.5 * torch.randn(old.shape, generator=torch.Generator().manual_seed(4))
    sampling[mask == 0] = float("nan")  # padding: whatever the sampler left there must not leak
    w, raw = truncated_is_weights(old, sampling, mask, cap=1.3)
    for i in range(old.shape[0]):
        for j in range(old.shape[1]):
            if mask[i, j]:
                r = math.exp(old[i, j].item() - sampling[i, j].item())
                assert raw[i, j].item() == pytest.approx(r, rel=1e-6)
                assert w[i, j].item() == pytest.approx(min(r, 1.3), rel=1e-6)
            else:
                assert w[i, j].item() == 1.0 and raw[i, j].item() == 1.0
    assert (w < raw).any() and (w == raw).any()  # the cap bit somewhere, and not everywhere
    assert not w.requires_grad


@pytest.mark.parametrize("loss_type", LOSS_TYPES)
def test_policy_loss_with_is_weights_matches_direct_formula(loss_type):
    logp, old, adv, mask = _batch(seed=5)
    ref = logp - 0.1
    sampling = old - 0.3 * torch.rand(old.shape, generator=torch.Generator().manual_seed(6))
    w, _ = truncated_is_weights(old, sampling, mask, cap=1.2)
    loss, _ = policy_loss(logp, old, adv, mask, loss_type=loss_type, eps_low=0.2, eps_high=0.28, normalizer=2.5,
                          max_completion_length=10, beta=0.05, ref_logp=ref, is_weights=w)
    expected = direct_loss(logp, old, adv, mask, loss_type, 2.5, 10, beta=0.05, ref=ref,
                           w=[[min(math.exp(o - s), 1.2) for o, s in zip(ro.tolist(), rs.tolist())]
                              for ro, rs in zip(old, sampling)])
    assert loss.item() == pytest.approx(expected, rel=1e-5, abs=1e-6)


def test_loss_normalizers_are_each_loss_types_units_per_step_over_world():
    """Units in the whole optimizer step over all ranks / world size; dapo: the rollout's mean tokens per step."""
    tokens = torch.tensor([[30.0, 50.0, 0.0], [40.0, 20.0, 20.0]])  # [pass, step], summed over 2 ranks
    seqs = torch.full((2, 3), 16.0)  # 8 sequences per step on each of 2 ranks
    for lt in ("grpo", "dr_grpo"):
        assert loss_normalizers(lt, tokens, step_sequences=seqs, world_size=2).tolist() == [[8.0] * 3] * 2
    # zero_std_filter: steps train different numbers of sequences; a step with none divides by 1, not 0
    fewer = torch.tensor([[16.0, 5.0, 0.0], [3.0, 9.0, 16.0]])
    assert loss_normalizers("grpo", tokens, fewer, 2).tolist() == [[8.0, 2.5, 0.5], [1.5, 4.5, 8.0]]
    assert loss_normalizers("step_token_mean", tokens, seqs, 2).tolist() == [[15.0, 25.0, 0.5], [20.0, 10.0, 10.0]]
    assert loss_normalizers("dapo", tokens, seqs, 2).flatten().tolist() == pytest.approx([80 / 3 / 2] * 6)
    with pytest.raises(ValueError, match="loss_type"):
        loss_normalizers("ppo", tokens, seqs, 2)


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_entropy_comes_with_the_log_probs_and_equals_the_direct_formula(temperature, monkeypatch):
    import grpo_recipe.algo.loss as loss_mod

    monkeypatch.setattr(loss_mod, "LOGPS_CHUNK_ELEMENTS", 3 * 11)  # several chunks of positions
    g = torch.Generator().manual_seed(4)
    logits = torch.randn(3, 5, 11, generator=g) * 3
    logits[0, 0, 0] = 40.0  # a near one-hot position: entropy near 0
    ids = torch.randint(0, 11, (3, 5), generator=g)
    plain = token_logps(logits, ids, temperature)
    logp, entropy = token_logps(logits.requires_grad_(), ids, temperature, with_entropy=True)
    assert torch.equal(logp, plain) and not entropy.requires_grad
    p = torch.softmax(logits.detach().double() / temperature, -1)
    direct = -(p * p.log()).sum(-1)  # H = -sum p log p, element by element in float64
    torch.testing.assert_close(entropy.double(), direct, atol=1e-5, rtol=1e-5)
    assert entropy[0, 0] < 1e-6 and (entropy <= math.log(11) + 1e-5).all()


def test_zero_std_groups_are_the_groups_whose_rewards_are_all_equal():
    rewards = torch.tensor([1.0, 1.0, 1.0, 1.0, 0.0, 1.0, 0.0, 0.0, -2.5, -2.5, -2.5, -2.5])
    assert zero_std_groups(rewards, 4).tolist() == [True, False, True]
    assert group_advantages(rewards, 4)[torch.arange(12) // 4 != 1].abs().max() == 0  # they teach nothing
    assert zero_std_groups(torch.tensor([0.3, 0.3 + 1e-7]), 2).tolist() == [False]


@pytest.mark.parametrize("own_logits", [False, True])
@pytest.mark.parametrize("chunk", [1 << 24, 5])  # one chunk per row; several chunks per row
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_token_logps_equal_full_log_softmax_with_gradient(monkeypatch, chunk, temperature, own_logits):
    """The chunked selective log-softmax against the full fp32 log-softmax, values and gradients (float64 truth)."""
    import grpo_recipe.algo.loss as loss_mod

    monkeypatch.setattr(loss_mod, "LOGPS_CHUNK_ELEMENTS", chunk * 13)
    g = torch.Generator().manual_seed(0)
    leaf = (torch.randn(3, 9, 13, generator=g) * 4).requires_grad_(True)  # 9 positions, the last ignored
    ids = torch.randint(0, 13, (3, 8), generator=g)
    w = torch.randn(3, 8, generator=g)
    logits = leaf * 1.0  # a non-leaf, as a model's output is
    full = leaf.detach().double().requires_grad_(True)
    got = token_logps(logits, ids, temperature, own_logits=own_logits)
    (grad,) = torch.autograd.grad((got * w).sum(), leaf)
    want = torch.log_softmax(full[:, :8] / temperature, -1).gather(-1, ids.unsqueeze(-1)).squeeze(-1)
    (want_grad,) = torch.autograd.grad((want * w.double()).sum(), full)
    assert got.dtype == torch.float32
    torch.testing.assert_close(got.double(), want, atol=1e-5, rtol=0)
    torch.testing.assert_close(grad.double(), want_grad, atol=1e-5, rtol=0)
    assert grad[:, 8].abs().max() == 0  # the position past the completion gets no gradient


def test_token_logps_of_bf16_logits_are_fp32_and_keep_the_logits_dtype_for_the_gradient():
    logits = torch.randn(2, 4, 50, dtype=torch.bfloat16, requires_grad=True)
    ids = torch.randint(0, 50, (2, 4))
    got = token_logps(logits, ids)
    want = torch.log_softmax(logits.detach().float(), -1).gather(-1, ids.unsqueeze(-1)).squeeze(-1)
    assert got.dtype == torch.float32
    torch.testing.assert_close(got, want, atol=1e-5, rtol=0)
    got.sum().backward()
    assert logits.grad.dtype == torch.bfloat16


@pytest.mark.parametrize("entropy_grad", [False, True])
@pytest.mark.parametrize("chunk_rows", [1 << 20, 4])  # one chunk; several chunks across the batch's rows
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_fused_head_log_probs_and_entropy_equal_the_logits_computation_with_gradients(monkeypatch, chunk_rows,
                                                                                       temperature, entropy_grad):
    """The head computing log-probs chunk by chunk, against log_softmax of the whole logits hidden @ W.T + b in
    float64: values, entropy, and the gradients of hidden, W and b (with an entropy bonus in the loss or not)."""
    import grpo_recipe.algo.loss as loss_mod

    monkeypatch.setattr(loss_mod, "HEAD_CHUNK_ELEMENTS", chunk_rows * 13)
    g = torch.Generator().manual_seed(1)
    hidden = torch.randn(3, 9, 5, generator=g).requires_grad_(True)  # 9 positions, the last ignored
    weight = (torch.randn(13, 5, generator=g) * 2).requires_grad_(True)
    bias = torch.randn(13, generator=g).requires_grad_(True)
    ids = torch.randint(0, 13, (3, 8), generator=g)
    w, v = torch.randn(3, 8, generator=g), torch.randn(3, 8, generator=g)
    logp, entropy = head_token_logps(hidden * 1.0, weight, bias, ids, temperature, with_entropy=True,
                                     entropy_grad=entropy_grad)
    loss = (logp * w).sum() + ((entropy * v).sum() if entropy_grad else 0.0)
    grads = torch.autograd.grad(loss, (hidden, weight, bias))
    h64, w64, b64 = (t.detach().double().requires_grad_(True) for t in (hidden, weight, bias))
    x = torch.nn.functional.linear(h64[:, :8], w64, b64) / temperature
    want = torch.log_softmax(x, -1).gather(-1, ids.unsqueeze(-1)).squeeze(-1)
    want_entropy = -(torch.softmax(x, -1) * torch.log_softmax(x, -1)).sum(-1)
    want_loss = (want * w.double()).sum() + ((want_entropy * v.double()).sum() if entropy_grad else 0.0)
    want_grads = torch.autograd.grad(want_loss, (h64, w64, b64))
    assert logp.dtype == entropy.dtype == torch.float32 and entropy.requires_grad == entropy_grad
    torch.testing.assert_close(logp.double(), want.detach(), atol=1e-5, rtol=0)
    torch.testing.assert_close(entropy.double(), want_entropy.detach(), atol=5e-5, rtol=0)
    for got, expected in zip(grads, want_grads):
        torch.testing.assert_close(got.double(), expected, atol=1e-4, rtol=1e-4)
    assert grads[0][:, 8].abs().max() == 0  # the position past the completion gets no gradient


def test_fused_head_of_a_bf16_head_gives_fp32_log_probs_and_bf16_gradients_close_to_the_logits_path():
    g = torch.Generator().manual_seed(2)
    hidden = torch.randn(2, 5, 8, generator=g).bfloat16().requires_grad_(True)
    weight = torch.randn(50, 8, generator=g).bfloat16().requires_grad_(True)
    ids = torch.randint(0, 50, (2, 4), generator=g)
    got = head_token_logps(hidden, weight, None, ids)
    got.sum().backward()
    logits = torch.nn.functional.linear(hidden.detach(), weight.detach())  # bf16, as the model's head computes
    want = torch.log_softmax(logits.float(), -1)[:, :4].gather(-1, ids.unsqueeze(-1)).squeeze(-1)
    assert got.dtype == torch.float32 and hidden.grad.dtype == weight.grad.dtype == torch.bfloat16
    torch.testing.assert_close(got, want, atol=1e-5, rtol=0)  # the same bf16 logits, upcast


@pytest.mark.parametrize("head_has_gradient", [True, False])
def test_a_tied_lookup_completes_the_heads_deferred_gradient_in_place(head_has_gradient):
    """Embedding and head sharing W: the head leaves W's gradient to the lookup, which adds its rows (none for
    the padding row) and returns the sum; equal to autograd's sum of the two plain paths' gradients."""
    g = torch.Generator().manual_seed(3)
    weight = torch.randn(13, 5, generator=g).requires_grad_(True)
    ids = torch.randint(0, 13, (2, 6), generator=g)
    ids[0, :2] = 0  # the padding row
    w = torch.randn(2, 5, generator=g)

    def loss(embed, head):
        hidden = torch.tanh(embed(ids))  # a stand-in for the layers
        logp = head(hidden)
        return (logp * w).sum() if head_has_gradient else hidden.sum()

    deferred = {}
    got = loss(lambda x: tied_embedding(x, weight, 0, deferred),
               lambda h: head_token_logps(h, weight, None, ids[:, 1:], deferred=deferred))
    (grad,) = torch.autograd.grad(got, weight)
    want = loss(lambda x: torch.nn.functional.embedding(x, weight, 0),
                lambda h: token_logps(torch.nn.functional.linear(h, weight), ids[:, 1:]))
    (want_grad,) = torch.autograd.grad(want, weight)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=0)
    torch.testing.assert_close(grad, want_grad, atol=1e-5, rtol=1e-5)
    assert deferred == {}  # consumed


def test_chunks_are_cache_sized_on_cpu_and_few_on_a_gpu():
    """A 152k vocabulary: 4 MiB chunks are ~7 positions (fine for a CPU's cache, thousands of kernel launches on a
    GPU); on CUDA a chunk covers hundreds of positions."""
    from grpo_recipe.algo.loss import HEAD_CHUNK_ELEMENTS, LOGPS_CHUNK_ELEMENTS, chunk_elements

    vocab = 151936
    assert chunk_elements(torch.device("cpu"), LOGPS_CHUNK_ELEMENTS) // vocab == 6
    assert chunk_elements(torch.device("cuda", 1), LOGPS_CHUNK_ELEMENTS) // vocab >= 400
    assert chunk_elements(torch.device("cuda", 0), HEAD_CHUNK_ELEMENTS) // vocab >= 400


def test_tf32_is_on_only_inside_a_mixed_precision_heads_gradient_sum():
    from grpo_recipe.algo.loss import tf32_matmuls

    before = torch.backends.cuda.matmul.allow_tf32
    with tf32_matmuls(True):
        assert torch.backends.cuda.matmul.allow_tf32 is True
    assert torch.backends.cuda.matmul.allow_tf32 == before
    torch.backends.cuda.matmul.allow_tf32 = False
    try:
        with tf32_matmuls(False):
            assert torch.backends.cuda.matmul.allow_tf32 is False  # an fp32 run keeps full fp32
    finally:
        torch.backends.cuda.matmul.allow_tf32 = before


def test_gdpo_normalizes_each_function_within_its_group_before_the_weighted_sum():
    """normalize_then_sum against a plain loop: per group and function, (r - mean) / (sample std + 1e-4) over the
    completions the function applies to (NaN: it does not), weighted, summed over the functions it applies to."""
    from grpo_recipe.algo.loss import batch_normalized, normalized_sum

    g = torch.Generator().manual_seed(0)
    G, groups, K = 4, 3, 3
    per_func = torch.randn(groups * G, K, generator=g) * torch.tensor([1.0, 10.0, 0.1])
    per_func[1, 2] = per_func[5, 0] = per_func[6, 2] = float("nan")  # not applicable there
    per_func[8:12, 1] = 7.0  # a function that scores a whole group alike: 0 there
    weights = torch.tensor([1.0, 0.5, 2.0])
    want = torch.zeros(groups * G, dtype=torch.float64)
    for grp in range(groups):
        rows = range(grp * G, (grp + 1) * G)
        for k in range(K):
            vals = [float(per_func[i, k]) for i in rows if not math.isnan(per_func[i, k])]
            mean = sum(vals) / len(vals)
            std = (sum((v - mean) ** 2 for v in vals) / (len(vals) - 1)) ** 0.5 if len(vals) > 1 else 0.0
            for i in rows:
                if not math.isnan(per_func[i, k]):
                    want[i] += float(weights[k]) * (float(per_func[i, k]) - mean) / (std + 1e-4)
    got = normalized_sum(per_func, weights, G)
    torch.testing.assert_close(got.double(), want, atol=1e-5, rtol=1e-5)
    assert got[8:12].abs().max() > 0  # the others still move that group
    adv = batch_normalized(got, got.double().mean().item(), got.double().std().item())
    assert abs(adv.mean().item()) < 1e-6 and abs(adv.std().item() - 1.0) < 1e-3
