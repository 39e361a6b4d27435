"""A gated MLP's down projection that keeps two [B, T, I] tensors for its backward, where autograd keeps four.

`down_proj(silu(gate) * up)` as separate ops saves gate (for silu), silu(gate) and up (for the product) and the
product (for down_proj's weight gradient): four tensors of the MLP's width, about 70% of a decoder layer's
activations at Qwen2.5-0.5B's shape. `gated_down` saves gate and up and recomputes the two elementwise ops in its
backward. Every op is autograd's own (the same silu, product, matmuls and `silu_backward`), so values and gradients
are the same bits.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

# MLP classes whose forward is exactly down_proj(act_fn(gate_proj(x)) * up_proj(x)).
GATED_MLP_CLASSES = frozenset({"LlamaMLP", "MistralMLP", "Qwen2MLP", "Qwen3MLP", "Qwen2MoeMLP", "Qwen3MoeMLP",
                               "Olmo2MLP", "SmolLM3MLP"})


class _GatedDown(torch.autograd.Function):
    @staticmethod
    def forward(ctx, gate, up, weight, bias):
        ctx.save_for_backward(gate, up, weight)
        ctx.has_bias = bias is not None
        return F.linear(F.silu(gate) * up, weight, bias)

    @staticmethod
    def backward(ctx, grad_out):
        gate, up, weight = ctx.saved_tensors
        act = F.silu(gate)
        grad_h = grad_out.matmul(weight)
        grad_w = grad_b = None
        if ctx.needs_input_grad[2]:
            h = act * up
            grad_w = grad_out.reshape(-1, grad_out.shape[-1]).t().matmul(h.reshape(-1, h.shape[-1]))
        if ctx.has_bias and ctx.needs_input_grad[3]:
            grad_b = grad_out.reshape(-1, grad_out.shape[-1]).sum(0)
        grad_gate = torch.ops.aten.silu_backward(grad_h * up, gate) if ctx.needs_input_grad[0] else None
        grad_up = grad_h * act if ctx.needs_input_grad[1] else None
        return grad_gate, grad_up, grad_w, grad_b


def gated_down(gate: torch.Tensor, up: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None):
    """F.linear(F.silu(gate) * up, weight, bias), keeping only gate and up (and the weight) for the backward."""
    return _GatedDown.apply(gate, up, weight, bias)


def gated_mlps(model) -> list[torch.nn.Module]:
    """The model's MLPs that `gated_down` can serve: a class in GATED_MLP_CLASSES with a SiLU activation and plain
    Linear projections (a LoRA layer on any of them keeps the model's own forward)."""
    inner = getattr(model, "module", model)  # a DeepSpeed engine's model
    if not isinstance(inner, torch.nn.Module):  # e.g. model/lora.py's ReferencePolicy: the model's own forward
        return []
    return [m for m in inner.modules() if type(m).__name__ in GATED_MLP_CLASSES
            and type(getattr(m, "act_fn", None)).__name__ in ("SiLUActivation", "SiLU")
            and all(type(getattr(m, p, None)) is torch.nn.Linear for p in ("gate_proj", "up_proj", "down_proj"))]
