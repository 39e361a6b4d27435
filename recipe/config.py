"""The recipe's one config: a dataclass loaded from YAML with `--key value` CLI overrides.

Every field is checked here, before any process group starts, so that a bad value costs a one-line message
(exit code 2) instead of a crashed multi-node job. A leaf: it imports nothing from the recipe. The checks that
ask the environment (files, the built-in model, vLLM, reward imports) are `recipe.preflight`'s.
"""
from __future__ import annotations

import dataclasses
import os
import sys
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

REPO_ROOT = Path(__file__).resolve().parent.parent
LOSS_TYPES = ("grpo", "bnpo", "dr_grpo", "dapo")
SCALE_REWARDS = ("group", "batch", "none")
LORA_SYNC_MODES = ("merged", "adapter")  # how a LoRA policy reaches vLLM (generation/vllm_lora.py)
# Endings that make dataset_name a local file (so a missing one is "file not found", not a hub lookup);
# any format `datasets` reads is loaded, these are only the common ones.
DATA_SUFFIXES = {".jsonl", ".json", ".ndjson", ".parquet", ".csv", ".tsv", ".arrow", ".txt", ".xml",
                 ".gz", ".bz2", ".xz", ".zst", ".zip"}


class ConfigError(ValueError):
    """A bad config value; the message names the field."""


def need(ok: bool, msg: str) -> None:
    """A config check: raise ConfigError(msg) unless ok."""
    if not ok:
        raise ConfigError(msg)


@dataclass
class Config:
    # --- model -------------------------------------------------------------------------
    model_name_or_path: str = "builtin:tiny-qwen2"  # a folder, a hub name, builtin:tiny-qwen2 or tiny-qwen2-h64
    bf16: str | bool = "auto"  # auto = bf16 on GPUs, fp32 on CPU
    gradient_checkpointing: bool = False
    # --- LoRA (peft) -------------------------------------------------------------------
    use_peft: bool = False  # train a LoRA adapter only; the base stays frozen and is the KL reference
    lora_r: int = 16
    lora_alpha: int = 32
    lora_dropout: float = 0.0  # must be 0: the recipe trains without dropout (see validate)
    lora_target_modules: list = field(default_factory=lambda: ["all-linear"])  # module names, or all-linear
    save_merged: bool = False  # also write OUTPUT_DIR/final-merged, the full model with the adapter merged
    # --- data --------------------------------------------------------------------------
    dataset_name: str = "recipe/data/tldr_prompts.jsonl"  # a local jsonl/json/parquet/csv file or a hub name
    dataset_config: str | None = None
    dataset_split: str = "train"
    prompt_column: str = "prompt"
    system_prompt: str | None = None
    chat_template: str | bool = "auto"  # auto = use the tokenizer's chat template when it has one
    chat_template_kwargs: dict = field(default_factory=dict)
    max_prompt_length: int = 256
    # --- generation --------------------------------------------------------------------
    generation_backend: str = "hf"  # hf (transformers generate on the engine's weights) or vllm
    num_generations: int = 8  # G: completions per prompt
    max_completion_length: int = 64
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 = off
    # --- vLLM (generation_backend: vllm) -----------------------------------------------
    vllm_gpu_memory_utilization: float = 0.3  # share of GPU memory (on CPU: of host memory) vLLM may plan for
    vllm_tensor_parallel_size: int = 1  # consecutive ranks that shard one engine
    vllm_enable_sleep_mode: bool = False  # GPU: release vLLM's memory while training
    vllm_max_model_len: int | None = None  # None = max_prompt_length + max_completion_length
    vllm_kv_cache_mib: int | None = None  # None: GPU sizes it from the utilization, CPU fits one rollout
    vllm_importance_sampling_cap: float | None = None  # truncated IS correction of sampler drift; None = off
    vllm_lora_sync: str = "merged"  # with use_peft: merged (base + delta, reload_weights) or adapter (vLLM's LoRA)
    # --- rewards -----------------------------------------------------------------------
    # Each entry: a built-in name ("length", "accuracy"), "module:function" or "path/file.py:function",
    # or a mapping {func: ..., weight: 1.0, kwargs: {...}}.
    reward_funcs: list = field(default_factory=lambda: [{"func": "length", "kwargs": {"target_chars": 60}}])
    scale_rewards: str = "group"
    # --- GRPO --------------------------------------------------------------------------
    num_iterations: int = 1  # mu: optimizer passes over each rollout
    epsilon: float = 0.2
    epsilon_high: float | None = None  # None = epsilon
    beta: float = 0.0  # KL coefficient against the frozen reference model
    loss_type: str = "dapo"
    mask_truncated_completions: bool = False
    # Adaptive reuse (off when null): skip a rollout's remaining passes once a finished pass's mean approximate
    # KL to the sampling policy, or its clipped-token fraction, exceeds the target.
    reuse_target_kl: float | None = None
    reuse_max_clip_fraction: float | None = None
    # --- batch shape (per rank) --------------------------------------------------------
    per_device_train_batch_size: int = 8  # completions per micro-batch
    gradient_accumulation_steps: int = 1
    steps_per_generation: int = 1  # optimizer steps fed by one rollout per pass
    # --- optimizer ---------------------------------------------------------------------
    learning_rate: float = 1e-6
    weight_decay: float = 0.0
    adam_beta1: float = 0.9
    adam_beta2: float = 0.999
    adam_epsilon: float = 1e-8
    max_grad_norm: float = 1.0  # 0 = no clipping
    max_steps: int = 100  # optimizer steps
    # --- run ---------------------------------------------------------------------------
    seed: int = 42
    output_dir: str = "output"
    deepspeed_config: str = "ds_configs/zero3.json"
    logging_steps: int = 1
    save_steps: int = 100  # checkpoint every N optimizer steps (and at the end); 0 = never
    save_total_limit: int = 2  # keep the newest N complete checkpoints; 0 = keep all
    resume_from_checkpoint: str | None = None  # auto = the newest complete one in output_dir; or a step-* folder
    report_to_tensorboard: bool = False
    disable_tqdm: bool = False

    # --- derived -----------------------------------------------------------------------
    @property
    def eps_high(self) -> float:
        return self.epsilon if self.epsilon_high is None else self.epsilon_high

    @property
    def completions_per_rollout(self) -> int:
        """Completions one rank generates per rollout."""
        return self.per_device_train_batch_size * self.gradient_accumulation_steps * self.steps_per_generation

    @property
    def prompts_per_rollout(self) -> int:
        """Prompts one rank generates for per rollout (each gets num_generations completions)."""
        return self.completions_per_rollout // self.num_generations

    @property
    def needs_old_logps(self) -> bool:
        """Old log-probs differ from logp.detach() only when a rollout feeds several optimizer steps."""
        return self.num_iterations > 1 or self.steps_per_generation > 1

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


