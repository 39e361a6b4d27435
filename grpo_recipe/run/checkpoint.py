"""Checkpoints that never lose a run: exact resume (mid mu-cycle included), atomic saves, preemption.

Layout under OUTPUT_DIR/checkpoints/:
    step-00000012/ds/...          the DeepSpeed checkpoint, sharded as ZeRO-3 holds it
    step-00000012/loop_rank{r}.pt  rank r's loop position, counters, RNG states and rollout buffer shard
    step-00000012/meta.json        written last: step, config, world size, the writing run's id, every file's
                                   size and CRC-32
    latest                         the newest complete step folder's name (updated after the rename)
A save goes to `.tmp-step-...` and is renamed into place only when every rank has written, so a folder
named `step-*` whose files match meta.json is complete; anything else is skipped with a warning on resume.
Resuming (`auto`) and pruning consider only the checkpoints of this run's lineage (grpo_recipe/run/outdir.py).
A save that cannot be written (a full disk) removes its partial folder and stops the run with one line; the
earlier checkpoints stay. DeepSpeed's zero_to_fp32.py is not shipped (it unpickles with weights_only=False):
`python -m grpo_recipe.tools.export` converts a checkpoint instead.
"""
from __future__ import annotations

import json
import os
import random
import shutil
import sys
import zlib
from pathlib import Path

import numpy as np
import torch

from grpo_recipe.algo.schedule import depends_on_max_steps
from grpo_recipe.config.schema import Config
from grpo_recipe.dist import signals
from grpo_recipe.dist.collectives import all_gather_object, any_rank, barrier, every_rank, first_error
from grpo_recipe.run.outdir import in_lineage

# Fields that may change between a run and its resumption; every other field must match. Evaluation, samples and
# trackers are among them: they leave the training trajectory unchanged (tested). max_steps may change only
# while the learning-rate schedule does not depend on it. (hf_generation_gather: both modes generate the same
# tokens; a resumed run may need the other's memory.)
MUTABLE_FIELDS = {"max_steps", "logging_steps", "report_to_tensorboard", "disable_tqdm", "output_dir",
                  "resume_from_checkpoint", "save_steps", "save_total_limit", "overwrite_output_dir",
                  "collective_timeout_s", "reward_timeout_s", "skip_nonfinite_steps", "report_to", "wandb_project",
                  "run_name",
                  "eval_dataset_name", "eval_dataset_split", "eval_steps", "eval_on_start", "eval_num_generations",
                  "per_device_eval_batch_size", "log_completions_steps", "num_prompts_to_log",
                  "hf_generation_gather"}


def as_today(saved: dict) -> dict:
    """A checkpoint's config in today's fields: a field added since it was written takes the value that gives the
    behaviour the checkpoint was trained with (its default, where that changes nothing)."""
    saved = dict(saved)
    if "vllm_importance_sampling_correction" not in saved:  # before TRL's fields: only vllm_tis_cap corrected
        cap = saved.pop("vllm_tis_cap", None)
        if cap is not None:
            saved.update(vllm_importance_sampling_correction=True, vllm_importance_sampling_mode="token_truncate",
                         vllm_importance_sampling_clip_min=None, vllm_importance_sampling_clip_max=cap)
        elif saved.get("generation_backend") == "vllm":
            saved["vllm_importance_sampling_correction"] = False
    if "use_bias_correction_kl" not in saved and saved.get("beta", 0.0) > 0.0:
        saved["use_bias_correction_kl"] = False
    default = Config().to_dict()
    return {**{k: v for k, v in default.items() if k not in saved}, **saved}


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


def crc32_file(path: Path) -> str:
    """A file's CRC-32: catches accidental corruption (not tampering) at about 4x the speed of SHA-256 here."""
    crc = 0
    with open(path, "rb") as f:
        while chunk := f.read(16 << 20):
            crc = zlib.crc32(chunk, crc)
    return f"{crc:08x}"


def free_space(path: Path) -> tuple[int, int]:
    """(free bytes, free inodes) on the filesystem that holds `path`, or would once it exists."""
    while not path.exists():
        path = path.parent
    st = os.statvfs(path)
    return st.f_bavail * st.f_frsize, st.f_favail


def mib(n: float) -> str:
    return f"{n / 2**20:.1f} MiB"


def one_line(e: BaseException) -> str:
    return " ".join(str(e).split())[:300] or type(e).__name__


def min_checkpoint_bytes(trained: int, frozen_bytes: int, adam: bool, zero_partitions_grads: bool) -> int:
    """At least what one checkpoint holds: the fp32 copy of every trained parameter, with Adam its two moments,
    and under ZeRO-2/3 the frozen weights (the loop's state and small records come on top)."""
    return trained * (12 if adam else 4) + (frozen_bytes if zero_partitions_grads else 0)


