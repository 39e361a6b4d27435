"""Build-once locks that never go stale: OS locks die with their holder; DeepSpeed's CPU comm op is built once
per environment, a dead builder's lock file is cleared, and concurrent first runs build it once."""
import os
import signal
import subprocess
import sys
import time

import pytest
from conftest import REPO

from grpo_recipe.dist import buildlock
from grpo_recipe.dist.env import rank_env
from grpo_recipe.dist.env import torchrun as torchrun_cmd
from grpo_recipe.run.metrics import read_jsonl

HOLD = "import sys, time; from grpo_recipe.dist.buildlock import exclusive\nwith exclusive(sys.argv[1], 'a test build'):\n" \
       "    print('held', flush=True); time.sleep(float(sys.argv[2]))"


def hold(path, seconds):
    proc = subprocess.Popen([sys.executable, "-c", HOLD, str(path), str(seconds)], cwd=REPO, env=rank_env(),
                            stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline().strip() == "held"
    return proc


def test_lock_of_a_killed_holder_is_free_at_once(tmp_path):
    path = tmp_path / "x.lock"
    holder = hold(path, 600)
    holder.kill()
    holder.wait()
    t0 = time.monotonic()
    with buildlock.exclusive(path, "nothing"):
        assert time.monotonic() - t0 < 1.0


def test_a_waiter_says_what_it_waits_for_and_who_holds_it(tmp_path, monkeypatch, capfd):
    monkeypatch.setattr(buildlock, "NOTE_EVERY", 0.5)
    path = tmp_path / "x.lock"
    holder = hold(path, 3.5)
    with buildlock.exclusive(path, "the widget build"):
        pass
    holder.wait()
    notes = [line for line in capfd.readouterr().err.splitlines() if line.startswith("waiting for")]
    assert len(notes) >= 2  # the first after 2 s, then every NOTE_EVERY
    assert f"waiting for the widget build: pid {holder.pid} on" in notes[0] and str(path) in notes[0]


def run_two_ranks(out, ext_dir, **env):
    cmd = torchrun_cmd(2, ["-m", "grpo_recipe.train", "--config", "grpo_recipe/configs/quickstart.yaml", "--max_steps", "2",
                           "--per_device_train_batch_size", "4", "--num_generations", "4",
                           "--max_completion_length", "8", "--disable_tqdm", "true", "--output_dir", str(out)])
    log = open(f"{out}.log", "w+")  # a file, not a pipe: two runs' output must never block on a full pipe
    proc = subprocess.Popen(cmd, cwd=REPO, env=rank_env(TORCH_EXTENSIONS_DIR=ext_dir, **env),
                            stdout=subprocess.DEVNULL, stderr=log, text=True)
    proc.stderr_log = log
    return proc


def finish(proc, timeout=900):
    """(exit code, stderr) of a run started by run_two_ranks."""
    rc = proc.wait(timeout=timeout)
    proc.stderr_log.seek(0)
    return rc, proc.stderr_log.read()


@pytest.mark.slow
def test_killed_builder_then_two_concurrent_first_runs_build_the_op_once(tmp_path):
    ext = tmp_path / "ext"
    op_dir = ext / buildlock.COMM_OP
    # A builder killed mid-build (with its compiler) leaves torch's lock file behind.
    builder = subprocess.Popen([sys.executable, "-c", "from grpo_recipe.dist.buildlock import load_comm_op; load_comm_op()"],
                               cwd=REPO, env=rank_env(TORCH_EXTENSIONS_DIR=ext), start_new_session=True,
                               stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 120
    while not (op_dir / "lock").exists():
        assert time.monotonic() < deadline and builder.poll() is None, "the builder never took torch's lock"
        time.sleep(0.05)
    os.killpg(builder.pid, signal.SIGKILL)
    builder.wait()
    assert (op_dir / "lock").exists() and not (op_dir / f"{buildlock.COMM_OP}.so").exists()

    runs = [run_two_ranks(tmp_path / f"out{i}", ext) for i in range(2)]
    results = [finish(p) for p in runs]
    for rc, err in results:
        assert rc == 0, err[-3000:]
    errs = "".join(err for _, err in results)
    assert errs.count("removed a stale build lock") == 1
    assert errs.count("building DeepSpeed's CPU comm op") == 1  # four ranks, one build
    for i in range(2):
        assert [r["step"] for r in read_jsonl(tmp_path / f"out{i}" / "metrics.jsonl")] == [1, 2]

    assert not (op_dir / "lock").exists()

    # Built and stamped: loading takes no lock, neither ours (held here) nor torch's (a stale file left here),
    # so neither delays a run, and the stale file is not even looked at.
    holder = hold(ext / f"{buildlock.COMM_OP}.build-lock", 600)
    (op_dir / "lock").touch()
    try:
        proc = run_two_ranks(tmp_path / "out3", ext)
        rc, err = finish(proc)
    finally:
        holder.kill()
    assert rc == 0 and "waiting for" not in err, err[-3000:]
    assert "removed a stale build lock" not in err and (op_dir / "lock").exists()
