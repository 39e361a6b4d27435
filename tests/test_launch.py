"""launch/local.sh: one node, CPU ranks when there is no GPU, extra arguments passed through to the recipe."""
import subprocess
import sys

import pytest

from conftest import REPO
from recipe.launch import rank_env
from recipe.metrics import read_jsonl


@pytest.mark.slow
def test_local_sh_two_cpu_ranks_short_run_with_offload_config(tmp_path):
    out = tmp_path / "out"
    env = rank_env(VENV_PY=sys.executable, NPROC=2)
    del env["OMP_NUM_THREADS"]  # local.sh must set it
    proc = subprocess.run(["bash", "launch/local.sh", "--config", "recipe/configs/quickstart.yaml", "--max_steps", "3",
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
