"""launch/slurm/grpo.sbatch on a real 2-node Slurm cluster started on this host (tests/slurm_cluster.py).

Each "node" runs one CPU rank; the two ranks meet over gloo at the first node's address, as on a cluster.
"""
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import REPO
from procs import listening
from slurm_cluster import LocalSlurm, missing_reason

from grpo_recipe.run.metrics import read_jsonl

pytestmark = pytest.mark.slow

SHORT = ["--disable_tqdm", "true", "--max_completion_length", "24"]


@pytest.fixture(scope="module")
def cluster():
    reason = missing_reason()
    if reason and os.environ.get("GRPO_REQUIRE_SLURM"):  # tests/run.sh as root: the launcher must be tested
        pytest.fail(f"GRPO_REQUIRE_SLURM is set but {reason}")
    if reason:
        pytest.skip(reason)
    with LocalSlurm(nodes=2) as c:
        yield c


def sbatch(cluster, tmp_path, *args, background=False, name="grpo", **env):
    """`sbatch --wait` of grpo.sbatch, unchanged except for CPU nodes; logs and outputs under tmp_path."""
    cmd = ["sbatch", "--wait", "--gpus-per-node=0", f"--job-name={name}", f"--output={tmp_path}/%x-%j.out",
           "launch/slurm/grpo.sbatch", *args]
    env = cluster.env(**{"VENV_PY": sys.executable, "REPO": REPO, "OUTPUT_DIR": tmp_path / "out",
                         "TOKENIZERS_PARALLELISM": "false", **env})
    if background:
        return subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    return cluster.run(*cmd, cwd=REPO, env=env, timeout=900)


def job_log(tmp_path, name="grpo") -> str:
    return "\n".join(p.read_text() for p in sorted(tmp_path.glob(f"{name}-*.out")))


def test_two_nodes_one_rank_each_train_to_completion(cluster, tmp_path, tiny_model_dir):
    job = sbatch(cluster, tmp_path, *SHORT, "--max_steps", "24", background=True)
    # while it trains: what the job's processes (node.py, which hosts the store, and the ranks) listen on
    deadline = time.monotonic() + 600
    while not any(r["step"] >= 2 for r in read_jsonl(tmp_path / "out" / "metrics.jsonl")):
        assert job.poll() is None and time.monotonic() < deadline, job.communicate()[1][-3000:]
        time.sleep(0.2)
    sockets = listening(processes_of(tmp_path / "out"))
    _, err = job.communicate(timeout=900)
    log = job_log(tmp_path)
    assert job.returncode == 0, err + log[-4000:]
    # a multi-node store listens on the address the launcher was given (node0: 127.0.0.1 here), never on all
    assert sockets and all(a.rsplit(":", 1)[0] not in ("0.0.0.0", "::") for _, a in sockets), sockets
    # One task per node, each starting its rank, both meeting at the first node's address.
    assert "0: node.py: node 0/2: ranks 0..0 of 2 (CPU), rendezvous node0:" in log
    assert "1: node.py: node 1/2: ranks 1..1 of 2 (CPU), rendezvous node0:" in log
    assert "training exited with 0" in log
    records = read_jsonl(tmp_path / "out" / "metrics.jsonl")
    assert [r["step"] for r in records] == list(range(1, 25))
    # The world really had two ranks: step 1 trains the whole first rollout of both ranks.
    r = records[0]
    per_rank = 8 * 2  # quickstart: per_device_train_batch_size x gradient_accumulation_steps
    assert r["train_tokens"] == pytest.approx(r["completion_length_mean"] * per_rank * 2, rel=1e-6)
    first = sum(r["reward_mean"] for r in records[:6]) / 6
    last = sum(r["reward_mean"] for r in records[-6:]) / 6
    assert last > first, f"reward did not rise: first 6 steps {first:.2f}, last 6 {last:.2f}"
    assert (tmp_path / "out" / "final" / "config.json").exists()


def test_failed_training_fails_the_job(cluster, tmp_path):
    proc = sbatch(cluster, tmp_path, *SHORT, "--max_steps", "4", "--reward_funcs", "[tests.reward_fixtures:has_inf]")
    log = job_log(tmp_path)
    assert proc.returncode == 1, proc.stderr + log[-4000:]
    assert "reward 'has_inf' returned inf at sample 1" in log
    assert "training exited with 1" in log and "requeued" not in log


def test_config_error_is_exit_code_2_of_the_job(cluster, tmp_path):
    proc = sbatch(cluster, tmp_path, *SHORT, "--num_generations", "3")
    log = job_log(tmp_path)
    assert proc.returncode == 2, proc.stderr + log[-4000:]
    assert "config error: num_generations:" in log and "training exited with 2" in log and "Traceback" not in log


