"""The output folder: another run's outputs are refused unless resumed or overwritten, one run at a time holds
it, and resuming and pruning follow this run's lineage (real runs of grpo_recipe.train, real files and locks)."""
import json
import shutil
import signal
import subprocess
import sys

import pytest
from conftest import REPO
from procs import running

from grpo_recipe.config.schema import Config
from grpo_recipe.dist.env import rank_env
from grpo_recipe.run.metrics import read_jsonl
from grpo_recipe.run.outdir import OutputDirError, OutputLock, in_lineage

# One plain process (a world of one), 4 completions per step, 8-token completions: a few seconds a step.
RUN = [sys.executable, "-m", "grpo_recipe.train", "--config", "grpo_recipe/configs/quickstart.yaml", "--max_steps", "6",
       "--num_iterations", "2", "--save_steps", "2", "--per_device_train_batch_size", "4",
       "--gradient_accumulation_steps", "1", "--num_generations", "4", "--max_completion_length", "8",
       "--disable_tqdm", "true"]


def run(out, *extra, check=True):
    proc = subprocess.run([*RUN, "--output_dir", str(out), *extra], cwd=REPO, env=rank_env(), capture_output=True,
                          text=True, timeout=600)
    if check:
        assert proc.returncode == 0, proc.stderr[-3000:]
    return proc


def snapshot(out):
    """Every file under out with its bytes (the lock file aside: it names its latest holder)."""
    return {str(p.relative_to(out)): p.read_bytes() for p in sorted(out.rglob("*"))
            if p.is_file() and p.name != "run.lock"}


def steps(out):
    return [r["step"] for r in read_jsonl(out / "metrics.jsonl")]


def saved(out):
    return sorted(p.name for p in (out / "checkpoints").glob("step-*"))


def test_rerun_without_resume_is_refused_and_overwrite_replaces_only_the_runs_outputs(tmp_path):
    out = tmp_path / "out"
    run(out, "--log_completions_steps", "3", "--report_to", "tensorboard")
    (out / "wandb" / "offline-run-1").mkdir(parents=True)  # another wandb run's: no run of this recipe wrote it
    (out / "notes.txt").write_text("mine")  # the user's, not the recipe's
    before = snapshot(out)
    proc = run(out, "--max_steps", "2", check=False)
    assert proc.returncode == 2, proc.stderr[-3000:]
    line = [ln for ln in proc.stderr.splitlines() if "already holds a run's outputs" in ln]
    assert line and str(out) in line[0] and "--resume_from_checkpoint auto" in line[0] \
        and "--overwrite_output_dir true" in line[0], proc.stderr[-2000:]
    assert "Traceback" not in proc.stderr
    assert snapshot(out) == before  # nothing written, truncated or deleted
    # overwrite: the old run's outputs go, the user's file stays, and the new run is whole
    run(out, "--max_steps", "4", "--overwrite_output_dir", "true")
    assert steps(out) == [1, 2, 3, 4] and saved(out) == ["step-00000002", "step-00000004"]
    assert (out / "checkpoints" / "latest").read_text() == "step-00000004"
    assert (out / "notes.txt").read_text() == "mine" and (out / "final" / "config.json").exists()
    assert not any((out / name).exists() for name in ("completions.jsonl", "tensorboard"))  # the old run's
    assert (out / "wandb" / "offline-run-1").is_dir()  # not this recipe's: kept


OTHER_TOOLS = {"wandb/run-20261204_1200-abc/files/files.txt": "w", "tensorboard/events.out.tfevents.1.host": "t",
               "checkpoints/epoch=3.ckpt": "c"}


def put(out, files):
    for rel, text in files.items():
        (out / rel).parent.mkdir(parents=True, exist_ok=True)
        (out / rel).write_text(text)