def checkpoint_bytes(engine) -> int:
    params = list(engine.module.parameters())
    numel = lambda p: getattr(p, "ds_numel", p.numel())  # noqa: E731 -- ZeRO-3 leaves an empty tensor in place
    return min_checkpoint_bytes(sum(numel(p) for p in params if p.requires_grad),
                                sum(numel(p) * p.element_size() for p in params if not p.requires_grad),
                                "adam" in str(engine.optimizer_name() or "").lower(),
                                engine.zero_optimization_partition_gradients())


def space_note(save_total_limit: int, needed: int) -> str:
    """How much room checkpoints take: a save writes one more while the save_total_limit older ones stand."""
    keep = f"save_total_limit {save_total_limit} keeps {save_total_limit} and writes 1 more: " \
           f"{mib((save_total_limit + 1) * needed)}" if save_total_limit else "save_total_limit 0 keeps every one"
    return f"a checkpoint needs about {mib(needed)}, {keep}"


def meta_problem(meta) -> str | None:
    """What makes a parsed meta.json not of the shape Checkpointer.save writes (an edited file, another tool's, a
    torn value that still parses); None when it is."""
    def count(v) -> bool:
        return type(v) is int and v >= 0

    if not isinstance(meta, dict):
        return "not a JSON object"
    need = {"step": count, "world_size": lambda v: count(v) and v > 0, "config": lambda v: isinstance(v, dict),
            "files": lambda v: isinstance(v, dict) and all(isinstance(k, str) and count(n) for k, n in v.items())}
    for key, ok in need.items():
        if key not in meta:
            return f"no {key}"
        if not ok(meta[key]):
            return f"{key} is {json.dumps(meta[key])[:60]}"
    checksums, run_id = meta.get("checksums", {}), meta.get("run_id")
    if not (isinstance(checksums, dict) and all(isinstance(v, str) for v in checksums.values())):
        return f"checksums is {json.dumps(checksums)[:60]}"
    if run_id is not None and not isinstance(run_id, str):
        return f"run_id is {json.dumps(run_id)[:60]}"
    return None


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


def safe_load(path, map_location=None, mmap=None, _torch_load=torch.load):
    """torch.load with weights_only=True; only DeepSpeed's own plain data types (a stage enum, loss-scaler
    records) are allow-listed, so a checkpoint from an untrusted path cannot run code. (`_torch_load` is bound
    when this module loads, so grpo_recipe.tools.export may route torch.load itself through here.)"""
    from deepspeed.runtime.fp16.loss_scaler import DynamicLossScaler, LossScaler
    from deepspeed.runtime.zero.config import ZeroStageEnum

    with torch.serialization.safe_globals([ZeroStageEnum, LossScaler, DynamicLossScaler]):
        return _torch_load(path, map_location=map_location, weights_only=True, mmap=mmap)