# ------------------------------------------------------------------------------------------
# loading
# ------------------------------------------------------------------------------------------
def _field_types() -> dict[str, Any]:
    return typing.get_type_hints(Config)


def _coerce(name: str, value: Any, typ: Any) -> Any:
    """Check/convert one value against its annotated type; raise ConfigError naming the field."""
    args = typing.get_args(typ)
    allowed = [a for a in args if a is not type(None)] if args else [typ]
    if value is None:
        if args and type(None) in args:
            return None
        raise ConfigError(f"{name}: must not be null")
    origin = typing.get_origin(typ)
    if origin is list or typ is list:
        if not isinstance(value, list):
            value = [value]
        return value
    if origin is dict or typ is dict:
        if not isinstance(value, dict):
            raise ConfigError(f"{name}: expected a mapping, got {value!r}")
        return value
    for a in allowed:
        if a is bool and isinstance(value, bool):
            return value
        if a is int and isinstance(value, int) and not isinstance(value, bool):
            return value
        if a is float and isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
        if a is float and isinstance(value, str):  # YAML 1.1 reads 1e-9 (no dot) as a string
            try:
                return float(value)
            except ValueError:
                pass
        if a is str and isinstance(value, str):
            return value
    if str in allowed and not isinstance(value, (dict, list)):
        return str(value)
    names = " or ".join(getattr(a, "__name__", str(a)) for a in allowed)
    raise ConfigError(f"{name}: expected {names}, got {value!r}")


