"""Experiment trackers named by `report_to` (rank 0 only): TensorBoard (OUTPUT_DIR/tensorboard) and Weights & Biases.

wandb is an optional dependency (the `wandb` extra). Its credentials, entity, mode (e.g. WANDB_MODE=offline) and
run resumption (WANDB_RUN_ID, WANDB_RESUME) come from the environment, which wandb reads itself: no secret is ever
part of the config, and nothing here logs the environment. Its files go to OUTPUT_DIR/wandb.
"""
from __future__ import annotations

import json
from pathlib import Path


class TensorBoard:
    def __init__(self, output_dir: Path, cfg):
        from torch.utils.tensorboard import SummaryWriter

        folder = output_dir / "tensorboard"
        before = set(folder.iterdir()) if folder.is_dir() else set()
        self.writer = SummaryWriter(str(folder))
        self.written = sorted(set(folder.iterdir()) - before)  # its events file: the only one an overwrite removes

    def scalars(self, values: dict[str, float], step: int) -> None:
        for k, v in values.items():
            self.writer.add_scalar(k, v, step)

    def table(self, name: str, rows: list[dict], step: int) -> None:
        """Rows as a markdown table (TensorBoard's text plugin renders it)."""
        cols = list(rows[0])
        cell = lambda v: str(v).replace("|", "\\|").replace("\n", "<br>")  # noqa: E731
        lines = ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
        lines += ["| " + " | ".join(cell(r[c]) for c in cols) + " |" for r in rows]
        self.writer.add_text(name, "\n".join(lines), step)

    def close(self) -> None:
        self.writer.close()


class Wandb:
    def __init__(self, output_dir: Path, cfg):
        import wandb

        self.wandb = wandb
        self.run = wandb.init(project=cfg.wandb_project, name=cfg.run_name, dir=str(output_dir), config=cfg.to_dict())
        self.written = [Path(self.run.dir).parent]  # wandb/run-... (or offline-run-...): this run's folder only

    def scalars(self, values: dict[str, float], step: int) -> None:
        self.run.log(values, step=step)

    def table(self, name: str, rows: list[dict], step: int) -> None:
        cols = list(rows[0])
        plain = lambda v: v if isinstance(v, (int, float, str)) else json.dumps(v)  # noqa: E731 (chat prompts)
        self.run.log({name: self.wandb.Table(columns=cols, data=[[plain(r[c]) for c in cols] for r in rows])},
                     step=step)

    def close(self) -> None:
        self.run.finish()
        self.wandb.teardown()  # waits for wandb's service to write everything (the recipe ends with os._exit)


TRACKER_CLASSES = {"tensorboard": TensorBoard, "wandb": Wandb}


def build_trackers(report_to: list[str], output_dir: Path, cfg) -> list:
    """The trackers, their files recorded in run.json so that an overwrite removes them and nothing else."""
    from grpo_recipe.run.outdir import record_written

    trackers = [TRACKER_CLASSES[name](output_dir, cfg) for name in report_to if name != "none"]
    written = [p for t in trackers for p in t.written]
    if written:
        record_written(output_dir, written)
    return trackers
