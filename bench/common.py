"""Shared helpers for the benchmarks: launching recipe runs on CPU ranks, reading their metrics, describing the
machine."""
from __future__ import annotations

import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))  # the scripts run from bench/

from grpo_recipe.dist.env import rank_env, torchrun  # noqa: E402
from grpo_recipe.run.metrics import read_jsonl  # noqa: E402

RESULTS = Path(os.environ.get("BENCH_RESULTS", REPO / "bench" / "results"))  # tests point it elsewhere
QUICKSTART = "grpo_recipe/configs/quickstart.yaml"


def launch(nproc: int, entry: list[str], overrides: list[str], log: Path) -> float:
    """Run `entry` (e.g. ["-m", "grpo_recipe.train"]) under torchrun with nproc CPU ranks; returns wall seconds."""
    env, cmd = rank_env(), torchrun(nproc, [*entry, *overrides])
    log.parent.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    with open(log, "w") as f:
        f.write(" ".join(cmd) + "\n")
        f.flush()
        proc = subprocess.run(cmd, cwd=REPO, env=env, stdout=f, stderr=subprocess.STDOUT)
    if proc.returncode != 0:
        raise RuntimeError(f"run failed ({proc.returncode}); see {log}")
    return time.perf_counter() - t0


def read_metrics(out_dir: Path) -> list[dict]:
    """The run's metrics.jsonl records; a half-written last line (a run still going) is left out."""
    return read_jsonl(out_dir / "metrics.jsonl")


class MetricsTail:
    """A running run's metrics.jsonl, parsed incrementally: each read() parses only the lines completed since
    (read_jsonl's rule, without re-reading the file)."""

    def __init__(self, out_dir: Path):
        self.path, self.offset, self.records = out_dir / "metrics.jsonl", 0, []

    def read(self) -> list[dict]:
        if self.path.exists():
            with open(self.path, "rb") as f:
                f.seek(self.offset)
                data = f.read()
            done = data.rfind(b"\n") + 1  # a half-written last line waits for the next read
            self.records += [json.loads(line) for line in data[:done].splitlines() if line.strip()]
            self.offset += done
        return self.records


def moving_average(vals: list[float], k: int) -> list[float]:
    """Mean of each value and the k - 1 before it (fewer at the start)."""
    return [sum(vals[max(0, i - k + 1):i + 1]) / len(vals[max(0, i - k + 1):i + 1]) for i in range(len(vals))]


def smoothed(rows: list[dict], k: int) -> list[float]:
    """Moving average of the rows' rewards over the last k rollouts."""
    return moving_average([r["reward"] for r in rows], k)


def time_to(rows: list[dict], threshold: float, k: int, clock: str = "time_s") -> float | None:
    """Time (the rows' `clock`: time_s wall, cpu_s process CPU) at which the k-rollout moving average first reached
    the threshold (None: never)."""
    return next((r[clock] for r, s in zip(rows, smoothed(rows, k)) if s >= threshold), None)


def passes_per_rollout(records: list[dict]) -> list[int]:
    """The passes each rollout got: passes_used at its last step (the last rollout's: as far as the run went)."""
    return [r["passes_used"] for i, r in enumerate(records)
            if i + 1 == len(records) or records[i + 1]["generation"] != r["generation"]]


def per_generation(records: list[dict]) -> list[dict]:
    """One row per rollout: its reward and the wall time (sum of step times) at which that reward was known; with
    step_cpu_s in the records also cpu_s, the process CPU time by then (the first step's CPU split as its wall);
    with entropy, the policy's mean token entropy on the fresh rollout (its first step: on-policy). With decode_steps
    in the records, the work done by then, for a clock priced by counts (reuse_report.cost_clock): decode_steps
    (summed over rollouts, this one's included) and train_tokens (tokens trained in the steps before)."""
    rows, elapsed, cpu, decoded, trained = [], 0.0, 0.0, 0.0, 0
    for r in records:
        if r["iteration"] == 0 and (not rows or rows[-1]["generation"] != r["generation"]):
            rollout_s = r["time_generate_s"] + r["time_score_s"]
            rows.append({"generation": r["generation"], "reward": r["reward_mean"], "time_s": elapsed + rollout_s,
                         "step": r["step"] - 1})
            if "decode_steps" in r:
                decoded += r["decode_steps"]
                rows[-1] |= {"decode_steps": decoded, "train_tokens": trained}
            if "step_cpu_s" in r:
                rows[-1]["cpu_s"] = cpu + r["step_cpu_s"] * rollout_s / r["step_time_s"]
            if "entropy" in r:  # a policy collapsing onto one completion shows here before the reward stalls
                rows[-1]["entropy"] = r["entropy"]
        elapsed += r["step_time_s"]
        cpu += r.get("step_cpu_s", 0.0)
        trained += r.get("train_tokens", 0)
    return rows


