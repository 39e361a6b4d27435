"""Reward functions: built-ins, user functions by name or file, weighting, output validation.

A reward function has TRL's signature: `fn(prompts, completions, **columns) -> list[float]`, where
`columns` holds every dataset column of the batch (e.g. `answer=[...]`) plus the spec's `kwargs`.
Bad output stops the run at once with a RewardError naming the function and the sample index.
"""
from __future__ import annotations

import importlib
import importlib.util
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import torch


class RewardError(RuntimeError):
    """A reward function failed or returned something unusable."""


# ---------------------------------------------------------------------------------------
# built-ins
# ---------------------------------------------------------------------------------------
def length(prompts, completions, target_chars: int = 60, **_) -> list[float]:
    """The reference experiment's reward: -|target_chars - len(completion)|."""
    return [-abs(target_chars - len(c)) for c in completions]


def accuracy(prompts, completions, answer_column: str = "answer", **columns) -> list[float]:
    """1.0 when the stripped completion equals the stripped answer, else 0.0."""
    if answer_column not in columns:
        raise RewardError(f"reward 'accuracy': dataset has no column {answer_column!r} (have {sorted(columns)})")
    return [float(str(c).strip() == str(a).strip()) for c, a in zip(completions, columns[answer_column])]


BUILTINS: dict[str, Callable] = {"length": length, "accuracy": accuracy}


# ---------------------------------------------------------------------------------------
# loading
# ---------------------------------------------------------------------------------------
@dataclass
class RewardFunc:
    name: str
    fn: Callable
    weight: float
    kwargs: dict[str, Any]


def _import(spec: str) -> tuple[str, Callable]:
    if spec in BUILTINS:
        return spec, BUILTINS[spec]
    target, sep, attr = spec.rpartition(":")
    if not sep or not target or not attr:
        raise RewardError(f"reward_funcs: {spec!r} is not a built-in ({', '.join(BUILTINS)}), "
                          "'module:function' or 'path/file.py:function'")
    if target.endswith(".py"):
        path = Path(target).expanduser()
        if not path.is_file():
            raise RewardError(f"reward_funcs: file not found: {target}")
        mod_spec = importlib.util.spec_from_file_location(f"_reward_{path.stem}", path)
        module = importlib.util.module_from_spec(mod_spec)
        try:
            mod_spec.loader.exec_module(module)
        except Exception as e:
            raise RewardError(f"reward_funcs: importing {target} failed: {type(e).__name__}: {e}") from e
    else:
        try:
            module = importlib.import_module(target)
        except ImportError as e:
            raise RewardError(f"reward_funcs: cannot import module {target!r}: {e}") from e
    fn = getattr(module, attr, None)
    if not callable(fn):
        raise RewardError(f"reward_funcs: {target} has no function {attr!r}")
    return attr, fn


def load_reward_funcs(specs: list) -> list[RewardFunc]:
    funcs = []
    for spec in specs:
        if isinstance(spec, str):
            spec = {"func": spec}
        if not isinstance(spec, dict) or "func" not in spec:
            raise RewardError(f"reward_funcs: each entry is a name or a mapping with 'func', got {spec!r}")
        extra = set(spec) - {"func", "weight", "kwargs", "name"}
        if extra:
            raise RewardError(f"reward_funcs: unknown key(s) {sorted(extra)} in {spec!r}")
        name, fn = _import(str(spec["func"]))
        weight = spec.get("weight", 1.0)
        if not isinstance(weight, (int, float)) or isinstance(weight, bool) or not math.isfinite(weight):
            raise RewardError(f"reward_funcs: weight of {name!r} must be a finite number, got {weight!r}")
        kwargs = spec.get("kwargs") or {}
        if not isinstance(kwargs, dict):
            raise RewardError(f"reward_funcs: kwargs of {name!r} must be a mapping, got {kwargs!r}")
        funcs.append(RewardFunc(str(spec.get("name", name)), fn, float(weight), kwargs))
    names = [f.name for f in funcs]
    dup = {n for n in names if names.count(n) > 1}
    if dup:
        raise RewardError(f"reward_funcs: duplicate name(s) {sorted(dup)}: give each a distinct 'name'")
    return funcs


# ---------------------------------------------------------------------------------------
# scoring
# ---------------------------------------------------------------------------------------
def _validate(name: str, out: Any, n: int) -> torch.Tensor:
    if isinstance(out, torch.Tensor):
        out = out.detach().cpu().flatten().tolist()
    elif hasattr(out, "tolist"):  # numpy
        out = out.tolist()
    if not isinstance(out, (list, tuple)):
        raise RewardError(f"reward {name!r} returned {type(out).__name__}, expected a list of {n} floats")
    if len(out) != n:
        raise RewardError(f"reward {name!r} returned {len(out)} values for {n} completions")
    values = []
    for i, v in enumerate(out):
        if v is None or isinstance(v, bool) or not isinstance(v, (int, float)):
            raise RewardError(f"reward {name!r} returned {v!r} at sample {i}, expected a float")
        if not math.isfinite(v):
            raise RewardError(f"reward {name!r} returned {v} at sample {i}")
        values.append(float(v))
    return torch.tensor(values, dtype=torch.float32)


def score(funcs: list[RewardFunc], prompts: list[str], completions: list[str],
          columns: dict[str, list]) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Total weighted reward per completion, and each function's raw values (for logging)."""
    per_func: dict[str, torch.Tensor] = {}
    for f in funcs:
        try:
            out = f.fn(prompts=prompts, completions=completions, **columns, **f.kwargs)
        except RewardError:
            raise
        except Exception as e:
            raise RewardError(f"reward {f.name!r} raised {type(e).__name__}: {e}") from e
        per_func[f.name] = _validate(f.name, out, len(completions))
    total = sum(f.weight * per_func[f.name] for f in funcs)
    return total, per_func