def parse_cli(argv: list[str]) -> tuple[str | None, dict[str, Any]]:
    """`--config FILE` plus `--key value` / `--key=value` overrides (values parsed as YAML)."""
    config_path, overrides, i = None, {}, 0
    while i < len(argv):
        arg = argv[i]
        if not arg.startswith("--"):
            raise ConfigError(f"unexpected argument {arg!r}: overrides are --key value")
        key, eq, val = arg[2:].partition("=")
        if not eq:
            if i + 1 >= len(argv) or argv[i + 1].startswith("--"):
                raise ConfigError(f"--{key}: missing value")
            val, i = argv[i + 1], i + 1
        i += 1
        key = key.replace("-", "_")
        if key == "local_rank":  # set by the deepspeed launcher; LOCAL_RANK in the env says the same
            continue
        if key == "config":
            config_path = val
        else:
            try:
                overrides[key] = yaml.safe_load(val) if val != "" else ""
            except yaml.YAMLError:
                overrides[key] = val
    return config_path, overrides


def load_config(argv: list[str] | None = None, world_size: int | None = None) -> Config:
    """Build and validate the config from `--config FILE.yaml` and CLI overrides."""
    config_path, overrides = parse_cli(sys.argv[1:] if argv is None else argv)
    values: dict[str, Any] = {}
    if config_path is not None:
        path = Path(config_path)
        if not path.is_file():
            raise ConfigError(f"config file not found: {config_path}")
        try:
            loaded = yaml.safe_load(path.read_text()) or {}
        except yaml.YAMLError as e:
            raise ConfigError(f"config file {config_path} is not valid YAML: {str(e).splitlines()[0]}") from None
        if not isinstance(loaded, dict):
            raise ConfigError(f"config file {config_path} must hold a mapping of fields")
        values.update(loaded)
    values.update(overrides)
    types = _field_types()
    unknown = sorted(set(values) - set(types))
    if unknown:
        raise ConfigError(f"unknown config key(s): {', '.join(unknown)}")
    cfg = Config(**{k: _coerce(k, v, types[k]) for k, v in values.items()})
    if world_size is None:
        world_size = int(os.environ.get("WORLD_SIZE", "1"))
    validate(cfg, world_size)
    return cfg


def resolve_path(path: str) -> Path:
    """Relative paths resolve against the working directory, then against the repository."""
    p = Path(path)
    if p.is_absolute() or p.exists():
        return p
    alt = REPO_ROOT / p
    return alt if alt.exists() else p


def looks_like_file(name: str) -> bool:
    return bool(set(Path(name).suffixes) & DATA_SUFFIXES) or os.sep in name and Path(name).suffix != ""


