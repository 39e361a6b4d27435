"""Metrics: one JSON line per optimizer step (rank 0), a tqdm bar, optional TensorBoard."""
from __future__ import annotations

import json
import math
import time
from contextlib import contextmanager
from pathlib import Path


class Timer:
    """Accumulates named wall-clock durations until `pop`."""

    def __init__(self):
        self.totals: dict[str, float] = {}

    @contextmanager
    def __call__(self, name: str):
        t0 = time.perf_counter()
        try:
            yield
        finally:
            self.totals[name] = self.totals.get(name, 0.0) + time.perf_counter() - t0

    def pop(self, *names: str) -> dict[str, float]:
        return {f"time_{n}_s": self.totals.pop(n, 0.0) for n in names}


class MetricsLogger:
    def __init__(self, output_dir: Path, rank: int, total_steps: int, initial_step: int = 0,
                 tensorboard: bool = False, disable_tqdm: bool = False):
        self.rank = rank
        self.path = output_dir / "metrics.jsonl"
        self.file = self.bar = self.tb = None
        if rank != 0:
            return
        output_dir.mkdir(parents=True, exist_ok=True)
        if initial_step > 0 and self.path.exists():  # resumed: drop steps logged after the checkpoint
            kept = [r for r in read_jsonl(self.path) if r["step"] <= initial_step]
            self.path.write_text("".join(json.dumps(r) + "\n" for r in kept))
            self.file = self.path.open("a")
        else:
            self.file = self.path.open("w")
        if not disable_tqdm:
            from tqdm import tqdm

            self.bar = tqdm(total=total_steps, initial=initial_step, desc="grpo", dynamic_ncols=True)
        if tensorboard:
            from torch.utils.tensorboard import SummaryWriter

            self.tb = SummaryWriter(str(output_dir / "tensorboard"))

    def log(self, record: dict) -> None:
        if self.rank != 0:
            return
        clean = {k: (None if isinstance(v, float) and not math.isfinite(v) else v) for k, v in record.items()}
        self.file.write(json.dumps(clean) + "\n")
        self.file.flush()
        if self.bar is not None:
            self.bar.update(1)
            self.bar.set_postfix(reward=f"{record.get('reward_mean', 0.0):.3f}", loss=f"{record.get('loss', 0.0):.4f}")
        if self.tb is not None:
            for k, v in clean.items():
                if isinstance(v, (int, float)) and k != "step":
                    self.tb.add_scalar(k, v, record["step"])

    def close(self) -> None:
        for h in (self.bar, self.tb, self.file):
            if h is not None:
                h.close()


def read_jsonl(path: Path) -> list[dict]:
    """The records of a JSON-lines file (none when it does not exist). A last line without its newline -- a write
    still going on, or a kill mid-write -- is left out; every complete line must parse."""
    path = Path(path)
    if not path.exists():
        return []
    lines = path.read_text().split("\n")[:-1]  # the part after the last newline is not a complete line
    return [json.loads(line) for line in lines if line.strip()]


def reward_quarters(records: list[dict]) -> tuple[float, float]:
    """Mean reward of the first and the last quarter of the steps."""
    q = max(1, len(records) // 4)
    mean = lambda rs: sum(r["reward_mean"] for r in rs) / len(rs)  # noqa: E731
    return mean(records[:q]), mean(records[-q:])
