"""grpo_recipe/api.py: a user's own script with GRPORun, its reward function and a datasets.Dataset built in
Python, run under torchrun on 2 ranks and as one process through launch/local.sh; the checks of the CLI apply."""
import re
import subprocess
import sys

import pytest
from conftest import REPO, torchrun

from grpo_recipe.config.schema import ConfigError
from grpo_recipe.dist.env import rank_env
from grpo_recipe.run.metrics import read_jsonl

SMOKE = ["--max_steps", "3", "--save_steps", "2", "--max_completion_length", "8", "--disable_tqdm", "true"]


def docs_script(tmp_path):
    """The script of docs/python.md, as a user would save it."""
    page = (REPO / "docs" / "python.md").read_text()
    (code,) = re.findall(r"```python\n(.*?)```", page, re.DOTALL)
    path = tmp_path / "train_arith.py"
    path.write_text(code)
    return path


@pytest.mark.slow
def test_the_docs_script_trains_on_two_ranks_and_resumes(tmp_path):
    script = docs_script(tmp_path)
    out = tmp_path / "out"
    torchrun(2, [str(script), *SMOKE, "--output_dir", str(out)])
    records = read_jsonl(out / "metrics.jsonl")
    assert [r["step"] for r in records] == [1, 2, 3] and "reward/correct" in records[0]
    assert (out / "final" / "model.safetensors").is_file()
    # the checkpoint records the function and the dataset: the same script resumes from it
    proc = torchrun(2, [str(script), *SMOKE, "--max_steps", "4", "--output_dir", str(out), "--resume_from_checkpoint",
                        "auto"])
    assert "resumed from" in proc.stderr and [r["step"] for r in read_jsonl(out / "metrics.jsonl")] == [1, 2, 3, 4]


@pytest.mark.slow
def test_the_script_runs_through_the_launcher_and_bad_input_is_one_line(tmp_path):
    script = docs_script(tmp_path)
    out = tmp_path / "out"
    proc = subprocess.run(["bash", "launch/local.sh", str(script), *SMOKE, "--output_dir", str(out)], cwd=REPO,
                          env=rank_env(VENV_PY=sys.executable, NPROC=2), capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert [r["step"] for r in read_jsonl(out / "metrics.jsonl")] == [1, 2, 3]
    # a dataset without the prompt column: the CLI's one line and exit 2, before any process group
    bad = tmp_path / "bad.py"
    bad.write_text(script.read_text().replace('"prompt": f"What is', '"question": f"What is'))
    proc = subprocess.run([sys.executable, str(bad), "--output_dir", str(tmp_path / "bad_out")], cwd=tmp_path,
                          env=rank_env(), capture_output=True, text=True, timeout=600)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    assert "prompt_column: dataset train_dataset has no column 'prompt'" in proc.stderr


def test_a_bad_config_raises_before_anything_starts():
    from grpo_recipe import GRPORun

    with pytest.raises(ConfigError, match="num_generations"):
        GRPORun({"num_generations": 3, "per_device_train_batch_size": 8})
    with pytest.raises(ConfigError, match="unknown field 'learnig_rate': did you mean learning_rate"):
        GRPORun({"learnig_rate": 1e-3})
    with pytest.raises(ConfigError, match="steps_per_generation: sets optimizer_steps_per_pass to 2, but the config "
                                          "also sets optimizer_steps_per_pass: 1; keep one"):
        GRPORun("grpo_recipe/configs/quickstart.yaml", steps_per_generation=4)  # the file has the recipe's name
    run = GRPORun({"num_generations": 8}, use_vllm=False, steps_per_generation=4, gradient_accumulation_steps=2,
                  reward_funcs=[len], argv=["--max_steps", "7"])
    assert run.config.max_steps == 7 and run.config.optimizer_steps_per_pass == 2
    assert run.config.to_dict()["reward_funcs"] == ["builtins:len"]
