"""User code named in the config (`module:function` or `path/file.py:function`): reward functions, tools."""
from __future__ import annotations

import importlib
import importlib.util
import os
from typing import Callable

from grpo_recipe.config.schema import resolve_path


class UserCodeError(ValueError):
    """A `module:function` spec that does not name a callable; the message names the field."""


def import_callable(spec: str, field: str, hint: str = "") -> tuple[str, Callable]:
    """(function name, function) named by `spec`; a file path resolves against the working directory, then the
    repository. Anything wrong is one line naming `field`."""
    target, sep, attr = spec.rpartition(":")
    if not sep or not target or not attr:
        raise UserCodeError(f"{field}: {spec!r} is not 'module:function' or 'path/file.py:function'{hint}")
    if target.endswith(".py"):
        path = resolve_path(os.path.expanduser(target))
        if not path.is_file():
            raise UserCodeError(f"{field}: file not found: {target}")
        mod_spec = importlib.util.spec_from_file_location(f"_{field}_{path.stem}", path)
        module = importlib.util.module_from_spec(mod_spec)
        try:
            mod_spec.loader.exec_module(module)
        except Exception as e:
            raise UserCodeError(f"{field}: importing {target} failed: {type(e).__name__}: {e}") from e
    else:
        try:
            module = importlib.import_module(target)
        except ImportError as e:
            raise UserCodeError(f"{field}: cannot import module {target!r}: {e}") from e
    fn = getattr(module, attr, None)
    if not callable(fn):
        raise UserCodeError(f"{field}: {target} has no function {attr!r}")
    return attr, fn