def processes_of(out) -> list[int]:
    """The recipe's processes for this output folder: each node's launcher (node.py) and its ranks (Slurm's own,
    srun and slurmstepd, are not the recipe's)."""
    return [int(p.name) for p in Path("/proc").iterdir() if p.name.isdigit() and str(out).encode() in _cmdline(p)
            and b"python" in _cmdline(p).split(b"\0")[0]
            and any(k in _cmdline(p) for k in (b"launch/slurm/node.py", b"grpo_recipe.train"))]


def _cmdline(p: Path) -> bytes:
    try:
        return (p / "cmdline").read_bytes()
    except OSError:
        return b""


def recipe_processes(out) -> list[int]:
    """Processes still running grpo_recipe.train for this output folder."""
    found = []
    for p in Path("/proc").iterdir():
        try:
            cmd = (p / "cmdline").read_bytes()
        except (OSError, ValueError):
            continue
        if b"grpo_recipe.train" in cmd and str(out).encode() in cmd:
            found.append(int(p.name))
    return found


def test_signal_without_requeue_is_exit_code_75_and_leaves_no_rank(cluster, tmp_path, tiny_model_dir):
    """REQUEUE=0: a wrapper that requeues by itself gets 75 (checkpointed) from the job, and no rank survives."""
    out, name = tmp_path / "out", "norequeue"
    proc = sbatch(cluster, tmp_path, *SHORT, "--max_steps", "100000", "--save_steps", "0", background=True,
                  name=name, REQUEUE=0)
    metrics = out / "metrics.jsonl"
    wait_for("2 steps", lambda: metrics.exists() and len(read_jsonl(metrics)) >= 2, proc=proc)
    job = cluster.run("squeue", "-h", "-n", name, "-o", "%i").stdout.split()[0]
    assert cluster.run("scancel", "--signal=TERM", job).returncode == 0
    _, stderr = proc.communicate(timeout=600)
    log = job_log(tmp_path, name)
    assert proc.returncode == 75, stderr + log[-4000:]
    assert "training exited with 75" in log and "requeued" not in log
    k = read_jsonl(metrics)[-1]["step"]
    assert (out / "checkpoints" / "latest").read_text() == f"step-{k:08d}"
    assert recipe_processes(out) == []


def test_submitting_outside_the_repository_is_a_clear_error(cluster, tmp_path):
    proc = sbatch(cluster, tmp_path, REPO=tmp_path)
    assert proc.returncode == 2
    assert f"{tmp_path} is not the repository: submit from its root or set REPO" in job_log(tmp_path)


def wait_for(what, ok, timeout=300, proc=None):
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if ok():
            return
        if proc is not None and proc.poll() is not None:
            raise AssertionError(f"job ended before {what}: {proc.communicate()}")
        time.sleep(0.5)
    raise AssertionError(f"timed out waiting for {what}")


def test_warning_signal_checkpoints_requeues_and_resumes(cluster, tmp_path, tiny_model_dir):
    """USR1 mid-run: the ranks checkpoint and exit 75, the job requeues itself and resumes from the checkpoint."""
    out, name = tmp_path / "out", "preempt"
    proc = sbatch(cluster, tmp_path, *SHORT, "--max_steps", "24", background=True, name=name)
    metrics = out / "metrics.jsonl"
    wait_for("6 steps", lambda: metrics.exists() and len(read_jsonl(metrics)) >= 6, proc=proc)
    job = cluster.run("squeue", "-h", "-n", name, "-o", "%i").stdout.split()[0]
    assert cluster.run("scancel", "--signal=USR1", job).returncode == 0
    # Requeued jobs wait ~10 s (cred_expire) before they run again: move the first run's metrics aside.
    wait_for("the requeue", lambda: "Restarts=1" in cluster.run("scontrol", "show", "job", job).stdout
             and "JobState=PENDING" in cluster.run("scontrol", "show", "job", job).stdout, proc=proc)
    shutil.move(metrics, out / "metrics.run1.jsonl")
    stdout, stderr = proc.communicate(timeout=600)
    log = job_log(tmp_path, name)
    assert proc.returncode == 0, stderr + log[-4000:]
    assert "restart 0: training exited with 75" in log and "=== requeued" in log
    assert "restart 1: training exited with 0" in log
    first = [r["step"] for r in read_jsonl(out / "metrics.run1.jsonl")]
    second = [r["step"] for r in read_jsonl(metrics)]
    k = first[-1]
    assert first == list(range(1, k + 1)) and k >= 6
    assert second == list(range(k + 1, 25)), f"the resumed run did not continue from step {k}: {second}"
