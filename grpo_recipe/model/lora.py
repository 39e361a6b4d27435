"""LoRA through peft: adapter-only training, the base model as the free reference policy, merging for generation.

Under ZeRO-3 every parameter is sharded, the frozen base included; only the adapter reaches the optimizer
(engine.init_engine passes the trainable parameters only), so the base never moves.
"""
from __future__ import annotations

import contextlib
import warnings
from collections import Counter
from pathlib import Path

import torch

from grpo_recipe.config.schema import Config

ALL_LINEAR = "all-linear"  # peft: every Linear of the attention and MLP blocks, never the output head


def is_peft(model) -> bool:
    from peft import PeftModel

    return isinstance(model, PeftModel)


def lora_config(cfg: Config):
    from peft import LoraConfig

    targets = cfg.lora_target_modules
    return LoraConfig(r=cfg.lora_r, lora_alpha=cfg.lora_alpha, lora_dropout=cfg.lora_dropout, bias="none",
                      task_type="CAUSAL_LM", target_modules=ALL_LINEAR if targets == [ALL_LINEAR] else targets)


def wrap(model, cfg: Config):
    """The model with LoRA adapters; everything else frozen.

    The adapter's random init (lora_A) comes from cfg.seed alone: the same on every rank, whatever the
    caller's per-rank seeding, so a 1-rank and an N-rank run start from the same policy.
    """
    from peft import get_peft_model

    with torch.random.fork_rng(devices=[]), warnings.catch_warnings():
        # peft warns about adapting a layer tied to the embeddings; the recipe handles that itself (the tied
        # layer runs unmerged in generation, and the merged save unties it).
        warnings.filterwarnings("ignore", message=r".*tie_word_embeddings=True", category=UserWarning)
        torch.manual_seed(cfg.seed)
        model = get_peft_model(model, lora_config(cfg))
    if cfg.gradient_checkpointing:  # checkpointed blocks need an input that requires grad; the embeddings are frozen
        model.enable_input_require_grads()
    return model


class ReferencePolicy:
    """The policy's own engine with the adapter switched off: the starting model, with no second copy.

    Called like a model, so the update path does not care whether the reference is this or a frozen engine.
    """

    def __init__(self, engine):
        self.engine = engine

    def __call__(self, *args, **kwargs):
        with self.engine.module.disable_adapter():
            return self.engine(*args, **kwargs)


def lora_layers(model) -> list[tuple[str, torch.nn.Module, bool]]:
    """(name, layer, tied) for each LoRA layer; tied = its base weight is shared with another module.

    A tied weight (e.g. an lm_head tied to the input embeddings) cannot take a merge: the other module would
    see the merged weight too.
    """
    from peft.tuners.lora import LoraLayer

    uses = Counter(id(p) for _, p in model.named_parameters(remove_duplicate=False))
    return [(name, m, uses[id(m.get_base_layer().weight)] > 1) for name, m in model.named_modules()
            if isinstance(m, LoraLayer)]


@contextlib.contextmanager
def merged_adapter(model, restore: bool = True):
    """The adapter merged into the base weights (for fast generation), unmerged on exit; a no-op without LoRA.

    `restore=True` keeps a copy of each merged base weight and puts it back bit for bit: peft's unmerge
    subtracts the delta again, which leaves rounding residue that would pile up over rollouts. Gathered
    ZeRO-3 weights need no copy (restore=False): the gathered tensors are thrown away on release
    (GatheredParameters with modifier_rank=None), so the shards never see the merge. A layer that cannot be
    merged (a type peft cannot merge, or a tied weight) keeps running its adapter unmerged (correct, just
    slower), with a warning.

    Base weights in bf16 or fp16 are not merged: the merge rounds the adapter's delta to the base weight's
    precision, and a delta below half its ulp (a young adapter's, at bf16's 8 bits) vanishes, so the sampler
    would not be the trained policy, which adds the adapter's output apart (tests/test_lora.py measures it).
    """
    merged, saved, unmerged = [], [], {}
    try:
        for name, layer, tied in lora_layers(model):
            weight = layer.get_base_layer().weight
            if weight.dtype in (torch.bfloat16, torch.float16):
                continue  # unmerged: exact, the trained function (no warning: this is the rule, not a failure)
            if tied:
                unmerged[name] = "its weight is tied to another module's"
                continue
            copy = weight.detach().clone() if restore else None
            try:
                layer.merge()
            except (NotImplementedError, RuntimeError, AttributeError, ValueError) as e:
                unmerged[name] = f"cannot merge {type(layer).__name__} ({e})"
                continue
            merged.append(layer)
            if copy is not None:
                saved.append((weight, copy))
        if unmerged:
            warnings.warn("LoRA: generating with the adapter unmerged for " +
                          "; ".join(f"{n}: {why}" for n, why in unmerged.items()), stacklevel=3)
        yield model
    finally:
        for layer in merged:
            layer.unmerge()  # peft's bookkeeping (the weights are put back exactly just below)
        with torch.no_grad():
            for weight, copy in saved:
                weight.copy_(copy)


def adapter_state(engine, rank: int) -> dict:
    """The adapter's (trainable) parameters, gathered from their ZeRO-3 shards onto rank 0 (small)."""
    import deepspeed

    named = [(n, p) for n, p in engine.module.named_parameters() if p.requires_grad]
    with deepspeed.zero.GatheredParameters([p for _, p in named], modifier_rank=None):
        return {n: p.detach().cpu().clone() for n, p in named} if rank == 0 else {}


def merged_model(peft_model, adapter_dir: Path):
    """The full model with the saved adapter merged in, built from the base weights on disk.

    The base never moved, so those are exactly the engine's base weights: no gather of the sharded model.
    """
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(peft_model.peft_config["default"].base_model_name_or_path,
                                                dtype=torch.float32)
    model = PeftModel.from_pretrained(base, adapter_dir)
    for _, layer, tied in lora_layers(model):
        if tied:  # e.g. an adapted lm_head tied to the input embeddings: untie, or the merge would change both
            base_layer = layer.get_base_layer()
            base_layer.weight = torch.nn.Parameter(base_layer.weight.detach().clone(), requires_grad=False)
            base.config.tie_word_embeddings = False
    return model.merge_and_unload()
