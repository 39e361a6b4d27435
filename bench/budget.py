"""A training budget in rollouts with model snapshots, the same for the recipe and TRL (bench/real_vs_trl.py).

A snapshot at point k is the policy after k rollouts have been trained on (all their passes), taken just before
rollout k + 1 is generated (the recipe) or after optimizer step k (TRL at mu = 1: one step per rollout); after the
last point the run ends. Every rank calls `after`: the save is collective. BUDGET_SPEC (JSON, in the
environment): {"rollouts": [k1, k2, ...], "dir": FOLDER}; snapshots go to FOLDER/r{k}, and FOLDER/snapshots.json
lists them with the optimizer step at which each was taken and the seconds its save took (not training time).
"""
from __future__ import annotations

import json
import os
import time
from pathlib import Path


class RolloutBudget:
    def __init__(self, spec: dict):
        self.points, self.dir = sorted(spec["rollouts"]), Path(spec["dir"])
        # a resumed run (bench/real_vs_trl.py) keeps the snapshots taken before it was cut off: a resume repeats
        # training bit for bit, so they are the snapshots it would take again
        done = self.dir / "snapshots.json"
        self.taken: list[dict] = json.loads(done.read_text()) if done.is_file() else []
        self.points = [p for p in self.points if p not in {t["rollouts"] for t in self.taken}]

    @classmethod
    def from_env(cls) -> "RolloutBudget | None":
        spec = os.environ.get("BUDGET_SPEC")
        return cls(json.loads(spec)) if spec else None

    def after(self, rollouts: int, step: int, save) -> bool:
        """`rollouts` have been trained on: take the snapshot due there (`save(folder)`, collective); True once
        the last one is taken."""
        if self.points and self.points[0] <= rollouts:
            point = self.points.pop(0)
            t = time.perf_counter()
            save(self.dir / f"r{point}")
            self.taken.append({"rollouts": point, "step": step, "save_s": time.perf_counter() - t,
                               "wall": time.time()})
            if int(os.environ.get("RANK", "0")) == 0:
                self.dir.mkdir(parents=True, exist_ok=True)
                (self.dir / "snapshots.json").write_text(json.dumps(self.taken, indent=1))
        return not self.points
