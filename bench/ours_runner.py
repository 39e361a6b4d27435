"""The recipe under a training budget in rollouts with snapshots (bench/budget.py): grpo_recipe.train as it is,
with the snapshot after k rollouts taken just before rollout k + 1 is generated; after the last snapshot every
rank ends at once (the metrics line of every step is written by then).

    BUDGET_SPEC='{"rollouts": [...], "dir": ...}' torchrun ... bench/ours_runner.py --config ... [--key value ...]
"""
from __future__ import annotations

import os
import sys
from pathlib import Path

sys.path[:0] = [str(Path(__file__).resolve().parent.parent), str(Path(__file__).resolve().parent)]
from budget import RolloutBudget  # noqa: E402


def main() -> int:
    from grpo_recipe import train
    from grpo_recipe.dist.collectives import barrier
    from grpo_recipe.model.save import save_hf_model

    budget = RolloutBudget.from_env()
    collect = train.collect_rollout

    def snapshot_then_collect(run, rollout, timer):
        save = lambda folder: save_hf_model(run.engine, run.tokenizer, folder, run.rank)  # noqa: E731
        if budget.after(rollout, run.engine.global_steps, save):
            barrier()
            os._exit(0)  # the budget is spent: every snapshot and metrics line is written
        return collect(run, rollout, timer)

    train.collect_rollout = snapshot_then_collect
    return train.main(sys.argv[1:])


if __name__ == "__main__":
    from grpo_recipe.dist import liveness

    liveness.run_and_exit(main)
