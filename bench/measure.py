"""What bench/scale.py, scale_worker.py and gpu_check.py share: the model shapes and their random-weight builds,
a process's private memory sampled over phases, and one rollout's update as the recipe runs it."""
from __future__ import annotations

import os
import shutil
import threading
import time
from pathlib import Path

# Qwen2.5-0.5B's shape (config.json of the released model), random weights
QWEN05B = dict(vocab_size=151936, hidden_size=896, intermediate_size=4864, num_hidden_layers=24, num_attention_heads=14,
               num_key_value_heads=2, max_position_embeddings=32768, rope_theta=1000000.0, rms_norm_eps=1e-6,
               tie_word_embeddings=True)


SMOKE = dict(QWEN05B, vocab_size=4096, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
             num_attention_heads=4, num_key_value_heads=2)


def build_model(shape: dict, folder: Path) -> Path:
    """A Qwen2 of `shape` with random weights (seed 0), saved in bf16 as the released checkpoints are."""
    from grpo_recipe.dist.buildlock import exclusive
    from grpo_recipe.model.tiny import missing_files, save_model

    def complete() -> bool:
        return not [m for m in missing_files(folder) if not m.startswith("tokenizer")]

    if complete():
        return folder
    with exclusive(folder.with_name(folder.name + ".lock"), f"the build of {folder}"):
        if not complete():
            import torch
            from transformers import AutoModelForCausalLM, Qwen2Config

            torch.manual_seed(0)
            model = AutoModelForCausalLM.from_config(Qwen2Config(**shape), dtype=torch.bfloat16)
            tmp = folder.with_name(folder.name + ".tmp")
            shutil.rmtree(tmp, ignore_errors=True)
            tmp.mkdir(parents=True)
            save_model(model, tmp)
            shutil.rmtree(folder, ignore_errors=True)
            os.rename(tmp, folder)  # complete or absent
    return folder


def rss_anon() -> int:
    """Private (anonymous) resident bytes of this process: pages of mapped files are not counted."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("RssAnon:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("no RssAnon in /proc/self/status")


class PeakSampler:
    """RssAnon sampled every millisecond from a thread (torch releases the GIL in its kernels), relative to
    the process's own level at start. `mark(name)` closes a phase: its level at start, its peak and its level
    at the end."""

    def __init__(self):
        self.base = rss_anon()
        self.peak, self.start, self.phases, self._stop = self.base, self.base, {}, False
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self):
        while not self._stop:
            self.peak = max(self.peak, rss_anon())
            time.sleep(0.001)

    def mark(self, name: str) -> None:
        now = rss_anon()
        self.peak = max(self.peak, now)
        self.phases[name] = {"start_bytes": self.start - self.base, "peak_bytes": self.peak - self.base,
                             "end_bytes": now - self.base}
        self.start = self.peak = now

    def stop(self) -> dict:
        self._stop = True
        self._thread.join()
        return {"phases": self.phases, "peak_bytes": max(p["peak_bytes"] for p in self.phases.values())}


def update(engine, buf, cfg) -> list[dict]:
    """One rollout's update, as grpo_recipe.train runs it: each optimizer step's statistics."""
    from grpo_recipe.algo.update import train_on_rollout

    return [step.stats for step in train_on_rollout(engine, None, buf, cfg)]


def rss_anon_of(pid: int) -> int | None:
    """Private resident bytes of another process (None once it is gone)."""
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("RssAnon:"):
                    return int(line.split()[1]) * 1024
    except (FileNotFoundError, ProcessLookupError, PermissionError):
        return None
    return None


def alive(pid: int) -> bool:
    """Whether any thread of process `pid` is still running or exiting: a killed process's memory is back once all
    are dead or zombies (its first thread turns zombie while the others still exit, its memory held until the last)."""
    try:
        tasks = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return False
    for task in tasks:
        try:
            with open(f"/proc/{pid}/task/{task}/stat") as f:
                if f.read().rsplit(")", 1)[1].split()[0] not in ("Z", "X"):
                    return True
        except (OSError, IndexError):
            continue
    return False


def descendants(pid: int) -> list[int]:
    """Every process below `pid` (from /proc's parent links)."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    ppid = int(f.read().rsplit(")", 1)[1].split()[1])
            except (OSError, ValueError, IndexError):
                continue
            children.setdefault(ppid, []).append(int(entry))
    out, todo = [], [pid]
    while todo:
        for c in children.get(todo.pop(), []):
            out.append(c)
            todo.append(c)
    return out


def available_memory() -> int:
    """Bytes the system could still give processes now (/proc/meminfo MemAvailable)."""
    with open("/proc/meminfo") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("MemAvailable:"))


def whole_run_peaks(cmd: list[str], env: dict, cwd: Path, every_s: float = 0.1, log: Path | None = None,
                    timeout_s: float | None = None, memory_limit: int | None = None) -> dict:
    """Run a launcher command and sample the private memory (RssAnon) of each of its rank processes (those with a
    RANK in their environment) every `every_s` seconds, from start to exit, nothing subtracted: what a user's
    processes reach. Returns the exit code, each rank's peak bytes and the run's wall seconds. Past `timeout_s`, or
    once the ranks together hold more than `memory_limit` bytes (before the kernel's OOM killer picks a victim,
    which may be another process), the launcher and everything below it are killed and `stopped` says why."""
    import signal
    import subprocess

    out = open(log, "w") if log is not None else subprocess.DEVNULL
    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd, env=env, cwd=cwd, stdout=out, stderr=subprocess.STDOUT)
    peaks: dict[int, int] = {}
    ranks: dict[int, int] = {}
    stopped = None
    while proc.poll() is None:
        below, held = descendants(proc.pid), 0
        for pid in below:
            if pid not in ranks:
                try:
                    environ = open(f"/proc/{pid}/environ", "rb").read().split(b"\0")
                except OSError:
                    continue
                rank = next((int(e[5:]) for e in environ if e.startswith(b"RANK=")), None)
                if rank is None:
                    continue
                ranks[pid] = rank
            value = rss_anon_of(pid)
            if value is not None:
                peaks[ranks[pid]] = max(peaks.get(ranks[pid], 0), value)
                held += value
        if memory_limit is not None and held > memory_limit:
            stopped = "memory"
        elif timeout_s is not None and time.perf_counter() - t0 > timeout_s:
            stopped = "timeout"
        if stopped:
            proc.kill()  # first, so that it starts nothing more; what it started is listed in `below`
            for pid in below:
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            proc.wait()
            gone_by = time.perf_counter() + 60  # the killed ranks' memory back before anything else is measured
            while any(alive(pid) for pid in below) and time.perf_counter() < gone_by:
                time.sleep(every_s)
            break
        time.sleep(every_s)
    if log is not None:
        out.close()
    return {"exit_code": proc.returncode, "peak_bytes": [peaks[r] for r in sorted(peaks)],
            "wall_s": time.perf_counter() - t0, "stopped": stopped}
