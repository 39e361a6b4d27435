"""The recipe's one config: a dataclass of every field and the checks of their values.

`grpo_recipe.config.load` reads it from YAML and `--key value` CLI overrides. Every field is checked here, before any process group starts, so that a bad value costs a one-line message
(exit code 2) instead of a crashed multi-node job. A leaf: it imports nothing from the recipe. The checks that
ask the environment (files, the built-in model, vLLM, reward imports) are `grpo_recipe.run.preflight`'s.
"""
from __future__ import annotations

import copy
import dataclasses
import os
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

REPO_ROOT = Path(__file__).resolve().parents[2]
LOSS_TYPES = ("grpo", "step_token_mean", "dr_grpo", "dapo", "cispo", "sapo", "luspo", "vespo")  # what each means: algo/loss.py
# Losses that sum token contributions: a sequence-level ratio would weight each sequence by its length.
TOKEN_SUM_LOSSES = ("step_token_mean", "dr_grpo", "dapo", "cispo")
IS_LEVELS = ("token", "sequence")
SAMPLER_IS_MODES = ("token_truncate", "token_mask", "sequence_truncate", "sequence_mask")
SCALE_REWARDS = ("group", "batch", "none")
LORA_SYNC_MODES = ("merged", "adapter")  # how a LoRA policy reaches vLLM (generation/vllm_lora.py)
# Endings that make dataset_name a local file (so a missing one is "file not found", not a hub lookup);
# any format `datasets` reads is loaded, these are only the common ones.
DATA_SUFFIXES = {".jsonl", ".json", ".ndjson", ".parquet", ".csv", ".tsv", ".arrow", ".txt", ".xml",
                 ".gz", ".bz2", ".xz", ".zst", ".zip"}
MAX_SEED = 2**31 - 1
LR_SCHEDULES = ("constant", "constant_with_warmup", "linear", "cosine")
TRACKERS = ("tensorboard", "wandb", "none")


class ConfigError(ValueError):
    """A bad config value; the message names the field."""


def need(ok: bool, msg: str) -> None:
    """A config check: raise ConfigError(msg) unless ok."""
    if not ok:
        raise ConfigError(msg)


class BiasedSamplingError(ConfigError):
    """A sampling option that would make the sampled distribution differ from the one the trainer scores."""


def opt(default: Any, help: str):
    """A config field and its one-line description, which `--help` prints."""
    if isinstance(default, (list, dict)):
        return field(default_factory=lambda: copy.deepcopy(default), metadata={"help": help})
    return field(default=default, metadata={"help": help})


