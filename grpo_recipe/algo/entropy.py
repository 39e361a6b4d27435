"""The entropy bonus's coefficient across optimizer steps: fixed (`entropy_coef`), or Skywork-OR1's adaptive
control (`use_adaptive_entropy`, TRL 1.16's semantics).

Adaptive: each optimizer step applies the coefficient only when the previous step's entropy (over all ranks, the
tokens the policy loss keeps) was at most `entropy_target`, else 0; after the step the coefficient moves by
`entropy_coef_delta`, up when that step's entropy was at most the target, down otherwise, within
[`entropy_coef_min`, `entropy_coef_max`]. The state is part of a checkpoint (LoopState.entropy), so a resume
continues it exactly.
"""
from __future__ import annotations

import math
from dataclasses import dataclass


@dataclass
class EntropyControl:
    coef: float = 0.0  # the coefficient now (adaptive: starts at entropy_coef)
    adaptive: bool = False
    target: float = 0.2
    delta: float = 0.005
    low: float = 0.0
    high: float = 1.0
    last_entropy: float = math.inf  # the last step's mean token entropy; inf before the first step

    @classmethod
    def from_config(cls, cfg) -> "EntropyControl":
        return cls(cfg.entropy_coef, cfg.use_adaptive_entropy, cfg.entropy_target, cfg.entropy_coef_delta,
                   cfg.entropy_coef_min, cfg.entropy_coef_max)

    @property
    def enabled(self) -> bool:
        """Whether the run has an entropy bonus at all (adaptive: even while the coefficient is 0)."""
        return self.adaptive or self.coef != 0.0

    def applied(self) -> float:
        """The coefficient this step's loss uses."""
        if self.adaptive and not self.last_entropy <= self.target:
            return 0.0
        return self.coef

    def step_done(self, entropy: float) -> None:
        """After an optimizer step whose mean token entropy over all ranks was `entropy`."""
        if not self.adaptive:
            return
        if entropy <= self.target:
            self.coef = min(self.coef + self.delta, self.high)
        else:
            self.coef = max(self.coef - self.delta, self.low)
        self.last_entropy = entropy

    def state_dict(self) -> dict:
        return {"coef": self.coef, "last_entropy": self.last_entropy}

    def load_state_dict(self, state: dict) -> None:
        self.coef, self.last_entropy = state["coef"], state["last_entropy"]
