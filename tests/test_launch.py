"""launch/local.sh: one node, CPU ranks when there is no GPU, extra arguments passed through to the recipe; the
ranks' exit codes come back unchanged, signals to the launcher reach the ranks, no rank outlives it, a stopped
rank ends the job within the collective timeout, and the run listens on loopback only."""
import signal
import subprocess
import sys
import time

import pytest
from conftest import REPO
from procs import alive, descendants, is_loopback, listening, rank_pids, running

from grpo_recipe.dist.env import rank_env
from grpo_recipe.run.metrics import read_jsonl

SHORT = ["--config", "grpo_recipe/configs/quickstart.yaml", "--per_device_train_batch_size", "4",
         "--gradient_accumulation_steps", "1", "--num_generations", "4", "--max_completion_length", "8",
         "--disable_tqdm", "true"]


def local_sh_cmd(*args):
    return ["bash", "launch/local.sh", *SHORT, *args]


def local_sh(*args):
    return subprocess.Popen(local_sh_cmd(*args), cwd=REPO, env=rank_env(VENV_PY=sys.executable),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def local_sh_running(out, *args, step=2):
    """A long local.sh run into `out`, from its `step` on (killed when the block ends)."""
    return running(local_sh_cmd("--max_steps", "100000", "--save_steps", "0", "--output_dir", str(out), *args),
                   out, step, cwd=REPO, env=rank_env(VENV_PY=sys.executable))


@pytest.mark.slow
def test_local_sh_two_cpu_ranks_short_run_with_offload_config(tmp_path):
    out = tmp_path / "out"
    env = rank_env(VENV_PY=sys.executable, NPROC=2)
    del env["OMP_NUM_THREADS"]  # local.sh must set it
    proc = subprocess.run(["bash", "launch/local.sh", "--config", "grpo_recipe/configs/quickstart.yaml", "--max_steps", "3",
                           "--per_device_train_batch_size", "4", "--gradient_accumulation_steps", "1",
                           "--num_generations", "4", "--max_completion_length", "8", "--disable_tqdm", "true",
                           "--deepspeed_config", "ds_configs/zero3_offload.json", "--beta", "0.05",
                           "--output_dir", str(out)], cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "local.sh: 2 ranks on CPU, OMP_NUM_THREADS=1" in proc.stderr
    records = read_jsonl(out / "metrics.jsonl")
    assert [r["step"] for r in records] == [1, 2, 3] and "kl" in records[0]
    # Two ranks: the first step trains both ranks' rollouts (4 completions each).
    assert records[0]["train_tokens"] == pytest.approx(records[0]["completion_length_mean"] * 4 * 2, rel=1e-6)
    assert (out / "final" / "config.json").exists()


def test_config_error_exits_2_with_one_line(tmp_path):
    proc = local_sh("--num_generations", "3", "--output_dir", str(tmp_path / "out"))
    _, err = proc.communicate(timeout=300)
    assert proc.returncode == 2, err[-3000:]
    assert "config error: num_generations:" in err and "Traceback" not in err


@pytest.mark.parametrize("sig", [signal.SIGUSR1, signal.SIGTERM])
def test_signal_to_the_launcher_checkpoints_exits_75_and_leaves_no_rank(tmp_path, sig):
    """The launcher forwards the signal, the ranks checkpoint and exit 75, which comes back unchanged; while it
    runs, every socket the run listens on is on loopback, and a second run on its folder exits 2."""
    out = tmp_path / "out"
    with local_sh_running(out) as proc:
        ranks = rank_pids(proc.pid)
        assert sorted(ranks) == [0, 1], ranks
        sockets = listening([proc.pid, *descendants(proc.pid)])
        assert sockets and all(is_loopback(a) for _, a in sockets), f"listening beyond loopback: {sockets}"
        if sig == signal.SIGUSR1:  # a second run on the same folder: one line, exit 2, through the launcher
            second = local_sh("--max_steps", "2", "--output_dir", str(out))
            _, err2 = second.communicate(timeout=300)
            assert second.returncode == 2 and f"output_dir {out} is in use by another run" in err2, err2[-3000:]
        proc.send_signal(sig)
        while sig == signal.SIGTERM and proc.poll() is None:  # and again, until it has ended (issue #60.6)
            time.sleep(0.1)
            proc.send_signal(sig)
        _, err = proc.communicate(timeout=300)
    assert proc.returncode == 75, err[-3000:]
    assert f"got {sig.name}: forwarding it to the ranks" in err and "checkpoint saved, exit 75" in err
    assert not [r for r, pid in ranks.items() if alive(pid)], "a rank outlived the launcher"
    k = [r["step"] for r in read_jsonl(out / "metrics.jsonl")][-1]
    assert (out / "checkpoints" / "latest").read_text() == f"step-{k:08d}"
    if sig == signal.SIGTERM:  # and the requeued run continues from there
        again = local_sh("--max_steps", str(k + 1), "--resume_from_checkpoint", "auto", "--output_dir", str(out))
        _, err = again.communicate(timeout=600)
        assert again.returncode == 0 and f"at step {k}" in err, err[-3000:]
        assert [r["step"] for r in read_jsonl(out / "metrics.jsonl")] == list(range(1, k + 2))


def test_a_single_process_run_listens_on_loopback_only(tmp_path):
    out = tmp_path / "out"
    with running([sys.executable, "-m", "grpo_recipe.train", *SHORT, "--max_steps", "100000", "--save_steps", "0",
                  "--output_dir", str(out)], out, cwd=REPO, env=rank_env()) as proc:
        sockets = listening([proc.pid])
        proc.send_signal(signal.SIGUSR1)
        _, err = proc.communicate(timeout=300)
    assert proc.returncode == 75, err[-3000:]
    assert all(is_loopback(a) for _, a in sockets), f"listening beyond loopback: {sockets}"


@pytest.mark.parametrize("stopped", [1, 0])
def test_a_stopped_rank_ends_the_job_within_the_collective_timeout(tmp_path, stopped):
    """SIGSTOP one rank: the other's next collective times out, it names the stopped rank, the launcher stops
    the stopped one and the job exits non-zero. Rank 0 too: the store it would ask lives in the launcher."""
    out, timeout_s = tmp_path / "out", 20
    with local_sh_running(out, "--collective_timeout_s", str(timeout_s)) as proc:
        ranks = rank_pids(proc.pid)
        t0 = time.monotonic()
        subprocess.run(["kill", "-STOP", str(ranks[stopped])], check=True)
        _, err = proc.communicate(timeout=20 * timeout_s)  # a hang guard, not a measurement
        elapsed = time.monotonic() - t0
    print(f"rank {stopped} stopped: the job ended {elapsed:.1f} s later (collective_timeout_s = {timeout_s})")
    assert proc.returncode == 1, err[-3000:]
    # the bound: the timeout itself, plus reaching the next collective (a step) and stopping the ranks
    assert elapsed < timeout_s + 60, f"the job ended {elapsed:.0f} s after the stop, timeout {timeout_s} s"
    assert f"error (rank {1 - stopped}): a collective failed or did not complete within collective_timeout_s = " \
           f"{timeout_s} s: rank {stopped} stopped answering" in err, err[-3000:]
    assert f"local.sh: rank {1 - stopped} exited with 1; stopping ranks [{stopped}]" in err
    assert not [r for r, pid in ranks.items() if alive(pid)], "a rank outlived the launcher"


@pytest.mark.slow
def test_relative_paths_are_the_callers(tmp_path):
    """Issue #41.6: `--config my.yaml` in the caller's folder was "not found" and `--output_dir myout` wrote into
    the checkout. Both are the caller's now; a shipped config's own paths (model, data, ds_configs) still resolve."""
    (tmp_path / "my.yaml").write_text((REPO / "grpo_recipe/configs/quickstart.yaml").read_text())
    proc = subprocess.run(["bash", str(REPO / "launch/local.sh"), "--config", "my.yaml", *SHORT[2:],
                           "--max_steps", "2", "--output_dir", "myout"], cwd=tmp_path,
                          env=rank_env(VENV_PY=sys.executable), capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert [r["step"] for r in read_jsonl(tmp_path / "myout" / "metrics.jsonl")] == [1, 2]
    assert not (REPO / "myout").exists()
    assert "metrics: myout/metrics.jsonl" in proc.stdout


@pytest.mark.slow
@pytest.mark.parametrize("sig", [signal.SIGUSR1, signal.SIGTERM])
@pytest.mark.parametrize("after_s", [0.3, 4.0], ids=["interpreter_start", "setup"])
def test_a_signal_during_start_up_ends_in_exit_75_with_nothing_lost(tmp_path, sig, after_s):
    """Issue #41.5: SIGUSR1 4 s after launch once trained every step and exited 0; SIGTERM gave 143, which the
    sbatch script does not requeue. Now the run stops at its next safe point, saying there was nothing new to
    save, exits 75, and leaves no rank."""
    out = tmp_path / "out"
    proc = local_sh("--max_steps", "50", "--output_dir", str(out))
    time.sleep(after_s)
    proc.send_signal(sig)
    _, err = proc.communicate(timeout=600)
    assert proc.returncode == 75, err[-3000:]
    assert "Traceback" not in err
    assert f"stopped by {sig.name}" in err and ("during start-up" in err), err[-3000:]
    assert not descendants(proc.pid)
    assert len(read_jsonl(out / "metrics.jsonl")) <= 1  # stopped at start-up, not after training on


def hang(ranks, at_call=1):
    return ["--reward_funcs", f"[length, {{func: 'tests.reward_fixtures:hangs', weight: 0, kwargs: "
                              f"{{ranks: '{ranks}', at_call: {at_call}}}}}]"]


@pytest.mark.slow
@pytest.mark.parametrize("ranks", ["all", "1"], ids=["every_rank", "rank_1"])
def test_a_reward_that_hangs_ends_the_job_within_its_bound_naming_rank_and_function(tmp_path, ranks):
    """Issue #41.2: a reward sleeping forever on every rank once hung the job for good (632 s and counting); on
    rank 1 alone it ended after the collective timeout naming no rank, function or phase."""
    started = time.monotonic()
    proc = local_sh("--max_steps", "4", "--reward_timeout_s", "5", "--collective_timeout_s", "60",
                    "--output_dir", str(tmp_path / "out"), *hang(ranks))
    _, err = proc.communicate(timeout=600)
    took = time.monotonic() - started
    assert proc.returncode == 1, err[-3000:]
    assert "Traceback" not in err
    line = "reward 'hangs' did not return within 5 s (reward_timeout_s): it hangs or is too slow"
    assert f"reward error (rank 1): {line}" in err, err[-3000:]
    rank0 = next(ln for ln in err.splitlines() if ln.startswith("reward error (rank 0): "))
    assert line in rank0 and rank0.endswith("raise reward_timeout_s" + ("" if ranks == "all" else " (on rank 1)"))
    assert took < 60, f"the job took {took:.0f} s to end"  # start-up + 5 s, far below the collective timeout
    assert not descendants(proc.pid)


@pytest.mark.slow
def test_sigterm_during_a_hang_in_user_code_checkpoints_and_exits_75(tmp_path):
    """The reward hangs on every rank from the third rollout on (no time bound): SIGTERM cuts it short, the
    steps trained so far are checkpointed, the job exits 75, and the run resumes from there."""
    out = tmp_path / "out"
    proc = local_sh("--max_steps", "40", "--num_iterations", "1", "--reward_timeout_s", "0", "--save_steps", "0",
                    "--output_dir", str(out), *hang("all", at_call=3))
    while len(read_jsonl(out / "metrics.jsonl")) < 2:
        time.sleep(0.5)
    time.sleep(3)  # well inside the hang
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=300)
    assert proc.returncode == 75, err[-3000:]
    assert "stopped by SIGTERM while reward 'hangs' ran" in err and "checkpoint saved" in err, err[-3000:]
    assert (out / "checkpoints" / "latest").read_text() == "step-00000002"
    assert not descendants(proc.pid)
    again = local_sh("--max_steps", "3", "--num_iterations", "1", "--save_steps", "0", "--output_dir", str(out),
                     "--resume_from_checkpoint", "auto", *hang("all", at_call=3))  # its calls count from 1 again
    _, err = again.communicate(timeout=600)
    assert again.returncode == 0 and "step-00000002 at step 2" in err, err[-3000:]
    assert [r["step"] for r in read_jsonl(out / "metrics.jsonl")] == [1, 2, 3]


@pytest.mark.slow
def test_a_collective_timeout_names_the_stuck_rank_and_what_it_runs(tmp_path):
    """Unbounded reward (reward_timeout_s 0) hanging on rank 1: rank 0 waits in the reward statistics all-reduce
    until collective_timeout_s, then names rank 1 and the function it has been in, for how long."""
    proc = local_sh("--max_steps", "4", "--reward_timeout_s", "0", "--collective_timeout_s", "15",
                    "--output_dir", str(tmp_path / "out"), *hang("1"))
    _, err = proc.communicate(timeout=600)
    assert proc.returncode == 1, err[-3000:]
    line = next(ln for ln in err.splitlines() if ln.startswith("error (rank 0): a collective failed"))
    assert "rank 1 in \"rollout 0: reward 'hangs'\" for" in line, line
    assert "rank 0: rollout 0: reward statistics (all ranks)" in line, line
    assert not descendants(proc.pid)


@pytest.mark.parametrize("env,line", [({"NPROC": "abc"}, "local.sh: NPROC must be a whole number >= 1, got 'abc'"),
                                      ({"NPROC": "0"}, "local.sh: NPROC must be a whole number >= 1, got '0'"),
                                      ({"MASTER_PORT": "70000"}, "MASTER_PORT must be a whole number in 0..65535")])
def test_a_bad_launcher_setting_is_one_line_and_exit_2(tmp_path, env, line):
    proc = subprocess.run(local_sh_cmd("--output_dir", str(tmp_path / "out")), cwd=REPO, capture_output=True,
                          text=True, env=rank_env(VENV_PY=sys.executable, **env), timeout=120)
    assert proc.returncode == 2 and line in proc.stderr.strip().splitlines()[-1], proc.stderr[-2000:]
    assert "Traceback" not in proc.stderr and not (tmp_path / "out").exists()


def launch_node():
    import importlib.util

    saved = {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGUSR1, signal.SIGINT)}
    spec = importlib.util.spec_from_file_location("launch_node", REPO / "launch" / "node.py")
    module = importlib.util.module_from_spec(spec)
    try:
        spec.loader.exec_module(module)
    finally:  # the launcher records stop signals from its first line: not in this test process
        for s, handler in saved.items():
            signal.signal(s, handler)
    return module


def test_rank_environment_by_device(monkeypatch, capsys):
    """CPU nodes: DeepSpeed's CPU accelerator, one thread per rank. GPU nodes: no CPU accelerator and the node's
    cores shared among its ranks (an offloaded optimizer's Adam is threaded); the user's own choice is kept."""
    node = launch_node()
    monkeypatch.setattr(node.os, "sched_getaffinity", lambda pid: set(range(16)))
    cpu = node.rank_environment({}, gpus=0, nproc=2)
    assert cpu["DS_ACCELERATOR"] == "cpu" and cpu["OMP_NUM_THREADS"] == "1"
    gpu = node.rank_environment({}, gpus=4, nproc=4)
    assert "DS_ACCELERATOR" not in gpu and gpu["OMP_NUM_THREADS"] == "4"
    assert node.rank_environment({}, gpus=8, nproc=32)["OMP_NUM_THREADS"] == "1"
    assert node.rank_environment({"OMP_NUM_THREADS": "3"}, gpus=4, nproc=4)["OMP_NUM_THREADS"] == "3"


def test_an_inherited_cpu_accelerator_on_a_gpu_node_is_refused_before_any_rank_starts(capsys):
    node = launch_node()
    with pytest.raises(SystemExit) as e:
        node.rank_environment({"DS_ACCELERATOR": "cpu"}, gpus=2, nproc=2)
    assert e.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "DS_ACCELERATOR=cpu" in err[0] and "CUDA_VISIBLE_DEVICES=" in err[0]


def test_a_taken_master_port_is_one_line_and_exit_2_before_any_rank_starts(tmp_path):
    import socket

    taken = socket.socket()
    taken.bind(("127.0.0.1", 0))
    taken.listen(1)
    port = taken.getsockname()[1]
    proc = subprocess.run(local_sh_cmd("--output_dir", str(tmp_path / "out")), cwd=REPO, capture_output=True,
                          text=True, env=rank_env(VENV_PY=sys.executable, MASTER_PORT=str(port)), timeout=120)
    taken.close()
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr[-2000:]
    assert f"local.sh: MASTER_ADDR:MASTER_PORT 127.0.0.1:{port} cannot be listened on" in proc.stderr
    assert not (tmp_path / "out").exists()


@pytest.mark.slow
def test_a_signal_during_start_up_with_a_generation_rank_ends_every_rank_in_75(tmp_path):
    """Issue #60.5: the trainers exited 75 at once, and the generation rank waited in the link's rendezvous for
    collective_timeout_s, then a traceback and exit 1: no requeue. Now it hears the signal while it waits."""
    out = tmp_path / "out"
    started = time.monotonic()
    proc = subprocess.Popen(local_sh_cmd("--max_steps", "50", "--generation_ranks", "1", "--output_dir", str(out)),
                            cwd=REPO, env=rank_env(VENV_PY=sys.executable, NPROC=3), stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    time.sleep(4.0)
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=600)
    assert proc.returncode == 75 and "Traceback" not in err, err[-3000:]
    assert "generation rank 2: stopped by SIGTERM during start-up" in err, err[-3000:]
    assert time.monotonic() - started < 120  # not collective_timeout_s (600 s)
    assert not descendants(proc.pid)
