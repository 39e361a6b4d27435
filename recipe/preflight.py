"""Preflight: the config checks that ask the environment, run once by `recipe.train.main` before any process
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
import math
import os
import sys
import tempfile
import threading
import urllib.error
import urllib.request
from pathlib import Path

import torch

from recipe.checkpoint import free_space, mib, min_checkpoint_bytes, space_note
from recipe.config import Config, ConfigError, looks_like_file, need, resolve_path
from recipe.generation.vllm import VLLMUnavailable, check_adapter_mode, check_available
from recipe.rewards import RewardError, load_reward_funcs
from recipe.tiny import BUILTIN_MODELS, ensure_builtin

HUB_PROBE_S = 5.0  # how long the hub may take to answer before it counts as unreachable


def preflight(cfg: Config) -> None:
    """Raise a ConfigError naming the field whose file, model, backend or reward function is unusable here."""
    ds = deepspeed_json(cfg.deepspeed_config)
    if cfg.hf_generation_gather == "per_layer":
        stage = ds.get("zero_optimization", {}).get("stage", 0)
        need(stage == 3, f"hf_generation_gather: per_layer needs a ZeRO-3 deepspeed_config; {cfg.deepspeed_config} "
                         f"is stage {stage}, where every rank holds all weights (use full)")
    if str(cfg.bf16).lower() == "true":
        cuda = torch.cuda.is_available()
        check_bf16(cuda, cuda and torch.cuda.is_bf16_supported(), torch.cuda.get_device_name() if cuda else "")
    if looks_like_file(cfg.dataset_name):
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


def check_disk_space(cfg: Config, folder: Path | None, ds: dict) -> None:
    """A disk that cannot hold one checkpoint would fail at the first save, hours in: refuse it now, and warn
    when it cannot hold the save_total_limit + 1 that a save needs. Sizes from the weights' headers; a model
    still to be downloaded is checked at its first save."""
    params = weight_count(folder) if folder is not None and cfg.save_steps > 0 else 0
    if not params:
        return
    adam = "adam" in str(ds.get("optimizer", {}).get("type", "")).lower()
    stage = ds.get("zero_optimization", {}).get("stage", 0)
    partitioned = isinstance(stage, int) and stage >= 2
    # with LoRA the adapter is small, the frozen base (fp32) is what ZeRO-2/3 checkpoints hold
    needed = min_checkpoint_bytes(0 if cfg.use_peft else params, 4 * params if cfg.use_peft else 0, adam, partitioned)
    free, _ = free_space(Path(cfg.output_dir).expanduser())
    limit = cfg.save_total_limit
    need(free >= needed, f"output_dir: {cfg.output_dir} has {mib(free)} free, too little for one checkpoint "
                         f"({space_note(limit, needed)}): free space or choose another output_dir")
    if limit and free < (limit + 1) * needed and os.environ.get("RANK", "0") == "0":
        print(f"warning: output_dir {cfg.output_dir} has {mib(free)} free, less than the save_total_limit + 1 = "
              f"{limit + 1} checkpoints a save may need ({space_note(limit, needed)})", file=sys.stderr)


def weight_count(folder: Path) -> int:
    """Parameters in a model folder's safetensors files (headers only; 0 when it has none)."""
    from safetensors import safe_open

    count = 0
    for path in folder.glob("*.safetensors"):
        with safe_open(str(path), framework="pt") as f:
            for key in f.keys():
                count += math.prod(f.get_slice(key).get_shape())
    return count


def check_bf16(cuda: bool, supported: bool, device_name: str) -> None:
    """bf16: true needs bf16 arithmetic: every CPU has it (emulated where not native), GPUs from Ampere on."""
    need(not cuda or supported, f"bf16: true, but {device_name} has no bf16 support (compute capability < 8.0); "
                                f"use bf16: false (fp32)")


def model_folder(model: str) -> Path | None:
    """The model's local folder (a built-in one built now, a hub name's cached snapshot), or None for a hub name
    that will be downloaded."""
    if model.startswith("builtin:"):
        need(model in BUILTIN_MODELS, f"model_name_or_path: unknown built-in {model!r} (have {', '.join(BUILTIN_MODELS)})")
        return ensure_builtin(model)
    if model.startswith((".", "/", "~")) or resolve_path(model).exists():
        folder = resolve_path(os.path.expanduser(model))
        need(folder.is_dir(), f"model_name_or_path: folder not found: {model}")
        check_model_folder(folder, model)
        return folder
    return hub_snapshot(model)


TOKENIZER_FILES = ("tokenizer_config.json", "tokenizer.json", "tokenizer.model", "vocab.json", "vocab.txt")


