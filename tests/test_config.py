"""Config fields: derived sizes, each bad value named in one line, sampling the trainer does not score, and
preflight's environment checks reported as config errors before any work."""
import json
import subprocess
import sys

import pytest
from conftest import REPO

from grpo_recipe.config.load import load_config
from grpo_recipe.config.schema import BiasedSamplingError, Config, ConfigError
from grpo_recipe.dist.env import rank_env
from grpo_recipe.run.preflight import preflight

QUICKSTART = str(REPO / "grpo_recipe/configs/quickstart.yaml")


def test_derived_sizes():
    cfg = Config(per_device_train_batch_size=4, gradient_accumulation_steps=2, optimizer_steps_per_pass=3,
                 num_generations=4)
    assert cfg.completions_per_rollout == 24 and cfg.prompts_per_rollout == 6
    assert not Config(num_iterations=1, optimizer_steps_per_pass=1).needs_old_logps
    assert Config(num_iterations=2).needs_old_logps and Config(optimizer_steps_per_pass=2).needs_old_logps


@pytest.mark.parametrize("args, message, caught_by", [
    (["--num_iterations", "0"], "num_iterations: mu must be >= 1", "fields"),
    (["--epsilon", "1.5"], "epsilon: must be in (0, 1)", "fields"),
    (["--epsilon", "0"], "epsilon: must be in (0, 1)", "fields"),
    (["--num_generations", "3"], "must be divisible by num_generations = 3", "fields"),
    (["--loss_type", "ppo"], "loss_type: must be one of", "fields"),
    (["--vllm_lora_sync", "both"], "vllm_lora_sync: must be one of merged, adapter", "fields"),
    (["--scale_rewards", "maybe"], "scale_rewards: must be one of", "fields"),
    (["--no_such_key", "1"], "unknown field 'no_such_key' (--help lists every field)", "fields"),
    (["--learnig_rate", "1"], "unknown field 'learnig_rate': did you mean learning_rate?", "fields"),
    (["--reward_weights", "[1, 2]"], "reward_weights: 2 weights for 1 reward_funcs: give one per function", "fields"),
    (["--use_vllm", "--vllm_mode", "server"], "use_vllm: true with vllm_mode: server: no vLLM server is used here",
     "fields"),
    (["--stop", "['']"], "stop: must be a list of non-empty strings", "fields"),
    (["--loss_type", "vespo", "--importance_sampling_level", "sequence"], "vespo computes its sequence weight itself",
     "fields"),
    (["--loss_type", "vespo", "--vespo_k_pos", "-1"], "vespo_k_pos: must be >= 0", "fields"),
    (["--loss_type", "vespo", "--generation_backend", "vllm"], "vllm_importance_sampling_mode: vespo takes the "
     "sampler's token weights", "fields"),
    (["--chat_template_kwargs", "[1]"], "chat_template_kwargs: expected a mapping", "fields"),
    (["--learning_rate", "abc"], "learning_rate: expected float", "fields"),
    (["--per_device_train_batch_size", "0"], "per_device_train_batch_size: must be >= 1", "fields"),
    (["--lr_scheduler_type", "cosine_with_restarts"], "lr_scheduler_type: must be one of constant, "
     "constant_with_warmup, linear, cosine", "fields"),
    (["--warmup_steps", "3"], "lr_scheduler_type: constant has no warmup (transformers ignores one); use "
     "constant_with_warmup", "fields"),
    (["--warmup_steps", "3", "--warmup_ratio", "0.1"], "warmup_ratio: give warmup_steps (3) or warmup_ratio", "fields"),
    (["--warmup_ratio", "1.5"], "warmup_ratio: must be in [0, 1)", "fields"),
    (["--min_lr_ratio", "0.1"], "min_lr_ratio: applies to lr_scheduler_type cosine only", "fields"),
    (["--eval_steps", "5"], "eval_steps: evaluation needs eval prompts", "fields"),
    (["--eval_on_start", "true"], "eval_steps: evaluation needs eval prompts", "fields"),
    (["--eval_holdout_size", "4", "--eval_dataset_name", "x.jsonl"], "eval_holdout_size: give eval_dataset_name or",
     "fields"),
    (["--eval_num_generations", "0"], "eval_num_generations: must be >= 1", "fields"),
    (["--log_completions_steps", "-1"], "log_completions_steps: must be >= 0", "fields"),
    (["--report_to", "mlflow"], "report_to: unknown tracker(s) ['mlflow']", "fields"),
    (["--report_to", "[none, wandb]"], "report_to: none goes alone", "fields"),
    # what the environment lacks: the fields themselves are fine, preflight names it
    (["--dataset_name", "missing/prompts.jsonl"], "dataset_name: file not found", "preflight"),
    (["--deepspeed_config", "nope.json"], "deepspeed_config: file not found", "preflight"),
    (["--eval_dataset_name", "missing/eval.jsonl", "--eval_steps", "2"], "eval_dataset_name: file not found",
     "preflight"),
    (["--model_name_or_path", "./no/such/model"], "model_name_or_path: folder not found", "preflight"),
    (["--model_name_or_path", "builtin:huge"], "unknown built-in", "preflight"),
    (["--reward_funcs", "[nosuchmodule_xyz:fn]"], "cannot import module", "preflight"),
    (["--reward_funcs", "[length_typo]"], "is not a built-in", "preflight"),
])
def test_bad_values_are_named(args, message, caught_by):
    argv = ["--config", QUICKSTART, *args]
    if caught_by == "preflight":
        cfg = load_config(argv)  # the fields themselves are fine
        with pytest.raises(ConfigError) as e:
            preflight(cfg)
    else:
        with pytest.raises(ConfigError) as e:
            load_config(argv)
    assert message in str(e.value)


