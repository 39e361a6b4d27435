"""Config loading: YAML + CLI overrides, bare flags, names from TRL, YAML errors with their place, exit code 2
with one line before any work, and every shipped config loads."""
import subprocess
import sys

import pytest
from conftest import REPO

from grpo_recipe.config.load import load_config, parse_cli
from grpo_recipe.config.schema import Config, ConfigError
from grpo_recipe.dist.env import rank_env

QUICKSTART = str(REPO / "grpo_recipe/configs/quickstart.yaml")


def test_yaml_and_cli_overrides():
    cfg = load_config(["--config", QUICKSTART, "--num_iterations", "2", "--epsilon_high=0.3", "--local_rank=0",
                       "--reward_funcs", "[length, accuracy]"])
    assert cfg.num_iterations == 2 and cfg.epsilon_high == 0.3 and cfg.eps_high == 0.3
    assert cfg.reward_funcs == ["length", "accuracy"]
    assert cfg.num_generations == 8  # from the YAML
    assert load_config([]).loss_type == Config().loss_type


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


def test_a_trl_style_config_loads_or_says_what_to_use(tmp_path):
    """TRL's names load under their TRL name (mapped, with a note) or say what to write instead, in one line."""
    trl = tmp_path / "trl.yaml"
    trl.write_text("per_device_train_batch_size: 8\ngradient_accumulation_steps: 2\nsteps_per_generation: 4\n"
                   "num_generations: 8\nloss_type: dapo\n")
    cfg = load_config(["--config", str(trl)])
    assert cfg.optimizer_steps_per_pass == 2 and cfg.completions_per_rollout == 8 * 2 * 2  # TRL's generation batch
    with pytest.raises(ConfigError, match=r"^steps_per_generation: 3 micro-batches is not a whole number of "
                                          r"optimizer steps of gradient_accumulation_steps = 2"):
        load_config(["--config", str(trl), "--steps_per_generation", "3"])
    with pytest.raises(ConfigError, match=r"^loss_type: bnpo: TRL's bnpo divides each micro-batch by its own token "
                                          r"count.*use step_token_mean"):
        load_config(["--config", str(trl), "--loss_type", "bnpo"])
    cfg = load_config(["--config", str(trl), "--vllm_importance_sampling_cap", "2.5"])
    assert cfg.vllm_importance_sampling_clip_max == 2.5
    cfg = load_config(["--config", str(trl), "--top_entropy_quantile", "0.2", "--use_adaptive_entropy", "true"])
    assert (cfg.top_entropy_quantile, cfg.use_adaptive_entropy) == (0.2, True)  # TRL's names are the recipe's
    with pytest.raises(ConfigError, match=r"^vllm_tis_cap: replaced by TRL's fields: vllm_importance_sampling_mode: "
                                          r"token_truncate with vllm_importance_sampling_clip_max: 2.0$"):
        load_config(["--config", str(trl), "--vllm_tis_cap", "2.0"])


@pytest.mark.parametrize("argv,message", [
    (["--importance_sampling_level", "sequence"],
     "importance_sampling_level: sequence with loss_type dapo, which sums token contributions"),
    (["--importance_sampling_level", "seq", "--loss_type", "grpo"], "importance_sampling_level: must be token or"),
    (["--loss_type", "cispo"], "epsilon_high: cispo caps the ratio itself at epsilon_high"),
    (["--loss_type", "cispo", "--epsilon_high", "5.0", "--delta", "8"], "delta: caps the clipped surrogate's ratio"),
    (["--delta", "1.1"], "delta: must be > 1 + epsilon_high = 1.2"),
    (["--sapo_temperature_neg", "0"], "sapo_temperature_neg: must be > 0"),
    (["--off_policy_mask_threshold", "-1"], "off_policy_mask_threshold: must be > 0"),
    (["--entropy_coef", "-0.1"], "entropy_coef: must be >= 0"),
    (["--top_entropy_quantile", "1.5"], "top_entropy_quantile: must be in [0, 1]"),
    (["--use_adaptive_entropy", "true", "--entropy_coef_min", "0.5", "--entropy_coef_max", "0.1"],
     "entropy_coef_min, entropy_coef_max: need 0 <= min <= max"),
    (["--use_adaptive_entropy", "true", "--entropy_coef_delta", "-1"], "entropy_coef_delta: must be >= 0"),
    (["--sync_ref_model", "true"], "sync_ref_model: beta is 0, so there is no reference model to sync"),
    (["--sync_ref_model", "true", "--beta", "0.1", "--use_peft", "true"],
     "sync_ref_model: with use_peft the reference is the base model under the disabled adapter"),
    (["--sync_ref_model", "true", "--beta", "0.1", "--ref_model_mixup_alpha", "1.5"],
     "ref_model_mixup_alpha: must be in [0, 1]"),
    (["--sync_ref_model", "true", "--beta", "0.1", "--ref_model_sync_steps", "0"], "ref_model_sync_steps: must be >= 1"),
    (["--generation_backend", "vllm", "--vllm_importance_sampling_mode", "seq_mask"],
     "vllm_importance_sampling_mode: must be one of token_truncate, token_mask, sequence_truncate, sequence_mask"),
    (["--generation_backend", "vllm", "--vllm_importance_sampling_clip_max", "0.5"],
     "vllm_importance_sampling_clip_max: must be >= 1"),
])
def test_bad_loss_options_are_one_line_errors(argv, message):
    with pytest.raises(ConfigError) as e:
        load_config(argv)
    assert str(e.value).startswith(message) and "\n" not in str(e.value), str(e.value)


