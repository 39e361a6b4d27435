"""Read the config from `--config FILE.yaml` and `--key value` CLI overrides into a checked `Config`.

Types are checked field by field, unknown names get the closest field (or TRL's equivalent), and every value
is then validated by `grpo_recipe.config.schema.validate`, all before any process group starts.
"""
from __future__ import annotations

import dataclasses
import difflib
import os
import sys
import typing
from typing import Any

import yaml

from grpo_recipe.config.schema import Config, ConfigError, field_types, resolve_path, validate
from grpo_recipe.config.trl_names import TRL_FLAGS, translate


def training_defaults() -> dict:
    """transformers' TrainingArguments defaults (a TRL config carries many of its fields)."""
    from transformers import TrainingArguments

    return {f.name: f.default for f in dataclasses.fields(TrainingArguments)
            if f.default is not dataclasses.MISSING}


PYTHON_OBJECT_FIELDS = ("environment_factory",)  # module:Class fields that GRPORun may give as the class itself


def _coerce(name: str, value: Any, typ: Any) -> Any:
    """Check/convert one value against its annotated type; raise ConfigError naming the field."""
    args = typing.get_args(typ)
    allowed = [a for a in args if a is not type(None)] if args else [typ]
    if value is None:
        if args and type(None) in args:
            return None
        if typing.get_origin(typ) is dict or typ is dict:  # null: no mapping given (TRL's configs write it so)
            return {}
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
        if a is dict and isinstance(value, dict):
            return value
    if callable(value) and name in PYTHON_OBJECT_FIELDS:  # a class given from Python stands for its module:name
        return value
    if str in allowed and not isinstance(value, (dict, list)):
        return str(value)
    names = " or ".join(getattr(a, "__name__", str(a)) for a in allowed)
    raise ConfigError(f"{name}: expected {names}, got {value!r}")


class HelpRequested(Exception):
    """`--help` / `-h`: print `grpo_recipe.config.help.help_text()` and exit 0."""


def _is_text(typ: Any) -> bool:
    """A field that only holds text (or null)."""
    return {a for a in typing.get_args(typ) or [typ] if a is not type(None)} == {str}


def unknown_key_message(key: str, values: dict) -> str:
    """Why `key` is not a field: a former field's replacement, else the closest field's name (TRL's names are
    translated before: trl_names.py)."""
    if key == "report_to_tensorboard":  # an earlier field of this recipe
        return f"{key}: replaced by report_to: write report_to: [tensorboard]"
    if key == "vllm_tis_cap":  # an earlier field of this recipe
        cap = values.get(key)
        return (f"{key}: replaced by TRL's fields: vllm_importance_sampling_mode: token_truncate with "
                f"vllm_importance_sampling_clip_max: {cap if cap is not None else 'CAP'}")
    close = difflib.get_close_matches(key, [f.name for f in dataclasses.fields(Config)], n=1, cutoff=0.6)
    return f"unknown field {key!r}" + (f": did you mean {close[0]}?" if close else " (--help lists every field)")


def parse_cli(argv: list[str]) -> tuple[str | None, dict[str, Any]]:
    """`--config FILE` plus `--key value` / `--key=value` overrides (values parsed as YAML); a bare `--flag`
    sets a bool field to true; `--help` / `-h` raise HelpRequested."""
    if "--help" in argv or "-h" in argv:
        raise HelpRequested()
    types = field_types()
    config_path, overrides, i = None, {}, 0
    while i < len(argv):
        arg = argv[i]
        if not arg.startswith("--"):
            raise ConfigError(f"unexpected argument {arg!r}: overrides are --key value")
        key, eq, val = arg[2:].partition("=")
        key = key.replace("-", "_")
        if not eq:
            if i + 1 < len(argv) and not argv[i + 1].startswith("--"):
                val, i = argv[i + 1], i + 1
            elif bool in (typing.get_args(types.get(key)) or [types.get(key)]) or key in TRL_FLAGS:
                val = "true"
            elif key not in types and key not in ("config", "local_rank"):
                raise ConfigError(unknown_key_message(key, {}))
            else:
                raise ConfigError(f"--{key}: missing value")
        i += 1
        if key == "local_rank":  # set by the deepspeed launcher; LOCAL_RANK in the env says the same
            continue
        if key == "config":
            config_path = val
        elif _is_text(types.get(key)) and val not in ("null", "~"):  # "Answer: N" is text, not a YAML mapping
            overrides[key] = val
        else:
            try:
                overrides[key] = yaml.safe_load(val) if val != "" else ""
            except yaml.YAMLError:
                overrides[key] = val
    return config_path, overrides


