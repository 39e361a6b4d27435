"""`--help`: every config field with its type, default and one-line description, read from the dataclass."""
from __future__ import annotations

import dataclasses
import typing
from typing import Any

import yaml

from grpo_recipe.config.schema import Config, field_types


def _type_name(typ: Any) -> str:
    args = [a for a in typing.get_args(typ)] or [typ]
    return " | ".join("null" if a is type(None) else getattr(a, "__name__", str(a)) for a in args)


def help_text() -> str:
    """Every field with its type, default and description, from the dataclass itself."""
    types = field_types()
    lines = ["usage: python -m grpo_recipe.train [--config FILE.yaml] [--FIELD VALUE ...]", "",
             "Fields come from the YAML file, then from --FIELD VALUE overrides (values are parsed as YAML:",
             "--reward_funcs '[length, accuracy]'); a bare --FLAG sets a bool field to true.", "",
             "  --config FILE.yaml", "      a YAML file of fields (e.g. grpo_recipe/configs/quickstart.yaml)"]
    for f in dataclasses.fields(Config):
        default = f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default
        shown = yaml.safe_dump(default, default_flow_style=True, width=1000).strip().removesuffix("...").strip()
        lines += [f"  --{f.name} ({_type_name(types[f.name])}, default: {shown})", f"      {f.metadata['help']}"]
    return "\n".join(lines)
