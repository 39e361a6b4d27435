"""The generation backends' one interface; the training loop never asks which backend it has.

    generate(prompt_ids, seed) -> Completions   # num_generations samples per prompt, group-contiguous
    sync(engine)                                # make the backend see the engine's current weights
    close()
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch


@dataclass
class Completions:
    ids: list[list[int]]  # completion tokens per sample, through the first EOS
    mask: torch.Tensor  # [N, C] 1 on those tokens
    truncated: torch.Tensor  # [N] bool: no EOS within max_completion_length
    texts: list[str]  # decoded, EOS and special tokens dropped
    logps: torch.Tensor | None = None  # [N, C] the sampler's own log-probs, if the backend reports them


class Generator(Protocol):
    syncs: int  # weight syncs done so far

    def generate(self, prompt_ids: list[list[int]], seed: int) -> Completions: ...

    def sync(self, engine) -> None: ...

    def close(self) -> None: ...


def finish(raw: list[list[int]], eos_id: int, tokenizer, max_len: int) -> Completions:
    """Cut each sample after its first EOS (later tokens are padding or noise) and build the masks."""
    ids, truncated = [], []
    for seq in raw:
        seq = list(seq)[:max_len]
        cut = seq.index(eos_id) + 1 if eos_id in seq else len(seq)
        ids.append(seq[:cut])
        truncated.append(eos_id not in seq)
    width = max(1, max(len(x) for x in ids))
    mask = torch.zeros(len(ids), width)
    for i, x in enumerate(ids):
        mask[i, :len(x)] = 1.0
    texts = tokenizer.batch_decode(ids, skip_special_tokens=True)
    return Completions(ids, mask, torch.tensor(truncated, dtype=torch.bool), texts)