@dataclass
class Config:
    # --- model -------------------------------------------------------------------------
    model_name_or_path: str = opt("builtin:tiny-qwen2", "a model folder, a hub name, or builtin:tiny-qwen2(-h64)")
    bf16: str | bool = opt("auto", "auto = bf16 on GPUs, fp32 on CPU; or true / false")
    gradient_checkpointing: bool = opt(False, "recompute activations in the backward pass (less memory, slower)")
    # --- LoRA (peft) -------------------------------------------------------------------
    use_peft: bool = opt(False, "train a LoRA adapter only; the frozen base is the KL reference")
    lora_r: int = opt(16, "adapter rank")
    lora_alpha: int = opt(32, "adapter scale: the update is alpha / r * B A")
    lora_dropout: float = opt(0.0, "must be 0: no dropout, so the trained policy is the sampling one")
    lora_target_modules: list = opt(["all-linear"], "module names to adapt, or all-linear (every linear but the head)")
    save_merged: bool = opt(False, "with use_peft, also write OUTPUT_DIR/final-merged (adapter merged into the model)")
    # --- data --------------------------------------------------------------------------
    dataset_name: str = opt("grpo_recipe/assets/tldr_prompts.jsonl", "a local file in any format datasets reads "
                            "(jsonl, json, parquet, csv, tsv, arrow, ...), a local dataset folder, or a hub name")
    dataset_config: str | None = opt(None, "the dataset's config name (e.g. main for openai/gsm8k); null = none")
    dataset_split: str = opt("train", "split to train on; slices work: train[:1000], train[10%:]")
    prompt_column: str = opt("prompt", "column holding each prompt: text, or a list of chat messages {role, content}")
    system_prompt: str | None = opt(None, "a system message before each prompt (no chat template: a text prefix)")
    chat_template: str | bool = opt("auto", "auto = apply the tokenizer's chat template when it has one; true; false")
    chat_template_kwargs: dict = opt({}, "extra arguments of apply_chat_template, e.g. {enable_thinking: false}")
    max_prompt_length: int = opt(256, "prompts are cut from the left to this many tokens")
    chat_template_path: str | None = opt(None, "a Jinja chat template file replacing the tokenizer's (e.g. "
                                         "grpo_recipe/assets/chatml_tools.jinja: tool calls for ChatML models)")
    response_template_path: str | None = opt(None, "a JSON response template for transformers' parse_response "
                                             "(how tool calls are read from a completion); null = the tokenizer's")
    # --- tools (multi-turn rollouts; docs: tools) ------------------------------------------
    tools: list = opt([], "functions the model may call: module:function or path/file.py:function, typed "
                      "arguments and a Google-style docstring (they make the schema the prompt shows)")
    max_tool_calling_iterations: int | None = opt(None, "tool-call rounds per completion at most; null = until "
                                                  "max_completion_length")
    environment_factory: str | dict | None = opt(None, "module:Class (or path/file.py:Class) of an environment: one "
                                                 "per completion, reset from its row, its public methods the tools; "
                                                 "or {name: module:Class} chosen by an 'environment' column")
    tool_timeout_s: float = opt(30.0, "the most seconds one tool call may take: then its result is an error "
                                      "message the model reads (counted as a failure); 0 = no bound")
    # --- generation --------------------------------------------------------------------
    generation_backend: str = opt("hf", "hf (transformers generate on the training weights) or vllm (an engine per "
                                  "rank: colocated, or on each generation rank)")
    generation_ranks: int = opt(0, "ranks of the launch (its last ones) that only generate, each on a whole copy of "
                                "the policy (generation_backend); 0 = every rank generates, then trains")
    max_staleness: int = opt(0, "with generation_ranks: 1 = rollout k + 1 is generated while rollout k trains, from "
                                "weights one sync older (the loss corrects the lag: vllm_importance_sampling_*); "
                                "0 = the generators wait for the new weights")
    hf_generation_gather: str = opt("full", "hf under ZeRO-3: full = gather the whole model once per rollout (fast; "
                                    "it must fit one device), per_layer = ZeRO-3 gathers each layer as it runs")
    num_generations: int = opt(8, "G: completions per prompt (a group; all G are generated on one rank)")
    max_completion_length: int = opt(64, "new tokens per completion at most")
    temperature: float = opt(1.0, "sampling temperature (the trainer scores the same softmax(logits / T))")
    top_p: float = opt(1.0, "must be 1: truncated sampling would bias the importance ratios (docs: algorithm, sampling)")
    top_k: int = opt(0, "must be 0 (off): truncated sampling would bias the importance ratios (docs: algorithm, sampling)")
    min_p: float | None = opt(None, "must be null or 0: truncated sampling would bias the importance ratios")
    repetition_penalty: float = opt(1.0, "must be 1: a penalized sampler is not the policy the trainer scores")
    stop: list = opt([], "stop strings: a completion ends with the token that completes one (kept in the text)")
    # --- vLLM (generation_backend: vllm) -----------------------------------------------
    vllm_gpu_memory_utilization: float = opt(0.3, "share of GPU memory (on CPU: of host memory) vLLM may plan for")
    vllm_tensor_parallel_size: int = opt(1, "consecutive ranks that shard one vLLM engine (divides the world size)")
    vllm_enable_sleep_mode: bool = opt(False, "GPU only: release vLLM's KV cache and weights while training")
    vllm_max_model_len: int | None = opt(None, "vLLM context length; null = max_prompt_length + max_completion_length")
    vllm_kv_cache_mib: int | None = opt(None, "vLLM KV cache size; null = from the utilization (GPU), one rollout")
    vllm_importance_sampling_correction: bool = opt(True, "weight the loss by vLLM's drift from the trainer, "
                                                    "exp(old_logp - vllm_logp), per vllm_importance_sampling_mode")
    vllm_importance_sampling_mode: str = opt("sequence_mask", "token_truncate, token_mask, sequence_truncate or "
                                             "sequence_mask: per token or one ratio per sequence (its token sum); "
                                             "clamp to [clip_min, clip_max] or set to 0 outside")
    vllm_importance_sampling_clip_min: float | None = opt(None, "lower bound of the drift ratio; null = none")
    vllm_importance_sampling_clip_max: float | None = opt(3.0, "upper bound of the drift ratio; null = none")
    vllm_lora_sync: str = opt("merged", "with use_peft: merged (base + delta, reload_weights) or adapter (vLLM LoRA)")
    # --- rewards -----------------------------------------------------------------------
    reward_funcs: list = opt([{"func": "length", "kwargs": {"target_chars": 60}}],
                             "built-ins (length, accuracy, math_accuracy), module:function, path/file.py:function, "
                             "a reward model (a sequence-classification model's folder or hub name, or "
                             "{model, tokenizer, batch_size, sharded}), or mappings {func, weight, kwargs, name}")
    reward_timeout_s: float = opt(300.0, "the most seconds one reward function call may take on a rank: then the "
                                          "run stops naming it (a stop signal also cuts it short); 0 = no bound")
    scale_rewards: str = opt("group", "std dividing the centered rewards: group, batch (all ranks) or none")
    multi_objective_aggregation: str = opt("sum_then_normalize", "sum_then_normalize: weighted sum of the rewards, "
                                           "then group advantages; normalize_then_sum (GDPO): each function "
                                           "normalized within its group, weighted sum, then normalized over the "
                                           "batch (scale_rewards does not apply)")
    # --- GRPO --------------------------------------------------------------------------
    num_iterations: int | str = opt(1, "mu: optimizer passes over each rollout (1, as TRL), or auto: decided after "
                                    "each pass, at most reuse_max_iterations (docs: algorithm, reuse)")
    epsilon: float = opt(0.2, "clip range low: ratios below 1 - epsilon are clipped")
    epsilon_high: float | None = opt(None, "clip range high (1 + epsilon_high); null = epsilon. cispo: the ratio "
                                     "cap itself (ScaleRL: 5.0)")
    delta: float | None = opt(None, "two-sided clipping: also cap the ratio at delta (> 1 + epsilon_high); null = off")
    importance_sampling_level: str = opt("token", "token: a ratio per token; sequence (GSPO): exp of the sequence's "
                                         "mean log-ratio, for grpo and sapo")
    sapo_temperature_pos: float = opt(1.0, "sapo: temperature of the soft gate for tokens with advantage > 0")
    sapo_temperature_neg: float = opt(1.05, "sapo: temperature of the soft gate for tokens with advantage <= 0")
    off_policy_mask_threshold: float | None = opt(None, "drop sequences with advantage < 0 whose mean KL to the "
                                                  "sampling policy exceeds this (DeepSeek-V3.2); null = off")
    use_bias_correction_kl: bool = opt(True, "with beta > 0: multiply the k3 term by the importance ratio (the "
                                             "unbiased reverse-KL gradient)")
    entropy_coef: float = opt(0.0, "entropy bonus: subtract coef x the mean token entropy of the optimizer step "
                                    "(use_adaptive_entropy: the starting coefficient)")
    use_adaptive_entropy: bool = opt(False, "adapt entropy_coef each optimizer step (Skywork-OR1): up by "
                                            "entropy_coef_delta while the entropy is at most entropy_target, down "
                                            "otherwise; applied only while it is at most the target")
    entropy_coef_min: float = opt(0.0, "use_adaptive_entropy: the coefficient's lower bound")
    entropy_coef_max: float = opt(1.0, "use_adaptive_entropy: the coefficient's upper bound")
    entropy_coef_delta: float = opt(0.005, "use_adaptive_entropy: the coefficient's change per optimizer step")
    entropy_target: float = opt(0.2, "use_adaptive_entropy: the mean token entropy (nats) below which the bonus "
                                     "applies, over the tokens the policy loss keeps")
    top_entropy_quantile: float = opt(1.0, "keep in the policy loss only the completion tokens whose entropy is in "
                                           "this top fraction of the optimizer step's tokens over all ranks (one "
                                           "extra no-grad forward per micro-batch); 1.0 keeps all")
    beta: float = opt(0.0, "KL coefficient (k3) against the frozen reference model; 0 = no reference")
    sync_ref_model: bool = opt(False, "TR-DPO: every ref_model_sync_steps optimizer steps the reference becomes "
                                      "ref_model_mixup_alpha x policy + (1 - alpha) x reference (needs beta > 0; "
                                      "its weights are then part of every checkpoint)")
    ref_model_mixup_alpha: float = opt(0.6, "sync_ref_model: the policy's share of the mixed reference")
    ref_model_sync_steps: int = opt(512, "sync_ref_model: optimizer steps between mixes")
    loss_type: str = opt("dapo", "grpo, step_token_mean, dr_grpo, dapo, cispo, sapo, luspo or vespo (docs: the "
                                 "loss table)")
    vespo_k_pos: float = opt(2.0, "vespo: the gamma weight's shape k for sequences with advantage >= 0")
    vespo_lambda_pos: float = opt(3.0, "vespo: the gamma weight's rate lambda for sequences with advantage >= 0")
    vespo_k_neg: float = opt(3.0, "vespo: the gamma weight's shape k for sequences with advantage < 0")
    vespo_lambda_neg: float = opt(2.0, "vespo: the gamma weight's rate lambda for sequences with advantage < 0")
    mask_truncated_completions: bool = opt(False, "drop completions that hit max_completion_length from the loss")
    reuse_target_kl: float | None = opt(None, "adaptive reuse at a fixed mu: skip a rollout's remaining passes once a "
                                        "pass's mean approximate KL to the sampling policy exceeds this; null = off")
    reuse_max_clip_fraction: float | None = opt(None, "adaptive reuse: the same on the clipped-token fraction")
    reuse_max_iterations: int = opt(8, "auto: the most passes a rollout gets (within it the KL rule decides)")
    reuse_max_kl: float = opt(3.6e-3, "auto: the drift at which a replay is worth nothing; replay while the next "
                                      "pass's KL < g * this")
    reuse_drift_smoothing: float = opt(1.0, "auto: weight of the pass just done in the drift rate a decision uses "
                                       "(1 = that pass alone; < 1 = a moving average over recent passes)")
    reuse_generation_share: float | None = opt(None, "auto: pin g, generation's share of a step; null = measure it")
    reuse_measure_rollouts: int = opt(3, "auto: rollouts after the first whose timings give the frozen cost ratio")
    # --- batch shape (per rank) --------------------------------------------------------
    per_device_train_batch_size: int = opt(8, "completions per micro-batch")
    gradient_accumulation_steps: int = opt(1, "micro-batches per optimizer step")
    optimizer_steps_per_pass: int = opt(1, "optimizer steps per pass over a rollout (TRL's steps_per_generation "
                                        "counts micro-batches: it is this x gradient_accumulation_steps)")
    # --- optimizer ---------------------------------------------------------------------
    learning_rate: float = opt(1e-6, "AdamW peak learning rate (lr_scheduler_type shapes it over the steps)")
    weight_decay: float = opt(0.0, "AdamW weight decay")
    adam_beta1: float = opt(0.9, "AdamW beta1")
    adam_beta2: float = opt(0.999, "AdamW beta2")
    adam_epsilon: float = opt(1e-8, "AdamW epsilon")
    max_grad_norm: float = opt(1.0, "gradient clipping norm; 0 = no clipping")
    max_steps: int = opt(100, "optimizer steps to train")
    skip_nonfinite_steps: int = opt(0, "steps with a non-finite loss or gradient norm (not applied) the run may "
                                    "skip before it stops; 0 = stop at the first")
    # learning-rate schedule (transformers' formulas), stepped once per optimizer step, saved with checkpoints
    lr_scheduler_type: str = opt("constant", "constant, constant_with_warmup, linear (to 0) or cosine (to min_lr_ratio "
                                 "x learning_rate)")
    warmup_steps: int = opt(0, "linear warmup from 0 over this many optimizer steps (or warmup_ratio)")
    warmup_ratio: float = opt(0.0, "linear warmup over this share of max_steps, rounded up (or warmup_steps)")
    min_lr_ratio: float = opt(0.0, "cosine only: the final learning rate as a share of learning_rate")
    zero_std_filter: bool = opt(False, "leave groups whose rewards are all equal (advantage 0) out of the update")
    # --- run ---------------------------------------------------------------------------
    seed: int = opt(42, "seeds sampling, data order and initialization")
    full_determinism: bool = opt(False, "deterministic kernels (transformers' enable_full_determinism): a GPU run "
                                        "repeats bit for bit, a resume too, at some speed (CPU runs do already)")
    output_dir: str = opt("output", "metrics.jsonl, checkpoints/ and final/ go here")
    deepspeed_config: str = opt("ds_configs/zero3.json", "a DeepSpeed JSON (the recipe fills batch and optimizer)")
    logging_steps: int = opt(1, "write metrics every N optimizer steps")
    save_steps: int = opt(100, "checkpoint every N optimizer steps (and at the end); 0 = never")
    save_total_limit: int = opt(2, "keep the newest N complete checkpoints; 0 = keep all")
    resume_from_checkpoint: str | None = opt(None, "auto = the newest complete checkpoint of this run in output_dir, or a step-N folder")
    overwrite_output_dir: bool = opt(False, "remove a previous run's outputs from output_dir (nothing else) "
                                      "and start afresh; excludes resume_from_checkpoint")
    disable_tqdm: bool = opt(False, "no progress bar")
    # must exceed the longest legitimate wait between ranks (rank 0 writing the final model, a slow save)
    collective_timeout_s: float = opt(600.0, "a collective waiting longer ends the run, naming the rank that stopped")
    # --- evaluation during training (costs no training state: the run is the same with it on or off) -------
    eval_dataset_name: str | None = opt(None, "eval prompts: a local file or a hub name (same prompt_column)")
    eval_dataset_split: str | None = opt(None, "its split (slices work); null = test, or for a file the whole file")
    eval_dataset_config: str | None = opt(None, "its config name (e.g. main); null = dataset_config's")
    eval_holdout_size: int = opt(0, "or: hold this many train prompts out of training and evaluate on them")
    eval_steps: int = opt(0, "evaluate every N optimizer steps; 0 = never")
    eval_on_start: bool = opt(False, "also evaluate before the first step (logged as step 0)")
    eval_num_generations: int = opt(1, "sampled completions per eval prompt, beside the greedy one")
    per_device_eval_batch_size: int = opt(16, "eval prompts per generation call on each rank")
    # --- samples and trackers ------------------------------------------------------------
    log_completions_steps: int = opt(0, "every N steps, rank 0's first groups to completions.jsonl; 0 = never")
    num_prompts_to_log: int = opt(2, "prompts per sample, each with all its num_generations completions")
    report_to: list = opt(["none"], "trackers: tensorboard, wandb (secrets from the environment), or none")
    wandb_project: str = opt("grpo-recipe", "the wandb project")
    run_name: str | None = opt(None, "the tracker's run name; null = the tracker's own")

    # --- derived -----------------------------------------------------------------------
    @property
    def eps_high(self) -> float:
        return self.epsilon if self.epsilon_high is None else self.epsilon_high

    @property
    def completions_per_rollout(self) -> int:
        """Completions one rank generates per rollout."""
        return (self.per_device_train_batch_size * self.gradient_accumulation_steps
                * self.optimizer_steps_per_pass)

    @property
    def prompts_per_rollout(self) -> int:
        """Prompts one rank generates for per rollout (each gets num_generations completions)."""
        return self.completions_per_rollout // self.num_generations

    @property
    def uses_tools(self) -> bool:
        """Whether rollouts are multi-turn: tools or environments the model may call."""
        return bool(self.tools) or self.environment_factory is not None

    @property
    def auto_reuse(self) -> bool:
        return self.num_iterations == "auto"

    @property
    def sampler_is_apart(self) -> bool:
        """Whether the samples come from another copy of the policy than the trainer's (vLLM's kernels, or a
        generation rank's copy, maybe one sync behind), whose own log-probs come with them."""
        return self.generation_backend == "vllm" or self.generation_ranks > 0

    @property
    def corrects_sampler(self) -> bool:
        """Whether the loss weighs the sampler's drift from the trainer (colocated hf samples with the trainer's
        own weights)."""
        return self.sampler_is_apart and self.vllm_importance_sampling_correction

    @property
    def max_passes(self) -> int:
        """The most passes a rollout may get: mu, or with num_iterations: auto its cap."""
        return self.reuse_max_iterations if self.auto_reuse else self.num_iterations

    @property
    def needs_old_logps(self) -> bool:
        """Old log-probs differ from logp.detach() only when a rollout feeds several optimizer steps."""
        return self.max_passes > 1 or self.optimizer_steps_per_pass > 1

    def to_dict(self) -> dict[str, Any]:
        """The fields as JSON-able data (a reward function given as a Python object appears as module:name)."""
        out = dataclasses.asdict(self)
        out["reward_funcs"] = [_named(f) for f in out["reward_funcs"]]
        out["tools"] = [_named(f) for f in out["tools"]]
        env = out["environment_factory"]
        out["environment_factory"] = {k: _named(v) for k, v in env.items()} if isinstance(env, dict) else _named(env)
        return out