class Checkpointer:
    def __init__(self, cfg: Config, rank: int, world_size: int):
        self.cfg, self.rank, self.world = cfg, rank, world_size
        self.root = Path(cfg.output_dir) / "checkpoints"
        # this run's segment and lineage (set from the output folder's claim); None: every checkpoint counts
        self.run_id: str | None = None
        self.lineage: list[dict] | None = None
        self.last_bytes: int | None = None  # size of the last checkpoint written or resumed from
        self.saved_step: int | None = None  # the step of the last checkpoint written or resumed from

    # --- preemption ---------------------------------------------------------------------
    def install_signal_handlers(self) -> None:
        """Stop signals recorded again (a library started during setup may have installed its own handlers)."""
        signals.catch()

    def stop_requested(self) -> bool:
        """True on every rank once any rank got SIGTERM/SIGUSR1 (ranks may see the signal at different steps)."""
        return any_rank(signals.pending() is not None)

    # --- saving -------------------------------------------------------------------------
    def should_save(self, step: int) -> bool:
        return self.cfg.save_steps > 0 and step % self.cfg.save_steps == 0

    def save(self, engine, step: int, loop_state: dict) -> Path:
        """Write a checkpoint atomically. A disk too full for it stops the run with a CheckpointError naming the
        folder, before writing when the free space is known to be short, else once a write fails: the partial
        folder is removed and the earlier checkpoints are kept."""
        name = f"step-{step:08d}"
        final, tmp = self.root / name, self.root / f".tmp-{name}"
        needed = self.last_bytes or checkpoint_bytes(engine)
        free, _ = free_space(self.root)
        if not self._all(free >= needed):
            raise CheckpointError(f"checkpoint {final}: not enough disk space ({mib(free)} free on that filesystem; "
                                  f"{space_note(self.cfg.save_total_limit, needed)}); nothing written, {self.kept_note()}")
        failure = first_error(self._write(engine, tmp, loop_state))
        if failure is None:
            sums = self._checksums(tmp)  # every rank has written: sum the files in parallel
            failure = sums if isinstance(sums, tuple) else first_error(self._publish(tmp, final, step, sums))
        if failure is not None:
            free, inodes = free_space(self.root)  # measured on every rank before the partial folder goes
            barrier()
            if self.rank == 0:
                shutil.rmtree(tmp, ignore_errors=True)
            full = "the disk is full" + (" (no free inodes)" if inodes == 0 else "") \
                if free < needed or inodes == 0 or "No space left" in failure[1] else "a write failed"
            raise CheckpointError(f"checkpoint {tmp} could not be written: {full} ({mib(free)} free; rank "
                                  f"{failure[0]}: {failure[1]}); removed it, {self.kept_note()}; "
                                  f"{space_note(self.cfg.save_total_limit, needed)}")
        self.last_bytes, self.saved_step = sum(_file_sizes(final).values()), step
        if self.rank == 0:
            try:
                _fsync_write(self.root / "latest.tmp", name)
                os.replace(self.root / "latest.tmp", self.root / "latest")
                self._prune()
            except OSError as e:  # the checkpoint itself is complete; resuming finds it without `latest`
                print(f"warning: {final} saved, but updating {self.root / 'latest'} failed: {one_line(e)}",
                      file=sys.stderr)
        barrier()
        return final

    def _write(self, engine, tmp: Path, loop_state: dict) -> str | None:
        """This rank's part of the checkpoint. A failed write is returned, not raised: every rank must still walk
        through DeepSpeed's collectives, then they agree."""
        errors: list[str] = []
        ds = engine.checkpoint_engine
        ds_save, ds_makedirs = ds.save, ds.makedirs

        def recorded(write):
            def call(*args, **kwargs):
                if not errors:  # the first failure is the one to report; the disk stays full after it
                    try:
                        write(*args, **kwargs)
                    except (OSError, RuntimeError) as e:  # torch reports a full disk as RuntimeError
                        errors.append(f"{args[-1] if args else kwargs.get('path')}: {one_line(e)}")
            return call

        ds.save, ds.makedirs = recorded(ds_save), recorded(ds_makedirs)
        # DeepSpeed copies zero_to_fp32.py into every checkpoint: it unpickles with weights_only=False, and its
        # copy (rank 0 only) could fail out of the save's collectives. grpo_recipe.tools.export converts checkpoints.
        engine._copy_recovery_script = lambda save_path: None
        try:
            if self.rank == 0:
                try:
                    shutil.rmtree(tmp, ignore_errors=True)
                    tmp.mkdir(parents=True)
                except OSError as e:
                    errors.append(f"{tmp}: {one_line(e)}")
            barrier()
            engine.save_checkpoint(str(tmp), tag="ds", save_latest=False)
            if not errors:
                path = tmp / f"loop_rank{self.rank}.pt"
                try:
                    torch.save({**loop_state, "rng": rng_state()}, path)
                    with open(path, "rb+") as f:
                        os.fsync(f.fileno())
                except (OSError, RuntimeError) as e:
                    errors.append(f"{path}: {one_line(e)}")
        finally:
            ds.save, ds.makedirs = ds_save, ds_makedirs
        return errors[0] if errors else None

    def _checksums(self, tmp: Path) -> dict[str, str] | tuple[int, str]:
        """Every file's CRC-32, each rank summing its share; or the first rank's failure."""
        names = sorted(_file_sizes(tmp))
        try:
            mine, error = {rel: crc32_file(tmp / rel) for rel in names[self.rank::self.world]}, None
        except OSError as e:
            mine, error = {}, one_line(e)
        failure = first_error(error)
        if failure is not None:
            return failure
        parts = all_gather_object(mine)
        return {k: v for part in parts for k, v in part.items()}

    def _publish(self, tmp: Path, final: Path, step: int, sums: dict[str, str]) -> str | None:
        """Rank 0 writes meta.json and renames the folder into place."""
        if self.rank != 0:
            return None
        try:
            meta = {"step": step, "world_size": self.world, "run_id": self.run_id, "config": self.cfg.to_dict(),
                    "files": _file_sizes(tmp), "checksums": sums}
            _fsync_write(tmp / "meta.json", json.dumps(meta, indent=1))
            if final.exists():
                shutil.rmtree(final)
            os.rename(tmp, final)
        except OSError as e:
            return f"{tmp / 'meta.json'}: {one_line(e)}"
        return None

    def _all(self, ok: bool) -> bool:
        """Whether `ok` holds on every rank (so that every rank takes the same branch)."""
        return every_rank(ok)

    def kept_note(self) -> str:
        kept = [p.name for p in self._candidates() if self._problem(p) is None]
        return f"kept {', '.join(kept)}" if kept else "no earlier checkpoint to keep"

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
        """The checkpoint's meta.json as this recipe writes it; None when it is unreadable or not of that shape."""
        try:
            meta = json.loads((folder / "meta.json").read_text())
        except (OSError, ValueError):
            return None
        return meta if meta_problem(meta) is None else None

    def run_id_of(self, folder: Path) -> str | None:
        """The id of the run (segment) that wrote a checkpoint; None for checkpoints older than run ids."""
        return (self.meta(folder) or {}).get("run_id")

    def _problem(self, folder: Path, verify: bool = False) -> str | None:
        """Why this folder is not a complete checkpoint, or None. `verify` reads every file against its checksum
        (checkpoints written before checksums were recorded are checked by size only)."""
        try:
            meta = json.loads((folder / "meta.json").read_text())
        except FileNotFoundError:
            return "no meta.json (the save did not finish)"
        except (OSError, ValueError) as e:
            return f"unreadable meta.json ({e})"
        shape = meta_problem(meta)
        if shape is not None:
            return f"meta.json is not one this recipe writes: {shape}"
        sizes = _file_sizes(folder)
        for rel, size in meta.get("files", {}).items():
            if rel not in sizes:
                return f"missing file {rel}"
            if sizes[rel] != size:
                return f"file {rel} has {sizes[rel]} bytes, expected {size} (truncated or corrupt)"
        for rel, crc in (meta.get("checksums", {}) if verify else {}).items():
            if crc32_file(folder / rel) != crc:
                return f"file {rel} does not match its checksum (corrupt)"
        return None

    def verify(self, folder: Path) -> str | None:
        """Why `folder` is not a complete, uncorrupted checkpoint (every file read against its checksum), or None."""
        return self._problem(folder, verify=True)

    def find(self, lineage: list[dict] | None = None) -> Path | None:
        """The checkpoint to resume from per `resume_from_checkpoint` (auto | PATH | null); `auto` takes the
        newest complete one of `lineage` (None: of any run)."""
        spec = self.cfg.resume_from_checkpoint
        if not spec:
            return None
        if spec != "auto":
            folder = Path(spec)
            problem = "not a folder" if not folder.is_dir() else self._problem(folder, verify=True)
            if problem:
                raise CheckpointError(f"resume_from_checkpoint: {spec}: {problem}")
            return folder
        for folder in self._candidates(lineage):
            problem = self._problem(folder, verify=True)
            if problem is None:
                return folder
            if self.rank == 0:
                print(f"warning: skipping checkpoint {folder}: {problem}", file=sys.stderr)
        return None

    def check_config(self, folder: Path) -> None:
        """Refuse a resume whose config or world size would make it a different run."""
        meta = json.loads((folder / "meta.json").read_text())
        saved, now = as_today(meta["config"]), self.cfg.to_dict()
        diffs = [f"{k}: {saved.get(k)!r} -> {now.get(k)!r}" for k in sorted(set(saved) | set(now))
                 if k not in MUTABLE_FIELDS and saved.get(k) != now.get(k)]
        if meta["world_size"] != self.world:
            diffs.insert(0, f"world size: {meta['world_size']} -> {self.world}")
        if saved.get("max_steps") != now["max_steps"] and depends_on_max_steps(self.cfg):
            diffs.append(f"max_steps: {saved.get('max_steps')!r} -> {now['max_steps']!r} (it sets the length of the "
                         f"learning-rate schedule, lr_scheduler_type {self.cfg.lr_scheduler_type})")
        if diffs:
            raise CheckpointError(f"cannot resume from {folder}: the config differs in {'; '.join(diffs)}")
        if meta.get("step", 0) > now["max_steps"]:  # its final model would be a later one than max_steps asks for
            raise CheckpointError(f"cannot resume from {folder}: it is at step {meta['step']}, beyond max_steps "
                                  f"{now['max_steps']}; raise max_steps, or resume from a checkpoint at or before "
                                  f"step {now['max_steps']} (--resume_from_checkpoint PATH)")

    # --- loading ------------------------------------------------------------------------
    def load(self, folder: Path, engine) -> dict:
        engine.checkpoint_engine.load = safe_load  # DeepSpeed itself unpickles with weights_only=False
        load_path, _ = engine.load_checkpoint(str(folder), tag="ds", load_module_strict=True,
                                              load_optimizer_states=True, load_lr_scheduler_states=True)
        if load_path is None:
            raise CheckpointError(f"DeepSpeed could not load {folder / 'ds'}")
        state = safe_load(folder / f"loop_rank{self.rank}.pt")
        set_rng_state(state.pop("rng"))
        meta = json.loads((folder / "meta.json").read_text())
        self.last_bytes, self.saved_step = sum(meta["files"].values()), meta["step"]
        return state
