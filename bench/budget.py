"""A wall-clock training budget with model snapshots, the same for the recipe and TRL (bench/real_vs_trl.py).

The clock starts when training starts (after model loading and engine set-up) and runs until each snapshot
point (seconds of training); a snapshot's own save time is taken off the clock. All ranks take the same
decision (the slowest rank's clock: one all-reduce after each optimizer step). BUDGET_SPEC (JSON, in the
environment): {"points": [s1, s2, ...], "dir": FOLDER}; snapshots go to FOLDER/t{s}, and FOLDER/snapshots.json
lists them with the step and training seconds at which they were taken.
"""
from __future__ import annotations

import json
import os
import time
from pathlib import Path


class BudgetClock:
    def __init__(self, spec: dict):
        self.points, self.dir = sorted(spec["points"]), Path(spec["dir"])
        self.t0, self.excluded, self.taken = None, 0.0, []

    @classmethod
    def from_env(cls) -> "BudgetClock | None":
        spec = os.environ.get("BUDGET_SPEC")
        return cls(json.loads(spec)) if spec else None

    def start(self) -> None:
        self.t0 = time.perf_counter()

    def elapsed(self) -> float:
        """Training seconds so far, the same on every rank (the largest)."""
        import torch
        import torch.distributed as dist

        local = torch.tensor([time.perf_counter() - self.t0 - self.excluded], dtype=torch.float64)
        if dist.is_initialized() and dist.get_world_size() > 1:
            dist.all_reduce(local, op=dist.ReduceOp.MAX)
        return float(local.item())

    def after_step(self, step: int, save) -> bool:
        """Take the snapshots that are due (`save(folder)`: collective); True once the last one is taken."""
        if self.t0 is None:
            self.start()
        elapsed = self.elapsed()
        while self.points and self.points[0] <= elapsed:
            point = self.points.pop(0)
            t = time.perf_counter()
            save(self.dir / f"t{point:g}")
            self.excluded += time.perf_counter() - t
            self.taken.append({"point_s": point, "step": step, "train_s": elapsed})
            if int(os.environ.get("RANK", "0")) == 0:
                self.dir.mkdir(parents=True, exist_ok=True)
                (self.dir / "snapshots.json").write_text(json.dumps(self.taken, indent=1))
        return not self.points
