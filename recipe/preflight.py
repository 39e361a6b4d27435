"""Preflight: the config checks that ask the environment, run once by `recipe.train.main` before any process
group starts, so that a missing file or an unusable backend costs a one-line ConfigError (exit code 2).

`config.py` checks the fields on their own; this step asks the rest of the machine: do the files exist, is the
built-in model there (it is built here, once, before any rank needs it), can vLLM serve the model here, do the
reward functions import.
"""
from __future__ import annotations

import os
from pathlib import Path

import torch

from recipe.config import Config, ConfigError, looks_like_file, need, resolve_path
from recipe.generation.vllm import VLLMUnavailable, check_adapter_mode, check_available
from recipe.rewards import RewardError, load_reward_funcs
from recipe.tiny import BUILTIN_MODELS, ensure_builtin


def preflight(cfg: Config) -> None:
    """Raise a ConfigError naming the field whose file, model, backend or reward function is unusable here."""
    need(resolve_path(cfg.deepspeed_config).is_file(), f"deepspeed_config: file not found: {cfg.deepspeed_config}")
    if looks_like_file(cfg.dataset_name):
        need(resolve_path(cfg.dataset_name).is_file(), f"dataset_name: file not found: {cfg.dataset_name}")
    folder = model_folder(cfg.model_name_or_path)
    if cfg.generation_backend == "vllm":
        check_vllm(cfg, folder)
    try:
        load_reward_funcs(cfg.reward_funcs)  # imports only: nothing runs, so a typo fails before launch
    except RewardError as e:
        raise ConfigError(str(e)) from None


def model_folder(model: str) -> Path | None:
    """The model's local folder (a built-in one built now), or None for a hub name."""
    if model.startswith("builtin:"):
        need(model in BUILTIN_MODELS, f"model_name_or_path: unknown built-in {model!r} (have {', '.join(BUILTIN_MODELS)})")
        return ensure_builtin(model)
    if model.startswith((".", "/", "~")) or resolve_path(model).exists():
        folder = resolve_path(os.path.expanduser(model))
        need(folder.is_dir(), f"model_name_or_path: folder not found: {model}")
        return folder
    return None


def check_vllm(cfg: Config, folder: Path | None) -> None:
    """Whether vLLM can serve this model here: installed, a head size its CPU kernels support, and with
    `vllm_lora_sync: adapter` its LoRA support on this platform."""
    cuda = torch.cuda.is_available()
    need(not cfg.vllm_enable_sleep_mode or cuda, "vllm_enable_sleep_mode: needs a GPU (vLLM has no sleep mode on CPU)")
    config_json = folder / "config.json" if folder is not None and (folder / "config.json").is_file() else None
    try:
        check_available(config_json, cuda)  # a hub model's head size is checked when vLLM loads it
        if cfg.use_peft and cfg.vllm_lora_sync == "adapter":
            check_adapter_mode(cfg)
    except VLLMUnavailable as e:
        raise ConfigError(str(e)) from None