def _named(spec):
    if callable(spec):
        return f"{spec.__module__}:{spec.__qualname__}"
    if isinstance(spec, dict) and callable(spec.get("func")):
        return {**spec, "func": _named(spec["func"])}
    return spec


def field_types() -> dict[str, Any]:
    """Each field's annotated type (the annotations are strings under `from __future__ import annotations`)."""
    return typing.get_type_hints(Config)


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
    need(isinstance(cfg.num_iterations, int) or cfg.auto_reuse,
         f"num_iterations: must be an integer mu >= 1 or auto, got {cfg.num_iterations!r}")
    need(cfg.auto_reuse or cfg.num_iterations >= 1, f"num_iterations: mu must be >= 1, got {cfg.num_iterations}")
    for name in ("per_device_train_batch_size", "gradient_accumulation_steps", "optimizer_steps_per_pass",
                 "max_steps", "max_completion_length", "max_prompt_length", "logging_steps", "eval_num_generations",
                 "per_device_eval_batch_size", "num_prompts_to_log"):
        need(getattr(cfg, name) >= 1, f"{name}: must be >= 1, got {getattr(cfg, name)}")
    for name in ("save_steps", "save_total_limit", "warmup_steps", "eval_steps", "eval_holdout_size",
                 "log_completions_steps"):
        need(getattr(cfg, name) >= 0, f"{name}: must be >= 0, got {getattr(cfg, name)}")
    need(cfg.completions_per_rollout % cfg.num_generations == 0,
         f"num_generations: per_device_train_batch_size x gradient_accumulation_steps x optimizer_steps_per_pass "
         f"= {cfg.completions_per_rollout} completions per rank must be divisible by num_generations = {cfg.num_generations} "
         f"(each group's completions stay on one rank; TRL spreads a group over ranks): raise "
         f"per_device_train_batch_size or gradient_accumulation_steps")
    need(0.0 < cfg.epsilon < 1.0, f"epsilon: must be in (0, 1), got {cfg.epsilon}")
    need(cfg.eps_high > 0.0, f"epsilon_high: must be > 0, got {cfg.epsilon_high}")
    need(cfg.reuse_target_kl is None or cfg.reuse_target_kl > 0,
         f"reuse_target_kl: must be > 0 or null, got {cfg.reuse_target_kl}")
    need(cfg.reuse_max_clip_fraction is None or 0 < cfg.reuse_max_clip_fraction < 1,
         f"reuse_max_clip_fraction: must be in (0, 1) or null, got {cfg.reuse_max_clip_fraction}")
    need(not (cfg.auto_reuse and cfg.reuse_target_kl is not None),
         "reuse_target_kl: num_iterations: auto sets the KL target from the generation share (reuse_max_kl); "
         "give a fixed num_iterations to set it by hand")
    need(cfg.reuse_max_iterations >= 1, f"reuse_max_iterations: must be >= 1, got {cfg.reuse_max_iterations}")
    need(cfg.reuse_max_kl > 0, f"reuse_max_kl: must be > 0, got {cfg.reuse_max_kl}")
    need(0 < cfg.reuse_drift_smoothing <= 1,
         f"reuse_drift_smoothing: must be in (0, 1], got {cfg.reuse_drift_smoothing}")
    need(cfg.reuse_generation_share is None or 0 < cfg.reuse_generation_share < 1,
         f"reuse_generation_share: must be in (0, 1) or null, got {cfg.reuse_generation_share}")
    need(cfg.reuse_measure_rollouts >= 1, f"reuse_measure_rollouts: must be >= 1, got {cfg.reuse_measure_rollouts}")
    need(cfg.beta >= 0.0, f"beta: must be >= 0, got {cfg.beta}")
    if cfg.sync_ref_model:
        need(cfg.beta > 0.0, "sync_ref_model: beta is 0, so there is no reference model to sync; set beta > 0 or "
                             "sync_ref_model: false")
        need(not cfg.use_peft, "sync_ref_model: with use_peft the reference is the base model under the disabled "
                               "adapter (no second copy of the weights to mix into); use full fine-tuning or "
                               "sync_ref_model: false")
        need(0.0 <= cfg.ref_model_mixup_alpha <= 1.0,
             f"ref_model_mixup_alpha: must be in [0, 1], got {cfg.ref_model_mixup_alpha}")
        need(cfg.ref_model_sync_steps >= 1, f"ref_model_sync_steps: must be >= 1, got {cfg.ref_model_sync_steps}")
    need(cfg.loss_type != "bnpo", "loss_type: bnpo: TRL's bnpo divides each micro-batch by its own token count, so "
         "its update depends on how the rollout is split; use step_token_mean (the step's tokens on all ranks) or dapo")
    need(cfg.loss_type in LOSS_TYPES, f"loss_type: must be one of {', '.join(LOSS_TYPES)}, got {cfg.loss_type!r}")
    validate_loss_options(cfg)
    need(cfg.multi_objective_aggregation in ("sum_then_normalize", "normalize_then_sum"),
         f"multi_objective_aggregation: must be sum_then_normalize or normalize_then_sum, got "
         f"{cfg.multi_objective_aggregation!r}")
    need(cfg.scale_rewards in SCALE_REWARDS,
         f"scale_rewards: must be one of {', '.join(SCALE_REWARDS)}, got {cfg.scale_rewards!r}")
    need(cfg.temperature > 0.0, f"temperature: must be > 0, got {cfg.temperature}")
    need(0.0 < cfg.top_p <= 1.0, f"top_p: must be in (0, 1], got {cfg.top_p}")
    need(cfg.top_k >= 0, f"top_k: must be >= 0, got {cfg.top_k}")
    need(cfg.min_p is None or 0.0 <= cfg.min_p < 1.0, f"min_p: must be in [0, 1) or null, got {cfg.min_p}")
    need(cfg.repetition_penalty > 0.0, f"repetition_penalty: must be > 0, got {cfg.repetition_penalty}")
    need(all(isinstance(s, str) and s for s in cfg.stop),
         f"stop: must be a list of non-empty strings, got {cfg.stop!r}")
    check_sampling_is_scored(cfg)
    # numpy seeds each rank with seed + rank and takes unsigned 32-bit seeds only
    need(0 <= cfg.seed <= MAX_SEED, f"seed: must be in [0, {MAX_SEED}], got {cfg.seed}")
    need(cfg.skip_nonfinite_steps >= 0, f"skip_nonfinite_steps: must be >= 0, got {cfg.skip_nonfinite_steps}")
    need(cfg.learning_rate > 0.0, f"learning_rate: must be > 0, got {cfg.learning_rate}")
    need(cfg.collective_timeout_s > 0, f"collective_timeout_s: must be > 0, got {cfg.collective_timeout_s}")
    need(cfg.reward_timeout_s >= 0, f"reward_timeout_s: must be >= 0 (0 = no bound), got {cfg.reward_timeout_s}")
    validate_schedule_eval_trackers(cfg)
    need(cfg.max_grad_norm >= 0.0, f"max_grad_norm: must be >= 0, got {cfg.max_grad_norm}")
    need(cfg.generation_backend in ("hf", "vllm"),
         f"generation_backend: must be hf or vllm, got {cfg.generation_backend!r}")
    need(cfg.vllm_lora_sync in LORA_SYNC_MODES,
         f"vllm_lora_sync: must be one of {', '.join(LORA_SYNC_MODES)}, got {cfg.vllm_lora_sync!r}")
    need(cfg.hf_generation_gather in ("full", "per_layer"),
         f"hf_generation_gather: must be full or per_layer, got {cfg.hf_generation_gather!r}")
    need(cfg.hf_generation_gather == "full" or cfg.generation_backend == "hf",
         f"hf_generation_gather: per_layer applies to generation_backend: hf; {cfg.generation_backend} "
         f"holds its own copy of the weights")
    need(str(cfg.bf16).lower() in ("auto", "true", "false"), f"bf16: must be auto, true or false, got {cfg.bf16!r}")
    need(str(cfg.chat_template).lower() in ("auto", "true", "false"),
         f"chat_template: must be auto, true or false, got {cfg.chat_template!r}")
    need(world_size >= 1, f"WORLD_SIZE: must be >= 1, got {world_size}")
    need(bool(cfg.output_dir), "output_dir: must not be empty")
    need(not (cfg.overwrite_output_dir and cfg.resume_from_checkpoint),
         "overwrite_output_dir: cannot be combined with resume_from_checkpoint (one removes what the other "
         "continues); pass one of them")
    need(bool(cfg.reward_funcs) or cfg.environment_factory is not None,
         "reward_funcs: at least one reward function is needed")
    validate_tools(cfg)
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
    validate_generation_ranks(cfg, world_size)