COST_TERMS = ("decode_steps", "train_tokens", "step")  # and one term per rollout


def fit_prices(row_lists: list[list[dict]]) -> dict[str, float]:
    """CPU seconds per unit of work, one price per COST_TERMS and per rollout, fitted by least squares on the
    intervals between consecutive rollouts of all the given runs (each interval: what it did -> the CPU seconds it
    took). Fitted on every run of a regime together, so every run is priced alike whenever it ran."""
    import numpy as np

    x, y = [], []
    for rows in row_lists:
        for a, b in zip(rows, rows[1:]):
            x.append([b[k] - a[k] for k in COST_TERMS] + [1.0])
            y.append(b["cpu_s"] - a["cpu_s"])
    x, y = np.asarray(x, dtype=np.float64).reshape(-1, len(COST_TERMS) + 1), np.asarray(y, dtype=np.float64)
    coef, free = np.zeros(x.shape[1]), list(range(x.shape[1]))
    while free:  # no price is negative: drop the most negative term and refit without it (an active set)
        fit = np.linalg.lstsq(x[:, free], y, rcond=None)[0]
        if fit.min() >= 0:
            coef[free] = fit
            break
        free.pop(int(fit.argmin()))
    return dict(zip((*COST_TERMS, "rollout"), map(float, coef)))


def cost_clock(rows: list[dict], prices: dict[str, float]) -> list[float]:
    """Each rollout's time on the priced clock: the work done by then, at `prices` (rollouts counted from 1)."""
    return [sum(prices[k] * r[k] for k in COST_TERMS) + prices["rollout"] * (i + 1) for i, r in enumerate(rows)]


def save_figure(fig, path: Path) -> None:
    """A matplotlib figure as a PNG with a 256-colour palette: a third of the size of matplotlib's own, so the
    figures stay small in the repository (tests/test_docs.py caps the tracked tree)."""
    from PIL import Image

    fig.savefig(path, dpi=110)
    Image.open(path).convert("RGB").quantize(256).save(path, optimize=True)


def _git(*args: str) -> str:
    proc = subprocess.run(["git", *args], cwd=REPO, capture_output=True, text=True)
    return proc.stdout.strip() if proc.returncode == 0 else "unknown"


def _code() -> dict:
    return {"commit": _git("rev-parse", "--short=12", "HEAD"),
            # results written by earlier benchmarks are not code
            "uncommitted_changes": bool(_git("status", "--porcelain", "--untracked-files=no", "--", ".",
                                             ":(exclude)bench/results")),
            "started_at": time.strftime("%Y-%m-%dT%H:%M:%S%z")}


# The code a benchmark ran is the tree when it started (it imports this module first), not when it writes hours
# later.
CODE_AT_START = _code()


def provenance() -> dict:
    """Who wrote a results file: the command as run, the commit it started from (and whether the tree had
    changes then), the time, the machine and its load average at the end."""
    return {"command": " ".join(["python", *sys.argv]), **CODE_AT_START,
            "written_at": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "machine": machine(),
            "load_average": list(os.getloadavg())}


def save_json(name: str | Path, data: dict, folder: Path | None = None) -> Path:
    """Write a results file with its provenance (`provenance()`): only the script that measured it writes it.
    `name` is a file name in `folder` (default bench/results), or a path (a script's --out)."""
    path = Path(name) if folder is None and Path(name).parent != Path(".") else (folder or RESULTS) / name
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({**data, "provenance": provenance()}, indent=1, default=str) + "\n")
    return path


def instance() -> str:
    """This boot of this machine (Linux's boot id): timings from different boots do not pair, even of one machine
    type (a virtual machine's host and neighbours change with it)."""
    boot = Path("/proc/sys/kernel/random/boot_id")
    return boot.read_text().strip() if boot.exists() else f"{platform.node()}-unknown-boot"


def machine(**extra) -> dict:
    """The machine a result was measured on, plus `extra` (e.g. the load average at the end)."""
    import torch

    cpuinfo = Path("/proc/cpuinfo")
    cpu = next((line.split(":", 1)[1].strip() for line in cpuinfo.read_text().splitlines()
                if line.startswith("model name")), "") if cpuinfo.exists() else platform.processor()
    return {"cpus": os.cpu_count(), "cpu_model": cpu,
            "memory_gib": round(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30, 1),
            "gpu": torch.cuda.get_device_name() if torch.cuda.is_available() else None,
            "python": platform.python_version(), "torch": torch.__version__, "platform": platform.platform(), **extra}
