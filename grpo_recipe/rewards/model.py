"""A reward model as a reward function: a sequence-classification model (a folder or a hub name, as TRL's
`reward_funcs="org/model"`) scores each prompt + completion, its first logit being the reward.

The text is what TRL scores: for conversational prompts the chat template of prompt + completion messages (the
reward model's own template, from its own tokenizer or `tokenizer`: TRL's `reward_processing_classes`), else the
prompt's text followed by the completion's. Tokenized without added special tokens, padded on the right, scored in
batches of `batch_size` under no_grad. The model is loaded once per rank, at the first call, in the precision of
the run (bf16 on GPUs, fp32 on CPU) on the rank's device; it is never trained and never part of a checkpoint.

`sharded: true` (a model too large for one device beside the policy): ZeRO-3 inference over the training ranks,
each rank holding 1/world of the weights and gathering one layer at a time for the forward. Every rank then
runs the same number of forwards (a rank with fewer batches runs one-token ones whose scores it drops), and the
sharded models score before any other reward function, so that a function failing on one rank cannot leave
the others waiting in the model's collectives.
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

    def __init__(self, model: str, tokenizer: str | None = None, batch_size: int = 16, sharded: bool = False):
        self.model_name, self.tokenizer_name, self.batch_size = model, tokenizer or model, batch_size
        self.sharded = sharded  # ZeRO-3 over the training ranks: a collective forward (see the module's notes)
        self.__name__ = Path(model.rstrip("/")).name
        self.model = self.tok = None
        path = resolve_path(model)
        if path.is_dir():  # a hub name is checked when it loads
            check_folder(path)

    def load(self) -> None:
        from transformers import AutoModelForSequenceClassification, AutoTokenizer

        from grpo_recipe.dist.collectives import device
        from grpo_recipe.dist.group import bf16_capable

        dev = device()
        dtype = torch.bfloat16 if dev.type == "cuda" and bf16_capable() else torch.float32
        name = str(resolve_path(self.model_name)) if resolve_path(self.model_name).is_dir() else self.model_name
        tok_name = str(resolve_path(self.tokenizer_name)) if resolve_path(self.tokenizer_name).is_dir() \
            else self.tokenizer_name
        self.tok = AutoTokenizer.from_pretrained(tok_name)
        if self.tok.pad_token is None:
            self.tok.pad_token = self.tok.eos_token
        if self.sharded:
            self.model = self._sharded(AutoModelForSequenceClassification, name, dtype)
        else:
            self.model = AutoModelForSequenceClassification.from_pretrained(name, dtype=dtype).to(dev).eval()
        self.model.requires_grad_(False)
        config = getattr(self.model, "module", self.model).config  # a ZeRO-3 engine's model is its module
        if config.pad_token_id is None:  # the last non-pad token is the one scored
            config.pad_token_id = self.tok.pad_token_id

    @staticmethod
    def _sharded(auto_class, name: str, dtype: torch.dtype):
        """The model partitioned by ZeRO-3 as it loads (transformers' own ZeRO-3 path), in an inference engine."""
        import deepspeed
        from transformers.integrations import HfDeepSpeedConfig

        conf = {"train_micro_batch_size_per_gpu": 1, "zero_optimization": {"stage": 3},
                "bf16": {"enabled": dtype == torch.bfloat16}}
        keep = HfDeepSpeedConfig(conf)  # transformers partitions while this object lives
        try:
            model = auto_class.from_pretrained(name, dtype=dtype)
        finally:
            del keep
        engine, *_ = deepspeed.initialize(model=model, config=conf)
        engine.eval()
        return engine

    def texts(self, prompts: list, completions: list) -> list[str]:
        if prompts and isinstance(prompts[0], list):  # conversational: the reward model's own chat template
            return [self.tok.apply_chat_template(p + c, tokenize=False) for p, c in zip(prompts, completions)]
        return [str(p) + str(c) for p, c in zip(prompts, completions)]

    @torch.no_grad()
    def __call__(self, prompts, completions, **columns) -> list[float]:
        if self.model is None:
            self.load()
        from grpo_recipe.dist.collectives import all_reduce, device

        texts = self.texts(prompts, completions)
        batches = [texts[i:i + self.batch_size] for i in range(0, len(texts), self.batch_size)]
        if self.sharded:  # every rank runs as many forwards as the rank with the most batches
            most = int(all_reduce(torch.tensor([len(batches)], device=device()), "max").item())
            batches += [None] * (most - len(batches))
        out = []
        for texts in batches:
            batch = self.tok(texts or [self.tok.pad_token], return_tensors="pt", padding=True, padding_side="right",
                             add_special_tokens=False).to(device())
            scores = self.model(**batch).logits[:, 0].float().tolist()
            out += scores if texts else []
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