def validate_tools(cfg: Config) -> None:
    named = lambda x: callable(x) or isinstance(x, str) and ":" in x  # noqa: E731 (Python objects from GRPORun)
    need(all(named(t) for t in cfg.tools),
         f"tools: must be a list of module:function or path/file.py:function, got {cfg.tools!r}")
    need(cfg.max_tool_calling_iterations is None or cfg.max_tool_calling_iterations >= 1,
         f"max_tool_calling_iterations: must be >= 1 or null, got {cfg.max_tool_calling_iterations}")
    need(cfg.tool_timeout_s >= 0, f"tool_timeout_s: must be >= 0 (0 = no bound), got {cfg.tool_timeout_s}")
    env = cfg.environment_factory
    need(env is None or named(env) or isinstance(env, dict) and bool(env) and all(named(v) for v in env.values()),
         "environment_factory: must be module:Class, "
         f"path/file.py:Class or a mapping of names to them, got {env!r}")
    if not cfg.uses_tools:
        return
    need(str(cfg.chat_template).lower() != "false", "tools: need the chat template (it writes the tools into the "
         "prompt and the results into the completion); chat_template is false")
    need(cfg.environment_factory is None or cfg.generation_ranks == 0, "environment_factory: environments live "
         f"where the trainers score their rewards; generation_ranks is {cfg.generation_ranks} (set it to 0, or "
         "give the model plain tools)")


