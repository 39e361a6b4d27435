"""Adaptive reuse: stop replaying a rollout once the policy has drifted too far from the one that sampled it.

After each finished pass, the pass's mean approximate KL (k3 on the ratios the loss already computes, no
extra forward) and/or its clipped-token fraction are compared with the targets; above a target, the
remaining passes of that rollout are skipped and the next rollout is generated.
"""
from __future__ import annotations

from recipe.config import Config


class ReuseController:
    def __init__(self, cfg: Config):
        self.target_kl, self.max_clip = cfg.reuse_target_kl, cfg.reuse_max_clip_fraction
        self.kl_sum = self.clip_sum = 0.0
        self.tokens = 0

    @property
    def enabled(self) -> bool:
        return self.target_kl is not None or self.max_clip is not None

    def observe(self, out: dict) -> None:
        """Accumulate one optimizer step's statistics (already summed over ranks)."""
        self.kl_sum += out["approx_kl"] * out["train_tokens"]
        self.clip_sum += out["clip_ratio_region"] * out["train_tokens"]
        self.tokens += out["train_tokens"]

    def pass_done(self) -> bool:
        """At the end of a pass: True when the remaining passes should be skipped. Resets the accumulators."""
        n = max(self.tokens, 1)
        kl, clip = self.kl_sum / n, self.clip_sum / n
        self.kl_sum = self.clip_sum = 0.0
        self.tokens = 0
        return (self.target_kl is not None and kl > self.target_kl) or \
            (self.max_clip is not None and clip > self.max_clip)

    def state_dict(self) -> dict:
        return {"kl_sum": self.kl_sum, "clip_sum": self.clip_sum, "tokens": self.tokens}

    def load_state_dict(self, state: dict) -> None:
        self.kl_sum, self.clip_sum, self.tokens = state["kl_sum"], state["clip_sum"], state["tokens"]
