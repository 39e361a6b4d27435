"""Reuse decisions, in one place: after each finished pass over a rollout, replay it once more or generate anew.

Fixed mu (`num_iterations: N`): N passes per rollout, unless `reuse_target_kl` (the pass's mean approximate KL
to the sampling policy, k3 on the loss's own ratios) or `reuse_max_clip_fraction` (its clipped-token fraction)
is exceeded, which skips the rollout's remaining passes.

`num_iterations: auto`: a replayed pass costs one pass of training, T_train; a fresh rollout costs
T_gen + T_train (generation, scoring, weight sync, old log-probs). With g = T_gen / (T_gen + T_train),
generation's share of a mu = 1 step, a replay pays when it is worth more than 1 - g of a fresh pass. Taking a
replay's worth as 1 - KL / KL_max, KL the drift it will run at and KL_max (`reuse_max_kl`) the drift at which a
replay is worth nothing, gives: replay while KL_next < g * KL_max, at most `reuse_max_iterations` passes
(default 8; within it the KL rule decides). KL_next is extrapolated from the pass just done (`drift_rate`); with
`reuse_drift_smoothing` < 1 the rate is a moving average over recent passes instead. The worth reaches zero at a
finite drift: however dear generation is, a replay never runs past KL_max. A rollout whose every group has equal
rewards is never replayed: all its advantages are 0, so a replay has no gradient to follow.

g / (1 - g) = T_gen / T_train is priced per rollout from its own size: T_gen = a * decoding steps, T_train =
b * tokens trained per pass, so g follows the rollout as completions grow or shrink. The clock gives only the
cost ratio a / b: measured on rollouts 1..M (rollout 0 warms up), summed over all ranks, then frozen and
checkpointed; sizes are all-reduced counts. Every rank therefore takes the same decisions, and a resume repeats
them. Until a / b is known, g = 1/2 (target KL_max / 2); `reuse_generation_share` pins g for exactly reproducible runs.
"""
from __future__ import annotations

import torch

from grpo_recipe.config.schema import Config
from grpo_recipe.dist.collectives import all_reduce_named, device

ROLLOUT_PHASES = ("sync", "generate", "score", "old_logp")  # a fresh rollout's cost beyond its training


