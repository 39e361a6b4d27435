"""A reward model as a reward function: a sequence-classification model (a folder or a hub name, as TRL's
`reward_funcs="org/model"`) scores each prompt + completion, its first logit being the reward.

The text is what TRL scores: for conversational prompts the chat template of prompt + completion messages (the
reward model's own template, from its own tokenizer or `tokenizer`: TRL's `reward_processing_classes`), else the
prompt's text followed by the completion's. Tokenized without added special tokens, padded on the right, scored in
batches of `batch_size` under no_grad. The model is loaded once per rank, at the first call, in the precision of
the run (bf16 on GPUs, fp32 on CPU) on the rank's device; it is never trained and never part of a checkpoint.
"""
from __future__ import annotations

import json
from pathlib import Path

import torch

from grpo_recipe.config.schema import resolve_path


class RewardModelError(ValueError):
    """The reward model cannot be used; the message says why in one line."""


def is_model_spec(text: str) -> bool:
    """Whether a reward_funcs name is a model: a folder holding a config.json, or a hub name `org/model` (no
    `:` of module:function)."""
    if ":" in text:
        return False
    path = resolve_path(text)
    return (path / "config.json").is_file() or (not path.exists() and text.count("/") == 1
                                                and not text.endswith(".py") and not text.startswith((".", "/")))


class ModelReward:
    """Callable like a reward function: `(prompts, completions, **columns) -> list[float]`."""

    def __init__(self, model: str, tokenizer: str | None = None, batch_size: int = 16):
        self.model_name, self.tokenizer_name, self.batch_size = model, tokenizer or model, batch_size
        self.__name__ = Path(model.rstrip("/")).name
        self.model = self.tok = None
        path = resolve_path(model)
        if path.is_dir():  # a hub name is checked when it loads
            check_folder(path)

    def load(self) -> None:
        from transformers import AutoModelForSequenceClassification, AutoTokenizer

        from grpo_recipe.dist.collectives import device

        dev = device()
        dtype = torch.bfloat16 if dev.type == "cuda" and torch.cuda.is_bf16_supported() else torch.float32
        name = str(resolve_path(self.model_name)) if resolve_path(self.model_name).is_dir() else self.model_name
        tok_name = str(resolve_path(self.tokenizer_name)) if resolve_path(self.tokenizer_name).is_dir() \
            else self.tokenizer_name
        self.tok = AutoTokenizer.from_pretrained(tok_name)
        if self.tok.pad_token is None:
            self.tok.pad_token = self.tok.eos_token
        self.model = AutoModelForSequenceClassification.from_pretrained(name, dtype=dtype).to(dev).eval()
        self.model.requires_grad_(False)
        if self.model.config.pad_token_id is None:  # the last non-pad token is the one scored
            self.model.config.pad_token_id = self.tok.pad_token_id

    def texts(self, prompts: list, completions: list) -> list[str]:
        if prompts and isinstance(prompts[0], list):  # conversational: the reward model's own chat template
            return [self.tok.apply_chat_template(p + c, tokenize=False) for p, c in zip(prompts, completions)]
        return [str(p) + str(c) for p, c in zip(prompts, completions)]

    @torch.no_grad()
    def __call__(self, prompts, completions, **columns) -> list[float]:
        if self.model is None:
            self.load()
        texts = self.texts(prompts, completions)
        dev = next(self.model.parameters()).device
        out = []
        for i in range(0, len(texts), self.batch_size):
            batch = self.tok(texts[i:i + self.batch_size], return_tensors="pt", padding=True, padding_side="right",
                             add_special_tokens=False).to(dev)
            out += self.model(**batch).logits[:, 0].float().tolist()
        return out


def check_folder(path: Path) -> None:
    """A folder that holds a sequence-classification model with one output (the reward)."""
    config = path / "config.json"
    if not config.is_file():
        raise RewardModelError(f"reward model {path}: no config.json in the folder")
    conf = json.loads(config.read_text())
    archs = conf.get("architectures") or []
    if archs and not any(a.endswith("ForSequenceClassification") for a in archs):
        raise RewardModelError(f"reward model {path}: {', '.join(archs)} is not a sequence-classification model "
                               f"(its first logit is the reward)")
    labels = conf.get("num_labels") or len(conf.get("id2label") or {}) or 1
    if labels != 1:
        raise RewardModelError(f"reward model {path}: {labels} outputs; a reward model has one")
