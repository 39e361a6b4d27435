"""Checkpoints that never lose a run: exact resume (mid mu-cycle included), atomic saves, preemption.

Layout under OUTPUT_DIR/checkpoints/:
    step-00000012/ds/...          the DeepSpeed checkpoint, sharded as ZeRO-3 holds it
    step-00000012/loop_rank{r}.pt  rank r's loop position, counters, RNG states and rollout buffer shard
    step-00000012/meta.json        written last: step, config, world size, the writing run's id, every file's size
    latest                         the newest complete step folder's name (updated after the rename)
A save goes to `.tmp-step-...` and is renamed into place only when every rank has written, so a folder
named `step-*` with a matching meta.json is complete; anything else is skipped with a warning on resume.
Resuming (`auto`) and pruning consider only the checkpoints of this run's lineage (recipe/outdir.py).
"""
from __future__ import annotations

import json
import os
import random
import shutil
import signal
import sys
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist

from recipe.config import Config
from recipe.outdir import in_lineage

# Fields that may change between a run and its resumption; every other field must match.
MUTABLE_FIELDS = {"max_steps", "logging_steps", "report_to_tensorboard", "disable_tqdm", "output_dir",
                  "resume_from_checkpoint", "save_steps", "save_total_limit", "overwrite_output_dir",
                  "collective_timeout_s"}


class CheckpointError(RuntimeError):
    """A checkpoint cannot be used; the message says why."""


def _fsync_write(path: Path, text: str) -> None:
    with open(path, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())


def _file_sizes(folder: Path) -> dict[str, int]:
    return {str(p.relative_to(folder)): p.stat().st_size for p in sorted(folder.rglob("*"))
            if p.is_file() and p.name != "meta.json"}


def rng_state() -> dict:
    np_state = np.random.get_state()
    state = {"python": random.getstate(), "torch": torch.get_rng_state(),
             "numpy": (np_state[0], torch.from_numpy(np_state[1].copy()), *np_state[2:])}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def set_rng_state(state: dict) -> None:
    random.setstate(state["python"])
    torch.set_rng_state(state["torch"])
    name, keys, *rest = state["numpy"]
    np.random.set_state((name, keys.numpy(), *rest))
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])


def safe_load(path, map_location=None):
    """torch.load with weights_only=True; only DeepSpeed's own plain data types (a stage enum, loss-scaler
    records) are allow-listed, so a checkpoint from an untrusted path cannot run code."""
    from deepspeed.runtime.fp16.loss_scaler import DynamicLossScaler, LossScaler
    from deepspeed.runtime.zero.config import ZeroStageEnum

    with torch.serialization.safe_globals([ZeroStageEnum, LossScaler, DynamicLossScaler]):
        return torch.load(path, map_location=map_location, weights_only=True)