def test_a_fresh_start_never_deletes_other_tools_files(tmp_path):
    """Issue #41.1: another tool's wandb, tensorboard and checkpoint files in output_dir survive a fresh start,
    and a file at a name this run writes to (completions.jsonl) stops it before anything is touched."""
    out = tmp_path / "out"
    put(out, {**OTHER_TOOLS, "completions.jsonl": '{"theirs": 1}\n'})
    before = snapshot(out)
    proc = run(out, "--max_steps", "2", check=False)
    assert proc.returncode == 2, proc.stderr[-3000:]
    line = [ln for ln in proc.stderr.splitlines() if "completions.jsonl, which this run would write" in ln]
    assert line and "no run.json says this recipe wrote them" in line[0] and "Traceback" not in proc.stderr
    assert snapshot(out) == before
    (out / "completions.jsonl").unlink()
    run(out, "--max_steps", "2", "--report_to", "tensorboard", "--log_completions_steps", "1")
    assert steps(out) == [1, 2]
    assert all((out / rel).read_text() == text for rel, text in OTHER_TOOLS.items())
    # an overwrite removes this recipe's outputs (its own tensorboard file included) and keeps theirs
    proc = run(out, "--max_steps", "1", "--overwrite_output_dir", "true")
    assert "overwrite_output_dir: removed the previous run's" in proc.stderr, proc.stderr[-2000:]
    assert all((out / rel).read_text() == text for rel, text in OTHER_TOOLS.items())
    assert sorted(p.name for p in (out / "tensorboard").iterdir()) == ["events.out.tfevents.1.host"]
    assert steps(out) == [1] and not (out / "completions.jsonl").exists()


def test_overwrite_without_a_record_of_this_recipe_removes_nothing(tmp_path):
    out = tmp_path / "out"
    put(out, {**OTHER_TOOLS, "metrics.jsonl": '{"step": 7}\n', "final/model.safetensors": "x"})
    before = snapshot(out)
    proc = run(out, "--max_steps", "1", "--overwrite_output_dir", "true", check=False)
    assert proc.returncode == 2 and "nothing was removed" in proc.stderr, proc.stderr[-2000:]
    assert snapshot(out) == before


def test_resume_from_an_earlier_checkpoint_then_auto_follows_the_new_branch(tmp_path):
    """Resuming from step 2 of a run that reached step 6 starts a branch: its saves must survive pruning, and
    `latest` and a later `auto` must follow it, not the abandoned branch's higher step numbers."""
    out = tmp_path / "out"
    run(out, "--save_total_limit", "0")  # checkpoints 2, 4, 6
    assert saved(out) == ["step-00000002", "step-00000004", "step-00000006"]
    abandoned = json.loads((out / "checkpoints" / "step-00000006" / "meta.json").read_text())["run_id"]
    run(out, "--resume_from_checkpoint", str(out / "checkpoints" / "step-00000002"), "--max_steps", "4",
        "--save_total_limit", "1")
    branch = json.loads((out / "checkpoints" / "step-00000004" / "meta.json").read_text())["run_id"]
    assert branch != abandoned
    # the branch's own step 4 survived (limit 1); the abandoned step 6 is not this lineage's, so untouched
    assert saved(out) == ["step-00000004", "step-00000006"]
    assert (out / "checkpoints" / "latest").read_text() == "step-00000004"
    assert steps(out) == [1, 2, 3, 4]
    proc = run(out, "--resume_from_checkpoint", "auto", "--max_steps", "5", "--save_total_limit", "1")
    assert "resumed from" in proc.stderr and "step-00000004 at step 4" in proc.stderr, proc.stderr[-3000:]
    assert steps(out) == [1, 2, 3, 4, 5]


def test_auto_resume_with_outputs_but_no_checkpoint_is_refused(tmp_path):
    out = tmp_path / "out"
    run(out, "--max_steps", "2", "--save_steps", "0")
    before = snapshot(out)
    proc = run(out, "--resume_from_checkpoint", "auto", check=False)
    assert proc.returncode == 2 and "no complete checkpoint of it to resume from" in proc.stderr, proc.stderr[-2000:]
    assert snapshot(out) == before


