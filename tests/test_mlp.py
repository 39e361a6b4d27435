"""algo/mlp.py: the gated down projection against autograd's own ops, what it keeps for the backward, and which
MLPs it serves."""
import pytest
import torch
import torch.nn.functional as F

from grpo_recipe.algo.mlp import gated_down, gated_mlps


def kept_bytes(fn):
    """fn()'s result and the bytes of the distinct storages autograd keeps for its backward."""
    kept = {}

    def pack(t):
        kept[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = fn()
    return out, sum(kept.values())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("bias", [False, True])
def test_gated_down_gives_autograds_values_and_gradients_and_keeps_two_activations(dtype, bias):
    torch.manual_seed(0)
    batch, seq, inner, hidden = 3, 7, 48, 16
    gate, up = (torch.randn(batch, seq, inner, dtype=dtype, requires_grad=True) for _ in range(2))
    weight = (torch.randn(hidden, inner) / inner ** 0.5).to(dtype).requires_grad_()
    b = torch.randn(hidden, dtype=dtype, requires_grad=True) if bias else None
    grad_out = torch.randn(batch, seq, hidden, dtype=dtype)
    inputs = [gate, up, weight] + ([b] if bias else [])

    want, want_kept = kept_bytes(lambda: F.linear(F.silu(gate) * up, weight, b))
    got, got_kept = kept_bytes(lambda: gated_down(gate, up, weight, b))
    torch.testing.assert_close(got, want, atol=0, rtol=0)
    for g_got, g_want, name in zip(torch.autograd.grad(got, inputs, grad_out),
                                   torch.autograd.grad(want, inputs, grad_out), ["gate", "up", "weight", "bias"]):
        torch.testing.assert_close(g_got, g_want, atol=0, rtol=0, msg=name)  # the same ops: the same bits
    activation = gate.numel() * gate.element_size()
    assert want_kept >= 4 * activation  # gate, silu(gate), up, the product
    assert got_kept == 2 * activation + weight.numel() * weight.element_size()  # gate, up (and the weight)


def test_gated_down_with_a_frozen_weight_returns_no_weight_gradient():
    gate, up = (torch.randn(2, 3, 8, requires_grad=True) for _ in range(2))
    weight = torch.randn(4, 8)
    out = gated_down(gate, up, weight, None)
    g_gate, g_up = torch.autograd.grad(out.sum(), [gate, up])
    want = torch.autograd.grad(F.linear(F.silu(gate) * up, weight).sum(), [gate, up])
    torch.testing.assert_close((g_gate, g_up), want, atol=1e-6, rtol=1e-6)


def test_gated_mlps_are_the_plain_silu_mlps_only(tiny_model_dir):
    from peft import LoraConfig, get_peft_model
    from transformers import AutoConfig, AutoModelForCausalLM

    from grpo_recipe.model.lora import ReferencePolicy

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    layers = model.config.num_hidden_layers
    assert [type(m).__name__ for m in gated_mlps(model)] == ["Qwen2MLP"] * layers
    # LoRA on the attention only: the MLPs' projections stay plain (frozen) Linears
    attn_only = get_peft_model(AutoModelForCausalLM.from_pretrained(tiny_model_dir),
                               LoraConfig(r=2, target_modules=["q_proj", "v_proj"]))
    assert len(gated_mlps(attn_only)) == layers
    everywhere = get_peft_model(AutoModelForCausalLM.from_pretrained(tiny_model_dir),
                                LoraConfig(r=2, target_modules="all-linear"))
    assert gated_mlps(everywhere) == []
    gelu = AutoConfig.from_pretrained(tiny_model_dir)
    gelu.hidden_act = "gelu"
    assert gated_mlps(AutoModelForCausalLM.from_config(gelu)) == []
    assert gated_mlps(ReferencePolicy(engine=None)) == []  # called like a model, not a Module
