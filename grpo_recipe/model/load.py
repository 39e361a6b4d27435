"""Loading the tokenizer and the model (dropout off; partitioned for ZeRO-3 when a process group is up; LoRA)."""
from __future__ import annotations

import torch

from grpo_recipe.config.schema import Config
from grpo_recipe.model.ds_config import ds_config


def load_tokenizer(path: str):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(path, padding_side="left")
    if tok.pad_token is None:
        tok.pad_token = tok.eos_token
    if tok.eos_token_id is None:
        raise ValueError(f"tokenizer of {path} has no EOS token: completions could never stop")
    return tok


def load_model(path: str, cfg: Config, world_size: int | None = None):
    """The model (with its LoRA adapter when use_peft), dropout off.

    With `world_size` (a process group is up) and a ZeRO-3 config it is constructed already partitioned for
    the engine of that world: each rank loads only its 1/world of the weights (with LoRA, of the base
    model; the small adapter is partitioned by deepspeed.initialize). Otherwise the whole model, as
    `from_pretrained` gives it.
    """
    from transformers import AutoConfig, AutoModelForCausalLM

    conf = None
    if world_size is not None:
        conf = ds_config(cfg, world_size, AutoConfig.from_pretrained(path).hidden_size)
    if conf is not None and conf["zero_optimization"].get("stage", 0) == 3:
        from grpo_recipe.model.partitioned import load_partitioned

        model = load_partitioned(path, conf)
    else:
        model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    # RL needs the training forward to see the same policy that sampled: no dropout.
    for m in model.modules():
        if isinstance(m, torch.nn.Dropout):
            m.p = 0.0
    for key in ("attention_dropout", "hidden_dropout", "dropout", "resid_pdrop", "embd_pdrop", "attn_pdrop"):
        if isinstance(getattr(model.config, key, None), float):
            setattr(model.config, key, 0.0)
    if cfg.gradient_checkpointing:
        model.gradient_checkpointing_enable()
        model.config.use_cache = False
    if cfg.use_peft:
        from grpo_recipe.model import lora

        model = lora.wrap(model, cfg)
    return model
