"""Preflight: the config checks that ask the environment, run once by `grpo_recipe.train.main` before any process
group starts, so that a missing file or an unusable backend costs a one-line ConfigError (exit code 2).

`config.py` checks the fields on their own; this step asks the rest of the machine: do the files exist (the
DeepSpeed config parses, a resume folder is there), is the model there (a built-in one is built here, once,
before any rank needs it; a local folder holds a model; a hub name must be cached or on the reachable hub), can
the output folder be written and hold a checkpoint, can vLLM serve the model here, do the reward functions import,
does the DeepSpeed config shard what per-layer generation gathers, can the GPU do bf16.
"""
from __future__ import annotations

import importlib.util
import json
import os
import sys
import tempfile
from pathlib import Path

import torch

from grpo_recipe.config.schema import Config, ConfigError, looks_like_file, need, resolve_path
from grpo_recipe.dist.env import launch_env_problem
from grpo_recipe.dist.group import bf16_capable, own_gpu
from grpo_recipe.generation.vllm import VLLMUnavailable, check_adapter_mode, check_available
from grpo_recipe.model.ds_config import use_bf16
from grpo_recipe.model.source import model_folder, weight_count
from grpo_recipe.rewards.funcs import RewardError, load_reward_funcs
from grpo_recipe.run.checkpoint import free_space, mib, min_checkpoint_bytes, space_note


def preflight(cfg: Config, data_given: bool = False) -> None:
    """Raise a ConfigError naming the field whose file, model, backend or reward function is unusable here."""
    ds = deepspeed_json(cfg.deepspeed_config)
    if cfg.hf_generation_gather == "per_layer":
        stage = ds.get("zero_optimization", {}).get("stage", 0)
        need(stage == 3, f"hf_generation_gather: per_layer needs a ZeRO-3 deepspeed_config; {cfg.deepspeed_config} "
                         f"is stage {stage}, where every rank holds all weights (use full)")
    problem = launch_env_problem(os.environ)
    need(problem is None, f"launch environment: {problem}")
    check_accelerator(torch.cuda.is_available(), os.environ.get("DS_ACCELERATOR"))
    if str(cfg.bf16).lower() == "true" and torch.cuda.is_available():
        # this rank's GPU, asked without a context on it (is_bf16_supported allocates on GPU 0, on every rank)
        check_bf16(True, bf16_capable(), torch.cuda.get_device_name(own_gpu()))
    elif str(cfg.bf16).lower() == "true":
        check_bf16(False, False, "")
    if looks_like_file(cfg.dataset_name) and not data_given:
        need(resolve_path(cfg.dataset_name).is_file(), f"dataset_name: file not found: {cfg.dataset_name}")
    check_output_dir(cfg.output_dir)
    resume = cfg.resume_from_checkpoint  # a path's files are checked against its manifest when the run starts
    need(resume in (None, "auto") or Path(resume).is_dir(),
         f"resume_from_checkpoint: no such folder: {resume} (auto takes the newest complete one in output_dir)")
    if cfg.eval_dataset_name and looks_like_file(cfg.eval_dataset_name):
        need(resolve_path(cfg.eval_dataset_name).is_file(),
             f"eval_dataset_name: file not found: {cfg.eval_dataset_name}")
    need("wandb" not in cfg.report_to or importlib.util.find_spec("wandb") is not None,
         "report_to: wandb needs the wandb package (pip install -e '.[wandb]')")
    folder = model_folder(cfg.model_name_or_path)
    check_disk_space(cfg, folder, ds)
    if cfg.generation_backend == "vllm":
        check_vllm(cfg, folder)
        if torch.cuda.is_available() and not cfg.generation_ranks and folder is not None:  # colocated
            free, total = torch.cuda.mem_get_info(own_gpu())
            params = weight_count(folder)
            world = int(os.environ.get("WORLD_SIZE", "1"))
            offload = "offload_optimizer" in ds.get("zero_optimization", {})
            bf16 = use_bf16(cfg)
            trainable = params // 100 if cfg.use_peft else params  # an adapter: about a percent, at most
            check_vllm_memory(cfg.vllm_gpu_memory_utilization, free, total,
                              training_shard_bytes(params, trainable, world, bf16, offload), gpu)
    try:
        load_reward_funcs(cfg.reward_funcs)  # imports only: nothing runs, so a typo fails before launch
    except RewardError as e:
        raise ConfigError(str(e)) from None


def deepspeed_json(name: str) -> dict:
    """The deepspeed_config file's JSON object (it is read after the process group starts)."""
    path = resolve_path(name)
    need(path.is_file(), f"deepspeed_config: file not found: {name}")
    try:
        ds = json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise ConfigError(f"deepspeed_config: {name} is not valid JSON: line {e.lineno}, column {e.colno}: "
                          f"{e.msg}") from None
    except (OSError, UnicodeDecodeError) as e:
        raise ConfigError(f"deepspeed_config: cannot read {name}: {e}") from None
    need(isinstance(ds, dict), f"deepspeed_config: {name} must hold a JSON object")
    for key in ("optimizer", "zero_optimization"):
        need(isinstance(ds.get(key, {}), dict), f"deepspeed_config: {key} in {name} must be an object")
    # One schedule, the recipe's: DeepSpeed would otherwise run its own beside it (or instead of it).
    need("scheduler" not in ds, f"deepspeed_config: {name} has a \"scheduler\"; remove it: lr_scheduler_type, "
                                "warmup_steps and min_lr_ratio set the schedule")
    return ds