def validate_generation_ranks(cfg: Config, world_size: int) -> None:
    n = cfg.generation_ranks
    need(n >= 0, f"generation_ranks: must be >= 0, got {n}")
    need(cfg.max_staleness in (0, 1), f"max_staleness: must be 0 or 1, got {cfg.max_staleness}")
    need(n > 0 or cfg.max_staleness == 0, "max_staleness: 1 needs generation_ranks >= 1 (a rollout can only be "
         "generated while another trains on ranks that do not train)")
    if n == 0:
        return
    need(n < world_size, f"generation_ranks: {n} leaves no training rank in a launch of {world_size} rank(s); "
         f"launch at least {n + 1} ranks (e.g. NPROC={n + 2} launch/local.sh ...)")
    if cfg.generation_backend == "vllm":  # one engine per generation rank, fed merged weights by the trainers
        need(cfg.vllm_tensor_parallel_size == 1, "vllm_tensor_parallel_size: each generation rank runs its own "
             f"engine (generation_ranks: {n}); it must be 1, got {cfg.vllm_tensor_parallel_size}")
        need(not cfg.use_peft or cfg.vllm_lora_sync == "merged", "vllm_lora_sync: adapter is for a colocated "
             "engine; generation ranks get the merged weights (set vllm_lora_sync: merged)")
        need(not cfg.vllm_enable_sleep_mode, "vllm_enable_sleep_mode: frees a colocated engine's memory while its "
             "rank trains; a generation rank does not train (set it false)")
    need(cfg.hf_generation_gather == "full", "hf_generation_gather: per_layer is for colocated generation; "
         "a generation rank holds the whole policy")