# Paths and module names of the package before it was renamed `grpo_recipe`, and what they are now.
OLD_NAMES = (("recipe/configs/", "grpo_recipe/configs/"), ("recipe/data/", "grpo_recipe/assets/"),
             ("recipe/examples/", "grpo_recipe/examples/"), ("recipe.", "grpo_recipe."))


def renamed(value: str) -> str | None:
    """The new spelling of a path or module name of the old `recipe` package (None: not one, or one that exists
    here: a user's own folder or module may be called recipe)."""
    import importlib.util

    for old, new in OLD_NAMES:
        if value.startswith(old):
            exists = importlib.util.find_spec("recipe") is not None if old == "recipe." else \
                resolve_path(value.split(":")[0]).exists()
            return None if exists else new + value[len(old):]
    return None


def check_old_names(values: dict[str, Any]) -> None:
    """A config written for the package's old name gets one line with the new name, not "file not found"."""
    for key, value in values.items():
        items = value if isinstance(value, list) else [value]
        for item in items:
            text = item.get("func") if isinstance(item, dict) else item
            new = renamed(text) if isinstance(text, str) else None
            if new is not None:
                raise ConfigError(f"{key}: {text!r} names the package `recipe`, which is now `grpo_recipe`: "
                                  f"write {new!r}")


class UniqueKeyLoader(yaml.SafeLoader):
    """PyYAML's safe loader, but a key given twice in one mapping is an error (PyYAML keeps the last silently)."""

    def construct_mapping(self, node, deep=False):
        seen = {}
        for key_node, _ in node.value:
            key = self.construct_object(key_node, deep=True)
            line = key_node.start_mark.line + 1
            if isinstance(key, typing.Hashable) and key in seen:
                raise ConfigError(f"{key!r} is set twice, on line {seen[key]} and line {line}: keep one")
            seen[key] = line
        return super().construct_mapping(node, deep)


def load_config(argv: list[str] | None = None, world_size: int | None = None) -> Config:
    """Build and validate the config from `--config FILE.yaml` and CLI overrides."""
    config_path, overrides = parse_cli(sys.argv[1:] if argv is None else argv)
    values = read_yaml(config_path) if config_path is not None else {}
    values.update(overrides)
    return config_from_values(values, world_size)


def read_yaml(config_path: str) -> dict[str, Any]:
    """A config file's fields, as written (checked only as YAML here)."""
    path = resolve_path(config_path)  # the caller's folder first, then the repository (shipped configs)
    if not path.is_file():
        new = renamed(config_path)
        hint = f" (the package `recipe` is now `grpo_recipe`: {new})" if new else ""
        raise ConfigError(f"config file not found: {config_path}{hint}")
    try:
        loaded = yaml.load(path.read_text(), Loader=UniqueKeyLoader)
    except ConfigError as e:
        raise ConfigError(f"config file {config_path}: {e}") from None
    except yaml.YAMLError as e:
        raise ConfigError(f"config file {config_path} is not valid YAML: {yaml_problem(e)}") from None
    if loaded is None:  # an empty or comments-only file: almost surely the wrong file, not "all defaults"
        raise ConfigError(f"config file {config_path} is empty: it sets no field (leave out --config to run "
                          "on the defaults)")
    if not isinstance(loaded, dict):
        raise ConfigError(f"config file {config_path} must hold a mapping of fields")
    return dict(loaded)


def config_from_values(values: dict[str, Any], world_size: int | None = None) -> Config:
    """A checked Config from field values (a YAML file's, a dict given in Python), TRL's names taken."""
    values = dict(values)
    check_old_names(values)
    types = field_types()
    values, notes = translate(values, set(types), training_defaults)
    if notes and os.environ.get("RANK", "0") == "0":  # once, under a launcher
        for note in notes:
            print(f"note (TRL config): {note}", file=sys.stderr)
    unknown = sorted(set(values) - set(types))
    if unknown:
        raise ConfigError("; ".join(unknown_key_message(k, values) for k in unknown))
    cfg = Config(**{k: _coerce(k, v, types[k]) for k, v in values.items()})
    if world_size is None:
        world_size = int(os.environ.get("WORLD_SIZE", "1"))
    validate(cfg, world_size)
    return cfg


def yaml_problem(e: yaml.YAMLError) -> str:
    """What a YAML parser error says, with its line and column (PyYAML's str() spreads them over lines)."""
    mark = getattr(e, "problem_mark", None)
    where = f"line {mark.line + 1}, column {mark.column + 1}: " if mark is not None else ""
    return where + (getattr(e, "problem", None) or " ".join(str(e).split()))
