"""The rank-local rollout: token ids, masks, advantages, old log-probs, and its replay schedule.

It never leaves its rank (group advantages need no communication because every group is generated
on one rank). Its state is a plain dict of tensors, so a checkpoint can save and restore it exactly.

Old log-probs: a sample's old log-prob is the policy's log-prob *before any update on this rollout*.
Samples trained in the first optimizer step of the first pass see exactly that policy, so their old
log-probs are the training forward's own `logp.detach()` and are captured there for later passes (no
extra forward). Only samples of later steps of the first pass (optimizer_steps_per_pass > 1) need a
no_grad forward at rollout time.

Left-out samples (zero_std_filter: groups whose rewards are all equal): `active` False and completion mask 0.
The schedule trains only active samples, in the same number of micro-batches on every rank (DeepSpeed's
accumulation boundary and ZeRO-3's collective gathers need that): a micro-batch left empty gets one inactive
sample, whose zero mask adds nothing to the loss, the gradient or the counts.
"""
from __future__ import annotations

from dataclasses import dataclass, fields

import torch


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


@dataclass
class RolloutBuffer:
    input_ids: torch.Tensor  # [N, P + C] prompt (left-padded) + completion (right-padded)
    attention_mask: torch.Tensor  # [N, P + C]
    completion_mask: torch.Tensor  # [N, C] 1 for trained completion tokens: the model's, up to and including EOS
    advantages: torch.Tensor  # [N]
    old_logps: torch.Tensor  # [N, C] (NaN until known)
    has_old_logps: torch.Tensor  # [N] bool
    sampling_logps: torch.Tensor  # [N, C] the sampler's own log-probs (vLLM; NaN when not reported)
    order_seed: int  # seeds each pass's shuffle
    active: torch.Tensor  # [N] bool: trained (False: left out of the update, completion mask 0)

    @property
    def prompt_length(self) -> int:
        return self.input_ids.shape[1] - self.completion_mask.shape[1]

    def __len__(self) -> int:
        return self.input_ids.shape[0]

    @classmethod
    def build(cls, prompt_ids: list[list[int]], completion_ids: list[list[int]], advantages: torch.Tensor,
              completion_mask: torch.Tensor, pad_id: int, order_seed: int,
              sampling_logps: torch.Tensor | None = None, active: torch.Tensor | None = None,
              tool_mask: torch.Tensor | None = None) -> "RolloutBuffer":
        """Left-pad prompts and right-pad completions into one [N, P + C] batch; `active` None = all trained.
        `tool_mask` (multi-turn rollouts) is 0 on tool results: attended to, never trained on."""
        n, c_len = len(completion_ids), completion_mask.shape[1]
        prompts, prompt_attn = left_pad(prompt_ids, pad_id)
        completions = torch.full((n, c_len), pad_id, dtype=torch.long)
        for i, c in enumerate(completion_ids):
            completions[i, :len(c)] = torch.tensor(c, dtype=torch.long)
        ids = torch.cat([prompts, completions], dim=1)
        attn = torch.cat([prompt_attn, completion_mask.long()], dim=1)
        if sampling_logps is None:
            sampling_logps = torch.full((n, c_len), float("nan"))
        active = torch.ones(n, dtype=torch.bool) if active is None else active.bool().cpu()
        trained = completion_mask.float() if tool_mask is None else completion_mask.float() * tool_mask.float()
        return cls(ids, attn, trained * active.unsqueeze(-1), advantages.float(),
                   torch.full((n, c_len), float("nan")), torch.zeros(n, dtype=torch.bool),
                   sampling_logps.float().cpu(), order_seed, active)

    # --- schedule ---------------------------------------------------------------------
    def schedule(self, pass_index: int, steps: int, micro_batch_size: int) -> list[list[torch.Tensor]]:
        """Sample indices per [optimizer step][micro-batch] for one pass.

        Which samples an optimizer step trains on is reshuffled per pass from the seed. Within a step, samples
        of similar length share a micro-batch (longest first), so that trimming its all-padding columns
        (micro_batch) leaves little padding to compute; the step's update is the same whatever the grouping,
        since its normalizer covers the whole step. Always len(self) / (steps x micro_batch_size) micro-batches
        per step; only active samples (all of them, unless some were left out, when micro-batches shrink
        evenly), each once per pass.
        """
        g = torch.Generator().manual_seed(self.order_seed * 1000 + pass_index)
        order = torch.randperm(len(self), generator=g)
        per_step_mbs = max(1, len(self) // steps // micro_batch_size)
        order = order[self.active[order]]
        filler = (~self.active).nonzero().flatten()[:1]  # only needed when some are left out
        return [[mb if len(mb) else filler for mb in self._by_length(step).tensor_split(per_step_mbs)]
                for step in order.tensor_split(steps)]

    def _by_length(self, idx: torch.Tensor) -> torch.Tensor:
        """idx ordered by completion length, then prompt length, longest first (ties keep their order)."""
        c_len = self.attention_mask[idx, self.prompt_length:].sum(-1)
        p_len = self.attention_mask[idx, :self.prompt_length].sum(-1)
        key = c_len * (self.input_ids.shape[1] + 1) + p_len
        return idx[torch.sort(key, descending=True, stable=True).indices]

    def plan(self, passes: int, steps: int, micro_batch_size: int) -> list[list[list[torch.Tensor]]]:
        """The whole replay schedule: sample indices per [pass][optimizer step][micro-batch]."""
        return [self.schedule(p, steps, micro_batch_size) for p in range(passes)]

    def micro_batch(self, idx: torch.Tensor) -> dict[str, torch.Tensor]:
        """The samples `idx`, without the columns that are padding in all of them: the prompts' common left
        padding and the completions' common right padding (per-token tensors are [n, width <= C])."""
        attn = self.attention_mask[idx]
        p = self.prompt_length
        first = int(attn[:, :p].any(0).int().argmax()) if attn[:, :p].any() else p
        width = max(1, int(attn[:, p:].any(0).nonzero().max()) + 1 if attn[:, p:].any() else 1)
        cols = slice(first, p + width)
        return {"input_ids": self.input_ids[idx, cols], "attention_mask": attn[:, cols],
                "completion_mask": self.completion_mask[idx, :width], "advantages": self.advantages[idx],
                "old_logps": self.old_logps[idx, :width], "has_old_logps": self.has_old_logps[idx],
                "sampling_logps": self.sampling_logps[idx, :width], "index": idx}

    def store_old_logps(self, idx: torch.Tensor, logps: torch.Tensor) -> None:
        """Old log-probs of a (trimmed) micro-batch; the columns it did not have are padding: stored as 0."""
        full = torch.zeros(len(idx), self.completion_mask.shape[1])
        full[:, :logps.shape[1]] = logps.detach().float().cpu()
        self.old_logps[idx] = full
        self.has_old_logps[idx] = True

    def token_counts(self, plan: list[list[list[torch.Tensor]]]) -> torch.Tensor:
        """Active completion tokens on this rank per [pass, optimizer step] of `plan` (for token-level losses)."""
        counts = torch.zeros(len(plan), len(plan[0]))
        for p, steps in enumerate(plan):
            for s, micro_batches in enumerate(steps):
                counts[p, s] = sum(self.completion_mask[i].sum() for i in micro_batches)
        return counts

    def sequence_counts(self, plan: list[list[list[torch.Tensor]]]) -> torch.Tensor:
        """Trained (active) sequences on this rank per [pass, optimizer step] of `plan` (for sequence-level losses)."""
        return torch.tensor([[float(sum(self.active[i].sum() for i in step)) for step in steps] for steps in plan])

    # --- checkpointing ----------------------------------------------------------------
    def state_dict(self) -> dict:
        return {f.name: getattr(self, f.name) for f in fields(self)}

    @classmethod
    def from_state_dict(cls, state: dict) -> "RolloutBuffer":
        return cls(**{f.name: state[f.name] for f in fields(cls)})
