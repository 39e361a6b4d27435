"""Config: YAML + CLI overrides, bare flags, names from TRL, field checks and preflight with one-line
messages and exit code 2 before any work; config.py a leaf of the recipe's import graph."""
import json
import subprocess
import sys

import pytest

from conftest import REPO
from recipe.launch import rank_env
from recipe.config import BiasedSamplingError, Config, ConfigError, load_config, parse_cli
from recipe.preflight import preflight

QUICKSTART = str(REPO / "recipe/configs/quickstart.yaml")


def test_yaml_and_cli_overrides():
    cfg = load_config(["--config", QUICKSTART, "--num_iterations", "2", "--epsilon_high=0.3", "--local_rank=0",
                       "--reward_funcs", "[length, accuracy]"])
    assert cfg.num_iterations == 2 and cfg.epsilon_high == 0.3 and cfg.eps_high == 0.3
    assert cfg.reward_funcs == ["length", "accuracy"]
    assert cfg.num_generations == 8  # from the YAML
    assert load_config([]).loss_type == Config().loss_type


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
    (["--reward_weights", "[1, 2]"], "reward_weights: TRL's field has no equal here; use give each reward_funcs entry",
     "fields"),
    (["--use_vllm"], "use_vllm: TRL's field has no equal here; use generation_backend: vllm", "fields"),
    (["--stop", "['']"], "stop: must be a list of non-empty strings", "fields"),
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
    proc = subprocess.run([sys.executable, "-m", "recipe.train", "--config", QUICKSTART, "--reward_funcs",
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


def test_bare_flags_set_bools_true():
    cfg = load_config(["--config", QUICKSTART, "--disable_tqdm", "--eval_on_start", "--eval_holdout_size", "2",
                       "--seed", "3", "--mask_truncated_completions"])
    assert cfg.disable_tqdm is True and cfg.eval_on_start is True and cfg.mask_truncated_completions is True
    assert cfg.seed == 3
    assert load_config(["--disable_tqdm", "false"]).disable_tqdm is False  # an explicit value still works
    _, overrides = parse_cli(["--gradient_checkpointing", "--bf16"])
    assert overrides == {"gradient_checkpointing": True, "bf16": True}
    # a text field takes the text as given (YAML would read "Answer: N" as a mapping)
    _, overrides = parse_cli(["--system_prompt", "End with: Answer: N", "--dataset_config", "null", "--seed", "7"])
    assert overrides == {"system_prompt": "End with: Answer: N", "dataset_config": None, "seed": 7}


def test_a_trl_style_config_fails_with_what_to_use(tmp_path):
    """Names TRL has with another meaning are not fields here: a TRL config says what to write instead."""
    trl = tmp_path / "trl.yaml"
    trl.write_text("per_device_train_batch_size: 8\ngradient_accumulation_steps: 2\nsteps_per_generation: 4\n"
                   "num_generations: 8\nloss_type: dapo\n")
    with pytest.raises(ConfigError, match=r"^steps_per_generation: TRL counts micro-batches per generation, this "
                                          r"recipe counts optimizer steps .*: use optimizer_steps_per_pass = "
                                          r"steps_per_generation / gradient_accumulation_steps = 4 / 2 = 2$"):
        load_config(["--config", str(trl)])
    trl.write_text(trl.read_text().replace("steps_per_generation: 4", "optimizer_steps_per_pass: 2"))
    cfg = load_config(["--config", str(trl)])
    assert cfg.completions_per_rollout == 8 * 2 * 2  # what TRL's generation batch per rank was
    with pytest.raises(ConfigError, match=r"^loss_type: bnpo: TRL's bnpo divides each micro-batch by its own token "
                                          r"count.*use step_token_mean"):
        load_config(["--config", str(trl), "--loss_type", "bnpo"])
    with pytest.raises(ConfigError, match=r"^vllm_importance_sampling_cap: TRL's field has no equal here; use "
                                          r"vllm_tis_cap: C"):
        load_config(["--config", str(trl), "--vllm_importance_sampling_cap", "3.0"])


def test_missing_config_file_and_bad_cli():
    with pytest.raises(ConfigError, match="config file not found: nope.yaml"):
        load_config(["--config", "nope.yaml"])
    with pytest.raises(ConfigError, match="missing value"):
        parse_cli(["--seed"])
    with pytest.raises(ConfigError, match="unexpected argument"):
        parse_cli(["seed", "3"])


def test_cli_exits_2_with_one_line_before_any_work(tmp_path):
    out = tmp_path / "out"
    proc = subprocess.run([sys.executable, "-m", "recipe.train", "--config", QUICKSTART, "--num_iterations", "0",
                           "--output_dir", str(out)], cwd=REPO, env=rank_env(), capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 2
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert lines == ["config error: num_iterations: mu must be >= 1, got 0"]
    assert not out.exists()  # nothing was started or written


def test_readme_shows_the_example_config_as_shipped():
    import yaml

    readme = (REPO / "README.md").read_text()
    block = readme.split("CI runs it end to end:\n\n```yaml\n", 1)[1].split("```", 1)[0]
    shipped = REPO / "recipe/configs/gsm8k_local.yaml"
    assert yaml.safe_load(block) == yaml.safe_load(shipped.read_text())
    assert load_config(["--config", str(shipped)]).prompt_column == "question"


def test_seed_range_empty_config_and_yaml_errors_with_their_place(tmp_path):
    for seed in (-1, 2**31):
        with pytest.raises(ConfigError, match=rf"seed: must be in \[0, 2147483647\], got {seed}"):
            load_config(["--seed", str(seed)])
    assert load_config(["--seed", "0"]).seed == 0
    with pytest.raises(ConfigError, match="skip_nonfinite_steps: must be >= 0"):
        load_config(["--skip_nonfinite_steps", "-1"])
    for text in ("", "# only a comment\n"):
        (tmp_path / "c.yaml").write_text(text)
        with pytest.raises(ConfigError, match="c.yaml is empty: it sets no field"):
            load_config(["--config", str(tmp_path / "c.yaml")])
    (tmp_path / "c.yaml").write_text("{}\n")  # an explicit empty mapping says "the defaults" on purpose
    assert load_config(["--config", str(tmp_path / "c.yaml")]) == Config()
    (tmp_path / "c.yaml").write_text("seed: 1\nreward_funcs: [length\nbeta: 0\n")
    with pytest.raises(ConfigError) as e:
        load_config(["--config", str(tmp_path / "c.yaml")])
    assert "is not valid YAML: line 3, column 5: " in str(e.value) and "\n" not in str(e.value)
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


def test_report_to_takes_a_list_or_one_name_and_the_old_tensorboard_flag_says_what_to_write():
    assert load_config([]).report_to == ["none"]
    assert load_config(["--report_to", "wandb"]).report_to == ["wandb"]
    assert load_config(["--report_to", "[tensorboard, wandb]"]).report_to == ["tensorboard", "wandb"]
    with pytest.raises(ConfigError, match=r"report_to_tensorboard: replaced by report_to: write report_to: "
                                          r"\[tensorboard\]"):
        load_config(["--report_to_tensorboard", "true"])


@pytest.mark.parametrize("path", sorted((REPO / "recipe/configs").glob("*.yaml")), ids=lambda p: p.name)
def test_every_shipped_config_loads(path):
    cfg = load_config(["--config", str(path)], world_size=2)
    assert cfg.max_steps >= 1