def test_a_second_run_on_a_busy_folder_stops_with_the_holder_and_the_first_is_unharmed(tmp_path):
    out = tmp_path / "out"
    # long enough to outlive the second runs' start-up; stopped with SIGUSR1 (checkpoint, exit 75) afterwards
    with running([*RUN, "--output_dir", str(out), "--max_steps", "100000", "--save_steps", "0"], out, cwd=REPO,
                 env=rank_env()) as first:
        for extra in ([], ["--resume_from_checkpoint", "auto"], ["--overwrite_output_dir", "true"]):
            second = run(out, *extra, check=False)
            assert second.returncode == 2, second.stderr[-3000:]
            assert f"output_dir {out} is in use by another run (pid {first.pid} on " in second.stderr, second.stderr
        assert first.poll() is None
        first.send_signal(signal.SIGUSR1)
        _, err = first.communicate(timeout=600)
    assert first.returncode == 75, err[-3000:]
    k = steps(out)[-1]
    assert steps(out) == list(range(1, k + 1)) and saved(out) == [f"step-{k:08d}"]  # one run's, whole
    assert (out / "checkpoints" / "latest").read_text() == f"step-{k:08d}"


def test_the_lock_is_released_when_its_holder_dies(tmp_path):
    holder = subprocess.Popen([sys.executable, "-c", "import sys, time; from grpo_recipe.run.outdir import OutputLock; "
                               f"from pathlib import Path; lock = OutputLock(Path({str(tmp_path)!r})); "
                               "print('held', flush=True); time.sleep(600)"],
                              cwd=REPO, env=rank_env(), stdout=subprocess.PIPE, text=True)
    assert holder.stdout.readline().strip() == "held"
    with pytest.raises(OutputDirError, match=f"in use by another run \\(pid {holder.pid} on "):
        OutputLock(tmp_path)
    holder.kill()
    holder.wait()
    OutputLock(tmp_path).release()  # the kernel dropped the dead holder's lock


def test_lineage_membership():
    lineage = [{"run_id": "a", "from_step": 0}, {"run_id": "b", "from_step": 4}, {"run_id": "c", "from_step": 6}]
    assert in_lineage("a", 4, lineage) and not in_lineage("a", 6, lineage)  # a's step 6 was abandoned at 4
    assert in_lineage("b", 6, lineage) and not in_lineage("b", 8, lineage)
    assert in_lineage("c", 100, lineage) and not in_lineage("z", 1, lineage)


