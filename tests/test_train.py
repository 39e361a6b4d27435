"""The recipe end to end: plain process, torchrun, the deepspeed launcher, and the quickstart config."""
import subprocess
import sys

import pytest
import torch

from conftest import REPO, torchrun
from recipe.launch import rank_env
from recipe.metrics import read_jsonl, reward_quarters

QUICKSTART = "recipe/configs/quickstart.yaml"
REQUIRED_KEYS = {"step", "generation", "iteration", "loss", "reward_mean", "reward_std", "reward/length",
                 "clip_ratio_low", "clip_ratio_high", "clip_ratio_region", "completion_length_mean",
                 "truncated_fraction", "old_logp_forwards", "tokens_per_s", "time_generate_s", "time_score_s",
                 "time_old_logp_s", "time_train_s", "step_time_s"}
SHORT = ["--max_steps", "4", "--per_device_train_batch_size", "4", "--gradient_accumulation_steps", "1",
         "--num_generations", "4", "--max_completion_length", "8", "--disable_tqdm", "true"]


def check_final_model(out):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(out / "final")
    tok = AutoTokenizer.from_pretrained(out / "final")
    logits = model(**tok("TL;DR:", return_tensors="pt")).logits
    assert torch.isfinite(logits).all()


def test_plain_process_with_kl_and_two_optimizer_steps_per_pass(tmp_path):
    out = tmp_path / "out"
    proc = subprocess.run([sys.executable, "-m", "recipe.train", "--config", QUICKSTART, *SHORT,
                           "--num_iterations", "2", "--optimizer_steps_per_pass", "2", "--beta", "0.05",
                           "--output_dir", str(out)], cwd=REPO, env=rank_env(), capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    records = read_jsonl(out / "metrics.jsonl")
    assert [r["step"] for r in records] == [1, 2, 3, 4]
    assert [(r["generation"], r["iteration"]) for r in records] == [(0, 0), (0, 0), (0, 1), (0, 1)]
    assert REQUIRED_KEYS | {"kl"} <= set(records[0])
    # spg = 2 -> the second step's half of each rollout needs one no-grad forward per micro-batch, once.
    assert [r["old_logp_forwards"] for r in records] == [1, 1, 1, 1]
    assert records[0]["ratio_mean"] == pytest.approx(1.0, abs=1e-6)  # first step is on-policy
    assert "reward_mean: first quarter" in proc.stdout
    check_final_model(out)


def test_deepspeed_launcher_two_ranks(tmp_path):
    out = tmp_path / "out"
    proc = subprocess.run(["deepspeed", "--num_gpus", "2", "--master_port", "29731", "--module", "recipe.train",
                           "--config", QUICKSTART, *SHORT, "--output_dir", str(out)], cwd=REPO,
                          env=rank_env(PATH=f"{sys.prefix}/bin:" + rank_env()["PATH"]), capture_output=True,
                          text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    records = read_jsonl(out / "metrics.jsonl")
    assert len(records) == 4 and records[1]["iteration"] == 1  # auto: an on-policy pass is always replayed
    assert records[-1]["old_logp_forwards"] == 0  # spg = 1: captured from the first pass, no extra forward


def test_bad_reward_stops_every_rank_with_its_name(tmp_path):
    out = tmp_path / "out"
    proc = torchrun(2, ["-m", "recipe.train", "--config", QUICKSTART, *SHORT, "--output_dir", str(out),
                        "--reward_funcs", "[tests.reward_fixtures:has_nan]"], check=False, timeout=600)
    assert proc.returncode != 0
    assert "reward 'has_nan' returned nan at sample 1" in proc.stderr
    assert not (out / "final").exists()


def test_answer_reward_without_answer_column_stops_before_the_model_loads(tmp_path):
    out = tmp_path / "out"
    proc = subprocess.run([sys.executable, "-m", "recipe.train", "--config", QUICKSTART, "--reward_funcs",
                           "[math_accuracy]", "--output_dir", str(out)], cwd=REPO, env=rank_env(), capture_output=True,
                          text=True, timeout=600)
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert "error: reward 'math_accuracy': dataset has no column 'answer' (have ['post', 'prompt'])" in proc.stderr
    assert "Loading weights" not in proc.stderr and not (out / "metrics.jsonl").exists()


@pytest.mark.slow
def test_quickstart_end_to_end_reward_rises(tmp_path):
    """The README's first command, as on a fresh machine: an empty model cache (CI keeps ~/.cache)."""
    out, cache = tmp_path / "qs", tmp_path / "empty-cache"
    proc = subprocess.run(["bash", "launch/quickstart.sh", "--output_dir", str(out), "--disable_tqdm", "true"],
                          cwd=REPO, env=rank_env(VENV_PY=sys.executable, GRPO_RECIPE_CACHE=cache),
                          capture_output=True, text=True, timeout=1200)
    assert proc.returncode == 0, proc.stderr[-3000:]
    records = read_jsonl(out / "metrics.jsonl")
    assert len(records) == 160 and REQUIRED_KEYS <= set(records[0])
    first, last = reward_quarters(records)
    assert last > first + 5.0, f"reward did not rise clearly: first quarter {first:.2f}, last {last:.2f}"
    assert {0, 1} <= {r["iteration"] for r in records} <= set(range(8))  # num_iterations: auto, at most 8 passes
    assert records[-1]["reuse_generation_share"] is not None  # priced once rollouts 1-3 gave the cost ratio
    assert records[-1]["old_logp_forwards"] == 0
    check_final_model(out)


@pytest.mark.slow
def test_train_your_own_example_config_end_to_end(tmp_path):
    """The README's "Train your own model on your own data" example as written there: launch/local.sh on the
    shipped GSM8K-shaped parquet file, the built-in math_accuracy reward and a reward function file."""
    out = tmp_path / "gsm"
    proc = subprocess.run(["bash", "launch/local.sh", "--config", "recipe/configs/gsm8k_local.yaml", "--max_steps", "4",
                           "--output_dir", str(out), "--disable_tqdm"], cwd=REPO,
                          env=rank_env(VENV_PY=sys.executable, NPROC=2), capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    records = read_jsonl(out / "metrics.jsonl")
    assert [r["step"] for r in records] == [1, 2, 3, 4]
    assert {"reward/math_accuracy", "reward/format_reward"} <= set(records[0])
    assert all(0.0 <= r["reward/math_accuracy"] <= 1.0 for r in records)
    check_final_model(out)
