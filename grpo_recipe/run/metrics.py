"""Metrics: one JSON line per logged optimizer step (rank 0), completion samples, a tqdm bar, the trackers."""
from __future__ import annotations

import json
import math
import sys
import time
from pathlib import Path
from typing import Callable


class MetricsLogger:
    """Rank 0 writes metrics.jsonl (and completions.jsonl), feeds the trackers and moves the bar; other ranks no-op."""

    def __init__(self, output_dir: Path, rank: int, total_steps: int, initial_step: int = 0,
                 trackers: Callable[[], list] | None = None, disable_tqdm: bool = False):
        self.rank = rank
        self.path = output_dir / "metrics.jsonl"
        self.samples_path = output_dir / "completions.jsonl"
        self.file = self.bar = None
        self.trackers = []
        if rank != 0:
            return
        output_dir.mkdir(parents=True, exist_ok=True)
        self.file = self._reopen(self.path, initial_step)
        if initial_step > 0 and self.samples_path.exists():
            self._reopen(self.samples_path, initial_step).close()
        else:  # written on the first sample only (a fresh start drops an earlier run's)
            self.samples_path.unlink(missing_ok=True)
        if not disable_tqdm:
            from tqdm import tqdm

            self.bar = tqdm(total=total_steps, initial=initial_step, desc="grpo", dynamic_ncols=True)
        self.trackers = trackers() if trackers is not None else []

    @staticmethod
    def _reopen(path: Path, initial_step: int):
        """Open a JSONL file for appending; resumed (initial_step > 0): drop the lines of steps after it, and
        set aside a damaged file (see `repair_jsonl`) rather than stop the resume."""
        if initial_step > 0 and path.exists():
            kept = [r for r in repair_jsonl(path) if r["step"] <= initial_step]
            path.write_text("".join(json.dumps(r) + "\n" for r in kept))
            return path.open("a")
        return path.open("w")

    def advance(self, record: dict) -> None:
        """Every optimizer step, whatever logging_steps is: the bar moves."""
        if self.bar is not None:
            self.bar.update(1)
            self.bar.set_postfix(reward=f"{record.get('reward_mean', 0.0):.3f}", loss=f"{record.get('loss', 0.0):.4f}")

    def log(self, record: dict) -> None:
        """One line of metrics.jsonl, and its numbers to every tracker."""
        if self.rank != 0:
            return
        clean = {k: (None if isinstance(v, float) and not math.isfinite(v) else v) for k, v in record.items()}
        self.file.write(json.dumps(clean) + "\n")
        self.file.flush()
        numbers = {k: v for k, v in clean.items() if isinstance(v, (int, float)) and k != "step"}
        for t in self.trackers:
            t.scalars(numbers, record["step"])

    def log_completions(self, step: int, rows: list[dict]) -> None:
        """Sample rows (prompt, completion, rewards, advantage) to completions.jsonl and the trackers as a table."""
        if self.rank != 0 or not rows:
            return
        rows = [{"step": step, **r} for r in rows]
        with self.samples_path.open("a") as f:
            f.write("".join(json.dumps(r) + "\n" for r in rows))
        for t in self.trackers:
            t.table("completions", rows, step)

    def close(self) -> None:
        for h in (self.bar, *self.trackers, self.file):
            if h is not None:
                h.close()


def sample_rows(rollout: int, prompts: list, completions: list[str], rewards, per_func: dict, advantages,
                count: int, turns: list | None = None) -> list[dict]:
    """The first `count` completions of a rollout as flat rows: prompt, completion, reward (total and per
    function: null where it does not apply) and advantage; with `turns` (multi-turn), each one's messages."""
    value = lambda x: None if math.isnan(float(x)) else float(x)  # noqa: E731 (a function's None is NaN here)
    return [{"generation": rollout, "prompt": prompts[i], "completion": completions[i], "reward": float(rewards[i]),
             **{f"reward/{k}": value(v[i]) for k, v in per_func.items()}, "advantage": float(advantages[i]),
             **({"turns": turns[i]} if turns else {})}
            for i in range(min(count, len(completions)))]


def read_jsonl(path: Path) -> list[dict]:
    """The records of a JSON-lines file (none when it does not exist). A last line without its newline -- a write
    still going on, or a kill mid-write -- is left out; every complete line must parse."""
    path = Path(path)
    if not path.exists():
        return []
    lines = path.read_text().split("\n")[:-1]  # the part after the last newline is not a complete line
    return [json.loads(line) for line in lines if line.strip()]


def repair_jsonl(path: Path) -> list[dict]:
    """The readable records of a JSON-lines file the run wrote and reads back on resume. Lines that do not parse
    as a record with a step (a torn write, NUL bytes after a power loss) are dropped; the file as it was is kept
    beside it (PATH.damaged-TIME) and one warning names both. The checkpoint, not this log, holds the run."""
    raw = path.read_bytes()
    records, bad = [], 0
    for line in raw.split(b"\n"):
        line = line.strip(b"\x00 \r\t")
        if not line:
            continue
        try:
            record = json.loads(line)
        except (ValueError, UnicodeDecodeError):
            bad += 1
            continue
        if isinstance(record, dict) and isinstance(record.get("step"), int):
            records.append(record)
        else:
            bad += 1
    if bad or raw.replace(b"\x00", b"") != raw:
        kept = path.with_name(f"{path.name}.damaged-{time.strftime('%Y%m%d-%H%M%S')}")
        kept.write_bytes(raw)
        print(f"warning: {path} was damaged ({bad} unreadable line{'s' * (bad != 1)}, "
              f"{raw.count(bytes(1))} NUL bytes): kept {len(records)} records, the original is {kept}",
              file=sys.stderr)
    return records


def reward_quarters(records: list[dict]) -> tuple[float, float]:
    """Mean reward of the first and the last quarter of the steps (training lines: an eval_on_start line has none)."""
    records = [r for r in records if "reward_mean" in r]
    q = max(1, len(records) // 4)
    mean = lambda rs: sum(r["reward_mean"] for r in rs) / len(rs)  # noqa: E731
    return mean(records[:q]), mean(records[-q:])
