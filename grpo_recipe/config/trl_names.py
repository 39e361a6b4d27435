"""A TRL 1.16 `GRPOConfig` as it is: every field of TRL's is either taken under its TRL name (mapped to the recipe's
field, with one note saying so), or refused in one line naming the recipe's equivalent or why there is none.

`translate(values)` rewrites the TRL names in a config's values into the recipe's and returns the notes; a value
this recipe cannot honour raises ConfigError. `GRPO_FIELDS` covers every field TRL's `GRPOConfig` adds
(tests/test_config_trl.py checks that against the installed TRL); transformers' `TrainingArguments` fields that a
TRL config carries are taken when the recipe has the same field, ignored (with a note) at TRL's default when they
change nothing here, and refused otherwise.
"""
from __future__ import annotations

from typing import Any, Callable

from grpo_recipe.config.schema import ConfigError


# How one TRL field maps: rule(value, values) -> ({recipe field: value} to set, a note or None); ConfigError (its
# message without the field's name, which the caller puts first) for a value refused.
Rule = Callable[[Any, dict], tuple[dict, str | None]]


def described(text: str):
    """Give a rule the line the configuration reference shows for it."""
    def mark(rule):
        rule.describe = text
        return rule
    return mark


def same_meaning(why: str) -> Rule:
    """A field whose every value this recipe honours by what it always does (a note says so)."""
    return described(f"taken: {why}")(lambda value, values: ({}, why))


def only(default: Any, why: str, equivalent: str | None = None) -> Rule:
    """Taken at `default` (a no-op here); any other value is refused: `why` there is no equal (and `equivalent`)."""
    @described(f"only `{default}`: {why}" + (f" (use {equivalent})" if equivalent else ""))
    def rule(value, values):
        if value == default or (default is None and value in (None, {}, [])):
            return {}, None
        raise ConfigError(f"{value!r} is not available here: {why}" + (f"; use {equivalent}" if equivalent else ""))
    return rule


def rename(field: str, convert: Callable[[Any], Any] = lambda v: v) -> Rule:
    """Taken as the recipe's `field`; null (TRL's "not set") leaves the recipe's default."""
    return described(f"becomes `{field}`")(
        lambda value, values: ({}, None) if value is None else ({field: convert(value)}, f"-> {field}"))


@described("only adamw_torch(_fused): the optimizer is the DeepSpeed config's AdamW")
def _optim(value, values):
    if value in ("adamw_torch", "adamw_torch_fused"):
        return {}, None
    raise ConfigError(f"{value!r}: the optimizer is the DeepSpeed config's AdamW")


@described("true becomes `generation_backend: vllm` (with `vllm_mode: colocate`; server: use `generation_ranks`)")
def _vllm(value, values):
    mode = values.get("vllm_mode", "colocate")
    if not value:
        return {}, None
    if mode == "server":
        raise ConfigError("true with vllm_mode: server: no vLLM server is used here; give vLLM ranks of the job "
                          "itself: generation_backend: vllm with generation_ranks: N (docs/scaling.md)")
    return {"generation_backend": "vllm"}, "-> generation_backend: vllm (colocated, vllm_mode colocate)"


@described("colocate (with `use_vllm`); server is refused: use `generation_ranks`")
def _vllm_mode(value, values):
    if value == "server" and values.get("use_vllm"):
        return {}, None  # use_vllm says why
    if value not in ("colocate", "server"):
        raise ConfigError(f"{value!r}: TRL's modes are colocate and server")
    return {}, None


