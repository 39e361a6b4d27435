"""The output folder belongs to one run at a time, and a new run never silently takes over another's outputs.

- A lock (`OUTPUT_DIR/run.lock`, an OS lock held by rank 0 for the run's lifetime, released by the kernel
  when the process dies) makes a second run on the same folder stop with one line naming the holder.
- A folder that already holds a run's outputs (metrics, checkpoints, a final model) is refused unless the
  config says `resume_from_checkpoint` (continue that run) or `overwrite_output_dir` (remove the recipe's
  own outputs, nothing else in the folder).
- Nothing this recipe did not write is ever deleted. `run.json` is the proof of authorship: it is written
  before anything else, and it lists the tracker files the runs created (`written`). Without it, files at
  the names the recipe writes to are another tool's: a run that would write into them is refused, and
  nothing is removed. Whatever is removed is named on stderr.
- `run.json` records the run's lineage: the segments (one per start) that led to the current state, each
  with the step it started from. Checkpoints record the segment that wrote them, so resuming, pruning and
  `latest` consider only this lineage's checkpoints (not those of a branch abandoned by resuming from an
  earlier checkpoint).
"""
from __future__ import annotations

import errno
import fcntl
import json
import os
import re
import shutil
import socket
import sys
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path

from grpo_recipe.config.schema import Config

LOCK_NAME = "run.lock"
RECORD_NAME = "run.json"
WRITTEN_BY = "grpo_recipe"  # run.json's mark (one from before the mark has the same fields without it)
LOCK_LINE = re.compile(r"pid \d+ on \S+(, Slurm job \S+)?, since \d{4}-\d\d-\d\d \d\d:\d\d:\d\d")
# The files and folders at fixed names the recipe writes into OUTPUT_DIR (trackers' files are listed in run.json's
# `written`; inside checkpoints/ only the recipe's step folders, their temporary forms and `latest`).
FIXED = ("metrics.jsonl", "completions.jsonl", "final", "final.tmp", "final-merged", "final-merged.tmp")
CHECKPOINT_PATTERNS = ("step-*", ".tmp-step-*", "latest", "latest.tmp")


class OutputDirError(RuntimeError):
    """The output folder cannot be used by this run; the message says why and what to do."""