def check_model_folder(folder: Path, model: str) -> None:
    """A local folder holds a model: config, weights and tokenizer files. (From a folder without tokenizer files
    transformers builds a tokenizer of one token, silently; a missing config or weights fails after start-up.)"""
    if (folder / "meta.json").is_file() and (folder / "ds").is_dir():
        raise ConfigError(f"model_name_or_path: {model} is a recipe checkpoint, not a model folder: "
                          f"python -m recipe.export {model} OUT makes one")
    if (folder / "final" / "config.json").is_file():
        raise ConfigError(f"model_name_or_path: {model} is a run's output folder: did you mean {folder / 'final'}?")
    has = {"config.json": (folder / "config.json").is_file(),
           "weights (*.safetensors, pytorch_model*.bin)": any(folder.glob("*.safetensors")) or
           any(folder.glob("pytorch_model*.bin")),
           f"tokenizer files ({', '.join(TOKENIZER_FILES[:2])}, ...)": any((folder / f).is_file() for f in TOKENIZER_FILES)}
    missing = [what for what, ok in has.items() if not ok]
    need(not missing, f"model_name_or_path: {model} is not a model folder: it has no {' and no '.join(missing)}")


# ------------------------------------------------------------------------------------------
# hub names
# ------------------------------------------------------------------------------------------
def _env_true(name: str) -> bool:
    return os.environ.get(name, "").upper() in ("1", "ON", "YES", "TRUE")


def hub_offline() -> bool:
    """huggingface_hub's offline switch, read now (its own constant is read once, at import)."""
    return _env_true("HF_HUB_OFFLINE") or _env_true("TRANSFORMERS_OFFLINE")


def hub_cache() -> str:
    from huggingface_hub import constants

    return os.environ.get("HF_HUB_CACHE") or constants.HF_HUB_CACHE


def hub_unreachable(endpoint: str) -> str | None:
    """Why the hub does not answer (None: it does), within HUB_PROBE_S. Any HTTP answer counts: only whether
    files could be downloaded matters. Without it, transformers retries for minutes before it fails."""
    result: list[str | None] = []

    def probe():
        try:
            urllib.request.urlopen(urllib.request.Request(endpoint, method="HEAD"), timeout=HUB_PROBE_S)
            result.append(None)
        except urllib.error.HTTPError:
            result.append(None)  # it answered
        except (urllib.error.URLError, OSError, ValueError) as e:
            result.append(str(getattr(e, "reason", e)))

    # a thread: name resolution has no timeout of its own
    thread = threading.Thread(target=probe, daemon=True)
    thread.start()
    thread.join(HUB_PROBE_S + 1.0)
    return result[0] if result else f"no answer within {HUB_PROBE_S:.0f} s"


def on_hub(name: str, endpoint: str) -> bool:
    """Whether the hub has this model (its config.json). A mistyped name would otherwise fail inside
    transformers with a traceback; an answer that says neither yes nor no counts as yes (transformers tells)."""
    from huggingface_hub import HfApi

    try:
        return HfApi(endpoint=endpoint).file_exists(name, "config.json")
    except Exception:  # noqa: BLE001 -- gated, a server or network error: not a "no"
        return True


def go_offline() -> None:
    """Make this process's hub clients use the cache only (read from the environment at import; set on the
    module too when it is already imported)."""
    os.environ["HF_HUB_OFFLINE"] = "1"
    if "huggingface_hub.constants" in sys.modules:
        sys.modules["huggingface_hub.constants"].HF_HUB_OFFLINE = True


def hub_snapshot(name: str) -> Path | None:
    """A hub name's cached snapshot, or None when it will be downloaded. Offline, or with the hub unreachable,
    a name that is not cached is a one-line error, and a cached one is used offline."""
    from huggingface_hub import try_to_load_from_cache
    from huggingface_hub.utils import HFValidationError, validate_repo_id

    try:
        validate_repo_id(name)
    except HFValidationError:  # e.g. out/run/final: only a folder can have that name
        raise ConfigError(f"model_name_or_path: no such folder: {name}") from None
    cached = try_to_load_from_cache(name, "config.json", cache_dir=hub_cache())
    endpoint = os.environ.get("HF_ENDPOINT", "https://huggingface.co").rstrip("/")
    offline = hub_offline()
    why = None if offline else hub_unreachable(endpoint)
    if isinstance(cached, str):
        if why is not None:
            print(f"note: {endpoint} is unreachable ({why}): using the cached {name} offline", file=sys.stderr)
            go_offline()
        return Path(cached).parent
    if not offline and why is None:
        if on_hub(name, endpoint):
            return None  # transformers downloads it
        why = "not found"
    parent = name.split("/")[0]
    if "/" in name and resolve_path(parent).is_dir():  # out/finl with a folder out/ here: a mistyped path
        where = "exists" if why == "not found" else "is cached"
        raise ConfigError(f"model_name_or_path: no such folder: {name} (and no hub model of that name {where})")
    if why == "not found":
        raise ConfigError(f"model_name_or_path: {name} is neither a local folder nor a model on {endpoint} "
                          "(a private one needs `hf auth login` or HF_TOKEN)")
    reason = "offline mode is on (HF_HUB_OFFLINE)" if offline else f"{endpoint} is unreachable ({why})"
    raise ConfigError(f"model_name_or_path: {name} is neither a local folder nor in the hub cache ({hub_cache()}), "
                      f"and {reason}: download it first or give a local folder")


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