def test_cli_reports_a_preflight_error_as_a_config_error(tmp_path):
    out = tmp_path / "out"
    proc = subprocess.run([sys.executable, "-m", "grpo_recipe.train", "--config", QUICKSTART, "--reward_funcs",
                           "[length_typo]", "--output_dir", str(out)], cwd=REPO, env=rank_env(), capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 2
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("config error: reward_funcs: 'length_typo' is not a built-in")
    assert not out.exists()


@pytest.mark.parametrize("field, value", [("top_p", "0.9"), ("top_k", "50"), ("min_p", "0.05"),
                                          ("repetition_penalty", "1.1")])
def test_sampling_the_trainer_does_not_score_is_refused(field, value):
    with pytest.raises(BiasedSamplingError, match=f"^{field}: .* is refused: the sampler would draw from a different "
                                                  "distribution than the softmax"):
        load_config(["--config", QUICKSTART, f"--{field}", value])
    for backend in ("hf", "vllm"):  # neutral values pass on both backends
        neutral = {"top_p": "1.0", "top_k": "0", "min_p": "0.0", "repetition_penalty": "1.0"}[field]
        assert load_config(["--config", QUICKSTART, f"--{field}", neutral, "--generation_backend", backend])


def test_a_deepspeed_scheduler_is_refused_one_schedule_is_the_recipes(tmp_path):
    conf = json.loads((REPO / "ds_configs/zero3.json").read_text())
    conf["scheduler"] = {"type": "WarmupLR", "params": {"warmup_num_steps": 10}}
    path = tmp_path / "with_scheduler.json"
    path.write_text(json.dumps(conf))
    with pytest.raises(ConfigError, match='deepspeed_config: .* has a "scheduler"; remove it'):
        preflight(load_config(["--config", QUICKSTART, "--deepspeed_config", str(path)]))
    path.write_text("{not json")
    with pytest.raises(ConfigError, match="deepspeed_config: .* is not valid JSON"):
        preflight(load_config(["--config", QUICKSTART, "--deepspeed_config", str(path)]))