def validate(cfg: Config, world_size: int = 1) -> None:
    need(cfg.num_generations >= 2, f"num_generations: must be >= 2 (group advantages need a group), got {cfg.num_generations}")
    need(cfg.num_iterations >= 1, f"num_iterations: mu must be >= 1, got {cfg.num_iterations}")
    for name in ("per_device_train_batch_size", "gradient_accumulation_steps", "steps_per_generation",
                 "max_steps", "max_completion_length", "max_prompt_length", "logging_steps"):
        need(getattr(cfg, name) >= 1, f"{name}: must be >= 1, got {getattr(cfg, name)}")
    need(cfg.completions_per_rollout % cfg.num_generations == 0,
         f"num_generations: per_device_train_batch_size x gradient_accumulation_steps x steps_per_generation "
         f"= {cfg.completions_per_rollout} completions per rank must be divisible by num_generations = {cfg.num_generations}")
    need(0.0 < cfg.epsilon < 1.0, f"epsilon: must be in (0, 1), got {cfg.epsilon}")
    need(cfg.eps_high > 0.0, f"epsilon_high: must be > 0, got {cfg.epsilon_high}")
    need(cfg.reuse_target_kl is None or cfg.reuse_target_kl > 0,
         f"reuse_target_kl: must be > 0 or null, got {cfg.reuse_target_kl}")
    need(cfg.reuse_max_clip_fraction is None or 0 < cfg.reuse_max_clip_fraction < 1,
         f"reuse_max_clip_fraction: must be in (0, 1) or null, got {cfg.reuse_max_clip_fraction}")
    need(cfg.beta >= 0.0, f"beta: must be >= 0, got {cfg.beta}")
    need(cfg.loss_type in LOSS_TYPES, f"loss_type: must be one of {', '.join(LOSS_TYPES)}, got {cfg.loss_type!r}")
    need(cfg.scale_rewards in SCALE_REWARDS,
         f"scale_rewards: must be one of {', '.join(SCALE_REWARDS)}, got {cfg.scale_rewards!r}")
    need(cfg.temperature > 0.0, f"temperature: must be > 0, got {cfg.temperature}")
    need(0.0 < cfg.top_p <= 1.0, f"top_p: must be in (0, 1], got {cfg.top_p}")
    need(cfg.top_k >= 0, f"top_k: must be >= 0, got {cfg.top_k}")
    need(cfg.learning_rate > 0.0, f"learning_rate: must be > 0, got {cfg.learning_rate}")
    need(cfg.save_steps >= 0, f"save_steps: must be >= 0, got {cfg.save_steps}")
    need(cfg.save_total_limit >= 0, f"save_total_limit: must be >= 0, got {cfg.save_total_limit}")
    need(cfg.max_grad_norm >= 0.0, f"max_grad_norm: must be >= 0, got {cfg.max_grad_norm}")
    need(cfg.generation_backend in ("hf", "vllm"),
         f"generation_backend: must be hf or vllm, got {cfg.generation_backend!r}")
    need(cfg.vllm_lora_sync in LORA_SYNC_MODES,
         f"vllm_lora_sync: must be one of {', '.join(LORA_SYNC_MODES)}, got {cfg.vllm_lora_sync!r}")
    need(str(cfg.bf16).lower() in ("auto", "true", "false"), f"bf16: must be auto, true or false, got {cfg.bf16!r}")
    need(str(cfg.chat_template).lower() in ("auto", "true", "false"),
         f"chat_template: must be auto, true or false, got {cfg.chat_template!r}")
    need(world_size >= 1, f"WORLD_SIZE: must be >= 1, got {world_size}")
    need(bool(cfg.output_dir), "output_dir: must not be empty")
    need(bool(cfg.reward_funcs), "reward_funcs: at least one reward function is needed")
    if cfg.use_peft:
        need(cfg.lora_r >= 1, f"lora_r: must be >= 1, got {cfg.lora_r}")
        need(cfg.lora_alpha > 0, f"lora_alpha: must be > 0, got {cfg.lora_alpha}")
        # Dropout would make the training forward a different policy from the one that sampled (and
        # from the old log-probs); the recipe turns every dropout off, so a LoRA dropout is refused.
        need(cfg.lora_dropout == 0.0, f"lora_dropout: must be 0 (the recipe trains without dropout so that the "
                                      f"trained policy is the sampling policy), got {cfg.lora_dropout}")
        need(bool(cfg.lora_target_modules) and all(isinstance(m, str) and m for m in cfg.lora_target_modules),
             f"lora_target_modules: must be a non-empty list of module names (or [all-linear]), "
             f"got {cfg.lora_target_modules!r}")
    need(not cfg.save_merged or cfg.use_peft,
         "save_merged: needs use_peft: true (without LoRA, OUTPUT_DIR/final already is the full model)")

    if cfg.generation_backend == "vllm":
        validate_vllm(cfg, world_size)
    else:
        need(cfg.vllm_importance_sampling_cap is None,
             "vllm_importance_sampling_cap: needs generation_backend: vllm "
             "(the hf backend samples with the trainer's own weights)")


def validate_vllm(cfg: Config, world_size: int) -> None:
    """The vLLM fields (whether vLLM can serve this model here is preflight's question)."""
    tp = cfg.vllm_tensor_parallel_size
    if not 0.0 < cfg.vllm_gpu_memory_utilization <= 1.0:
        raise ConfigError(f"vllm_gpu_memory_utilization: must be in (0, 1], got {cfg.vllm_gpu_memory_utilization}")
    if tp < 1 or world_size % tp:
        raise ConfigError(f"vllm_tensor_parallel_size: must be >= 1 and divide the world size {world_size}, got {tp}")
    max_len = cfg.vllm_max_model_len
    if max_len is not None and max_len < cfg.max_prompt_length + cfg.max_completion_length:
        raise ConfigError(f"vllm_max_model_len: {max_len} is shorter than max_prompt_length + max_completion_length "
                          f"= {cfg.max_prompt_length + cfg.max_completion_length}")
    if cfg.vllm_kv_cache_mib is not None and cfg.vllm_kv_cache_mib < 1:
        raise ConfigError(f"vllm_kv_cache_mib: must be >= 1, got {cfg.vllm_kv_cache_mib}")
    cap = cfg.vllm_importance_sampling_cap
    if cap is not None and cap < 1.0:
        raise ConfigError(f"vllm_importance_sampling_cap: must be >= 1 (it truncates ratios from above), got {cap}")
