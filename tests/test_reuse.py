"""Adaptive reuse: the pass-level decision, and in a run: passes skipped once the policy drifted, resumed exactly."""
import shutil
import subprocess
import sys

import pytest

from conftest import REPO
from recipe.launch import rank_env
from recipe.metrics import read_jsonl
from recipe.config import Config
from recipe.reuse import ReuseController

RUN = [sys.executable, "-m", "recipe.train", "--config", "recipe/configs/quickstart.yaml", "--max_steps", "6",
       "--per_device_train_batch_size", "8", "--gradient_accumulation_steps", "1", "--max_completion_length", "16",
       "--disable_tqdm", "true"]


def run(*args):
    proc = subprocess.run([*RUN, *args], cwd=REPO, env=rank_env(), capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc


def test_controller_decides_per_pass_on_token_weighted_means():
    ctl = ReuseController(Config(reuse_target_kl=0.01))
    ctl.observe({"approx_kl": 0.0, "clip_ratio_region": 0.0, "train_tokens": 100})
    ctl.observe({"approx_kl": 0.03, "clip_ratio_region": 0.0, "train_tokens": 100})
    assert ctl.pass_done()  # mean 0.015 > 0.01
    ctl.observe({"approx_kl": 0.005, "clip_ratio_region": 0.9, "train_tokens": 10})
    assert not ctl.pass_done()  # accumulators were reset; clip fraction is not a target here
    clip = ReuseController(Config(reuse_max_clip_fraction=0.1))
    clip.observe({"approx_kl": 9.0, "clip_ratio_region": 0.2, "train_tokens": 5})
    assert clip.pass_done()
    off = ReuseController(Config())
    assert not off.enabled


@pytest.mark.slow
def test_run_skips_remaining_passes_and_resumes_exactly(tmp_path):
    # The first pass is on-policy (approx KL exactly 0); every later pass has drifted, so a tiny target
    # stops each rollout after its second pass: mu = 4 in the config, 2 passes used.
    out = tmp_path / "a"
    run("--reuse_target_kl", "1e-9", "--output_dir", str(out), "--save_steps", "2", "--save_total_limit", "0")
    recs = read_jsonl(out / "metrics.jsonl")
    assert [(r["generation"], r["iteration"]) for r in recs] == [(0, 0), (0, 1), (1, 0), (1, 1), (2, 0), (2, 1)]
    assert all(r["approx_kl"] == 0.0 for r in recs if r["iteration"] == 0)
    assert all(r["approx_kl"] > 0.0 for r in recs if r["iteration"] == 1)
    # Resume from the checkpoint taken exactly at a skip decision (step 4): the next step starts rollout 2.
    resumed = tmp_path / "b"
    shutil.copytree(out / "checkpoints" / "step-00000004", resumed / "checkpoints" / "step-00000004")
    shutil.copy(out / "metrics.jsonl", resumed / "metrics.jsonl")
    run("--reuse_target_kl", "1e-9", "--output_dir", str(resumed), "--save_steps", "2", "--save_total_limit", "0",
        "--resume_from_checkpoint", "auto")
    timing = ("time", "tokens_per_s", "step_time")
    strip = lambda rs: [{k: v for k, v in r.items() if not k.startswith(timing)} for r in rs]  # noqa: E731
    assert strip(read_jsonl(resumed / "metrics.jsonl")) == strip(recs)
    huge = tmp_path / "c"
    run("--reuse_target_kl", "1e9", "--output_dir", str(huge), "--max_steps", "4", "--save_steps", "0")
    assert [r["passes_used"] for r in read_jsonl(huge / "metrics.jsonl")] == [1, 2, 3, 4]
