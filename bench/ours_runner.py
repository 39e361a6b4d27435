"""The recipe under a wall-clock training budget with snapshots (bench/budget.py): grpo_recipe.train as it is,
with the snapshot taken after the optimizer step's report; after the last snapshot every rank ends at once.

    BUDGET_SPEC='{"points": [...], "dir": ...}' torchrun ... bench/ours_runner.py --config ... [--key value ...]
"""
from __future__ import annotations

import os
import sys
from pathlib import Path

sys.path[:0] = [str(Path(__file__).resolve().parent.parent), str(Path(__file__).resolve().parent)]
from budget import BudgetClock  # noqa: E402


def main() -> int:
    import torch.distributed as dist

    from grpo_recipe import train
    from grpo_recipe.model.save import save_hf_model

    clock = BudgetClock.from_env()
    train_loop, report = train.train, train.report

    def timed_train(run, state):
        clock.start()
        return train_loop(run, state)

    def report_and_snapshot(run, state, logger, record):
        report(run, state, logger, record)
        if clock.after_step(state.step, lambda folder: save_hf_model(run.engine, run.tokenizer, folder, run.rank)):
            logger.close()
            dist.barrier()
            os._exit(0)  # the budget is spent: every snapshot and metrics line is written

    train.train, train.report = timed_train, report_and_snapshot
    return train.main(sys.argv[1:])


if __name__ == "__main__":
    from grpo_recipe.dist import liveness

    liveness.run_and_exit(main)