class ReuseController:
    def __init__(self, cfg: Config):
        self.auto, self.max_clip = cfg.auto_reuse, cfg.reuse_max_clip_fraction
        self.fixed_kl, self.max_kl = cfg.reuse_target_kl, cfg.reuse_max_kl
        self.smoothing, self.rate = cfg.reuse_drift_smoothing, None  # the moving drift rate (None: none measured)
        self.measure, self.steps_per_pass = cfg.reuse_measure_rollouts, cfg.optimizer_steps_per_pass
        pinned = cfg.reuse_generation_share
        self.pinned_odds = None if pinned is None else pinned / (1.0 - pinned)
        self.cost_ratio = None  # a / b: seconds per decoding step over seconds per trained token (frozen)
        self.size = (0.0, 0)  # the current rollout's decoding steps and tokens per pass
        self.signal = True  # whether any group of the current rollout has unequal rewards (nonzero advantages)
        self.kl_sum = self.clip_sum = 0.0
        self.tokens = 0
        # rollouts 1..M: this rank's rollout-phase and training seconds; decoding steps; tokens x passes trained
        self.window = [0.0, 0.0, 0.0, 0.0]

    @property
    def enabled(self) -> bool:
        return self.auto or self.fixed_kl is not None or self.max_clip is not None

    @property
    def odds(self) -> float | None:
        """g / (1 - g) = T_gen / T_train of the current rollout (None: not known yet)."""
        if self.pinned_odds is not None:
            return self.pinned_odds
        if self.cost_ratio is None:
            return None
        return self.cost_ratio * self.size[0] / max(self.size[1], 1)

    @property
    def generation_share(self) -> float | None:
        """g of the current rollout (None: not known yet)."""
        odds = self.odds
        return None if odds is None else odds / (1.0 + odds)

    @property
    def target_kl(self) -> float | None:
        if not self.auto:
            return self.fixed_kl
        g = self.generation_share
        return self.max_kl * (0.5 if g is None else g)  # g = 1/2 until measured

    def measuring(self, rollout: int) -> bool:
        return self.auto and self.pinned_odds is None and self.cost_ratio is None and 1 <= rollout <= self.measure

    def observe(self, record: dict) -> None:
        """One optimizer step's metrics record: statistics already summed over ranks, timings this rank's."""
        self.kl_sum += record["approx_kl"] * record["train_tokens"]
        self.clip_sum += record["clip_ratio_region"] * record["train_tokens"]
        self.tokens += record["train_tokens"]
        self.size = (record["decode_steps"], record["rollout_tokens"])
        self.signal = record["frac_reward_zero_std"] < 1.0
        if self.measuring(record["generation"]):
            self.window[0] += sum(record[f"time_{p}_s"] for p in ROLLOUT_PHASES)
            self.window[1] += record["time_train_s"]

    def pass_done(self, rollout: int, pass_index: int) -> bool:
        """At the end of a pass (every rank, same point): True when the rollout's remaining passes should be
        skipped. Resets the pass's accumulators."""
        n = max(self.tokens, 1)
        kl, clip = self.kl_sum / n, self.clip_sum / n
        self.kl_sum = self.clip_sum = 0.0
        self.tokens = 0
        if self.measuring(rollout):
            self.window[2] += self.size[0] if pass_index == 0 else 0.0
            self.window[3] += self.size[1]
        elif self.auto and self.pinned_odds is None and self.cost_ratio is None and rollout > self.measure:
            self.cost_ratio = self.measured_cost_ratio()
        if self.auto:
            if not self.signal:  # all advantages 0: the policy loss has no gradient, a replay only steps momentum
                return True
            kl = self.next_kl(kl, pass_index)  # the drift the next pass would run at
        target = self.target_kl
        return (target is not None and kl > target) or (self.max_clip is not None and clip > self.max_clip)

    def next_kl(self, kl: float, pass_index: int) -> float:
        """The next pass's KL: the drift rate of this pass, blended into the moving rate at weight
        `reuse_drift_smoothing` (1: this pass's alone), times the next pass's squared updates."""
        rate = drift_rate(kl, pass_index, self.steps_per_pass)
        if rate is None:  # an on-policy pass says nothing about drift: its replay is taken
            return 0.0
        a = self.smoothing  # at 1 the blend is exactly this pass's rate (0 x old + rate)
        self.rate = rate if self.rate is None else (1.0 - a) * self.rate + a * rate
        return self.rate * squared_updates(pass_index + 1, self.steps_per_pass)

    def measured_cost_ratio(self) -> float:
        """a / b from rollouts 1..M, seconds summed over ranks (one all-reduce, so every rank freezes the same
        value; the sizes are already the same on every rank)."""
        gen_s, train_s = all_reduce_named({"t": torch.tensor(self.window[:2], dtype=torch.float64,
                                                             device=device())})["t"].tolist()
        steps, tokens = self.window[2:]
        return (gen_s / max(steps, 1.0)) / max(train_s / max(tokens, 1.0), 1e-12)

    def step_done(self, record: dict, last_in_pass: bool) -> bool:
        """Observe a step; after a finished pass, decide. True: skip the rollout's remaining passes."""
        self.observe(record)
        return self.enabled and last_in_pass and self.pass_done(record["generation"], record["iteration"])

    def status(self) -> dict:
        """For the metrics line: the KL target in force and, with auto, the rollout's g it came from."""
        return {"reuse_kl_target": self.target_kl, "reuse_generation_share": self.generation_share if self.auto else None}

    def state_dict(self) -> dict:
        return {"kl_sum": self.kl_sum, "clip_sum": self.clip_sum, "tokens": self.tokens, "size": list(self.size),
                "window": list(self.window), "cost_ratio": self.cost_ratio, "drift_rate": self.rate}

    def load_state_dict(self, state: dict) -> None:
        self.kl_sum, self.clip_sum, self.tokens = state["kl_sum"], state["clip_sum"], state["tokens"]
        # checkpoints from before num_iterations: auto lack the rest (and never used them)
        self.size = tuple(state.get("size", self.size))
        self.window = list(state.get("window", self.window))
        self.cost_ratio = state.get("cost_ratio", self.cost_ratio)
        self.rate = state.get("drift_rate", self.rate)


def squared_updates(pass_index: int, steps: int) -> int:
    """The sum over a pass's steps of the squared number of updates made before each since sampling."""
    return sum((pass_index * steps + t) ** 2 for t in range(steps))


def drift_rate(kl: float, pass_index: int, steps: int) -> float | None:
    """KL per squared update: KL grows like the square of the updates made since sampling (measured growth per
    pass on the tiny model: 5-6x, 2.6-3.2x, 2x, 1.5-1.8x from the second pass on; the square gives 4x, 2.25x,
    1.8x, 1.6x). None for a pass run on-policy (a rollout's first pass with one step: KL 0)."""
    now = squared_updates(pass_index, steps)
    return None if now == 0 else kl / now