@described("becomes `optimizer_steps_per_pass` = steps_per_generation / gradient_accumulation_steps")
def _steps_per_generation(value, values):
    if value is None:
        return {}, None  # TRL's default: gradient_accumulation_steps micro-batches, one optimizer step per pass
    ga = values.get("gradient_accumulation_steps", 1)
    if isinstance(value, int) and isinstance(ga, int) and ga > 0 and value % ga == 0:
        return {"optimizer_steps_per_pass": value // ga}, f"-> optimizer_steps_per_pass = {value} / {ga} (TRL counts " \
                                                          f"micro-batches per generation, the recipe optimizer steps)"
    raise ConfigError(f"{value!r} micro-batches is not a whole number of optimizer steps of "
                      f"gradient_accumulation_steps = {ga}: use optimizer_steps_per_pass")


@described("becomes each `reward_funcs` entry's `weight`")
def _reward_weights(value, values):
    if value is None:
        return {}, None
    funcs = values.get("reward_funcs")
    funcs = funcs if isinstance(funcs, list) else [funcs] if funcs is not None else []
    if not isinstance(value, list) or len(value) != len(funcs):
        raise ConfigError(f"{len(value) if isinstance(value, list) else value!r} weights for "
                          f"{len(funcs)} reward_funcs: give one per function")
    merged = [{**(f if isinstance(f, dict) else {"func": f}), "weight": float(w)} for f, w in zip(funcs, value)]
    return {"reward_funcs": merged}, "-> each reward_funcs entry's weight"


@described("stop, temperature, top_p, top_k, min_p, repetition_penalty become those fields; others are refused")
def _generation_kwargs(value, values):
    if not value:
        return {}, None
    names = {"stop": "stop", "stop_strings": "stop", "temperature": "temperature", "top_p": "top_p", "top_k": "top_k",
             "min_p": "min_p", "repetition_penalty": "repetition_penalty"}
    unknown = sorted(set(value) - set(names))
    if unknown:
        raise ConfigError(f"{', '.join(unknown)} cannot be set here (sampling is limited to what "
                          f"the trainer can score: stop, temperature, top_p, top_k, min_p, repetition_penalty)")
    return {names[k]: v for k, v in value.items()}, "-> the sampling fields themselves"


@described("steps; no becomes `save_steps: 0`")
def _save_strategy(value, values):
    if value == "steps":
        return {}, None
    if value == "no":
        return {"save_steps": 0}, "-> save_steps: 0"
    raise ConfigError(f"{value!r}: checkpoints are taken every save_steps optimizer steps")


@described("a file becomes `deepspeed_config`")
def _deepspeed(value, values):
    if value is None:
        return {}, None
    if not isinstance(value, str):
        raise ConfigError("give the DeepSpeed config as a file: deepspeed_config: PATH.json")
    return {"deepspeed_config": value}, "-> deepspeed_config"


@described("a reward model appended to `reward_funcs` (TRL's CLI script's field)")
def _reward_model(value, values):
    if not value:
        return {}, None
    funcs = values.get("reward_funcs")
    funcs = funcs if isinstance(funcs, list) else [funcs] if funcs is not None else []
    return {"reward_funcs": [*funcs, {"model": value}]}, "-> a reward_funcs entry {model: ...}"


@described("true becomes `log_completions_steps` = `logging_steps`")
def _log_completions(value, values):
    if not value:
        return {}, None
    return {"log_completions_steps": values.get("logging_steps", 1)}, \
        "-> log_completions_steps = logging_steps (completions.jsonl)"


DROPOUT = "the recipe turns every dropout off (old log-probs equal to the trainer's need a deterministic forward)"
NO_SERVER = "no vLLM server is used here (generation_ranks: N gives vLLM ranks of the job itself)"
GRPO_FIELDS: dict[str, Rule] = {
    "model_init_kwargs": only(None, "the model is loaded in fp32 and trained in the precision `bf16` asks for"),
    "trust_remote_code": only(False, "models are loaded without remote code"),
    "router_aux_loss_coef": only(None, "a MoE router's auxiliary loss is not added"),
    "disable_dropout": same_meaning(DROPOUT),
    "cast_lm_head_to_fp32": same_meaning("the output head's log-softmax is computed in fp32, chunk by chunk"),
    "num_generations_eval": rename("eval_num_generations"),
    "ds3_gather_for_generation": rename("hf_generation_gather", lambda v: "full" if v else "per_layer"),
    "shuffle_dataset": only(True, "prompts are always drawn in a seeded, shuffled order"),
    "pad_to_multiple_of": same_meaning("micro-batches are grouped by length, without all-padding columns"),
    "generation_batch_size": only(None, "a rank's rollout holds per_device_train_batch_size x "
                                        "gradient_accumulation_steps x optimizer_steps_per_pass completions",
                                  "those fields"),
    "steps_per_generation": _steps_per_generation,
    "generation_kwargs": _generation_kwargs,
    "cache_implementation": only(None, "transformers' generate runs with the model's own cache"),
    "use_vllm": _vllm,
    "vllm_mode": _vllm_mode,
    "vllm_model_impl": only("vllm", "vLLM runs its own model implementation"),
    "vllm_structured_outputs_regex": only(None, "structured outputs are not constrained here"),
    "vllm_server_base_url": only(None, NO_SERVER), "vllm_server_host": only("0.0.0.0", NO_SERVER),
    "vllm_server_port": only(8000, NO_SERVER), "vllm_server_timeout": only(240.0, NO_SERVER),
    "vllm_group_port": only(51216, NO_SERVER),
    "vllm_max_model_length": rename("vllm_max_model_len"),
    "vllm_importance_sampling_cap": rename("vllm_importance_sampling_clip_max"),
    "reward_weights": _reward_weights,
    "log_completions": _log_completions,
    "log_multimodal": same_meaning("there are no images to log"),
    "num_completions_to_print": only(None, "completions are written to completions.jsonl, not printed",
                                     "num_prompts_to_log"),
    "log_unique_prompts": only(False, "completions.jsonl holds each logged prompt with its group"),
    "log_completions_hub_repo": only(None, "nothing is uploaded to the hub"),
    "use_transformers_continuous_batching": only(False, "transformers' generate runs as is"),
    "transformers_continuous_batching_config": only(None, "transformers' generate runs as is"),
    "use_transformers_paged": only(False, "transformers' generate runs as is"),
}
# TRL GRPOConfig fields the recipe has under the same name and meaning.
SAME = ("num_generations", "max_completion_length", "temperature", "top_p", "top_k", "min_p", "repetition_penalty",
        "chat_template_kwargs", "vllm_enable_sleep_mode", "vllm_gpu_memory_utilization", "vllm_tensor_parallel_size",
        "beta", "num_iterations", "epsilon", "delta", "epsilon_high", "sapo_temperature_neg", "sapo_temperature_pos",
        "importance_sampling_level", "scale_rewards", "loss_type", "mask_truncated_completions", "entropy_coef",
        "vllm_importance_sampling_correction", "vllm_importance_sampling_mode", "vllm_importance_sampling_clip_max",
        "vllm_importance_sampling_clip_min", "off_policy_mask_threshold", "use_bias_correction_kl", "vespo_k_pos",
        "vespo_lambda_pos", "vespo_k_neg", "vespo_lambda_neg", "multi_objective_aggregation", "top_entropy_quantile",
        "use_adaptive_entropy", "entropy_coef_min", "entropy_coef_max", "entropy_coef_delta", "entropy_target",
        "sync_ref_model", "ref_model_mixup_alpha", "ref_model_sync_steps", "max_tool_calling_iterations")
# TrainingArguments fields that mean something else here, or a value the recipe cannot honour.
TRAINING_FIELDS: dict[str, Rule] = {
    "num_train_epochs": only(3.0, "runs are counted in optimizer steps", "max_steps"),
    "save_strategy": _save_strategy,
    "logging_strategy": only("steps", "metrics are logged every logging_steps optimizer steps"),
    "eval_strategy": same_meaning("evaluation runs every eval_steps when eval_steps is set"),
    "deepspeed": _deepspeed,
    "fp16": only(False, "fp16 is not supported: bf16 or fp32", "bf16"),
    "optim": _optim,
    "gradient_checkpointing_kwargs": same_meaning("checkpointing runs non-reentrant"),
    "push_to_hub": only(False, "nothing is uploaded to the hub"),
    "remove_unused_columns": same_meaning("every dataset column but the prompt reaches the reward functions"),
    "reward_model_name_or_path": _reward_model,  # TRL's CLI script argument, often in the same YAML
    "use_liger_kernel": only(False, "the recipe computes log-probs with its own chunked head"),
}


# (TRL field, recipe field) pairs where the TRL field completes the recipe field the config gives too
REWRITES = {("reward_weights", "reward_funcs"), ("reward_model_name_or_path", "reward_funcs")}
# TRL's boolean fields, which a command line may give as a bare flag (--use_vllm)
TRL_FLAGS = ("use_vllm", "disable_dropout", "cast_lm_head_to_fp32", "ds3_gather_for_generation", "shuffle_dataset",
             "trust_remote_code", "sync_ref_model", "use_adaptive_entropy", "log_completions", "log_unique_prompts",
             "use_transformers_continuous_batching", "use_transformers_paged", "push_to_hub", "fp16",
             "use_liger_kernel")


def translate(values: dict, recipe_fields: set[str], training_defaults: Callable[[], dict]) -> tuple[dict, list[str]]:
    """`values` with TRL's names mapped to the recipe's, and the notes; ConfigError for a value refused.
    `training_defaults()`: transformers' TrainingArguments defaults (asked only when a config carries one of its
    fields that neither the recipe nor the tables above know)."""
    out, notes, inert, defaults = dict(values), [], [], None
    for key, value in values.items():
        rule = TRAINING_FIELDS.get(key) or (None if key in recipe_fields else GRPO_FIELDS.get(key))
        if rule is None:
            if key in recipe_fields:
                continue  # the recipe's own field (or TRL's of the same name and meaning)
            defaults = training_defaults() if defaults is None else defaults
            if key not in defaults:
                continue  # nobody's: the loader names it as unknown
            if value == defaults[key] or (value in (None, [], {}) and defaults[key] in (None, [], {})):
                inert.append(key)
                del out[key]
                continue
            raise ConfigError(f"{key}: transformers' TrainingArguments field has no equal here (only its default, "
                              f"{defaults[key]!r}, is taken)")
        try:
            setting, note = rule(value, values)
        except ConfigError as e:
            raise ConfigError(f"{key}: {e}") from None
        if key not in setting:
            out.pop(key, None)
        for field, v in setting.items():
            if field != key and field in values and values[field] != v and (key, field) not in REWRITES:
                raise ConfigError(f"{key}: sets {field} to {v!r}, but the config also sets {field}: "
                                  f"{values[field]!r}; keep one")
            out[field] = v
        if note:
            notes.append(f"{key}: {note}" if note.startswith("->") else f"{key}: taken; {note}")
    if inert:
        notes.append(f"TRL/transformers fields at their defaults, which change nothing here: {', '.join(inert)}")
    return out, notes
