"""Prompts: loading (datasets), formatting (chat template), left truncation and padding, rank sharding, epoch order.

The prompt stream is a pure function of the rollout index: epoch e visits the dataset in a permutation
seeded by (seed, e), and rollout k takes the next `world x prompts_per_rank` prompts of that endless
stream, rank r its own contiguous slice. Nothing but the rollout index needs saving to resume.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from recipe.config import DATA_EXTENSIONS, Config, looks_like_file, resolve_path


class DataError(ValueError):
    """The dataset cannot feed the recipe; the message says why."""


def left_pad(rows: list[list[int]], pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Token rows as one batch (ids, attention mask), each row flush right so that generation continues every
    row at the same position."""
    width = max(len(r) for r in rows)
    ids = torch.full((len(rows), width), pad_id, dtype=torch.long)
    attn = torch.zeros_like(ids)
    for i, r in enumerate(rows):
        ids[i, width - len(r):] = torch.tensor(r, dtype=torch.long)
        attn[i, width - len(r):] = 1
    return ids, attn


def load_prompt_dataset(cfg: Config):
    import datasets

    datasets.disable_progress_bars()
    name = cfg.dataset_name
    if looks_like_file(name) or resolve_path(name).is_file():
        path = resolve_path(name)
        builder = DATA_EXTENSIONS.get(path.suffix)
        if builder is None:
            raise DataError(f"dataset_name: unsupported file type {path.suffix!r} (use {', '.join(DATA_EXTENSIONS)})")
        try:
            ds = datasets.load_dataset(builder, data_files=str(path), split="train")
        except Exception as e:
            raise DataError(f"dataset_name: cannot read {name}: {type(e).__name__}: {e}") from e
    else:
        try:
            ds = datasets.load_dataset(name, split=cfg.dataset_split)
        except Exception as e:
            raise DataError(f"dataset_name: cannot load {name!r} split {cfg.dataset_split!r}: {e}") from e
    if cfg.prompt_column not in ds.column_names:
        raise DataError(f"prompt_column: dataset {name} has no column {cfg.prompt_column!r} (has {ds.column_names})")
    if len(ds) == 0:
        raise DataError(f"dataset_name: {name} has no rows")
    return ds


@dataclass
class PromptBatch:
    prompts: list  # as in the dataset (strings or chat messages), one per prompt
    prompt_ids: list[list[int]]
    columns: dict[str, list]  # every dataset column, one value per prompt
    num_truncated: int

    def repeat(self, g: int) -> "PromptBatch":
        """Each prompt repeated g times, group-contiguous, to line up with its completions."""
        rep = lambda xs: [x for x in xs for _ in range(g)]  # noqa: E731
        return PromptBatch(rep(self.prompts), rep(self.prompt_ids),
                           {k: rep(v) for k, v in self.columns.items()}, self.num_truncated)


class PromptStream:
    def __init__(self, dataset, tokenizer, cfg: Config, rank: int, world_size: int):
        self.ds, self.tok, self.cfg = dataset, tokenizer, cfg
        self.rank, self.world = rank, world_size
        mode = str(cfg.chat_template).lower()
        has_template = getattr(tokenizer, "chat_template", None) is not None
        if mode == "true" and not has_template:
            raise DataError("chat_template: true, but the tokenizer has no chat template")
        self.use_chat = has_template and mode != "false"
        self._perms: dict[int, torch.Tensor] = {}

    def _perm(self, epoch: int) -> torch.Tensor:
        if epoch not in self._perms:
            g = torch.Generator().manual_seed(self.cfg.seed + 7919 * epoch)
            self._perms = {epoch: torch.randperm(len(self.ds), generator=g)}  # keep one epoch cached
        return self._perms[epoch]

    def format(self, prompt) -> str:
        if self.use_chat:
            messages = prompt if isinstance(prompt, list) else [{"role": "user", "content": str(prompt)}]
            return self.tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        if isinstance(prompt, list):
            raise DataError("prompt_column holds chat messages, but chat templates are off or missing")
        return str(prompt)

    def indices(self, rollout_index: int) -> list[int]:
        n, per_rank = len(self.ds), self.cfg.prompts_per_rollout
        start = (rollout_index * self.world + self.rank) * per_rank
        out = []
        for k in range(start, start + per_rank):
            epoch, pos = divmod(k, n)
            out.append(int(self._perm(epoch)[pos]))
        return out

    def batch(self, rollout_index: int) -> PromptBatch:
        rows = self.ds[self.indices(rollout_index)]  # load_prompt_dataset refuses an empty dataset
        prompts = rows[self.cfg.prompt_column]
        texts = [self.format(p) for p in prompts]
        add_special = not self.use_chat  # a chat template already writes the special tokens
        ids = self.tok(texts, add_special_tokens=add_special)["input_ids"]
        limit = self.cfg.max_prompt_length
        truncated = sum(len(x) > limit for x in ids)
        ids = [list(x[-limit:]) for x in ids]  # keep the end: it holds the question and the answer cue
        if any(len(x) == 0 for x in ids):
            raise DataError("a prompt tokenized to zero tokens; check prompt_column")
        return PromptBatch(prompts, ids, dict(rows), truncated)
