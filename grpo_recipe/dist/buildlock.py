"""Things built once per machine or environment, under locks that can never go stale.

The recipe builds two things on first use: the built-in tiny model (a cache folder) and, on CPU, DeepSpeed's
shared-memory communication op (a JIT-compiled extension, about a minute). Both are built under an OS file
lock (`flock`), which the kernel releases when its holder dies: a build interrupted by Ctrl-C or a killed job
leaves nothing that blocks the next run. A run that waits for another process's build says what it waits for,
and where, every `NOTE_EVERY` seconds.

torch's own JIT build lock is a plain file (`<build dir>/lock`) that a killed builder leaves behind, after which
every later load waits for it forever. Every build of the op goes through `load_comm_op` under the OS lock,
so such a file found while holding the lock belongs to a dead builder and is removed (with one line saying so).
An op already built for this environment is imported directly: no lock at all.
"""
from __future__ import annotations

import contextlib
import fcntl
import importlib.util
import json
import os
import socket
import sys
import time
from pathlib import Path

NOTE_EVERY = 30.0  # seconds between "still waiting" lines
COMM_OP = "deepspeed_shm_comm"
STAMP = "recipe-built.json"


def say(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


@contextlib.contextmanager
def exclusive(path: Path, what: str):
    """Hold an exclusive OS lock on `path` for the block; say what we wait for while another process holds it."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a+") as f:
        started = time.monotonic()
        next_note = started + 2.0  # a short wait needs no note
        while True:
            try:
                fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                now = time.monotonic()
                if now >= next_note:
                    f.seek(0)
                    holder = f.read().strip() or "another process"
                    say(f"waiting for {what}: {holder} holds {path} ({now - started:.0f} s so far)")
                    next_note = now + NOTE_EVERY
                time.sleep(0.2)
        f.seek(0)
        f.truncate()
        f.write(f"pid {os.getpid()} on {socket.gethostname()}\n")
        f.flush()
        try:
            yield
        finally:
            f.seek(0)
            f.truncate()
            f.flush()
            fcntl.flock(f, fcntl.LOCK_UN)


# ------------------------------------------------------------------------------------------
# DeepSpeed's CPU communication op
# ------------------------------------------------------------------------------------------
def extensions_dir() -> Path:
    """Where DeepSpeed JIT-builds its ops: one folder per environment (a folder shared by several venvs is
    rebuilt whenever their builds differ). TORCH_EXTENSIONS_DIR, when set, wins."""
    return Path(os.environ.get("TORCH_EXTENSIONS_DIR") or Path(sys.prefix) / "torch_extensions")


def _build_key() -> str:
    import deepspeed
    import torch

    return f"torch {torch.__version__}, deepspeed {deepspeed.__version__}, python {sys.version.split()[0]}"


def _import_built(folder: Path):
    so = folder / f"{COMM_OP}.so"
    spec = importlib.util.spec_from_file_location(COMM_OP, so)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def load_comm_op() -> None:
    """Make DeepSpeed's CPU shared-memory comm op loadable without waiting on a stale lock.

    Imports an op already built for this environment directly (no lock), else builds it under the OS lock.
    Either way the module is handed to DeepSpeed's op cache, so `deepspeed.init_distributed` loads nothing.
    """
    from deepspeed.ops.op_builder.builder import OpBuilder
    from deepspeed.ops.op_builder.cpu import ShareMemCommBuilder

    builder = ShareMemCommBuilder()
    if COMM_OP in OpBuilder._loaded_ops or not builder.is_compatible(verbose=False):
        return
    root = extensions_dir()
    os.environ["TORCH_EXTENSIONS_DIR"] = str(root)
    folder, key = root / COMM_OP, _build_key()

    def built() -> bool:
        try:
            return json.loads((folder / STAMP).read_text()).get("key") == key and (folder / f"{COMM_OP}.so").is_file()
        except (OSError, ValueError):
            return False

    if not built():
        with exclusive(root / f"{COMM_OP}.build-lock", f"DeepSpeed's CPU comm op build in {folder}"):
            if not built():
                baton = folder / "lock"
                if baton.exists():  # torch's lock file; every builder holds our OS lock, so its owner is gone
                    baton.unlink()
                    say(f"removed a stale build lock {baton} (left by an interrupted build)")
                say(f"building DeepSpeed's CPU comm op in {folder} (once per environment, about a minute)")
                OpBuilder._loaded_ops[COMM_OP] = builder.jit_load(verbose=False)
                (folder / STAMP).write_text(json.dumps({"key": key}))
                return
    OpBuilder._loaded_ops[COMM_OP] = _import_built(folder)