def test_missing_config_file_and_bad_cli():
    with pytest.raises(ConfigError, match="config file not found: nope.yaml"):
        load_config(["--config", "nope.yaml"])
    with pytest.raises(ConfigError, match="missing value"):
        parse_cli(["--seed"])
    with pytest.raises(ConfigError, match="unexpected argument"):
        parse_cli(["seed", "3"])


def test_cli_exits_2_with_one_line_before_any_work(tmp_path):
    out = tmp_path / "out"
    proc = subprocess.run([sys.executable, "-m", "grpo_recipe.train", "--config", QUICKSTART, "--num_iterations", "0",
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
    shipped = REPO / "grpo_recipe/configs/gsm8k_local.yaml"
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


def test_report_to_takes_a_list_or_one_name_and_the_old_tensorboard_flag_says_what_to_write():
    assert load_config([]).report_to == ["none"]
    assert load_config(["--report_to", "wandb"]).report_to == ["wandb"]
    assert load_config(["--report_to", "[tensorboard, wandb]"]).report_to == ["tensorboard", "wandb"]
    with pytest.raises(ConfigError, match=r"report_to_tensorboard: replaced by report_to: write report_to: "
                                          r"\[tensorboard\]"):
        load_config(["--report_to_tensorboard", "true"])


@pytest.mark.parametrize("path", sorted((REPO / "grpo_recipe/configs").glob("*.yaml")), ids=lambda p: p.name)
def test_every_shipped_config_loads(path):
    cfg = load_config(["--config", str(path)], world_size=2)
    assert cfg.max_steps >= 1


@pytest.mark.parametrize("argv,needle", [
    (["--reward_funcs", "[recipe.examples.arith_rewards:correctness]"],
     "reward_funcs: 'recipe.examples.arith_rewards:correctness' names the package `recipe`, which is now "
     "`grpo_recipe`: write 'grpo_recipe.examples.arith_rewards:correctness'"),
    (["--dataset_name", "recipe/data/gsm8k_like.parquet"], "write 'grpo_recipe/assets/gsm8k_like.parquet'"),
    (["--config", "recipe/configs/quickstart.yaml"],
     "config file not found: recipe/configs/quickstart.yaml (the package `recipe` is now `grpo_recipe`: "
     "grpo_recipe/configs/quickstart.yaml)"),
])
def test_a_config_naming_the_old_package_gets_the_new_name(argv, needle):
    with pytest.raises(ConfigError) as e:
        load_config(argv)
    assert needle in str(e.value) and "\n" not in str(e.value)


def test_a_key_given_twice_in_a_yaml_file_is_refused_naming_both_lines(tmp_path):
    """Issue #41.7: PyYAML keeps the last of two equal keys silently (a run at learning_rate 5.0)."""
    path = tmp_path / "dup.yaml"
    path.write_text("learning_rate: 0.002\nmax_steps: 4\nlearning_rate: 5.0\n")
    with pytest.raises(ConfigError, match=r"config file .*dup.yaml: 'learning_rate' is set twice, on line 1 and line 3"):
        load_config(["--config", str(path)])
    nested = tmp_path / "nested.yaml"
    nested.write_text("reward_funcs:\n  - {func: length, weight: 1.0, weight: 2.0}\n")
    with pytest.raises(ConfigError, match="'weight' is set twice, on line 2 and line 2"):
        load_config(["--config", str(nested)])