def check_output_dir(output_dir: str) -> None:
    """The output folder (or, before it exists, its nearest existing parent) takes new files. Nothing is left
    behind: the probe is an unnamed temporary file."""
    path = Path(output_dir).expanduser()
    need(not path.exists() or path.is_dir(), f"output_dir: {output_dir} is a file, not a folder")
    probe = path
    while not probe.exists():
        probe = probe.parent
    need(probe.is_dir(), f"output_dir: cannot create {output_dir}: {probe} is a file")
    try:
        with tempfile.TemporaryFile(dir=probe):
            pass
    except OSError as e:
        raise ConfigError(f"output_dir: cannot write in {probe}: {e.strerror}") from None


def final_model_bytes(folder: Path, params: int, cfg: Config) -> int:
    """What the end of a run writes, at most: the weights as trained (fp32; with LoRA the adapter, small, and a
    merged copy when asked), the model folder's other files (tokenizer, config, chat template) twice (the final
    folder's copy and its temporary), safetensors headers and the index, the run's metrics and completion logs,
    and 1% for the filesystem's blocks."""
    weights = 4 * params * (cfg.save_merged if cfg.use_peft else 1)
    others = sum(f.stat().st_size for f in folder.iterdir()
                 if f.is_file() and not f.name.endswith((".safetensors", ".bin", ".pt", ".pth", ".gguf", ".h5")))
    logs = cfg.max_steps * (4 << 10) + (cfg.max_steps * (64 << 10) if cfg.log_completions_steps else 0)
    return weights + 2 * others + (1 << 20) + logs + weights // 100


def check_disk_space(cfg: Config, folder: Path | None, ds: dict) -> None:
    """A disk that cannot hold one checkpoint, or the final model, would fail at the first save or at the very
    end, hours in: refuse it now, and warn when it cannot hold the save_total_limit + 1 that a save needs. Sizes
    from the weights' headers; a model still to be downloaded is checked at its first save."""
    params = weight_count(folder) if folder is not None else 0
    if not params:
        return
    free, _ = free_space(Path(cfg.output_dir).expanduser())
    final = final_model_bytes(folder, params, cfg)
    need(free >= final, f"output_dir: {cfg.output_dir} has {mib(free)} free, too little for the final model "
                        f"and the run's own files (about {mib(final)}): free space or choose another output_dir")
    if cfg.save_steps == 0:
        return
    adam = "adam" in str(ds.get("optimizer", {}).get("type", "")).lower()
    stage = ds.get("zero_optimization", {}).get("stage", 0)
    partitioned = isinstance(stage, int) and stage >= 2
    # with LoRA the adapter is small, the frozen base (fp32) is what ZeRO-2/3 checkpoints hold
    needed = min_checkpoint_bytes(0 if cfg.use_peft else params, 4 * params if cfg.use_peft else 0, adam, partitioned)
    needed += 4 * params if cfg.sync_ref_model else 0  # the mixed reference's weights
    limit = cfg.save_total_limit
    need(free >= needed, f"output_dir: {cfg.output_dir} has {mib(free)} free, too little for one checkpoint "
                         f"({space_note(limit, needed)}): free space or choose another output_dir")
    if limit and free < (limit + 1) * needed and os.environ.get("RANK", "0") == "0":
        print(f"warning: output_dir {cfg.output_dir} has {mib(free)} free, less than the save_total_limit + 1 = "
              f"{limit + 1} checkpoints a save may need ({space_note(limit, needed)})", file=sys.stderr)


def check_accelerator(cuda: bool, ds_accelerator: str | None) -> None:
    """DeepSpeed's CPU accelerator on a rank with a GPU would partition the model on the CPU while the inputs go
    to the GPU (an environment made for CPU runs: a shell, an sbatch script's exported variables)."""
    need(not (cuda and (ds_accelerator or "").lower() == "cpu"),
         "DS_ACCELERATOR=cpu is set, but this rank has a GPU: unset it to train on the GPU, or hide the GPUs "
         "(CUDA_VISIBLE_DEVICES=) to train on the CPU")


def check_bf16(cuda: bool, supported: bool, device_name: str) -> None:
    """bf16: true needs bf16 arithmetic: every CPU has it (emulated where not native), GPUs from Ampere on."""
    need(not cuda or supported, f"bf16: true, but {device_name} has no bf16 support (compute capability < 8.0); "
                                f"use bf16: false (fp32)")


def check_vllm_memory(util: float, free: int, total: int, shard_bytes: int, gpu: int) -> None:
    """A colocated vLLM engine takes `util` of its GPU's memory when it starts, after the ZeRO-3 engine is built
    and loaded: refuse now what would fail then, minutes in. `shard_bytes`: a lower bound of what training keeps
    on the GPU (this rank's shards of the weights, the gradients and the optimizer state)."""
    gib = lambda b: f"{b / 2**30:.1f} GiB"  # noqa: E731
    need(util * total <= free, f"vllm_gpu_memory_utilization: {util:g} of GPU {gpu} is {gib(util * total)}, but only "
                               f"{gib(free)} of its {gib(total)} are free (other processes on it?): lower it")
    need((1 - util) * total >= shard_bytes,
         f"vllm_gpu_memory_utilization: {util:g} leaves {gib((1 - util) * total)} of GPU {gpu} for training, which "
         f"keeps at least {gib(shard_bytes)} there (its ZeRO-3 shards alone): lower it, use more GPUs, or "
         f"offload the optimizer (ds_configs/zero3_offload.json)")


def training_shard_bytes(params: int, trainable: int, world: int, bf16: bool, offload: bool) -> int:
    """This rank's share of the weights (16- or 32-bit), and of the trainable parameters' fp32 master copy,
    gradients and Adam moments unless the optimizer is offloaded."""
    weights = params * (2 if bf16 else 4)
    state = 0 if offload else trainable * ((4 if bf16 else 0) + 4 + 8)
    return (weights + state) // max(world, 1)


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
