"""The generation backends' one interface; the training loop never asks which backend it has.

    generate(prompt_ids, seed, n=None, greedy=False, rollout=None) -> Completions
                                                # n (default num_generations) samples per prompt, group-contiguous;
                                                # greedy: one argmax decoding per prompt (evaluation); rollout:
                                                # which training rollout the prompts are (None: evaluation)
    sync(engine)                                # make the backend see the engine's current weights
    release()                                   # done generating for now (a rollout's every turn, an
                                                # evaluation): a colocated engine gives its GPU memory to training
    stats                                       # the last rollout's generation metrics (logged with it)
    state_dict() / load_state_dict(state)       # what a checkpoint must keep (a rollout in flight), or None
    close()
"""
from __future__ import annotations

import traceback
from dataclasses import dataclass
from typing import Protocol

import torch

from grpo_recipe.dist.collectives import first_error
from grpo_recipe.dist.liveness import is_collective_failure


@dataclass
class Completions:
    ids: list[list[int]]  # completion tokens per sample, through the first EOS or stop string
    mask: torch.Tensor  # [N, C] 1 on those tokens
    truncated: torch.Tensor  # [N] bool: neither EOS nor a stop string within max_completion_length
    texts: list[str]  # decoded, EOS and special tokens dropped (a stop string is kept)
    logps: torch.Tensor | None = None  # [N, C] the sampler's own log-probs, if the backend reports them
    # multi-turn rollouts (generation/tools.py): 1 on the model's tokens, 0 on tool results; None: all model's
    tool_mask: torch.Tensor | None = None
    turns: list[list[dict]] | None = None  # each completion's messages (assistant turns and tool results)
    tool_counts: dict | None = None  # tool calls, failures and rounds of this rank's rollout


class Generator(Protocol):
    syncs: int  # weight syncs done so far
    stats: dict  # metrics of the last training rollout's generation (empty when the backend has none)

    def generate(self, prompt_ids: list[list[int]], seed: int, n: int | None = None,
                 greedy: bool = False, rollout: int | None = None) -> Completions: ...

    def sync(self, engine) -> None: ...

    def release(self) -> None: ...

    def state_dict(self) -> dict | None: ...

    def load_state_dict(self, state: dict | None) -> None: ...

    def close(self) -> None: ...


class GenerationError(RuntimeError):
    """Generation failed on some rank; every rank raises it with that rank's message."""


def rollout_seed(seed: int, rollout: int, rank: int, world: int) -> int:
    """The sampling seed of one rank's share of a rollout. Seeds are spaced 1000 apart: vLLM's seeds s and s + 1
    gave shifted copies of the same n samples."""
    return (seed + (rollout * world + rank) * 1000) % 2**31


def generate_on_every_rank(generator: Generator, prompt_ids: list[list[int]], where: str, **kw) -> Completions:
    """`generator.generate`, where a failure on any rank stops every rank with one message: a rank that just
    left would leave the others waiting in their next collective (up to collective_timeout_s) and lose the
    reason. The failing rank prints its traceback first; the message names the rank."""
    try:
        comp, error = generator.generate(prompt_ids, **kw), None
    except Exception as e:  # noqa: BLE001 - any failure must reach the other ranks
        if is_collective_failure(e):  # a generation rank stopped answering: dist/liveness.py names it
            raise
        traceback.print_exc()
        comp, error = None, f"{type(e).__name__}: {' '.join(str(e).split())}"
    failure = first_error(error)
    if failure is not None:
        raise GenerationError(f"{where} failed (rank {failure[0]}): {failure[1]}")
    return comp


class StopStrings:
    """Where a completion ends at a stop string: after the first token with which the completion's text
    contains one. The one test serves hf's stopping criterion and the cut of both backends' samples, so the
    tokens trained on end exactly where sampling ended (vLLM's own check only stops it early)."""

    def __init__(self, stops: list[str], tokenizer):
        self.stops, self.tok = [s for s in stops if s], tokenizer
        # Every token adds at least one byte, so a stop string completed by the newest token lies within the
        # last len(bytes) tokens; one more for decoders that drop a leading space at the start of a window.
        self.window = max((len(s.encode()) for s in self.stops), default=0) + 1

    def hit(self, ids: list[int]) -> bool:
        """Whether the text of `ids` ends in (the newest token completes) a stop string."""
        text = self.tok.decode(ids[-self.window:], skip_special_tokens=False)
        return any(s in text for s in self.stops)

    def cut(self, ids: list[int]) -> int | None:
        """How many tokens to keep (through the one that completes a stop string), or None for no stop."""
        if not self.stops or not any(s in self.tok.decode(ids, skip_special_tokens=False) for s in self.stops):
            return None
        return next((k for k in range(1, len(ids) + 1) if self.hit(ids[:k])), None)


def finish(raw: list[list[int]], eos_id: int, tokenizer, max_len: int, stops: list[str] | None = None) -> Completions:
    """Cut each sample after its first EOS or stop string (later tokens are padding or noise), build the masks."""
    stop = StopStrings(stops or [], tokenizer)
    ids, truncated = [], []
    for seq in raw:
        seq = list(seq)[:max_len]
        cuts = [seq.index(eos_id) + 1] if eos_id in seq else []
        cuts += [k for k in (stop.cut(seq[:min(cuts, default=len(seq))]),) if k is not None]
        ids.append(seq[:min(cuts, default=len(seq))])
        truncated.append(not cuts and len(seq) >= max_len)
    width = max(1, max(len(x) for x in ids))
    mask = torch.zeros(len(ids), width)
    for i, x in enumerate(ids):
        mask[i, :len(x)] = 1.0
    texts = tokenizer.batch_decode(ids, skip_special_tokens=True)
    return Completions(ids, mask, torch.tensor(truncated, dtype=torch.bool), texts)