# ------------------------------------------------------------------------------------------
# the lock
# ------------------------------------------------------------------------------------------
class OutputLock:
    """An exclusive flock on OUTPUT_DIR/run.lock, naming its holder inside the file."""

    def __init__(self, folder: Path):
        self.path = folder / LOCK_NAME
        try:  # another tool's run.lock: never taken over (this recipe's holds one line, or nothing yet)
            held = self.path.read_text(errors="replace").strip() if not self.path.is_symlink() else "a symlink"
        except FileNotFoundError:
            held = ""
        except OSError as e:
            held = f"unreadable ({e.strerror})"
        if held and not LOCK_LINE.fullmatch(held):
            raise OutputDirError(f"output_dir {folder} holds a {LOCK_NAME} that this recipe did not write "
                                 f"({held[:60]!r}); nothing was touched: move it away or choose another output_dir")
        self.fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(self.fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as e:
            holder = self.path.read_text().strip() or "an unknown process"
            os.close(self.fd)
            if e.errno in (errno.EAGAIN, errno.EACCES):
                raise OutputDirError(f"output_dir {folder} is in use by another run ({holder}); wait for it to "
                                     f"end or choose another output_dir") from None
            # a filesystem without locks (e.g. Lustre mounted without flock): run, but say what is unguarded
            print(f"warning: cannot lock {self.path} ({e.strerror}): a second run on this folder would not be "
                  f"detected", file=sys.stderr)
            self.fd = None
            return
        job = os.environ.get("SLURM_JOB_ID")
        info = f"pid {os.getpid()} on {socket.gethostname()}{f', Slurm job {job}' if job else ''}, " \
               f"since {time.strftime('%Y-%m-%d %H:%M:%S')}"
        os.ftruncate(self.fd, 0)
        os.pwrite(self.fd, (info + "\n").encode(), 0)

    def release(self) -> None:
        if self.fd is not None:
            os.close(self.fd)  # closing drops the flock
            self.fd = None


# ------------------------------------------------------------------------------------------
# lineage
# ------------------------------------------------------------------------------------------
def in_lineage(run_id: str | None, step: int, lineage: list[dict]) -> bool:
    """Whether a checkpoint written by segment `run_id` at `step` is an ancestor of the current state: its
    segment is in the lineage and it was written no later than the next segment started from."""
    for i, seg in enumerate(lineage):
        if seg["run_id"] == run_id:
            return i + 1 == len(lineage) or step <= lineage[i + 1]["from_step"]
    return False


@dataclass
class Claim:
    """What rank 0 decided about the output folder, shared with every rank."""
    run_id: str
    lineage: list[dict] = field(default_factory=list)
    resume_from: Path | None = None


def data_outputs(folder: Path) -> list[str]:
    """The recipe's outputs in `folder` that hold a run's data (an empty metrics file holds none)."""
    found = []
    metrics = folder / "metrics.jsonl"
    if metrics.is_file() and metrics.stat().st_size > 0:
        found.append("metrics.jsonl")
    ckpts = folder / "checkpoints"
    if ckpts.is_dir():
        found += [f"checkpoints/{p.name}" for p in sorted(ckpts.glob("step-*"))]
    found += [name for name in ("final", "final-merged") if (folder / name).exists()]
    return found


def own_names(folder: Path) -> list[str]:
    """The entries of `folder` at the recipe's fixed names (FIXED and checkpoints/CHECKPOINT_PATTERNS)."""
    found = [name for name in FIXED if (folder / name).exists() or (folder / name).is_symlink()]
    ckpts = folder / "checkpoints"
    if ckpts.is_dir():
        found += sorted({f"checkpoints/{p.name}" for pat in CHECKPOINT_PATTERNS for p in ckpts.glob(pat)})
    return found


def _remove(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path)
    elif path.exists() or path.is_symlink():
        path.unlink()


def remove_recorded(folder: Path, record: dict) -> list[str]:
    """Remove what runs of this recipe wrote into `folder` (its fixed names and run.json's `written`), and the
    folders they leave empty; nothing else. Returns what was removed."""
    removed = []
    for rel in [*own_names(folder), *[w for w in record.get("written", []) if inside(folder, w)], RECORD_NAME]:
        path = folder / rel
        if path.exists() or path.is_symlink():
            _remove(path)
            removed.append(rel)
    for sub in ("checkpoints", "tensorboard", "wandb"):
        d = folder / sub
        if d.is_dir() and not d.is_symlink():
            for link in d.iterdir():  # wandb's latest-run and debug.log links into a removed run
                if link.is_symlink() and not link.exists():
                    link.unlink()
            if not any(d.iterdir()) and any(r == sub or r.startswith(sub + "/") for r in removed):
                d.rmdir()
    return removed


def inside(folder: Path, rel) -> bool:
    """Whether `rel` (a path a state file names) is a path inside `folder`: relative, no `..`, and its parent
    folder, symlinks resolved, within the folder's (the entry itself, a symlink, is unlinked, never followed)."""
    p = Path(str(rel))
    if not isinstance(rel, str) or not p.parts or p.is_absolute() or ".." in p.parts:
        return False
    root, parent = folder.resolve(), (folder / p).parent.resolve()
    return parent == root or root in parent.parents


def record_problem(record, folder: Path) -> str | None:
    """What makes a parsed run.json not one this recipe wrote for this folder; None when it is."""
    if not isinstance(record, dict):
        return "it is not a JSON object"
    if record.get("written_by", WRITTEN_BY) != WRITTEN_BY:
        return f"it says it was written by {record['written_by']!r}"
    unknown = sorted(set(record) - {"written_by", "lineage", "written"})
    if unknown or not isinstance(record.get("lineage"), list):
        return f"it has fields this recipe does not write ({', '.join(unknown)})" if unknown else "it has no lineage"
    for seg in record["lineage"]:
        if not (isinstance(seg, dict) and set(seg) == {"run_id", "from_step"} and isinstance(seg["run_id"], str)
                and type(seg["from_step"]) is int and seg["from_step"] >= 0):
            return f"its lineage holds {json.dumps(seg)[:80]}, not a segment (run_id, from_step)"
    written = record.get("written", [])
    if not isinstance(written, list):
        return "its written list is not a list"
    outside = [w for w in written if not inside(folder, w)]
    if outside:
        return f"its written list names {json.dumps(outside[0])[:80]}, which is not inside the folder"
    return None


def read_record(folder: Path) -> dict | None:
    """run.json, or None when there is none (no run of this recipe wrote into the folder). A damaged one (a torn
    write, NUL bytes) is set aside as run.json.damaged-TIME and counts as none: resuming then considers every
    complete checkpoint in the folder, and nothing is removed on its authority. A readable one that this recipe
    did not write (another tool's, or edited: a path outside the folder, a field it never writes) stops the run
    before anything is touched: nothing is removed or resumed on its authority."""
    path = folder / RECORD_NAME
    try:
        record = json.loads(path.read_text())
    except FileNotFoundError:
        return None
    except (OSError, ValueError, UnicodeDecodeError) as e:
        kept = folder / f"{RECORD_NAME}.damaged-{time.strftime('%Y%m%d-%H%M%S')}"
        os.replace(path, kept)
        print(f"warning: {path} was unreadable ({' '.join(str(e).split())[:120]}); set aside as {kept}: the "
              f"checkpoints in {folder} are intact, and resuming considers every complete one", file=sys.stderr)
        return None
    problem = record_problem(record, folder)
    if problem is not None:
        raise OutputDirError(f"output_dir {folder} holds a {RECORD_NAME} that this recipe did not write: {problem}; "
                             f"nothing was touched: move it away or choose another output_dir")
    return record


def read_lineage(folder: Path) -> list[dict] | None:
    record = read_record(folder)
    return None if record is None else record["lineage"]


def write_record(folder: Path, record: dict) -> None:
    tmp = folder / f"{RECORD_NAME}.tmp"
    tmp.write_text(json.dumps({"written_by": WRITTEN_BY, **record}, indent=1))
    os.replace(tmp, folder / RECORD_NAME)


def record_written(folder: Path, paths: list[Path]) -> None:
    """Add files a tracker created to run.json's `written` (rank 0), so that an overwrite removes them and only
    them."""
    record = read_record(folder) or {"lineage": []}
    rels = [str(Path(p).resolve().relative_to(folder.resolve())) for p in paths]
    record["written"] = sorted(set(record.get("written", [])) | set(rels))
    write_record(folder, record)


def _summary(names: list[str]) -> str:
    return ", ".join(names[:4]) + (f" and {len(names) - 4} more" if len(names) > 4 else "")


def decide(cfg: Config, folder: Path, find, checkpoint_run_id) -> Claim:
    """Rank 0's decision: refuse, overwrite, resume or start fresh; writes run.json for the new segment.

    `find(lineage)` is the checkpoint to resume from per `resume_from_checkpoint` among that lineage's
    (None: nothing to resume); `checkpoint_run_id(path)` the segment that wrote a checkpoint.
    """
    # no run.json (checkpoints copied in by hand, or another tool's files): any checkpoint counts for resuming,
    # and nothing in the folder is the recipe's to remove
    outputs, record = data_outputs(folder), read_record(folder)
    lineage = None if record is None else record["lineage"]
    written = [] if record is None else record.get("written", [])
    foreign = own_names(folder) if record is None else []
    resume_from = None
    if cfg.overwrite_output_dir:
        if foreign:
            raise OutputDirError(f"overwrite_output_dir: output_dir {folder} holds {_summary(foreign)}, but no "
                                 f"{RECORD_NAME} says this recipe wrote them, so nothing was removed: move them or "
                                 f"choose another output_dir")
        removed = remove_recorded(folder, record or {})
        if removed:
            print(f"overwrite_output_dir: removed the previous run's {_summary(removed)} from {folder} "
                  f"(nothing else)", file=sys.stderr)
        lineage, written = [], []
    elif cfg.resume_from_checkpoint:
        resume_from = find(lineage)
        if resume_from is None and outputs:
            raise OutputDirError(f"output_dir {folder} holds a run's outputs ({_summary(outputs)}) but no complete "
                                 f"checkpoint of it to resume from; pass --overwrite_output_dir true to replace them "
                                 f"or choose another output_dir")
        if resume_from is not None:
            ckpt_run = checkpoint_run_id(resume_from)
            ids = [seg["run_id"] for seg in lineage or []]
            if ckpt_run in ids:  # an earlier point of this folder's run: the later segments become a dead branch
                lineage = lineage[:ids.index(ckpt_run) + 1]
            elif outputs and lineage is not None:
                raise OutputDirError(f"output_dir {folder} holds another run's outputs ({_summary(outputs)}) than "
                                     f"the checkpoint {resume_from}; resume it into an empty output_dir")
            else:
                lineage = [{"run_id": ckpt_run, "from_step": 0}]
    elif outputs:
        raise OutputDirError(f"output_dir {folder} already holds a run's outputs ({_summary(outputs)}): pass "
                             f"--resume_from_checkpoint auto to continue it, --overwrite_output_dir true to replace "
                             f"them (nothing else in the folder is touched), or choose another output_dir")
    if not outputs and not cfg.overwrite_output_dir:
        blocking = [n for n in foreign if n in FIXED or n.startswith("checkpoints/latest")]
        if blocking:  # another tool's files at the names this run writes to: never append to or replace them
            raise OutputDirError(f"output_dir {folder} holds {_summary(blocking)}, which this run would write, but "
                                 f"no {RECORD_NAME} says this recipe wrote them; nothing was touched: move them or "
                                 f"choose another output_dir")
        if record is not None:  # leftovers of a run of this recipe that wrote no data (an empty metrics file, ...)
            removed = remove_recorded(folder, record)
            if [r for r in removed if r != RECORD_NAME]:
                print(f"removed {_summary([r for r in removed if r != RECORD_NAME])} from {folder}: left by an "
                      f"earlier run of this recipe that recorded no step", file=sys.stderr)
            written = []
    run_id = uuid.uuid4().hex[:12]
    from_step = json.loads((resume_from / "meta.json").read_text())["step"] if resume_from is not None else 0
    lineage = [*(lineage or []), {"run_id": run_id, "from_step": from_step}]
    write_record(folder, {"lineage": lineage, "written": written})
    return Claim(run_id, lineage, resume_from)


def claim(cfg: Config, rank: int, world: int, find, checkpoint_run_id) -> tuple[Claim, OutputLock | None]:
    """Rank 0 locks the folder and decides; every rank gets the same Claim, or the same OutputDirError."""
    from grpo_recipe.dist.collectives import broadcast_object

    lock, result = None, None
    if rank == 0:
        folder = Path(cfg.output_dir)
        try:
            folder.mkdir(parents=True, exist_ok=True)
            lock = OutputLock(folder)
            result = decide(cfg, folder, find, checkpoint_run_id)
        except (OutputDirError, OSError) as e:
            result = str(e)
        except Exception as e:  # noqa: BLE001 -- e.g. a CheckpointError: shared, then raised on every rank
            result = e
    result = broadcast_object(result)
    if isinstance(result, str):
        if lock is not None:
            lock.release()
        raise OutputDirError(result)
    if isinstance(result, Exception):
        raise result
    return result, lock
