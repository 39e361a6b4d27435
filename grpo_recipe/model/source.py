"""Where a model comes from: a local folder (checked to hold a model), a hub name (cached, or on a reachable hub),
or a built-in tiny model (built once, model/tiny.py); its size from the weights' headers."""
from __future__ import annotations

import math
import os
import sys
import threading
import urllib.error
import urllib.request
from pathlib import Path

from grpo_recipe.config.schema import Config, ConfigError, need, resolve_path
from grpo_recipe.model.tiny import BUILTIN_MODELS, ensure_builtin

HUB_PROBE_S = 5.0  # how long the hub may take to answer before it counts as unreachable


def model_path(cfg: Config) -> str:
    if cfg.model_name_or_path.startswith("builtin:"):
        return str(ensure_builtin(cfg.model_name_or_path))
    p = resolve_path(os.path.expanduser(cfg.model_name_or_path))
    return str(p) if p.exists() else cfg.model_name_or_path


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
                          f"python -m grpo_recipe.tools.export {model} OUT makes one")
    if (folder / "final" / "config.json").is_file():
        raise ConfigError(f"model_name_or_path: {model} is a run's output folder: did you mean {folder / 'final'}?")
    has = {"config.json": (folder / "config.json").is_file(),
           "weights (*.safetensors, pytorch_model*.bin)": any(folder.glob("*.safetensors")) or
           any(folder.glob("pytorch_model*.bin")),
           f"tokenizer files ({', '.join(TOKENIZER_FILES[:2])}, ...)": any((folder / f).is_file() for f in TOKENIZER_FILES)}
    missing = [what for what, ok in has.items() if not ok]
    need(not missing, f"model_name_or_path: {model} is not a model folder: it has no {' and no '.join(missing)}")


def weight_count(folder: Path) -> int:
    """Parameters in a model folder's safetensors files (headers only; 0 when it has none)."""
    from safetensors import safe_open

    count = 0
    for path in folder.glob("*.safetensors"):
        with safe_open(str(path), framework="pt") as f:
            for key in f.keys():
                count += math.prod(f.get_slice(key).get_shape())
    return count


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
