"""config/trl_names.py: every field of TRL 1.16's GRPOConfig loads under its TRL name (mapped, with a note) or is
refused in one line with its reason; none falls through as an unknown field. Against the installed TRL."""
import dataclasses
import importlib.util
import os
from pathlib import Path

import pytest
import yaml

from grpo_recipe.config.load import load_config
from grpo_recipe.config.schema import ConfigError, field_types
from grpo_recipe.config.trl_names import GRPO_FIELDS, SAME

needs_trl = pytest.mark.skipif(importlib.util.find_spec("trl") is None and not os.environ.get("GRPO_REQUIRE_TRL"),
                               reason="trl not installed (bash launch/setup_venv.sh test,bench-trl)")
QUICKSTART = ["--config", "grpo_recipe/configs/quickstart.yaml"]


def trl_fields() -> dict:
    """GRPOConfig's own fields (not transformers' TrainingArguments') with TRL's defaults."""
    from transformers import TrainingArguments
    from trl import GRPOConfig

    base = {f.name for f in dataclasses.fields(TrainingArguments)}
    out = {}
    for f in dataclasses.fields(GRPOConfig):
        if f.name in base:
            continue
        out[f.name] = f.default if f.default is not dataclasses.MISSING else \
            f.default_factory() if f.default_factory is not dataclasses.MISSING else None
    return out


@needs_trl
def test_the_table_covers_every_grpo_config_field_of_the_installed_trl():
    fields = trl_fields()
    assert set(fields) == set(GRPO_FIELDS) | set(SAME), (set(fields) ^ (set(GRPO_FIELDS) | set(SAME)))
    assert set(SAME) <= set(field_types()) and not set(SAME) & set(GRPO_FIELDS)


@needs_trl
def test_every_trl_field_at_trls_default_loads_or_is_refused_with_its_reason():
    """One field at a time, with TRL's default value (as a YAML would carry it), on the quickstart config."""
    refused = {}
    for name, default in trl_fields().items():
        value = "null" if default is None else str(default).lower() if isinstance(default, bool) else str(default)
        if isinstance(default, (dict, list)):
            value = str(default)
        try:
            load_config([*QUICKSTART, f"--{name}", value])
        except ConfigError as e:
            refused[name] = str(e)
    assert refused == {}, refused  # TRL's defaults are all behaviours the recipe has (or inert here)


@needs_trl
@pytest.mark.parametrize("name,value,fragment", [
    ("trust_remote_code", "true", "models are loaded without remote code"),
    ("sync_ref_model", "true", "beta is 0, so there is no reference model to sync"),
    ("max_tool_calling_iterations", "0", "must be >= 1 or null"),
    ("multi_objective_aggregation", "sum_then_average", "must be sum_then_normalize or normalize_then_sum"),
    ("generation_batch_size", "64", "use those fields"),
    ("vllm_server_port", "9000", "no vLLM server is used here"),
    ("fp16", "true", "fp16 is not supported"),
    ("dataloader_num_workers", "4", "transformers' TrainingArguments field has no equal here"),
    ("generation_kwargs", "{max_tokens: 9}", "max_tokens cannot be set here"),
])
def test_a_trl_value_the_recipe_cannot_honour_is_one_line_naming_why(name, value, fragment):
    with pytest.raises(ConfigError) as e:
        load_config([*QUICKSTART, f"--{name}", value])
    assert str(e.value).startswith(f"{name}: ") and fragment in str(e.value) and "\n" not in str(e.value)


def test_a_trl_grpo_yaml_runs_as_is(tmp_path, capsys):
    """A config written for TRL's GRPOTrainer (its quick-start's fields, a colocated vLLM, transformers'
    TrainingArguments at their usual values) loads, mapped, with one note per mapping."""
    trl = tmp_path / "trl_grpo.yaml"
    trl.write_text("""\
model_name_or_path: builtin:tiny-qwen2
dataset_name: grpo_recipe/assets/tldr_prompts.jsonl
output_dir: out/trl-grpo
learning_rate: 1.0e-6
lr_scheduler_type: linear
warmup_ratio: 0.1
per_device_train_batch_size: 8
gradient_accumulation_steps: 2
steps_per_generation: 4
num_generations: 8
max_completion_length: 32
num_iterations: 2
beta: 0.0
epsilon: 0.2
loss_type: dapo
scale_rewards: group
use_vllm: true
vllm_mode: colocate
vllm_gpu_memory_utilization: 0.3
reward_funcs: [length]
reward_weights: [0.5]
logging_steps: 1
log_completions: true
save_strategy: steps
save_steps: 50
save_total_limit: 2
report_to: none
bf16: false
gradient_checkpointing: false
push_to_hub: false
disable_dropout: true
seed: 42
dataloader_num_workers: 0
remove_unused_columns: false
""")
    cfg = load_config(["--config", str(trl)])
    assert (cfg.generation_backend, cfg.optimizer_steps_per_pass, cfg.log_completions_steps) == ("vllm", 2, 1)
    assert cfg.reward_funcs == [{"func": "length", "weight": 0.5}] and cfg.report_to == ["none"]
    err = capsys.readouterr().err
    assert "note (TRL config): use_vllm: -> generation_backend: vllm" in err
    assert "steps_per_generation: -> optimizer_steps_per_pass = 4 / 2" in err
    assert "fields at their defaults, which change nothing here: dataloader_num_workers" in err
    assert "remove_unused_columns: taken; every dataset column but the prompt reaches the reward functions" in err


DOCUMENTED = yaml.safe_load((Path(__file__).parent / "data" / "trl_documented_grpo_configs.yaml").read_text())
# The documented configs the recipe refuses, and the words that say why (every other one loads, mapped)
REFUSED = {
    "dr_grpo": "each group's completions stay on one rank; TRL spreads a group over ranks",
    "art_of_scaling_rl": "each group's completions stay on one rank; TRL spreads a group over ranks",
    "grpo_at_scale": "each group's completions stay on one rank; TRL spreads a group over ranks",
    "lite_ppo": "steps_per_generation: 8 micro-batches is not a whole number of optimizer steps",
    "vllm_server_mode": "no vLLM server is used here; give vLLM ranks of the job itself",
}


@pytest.mark.parametrize("name", DOCUMENTED, ids=list(DOCUMENTED))
def test_trls_own_documented_grpo_configs_load_or_are_refused_in_one_line(name, tmp_path):
    """Every GRPOConfig example in TRL's docs (paper index and GRPO trainer page, extracted as they are written
    into tests/data/trl_documented_grpo_configs.yaml), given as a YAML config with a model and a prompt file."""
    config = tmp_path / f"{name}.yaml"
    config.write_text(yaml.safe_dump({"model_name_or_path": "builtin:tiny-qwen2",
                                      "dataset_name": "grpo_recipe/assets/tldr_prompts.jsonl",
                                      **DOCUMENTED[name]["fields"]}))
    if name not in REFUSED:
        cfg = load_config(["--config", str(config)])
        for field, value in DOCUMENTED[name]["fields"].items():
            if hasattr(cfg, field) and field != "steps_per_generation":  # the same name means the same value
                assert getattr(cfg, field) == value, field
        return
    with pytest.raises(ConfigError) as e:
        load_config(["--config", str(config)])
    assert REFUSED[name] in str(e.value) and "\n" not in str(e.value), str(e.value)