def test_overwrite_and_resume_together_are_a_config_error():
    proc = subprocess.run([*RUN, "--overwrite_output_dir", "true", "--resume_from_checkpoint", "auto"], cwd=REPO,
                          env=rank_env(), capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and "overwrite_output_dir: cannot be combined with resume_from_checkpoint" in proc.stderr
    assert Config().overwrite_output_dir is False


def test_a_damaged_metrics_log_and_run_record_do_not_block_resuming(tmp_path):
    """Issue #41.4: a torn last line and trailing NUL bytes (power loss) in metrics.jsonl, and a run.json of NUL
    bytes, once made every resume fail after the model loaded. Now they are set aside, named, and the run goes on
    from its intact checkpoint."""
    out = tmp_path / "out"
    run(out, "--max_steps", "4")
    with (out / "metrics.jsonl").open("ab") as f:
        f.write(b'{"step": 5, "loss": 0.1' + b"\x00" * 64)
    (out / "run.json").write_bytes(b"\x00" * 40)
    proc = run(out, "--resume_from_checkpoint", "auto", "--max_steps", "6")
    assert "resumed from" in proc.stderr and "step-00000004 at step 4" in proc.stderr, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr
    assert steps(out) == [1, 2, 3, 4, 5, 6]
    (damaged_log,) = out.glob("metrics.jsonl.damaged-*")
    (damaged_record,) = out.glob("run.json.damaged-*")
    assert damaged_log.read_bytes().endswith(b"\x00" * 64) and damaged_record.read_bytes() == b"\x00" * 40
    assert f"the original is {damaged_log}" in proc.stderr and f"set aside as {damaged_record}" in proc.stderr


def test_resuming_a_finished_run_whose_final_save_failed_writes_it_without_training(tmp_path):
    """What the error of a failed final save advises (issue #41.3): the last checkpoint, resumed, gives the final
    model with no further step."""
    out = tmp_path / "out"
    run(out, "--max_steps", "4")
    shutil.rmtree(out / "final")
    proc = run(out, "--resume_from_checkpoint", "auto", "--max_steps", "4")
    assert "step-00000004 at step 4" in proc.stderr and (out / "final" / "config.json").exists(), proc.stderr[-2000:]
    assert steps(out) == [1, 2, 3, 4]


def test_a_record_naming_a_path_outside_the_folder_deletes_nothing_there(tmp_path):
    """Issue #60.1: run.json's `written` decided what an overwrite deleted, wherever it pointed: `../victim`, an
    absolute path, or a name under a symlinked folder that leads outside. Now such a record stops the run in one
    line before anything is touched, and every entry is checked again where it is removed."""
    out, victim = tmp_path / "out", tmp_path / "victim"
    run(out, "--max_steps", "2")
    victim.mkdir()
    (victim / "precious.txt").write_text("keep me")
    (out / "elsewhere").symlink_to(victim)
    record = json.loads((out / "run.json").read_text())
    for entry in ("../victim", str(victim), "elsewhere/precious.txt"):
        (out / "run.json").write_text(json.dumps({**record, "written": [entry]}))
        before = snapshot(out)
        for mode in (["--overwrite_output_dir", "true"], ["--resume_from_checkpoint", "auto", "--max_steps", "4"]):
            proc = run(out, *mode, check=False)
            assert proc.returncode == 2, proc.stderr[-2000:]
            lines = [ln for ln in proc.stderr.splitlines() if "run.json that this recipe did not write" in ln]
            assert lines and "is not inside the folder" in lines[0] and "Traceback" not in proc.stderr, proc.stderr
            assert (victim / "precious.txt").read_text() == "keep me" and snapshot(out) == before


def test_another_tools_run_json_and_run_lock_are_never_taken_over(tmp_path):
    """Issue #60.3: a foreign run.lock was overwritten and a valid foreign run.json set aside as "unreadable".
    Both now stop the run in one line, like the recipe's other names; this recipe's own files still work."""
    out = tmp_path / "out"
    out.mkdir()
    (out / "run.json").write_text(json.dumps({"experiment": "theirs", "status": "running"}))
    before = snapshot(out)
    proc = run(out, "--max_steps", "1", check=False)
    assert proc.returncode == 2 and "run.json that this recipe did not write: it has fields this recipe does not " \
                                   "write (experiment, status)" in proc.stderr, proc.stderr[-2000:]
    assert snapshot(out) == before and not list(out.glob("run.json.damaged-*"))
    (out / "run.json").unlink()
    (out / "run.lock").write_text("locked by their scheduler, job 17\n")
    proc = run(out, "--max_steps", "1", check=False)
    assert proc.returncode == 2 and "run.lock that this recipe did not write ('locked by their scheduler" \
                                   in proc.stderr, proc.stderr[-2000:]
    assert (out / "run.lock").read_text() == "locked by their scheduler, job 17\n"
    (out / "run.lock").unlink()
    run(out, "--max_steps", "1")  # the recipe's own run.json (marked) and run.lock
    assert json.loads((out / "run.json").read_text())["written_by"] == "grpo_recipe"
    run(out, "--max_steps", "2", "--resume_from_checkpoint", "auto", "--save_steps", "1")