def check_sampling_is_scored(cfg: Config) -> None:
    """Refuse sampling options under which the trainer's log-probs are not those of the distribution sampled.

    The trainer scores softmax(logits / temperature) (the old log-probs and the ratios too). Truncation (top-k,
    top-p, min-p) never samples the tokens it cuts, so no reweighting of the samples can recover the full
    distribution's gradient; a repetition penalty reshapes the logits by context. Both backends apply them
    (vLLM's processed log-probs even report them), but the ratios and the policy gradient would be biased.
    """
    why = ("the sampler would draw from a different distribution than the softmax(logits / temperature) the "
           "trainer scores, biasing the importance ratios and the policy gradient")
    for name, value, neutral in (("top_p", cfg.top_p, 1.0), ("top_k", cfg.top_k, 0),
                                 ("min_p", cfg.min_p or 0.0, 0.0), ("repetition_penalty", cfg.repetition_penalty, 1.0)):
        if value != neutral:
            raise BiasedSamplingError(f"{name}: {value} is refused: {why}; use {name}: {neutral} "
                                      "(temperature is scored exactly)")


def validate_schedule_eval_trackers(cfg: Config) -> None:
    need(cfg.lr_scheduler_type in LR_SCHEDULES,
         f"lr_scheduler_type: must be one of {', '.join(LR_SCHEDULES)}, got {cfg.lr_scheduler_type!r}")
    need(0.0 <= cfg.warmup_ratio < 1.0, f"warmup_ratio: must be in [0, 1), got {cfg.warmup_ratio}")
    need(cfg.warmup_steps == 0 or cfg.warmup_ratio == 0.0,
         f"warmup_ratio: give warmup_steps ({cfg.warmup_steps}) or warmup_ratio ({cfg.warmup_ratio}), not both")
    need(cfg.lr_scheduler_type != "constant" or cfg.warmup_steps == cfg.warmup_ratio == 0,  # TRL's meaning
         "lr_scheduler_type: constant has no warmup (transformers ignores one); use constant_with_warmup")
    need(0.0 <= cfg.min_lr_ratio <= 1.0, f"min_lr_ratio: must be in [0, 1], got {cfg.min_lr_ratio}")
    need(cfg.min_lr_ratio == 0.0 or cfg.lr_scheduler_type == "cosine",
         f"min_lr_ratio: applies to lr_scheduler_type cosine only, got {cfg.lr_scheduler_type!r}")
    need(not (cfg.eval_dataset_name and cfg.eval_holdout_size),
         "eval_holdout_size: give eval_dataset_name or eval_holdout_size, not both")
    need(not (cfg.eval_steps or cfg.eval_on_start) or bool(cfg.eval_dataset_name or cfg.eval_holdout_size),
         "eval_steps: evaluation needs eval prompts: set eval_dataset_name or eval_holdout_size")
    bad = [t for t in cfg.report_to if t not in TRACKERS]
    need(not bad, f"report_to: unknown tracker(s) {bad}; choose from {', '.join(TRACKERS)}")
    need("none" not in cfg.report_to or len(cfg.report_to) == 1, f"report_to: none goes alone, got {cfg.report_to}")


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
    mode = cfg.vllm_importance_sampling_mode
    need(mode in SAMPLER_IS_MODES, f"vllm_importance_sampling_mode: must be one of {', '.join(SAMPLER_IS_MODES)}, "
                                   f"got {mode!r}")
    lo, hi = cfg.vllm_importance_sampling_clip_min, cfg.vllm_importance_sampling_clip_max
    need(lo is None or lo >= 0.0, f"vllm_importance_sampling_clip_min: must be >= 0, got {lo}")
    need(hi is None or hi >= 1.0, f"vllm_importance_sampling_clip_max: must be >= 1 (a ratio of 1 is no drift), "
                                  f"got {hi}")
    need(lo is None or lo <= 1.0, f"vllm_importance_sampling_clip_min: must be <= 1 (a ratio of 1 is no drift), "
                                  f"got {lo}")