class Checkpointer:
    def __init__(self, cfg: Config, rank: int, world_size: int):
        self.cfg, self.rank, self.world = cfg, rank, world_size
        self.root = Path(cfg.output_dir) / "checkpoints"
        self._signal = None
        # this run's segment and lineage (set from the output folder's claim); None: every checkpoint counts
        self.run_id: str | None = None
        self.lineage: list[dict] | None = None

    # --- preemption ---------------------------------------------------------------------
    def install_signal_handlers(self) -> None:
        def handler(signum, frame):
            self._signal = signal.Signals(signum).name

        for sig in (signal.SIGTERM, signal.SIGUSR1):
            signal.signal(sig, handler)

    def stop_requested(self) -> bool:
        """True on every rank once any rank got SIGTERM/SIGUSR1 (ranks may see the signal at different steps)."""
        flag = torch.tensor([1.0 if self._signal else 0.0])
        if self.world > 1:
            dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        return bool(flag.item())

    # --- saving -------------------------------------------------------------------------
    def should_save(self, step: int) -> bool:
        return self.cfg.save_steps > 0 and step % self.cfg.save_steps == 0

    def save(self, engine, step: int, loop_state: dict) -> Path:
        name = f"step-{step:08d}"
        final, tmp = self.root / name, self.root / f".tmp-{name}"
        if self.rank == 0:
            shutil.rmtree(tmp, ignore_errors=True)
            tmp.mkdir(parents=True)
        dist.barrier()
        engine.save_checkpoint(str(tmp), tag="ds", save_latest=False)
        path = tmp / f"loop_rank{self.rank}.pt"
        torch.save({**loop_state, "rng": rng_state()}, path)
        with open(path, "rb+") as f:
            os.fsync(f.fileno())
        dist.barrier()
        if self.rank == 0:
            meta = {"step": step, "world_size": self.world, "run_id": self.run_id, "config": self.cfg.to_dict(),
                    "files": _file_sizes(tmp)}
            _fsync_write(tmp / "meta.json", json.dumps(meta, indent=1))
            if final.exists():
                shutil.rmtree(final)
            os.rename(tmp, final)
            _fsync_write(self.root / "latest.tmp", name)
            os.replace(self.root / "latest.tmp", self.root / "latest")
            self._prune()
        dist.barrier()
        return final

    def _prune(self) -> None:
        if self.cfg.save_total_limit <= 0:
            return
        # only this lineage's: another branch's higher step numbers must not push this run's own saves out
        complete = [p for p in self._candidates(self.lineage) if self._problem(p) is None]
        for old in complete[self.cfg.save_total_limit:]:
            shutil.rmtree(old, ignore_errors=True)

    # --- finding and checking -------------------------------------------------------------
    def _candidates(self, lineage: list[dict] | None = None) -> list[Path]:
        """step-* folders, newest first; with a lineage, only those its runs wrote (or whose meta is unreadable,
        so that a damaged save is reported rather than silently passed over)."""
        if not self.root.is_dir():
            return []
        found = sorted((p for p in self.root.glob("step-*") if p.is_dir()), reverse=True)
        if lineage is None:
            return found
        metas = {p: self.meta(p) for p in found}
        return [p for p, m in metas.items() if m is None or in_lineage(m.get("run_id"), m["step"], lineage)]

    @staticmethod
    def meta(folder: Path) -> dict | None:
        try:
            return json.loads((folder / "meta.json").read_text())
        except (OSError, ValueError):
            return None

    def run_id_of(self, folder: Path) -> str | None:
        """The id of the run (segment) that wrote a checkpoint; None for checkpoints older than run ids."""
        return (self.meta(folder) or {}).get("run_id")

    def _problem(self, folder: Path) -> str | None:
        """Why this folder is not a complete checkpoint for this world size, or None."""
        try:
            meta = json.loads((folder / "meta.json").read_text())
        except FileNotFoundError:
            return "no meta.json (the save did not finish)"
        except (OSError, ValueError) as e:
            return f"unreadable meta.json ({e})"
        sizes = _file_sizes(folder)
        for rel, size in meta.get("files", {}).items():
            if rel not in sizes:
                return f"missing file {rel}"
            if sizes[rel] != size:
                return f"file {rel} has {sizes[rel]} bytes, expected {size} (truncated or corrupt)"
        return None

    def find(self, lineage: list[dict] | None = None) -> Path | None:
        """The checkpoint to resume from per `resume_from_checkpoint` (auto | PATH | null); `auto` takes the
        newest complete one of `lineage` (None: of any run)."""
        spec = self.cfg.resume_from_checkpoint
        if not spec:
            return None
        if spec != "auto":
            folder = Path(spec)
            problem = "not a folder" if not folder.is_dir() else self._problem(folder)
            if problem:
                raise CheckpointError(f"resume_from_checkpoint: {spec}: {problem}")
            return folder
        for folder in self._candidates(lineage):
            problem = self._problem(folder)
            if problem is None:
                return folder
            if self.rank == 0:
                print(f"warning: skipping checkpoint {folder}: {problem}", file=sys.stderr)
        return None

    def check_config(self, folder: Path) -> None:
        """Refuse a resume whose config or world size would make it a different run."""
        meta = json.loads((folder / "meta.json").read_text())
        saved, now = meta["config"], self.cfg.to_dict()
        # a field added since the checkpoint was written, left at its default, changes nothing
        default = Config().to_dict()
        saved = {**{k: v for k, v in default.items() if k not in saved}, **saved}
        diffs = [f"{k}: {saved.get(k)!r} -> {now.get(k)!r}" for k in sorted(set(saved) | set(now))
                 if k not in MUTABLE_FIELDS and saved.get(k) != now.get(k)]
        if meta["world_size"] != self.world:
            diffs.insert(0, f"world size: {meta['world_size']} -> {self.world}")
        if diffs:
            raise CheckpointError(f"cannot resume from {folder}: the config differs in {'; '.join(diffs)}")

    # --- loading ------------------------------------------------------------------------
    def load(self, folder: Path, engine) -> dict:
        engine.checkpoint_engine.load = safe_load  # DeepSpeed itself unpickles with weights_only=False
        load_path, _ = engine.load_checkpoint(str(folder), tag="ds", load_module_strict=True,
                                              load_optimizer_states=True, load_lr_scheduler_states=True)
        if load_path is None:
            raise CheckpointError(f"DeepSpeed could not load {folder / 'ds'}")
        state = safe_load(folder / f"loop_rank{self.rank}.pt")
        set_rng_state(state.pop("rng"))
        return state