def validate_loss_options(cfg: Config) -> None:
    """The policy-loss options of TRL's GRPOConfig, each on its own and in combination."""
    level = cfg.importance_sampling_level
    need(level in IS_LEVELS, f"importance_sampling_level: must be token or sequence, got {level!r}")
    need(level == "token" or cfg.loss_type not in TOKEN_SUM_LOSSES,
         f"importance_sampling_level: sequence with loss_type {cfg.loss_type}, which sums token contributions, "
         f"weights each sequence by its length instead of the per-sequence objective: use loss_type grpo, sapo or luspo")
    need(cfg.delta is None or cfg.delta > 1.0 + cfg.eps_high,
         f"delta: must be > 1 + epsilon_high = {1.0 + cfg.eps_high} (it caps ratios above the clip range), "
         f"got {cfg.delta}")
    need(cfg.delta is None or cfg.loss_type not in ("cispo", "sapo", "vespo"),
         f"delta: caps the clipped surrogate's ratio; loss_type {cfg.loss_type} has none")
    if cfg.loss_type == "cispo":
        need(cfg.epsilon_high is not None and cfg.epsilon_high > 1.0,
             f"epsilon_high: cispo caps the ratio itself at epsilon_high (not 1 + epsilon_high): set it above 1 "
             f"(ScaleRL: 5.0), got {cfg.epsilon_high}")
    for name in ("sapo_temperature_pos", "sapo_temperature_neg"):
        need(getattr(cfg, name) > 0.0, f"{name}: must be > 0, got {getattr(cfg, name)}")
    if cfg.loss_type == "vespo":
        need(level == "token", "importance_sampling_level: vespo computes its sequence weight itself from the token "
                               "ratios: use token")
        need(not cfg.corrects_sampler or not cfg.vllm_importance_sampling_mode.startswith("sequence"),
             f"vllm_importance_sampling_mode: vespo takes the sampler's token weights into its sequence weight: use "
             f"token_truncate or token_mask, got {cfg.vllm_importance_sampling_mode}")
        for name in ("vespo_k_pos", "vespo_k_neg", "vespo_lambda_pos", "vespo_lambda_neg"):
            need(getattr(cfg, name) >= 0.0, f"{name}: must be >= 0, got {getattr(cfg, name)}")
    thr = cfg.off_policy_mask_threshold
    need(thr is None or thr > 0.0, f"off_policy_mask_threshold: must be > 0 (a mean KL), got {thr}")
    need(cfg.entropy_coef >= 0.0, f"entropy_coef: must be >= 0 (a bonus), got {cfg.entropy_coef}")
    need(0.0 <= cfg.top_entropy_quantile <= 1.0,
         f"top_entropy_quantile: must be in [0, 1] (the fraction of tokens kept), got {cfg.top_entropy_quantile}")
    if cfg.use_adaptive_entropy:
        need(0.0 <= cfg.entropy_coef_min <= cfg.entropy_coef_max,
             f"entropy_coef_min, entropy_coef_max: need 0 <= min <= max, got {cfg.entropy_coef_min} and "
             f"{cfg.entropy_coef_max}")
        need(cfg.entropy_coef_delta >= 0.0, f"entropy_coef_delta: must be >= 0, got {cfg.entropy_coef_delta}")
