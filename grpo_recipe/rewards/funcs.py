"""Reward functions: built-ins, user functions by name or file, weighting, output validation.

A reward function has TRL's signature: `fn(prompts, completions, completion_ids, **columns) -> list`, where
`columns` holds every dataset column of the batch but the prompt column (e.g. `answer=[...]`) plus the
spec's `kwargs`. Prompts are as in the dataset; when they are conversational (lists of messages), each
completion is a list holding one assistant message, as in TRL. `async def` functions run concurrently.
A value of None (or NaN, as TRL reads it) means "not applicable to this sample": the total is the weighted sum
over the others. Values are taken as TRL takes them: floats, ints, bools, numpy scalars, 0-d tensors.
Bad output stops the run at once with a RewardError naming the function and the sample index.
"""
from __future__ import annotations

import asyncio
import difflib
import inspect
import math
import numbers
from dataclasses import dataclass
from typing import Any, Callable

import torch

from grpo_recipe.config.usercode import UserCodeError, import_callable
from grpo_recipe.data.prompts import RESERVED_COLUMNS  # what the recipe passes itself
from grpo_recipe.dist import liveness, signals
from grpo_recipe.rewards.math_answers import answers_match, completion_answer, reference_answer
from grpo_recipe.rewards.model import ModelReward, RewardModelError, is_model_spec


class RewardError(RuntimeError):
    """A reward function failed or returned something unusable."""


class RewardStopped(RewardError):
    """A stop signal cut a reward function short: the run saves and exits 75, it did not fail."""


# ---------------------------------------------------------------------------------------
# built-ins
# ---------------------------------------------------------------------------------------
def completion_text(completion) -> str:
    """The text of a completion: itself, or the content of a conversational completion's last message."""
    if isinstance(completion, list):
        return str(completion[-1]["content"]) if completion else ""
    return str(completion)


def _answers(name: str, columns: dict, answer_column: str | None) -> list:
    column = answer_column or next((c for c in ("answer", "solution") if c in columns), "answer")
    if column not in columns:
        have = sorted(c for c in columns if c != "completion_ids")
        raise RewardError(f"reward {name!r}: dataset has no column {column!r} (have {have}); "
                          "name it with kwargs: {answer_column: ...}")
    return columns[column]


def length(prompts, completions, target_chars: int = 60, **_) -> list[float]:
    """The reference experiment's reward: -|target_chars - len(completion)|."""
    return [-abs(target_chars - len(completion_text(c))) for c in completions]


def accuracy(prompts, completions, answer_column: str | None = None, **columns) -> list[float]:
    """1.0 when the stripped completion equals the stripped answer (exact text), else 0.0."""
    answers = _answers("accuracy", columns, answer_column)
    return [float(completion_text(c).strip() == str(a).strip()) for c, a in zip(completions, answers)]


def math_accuracy(prompts, completions, answer_column: str | None = None, **columns) -> list[float]:
    """1.0 when the completion's final answer (last \\boxed{}, `#### N`, "answer is N", else the last number)
    equals the reference numerically (a GSM8K solution's `#### N` included), else 0.0. The reference is the
    `answer` column (`solution` when there is none), or `answer_column`."""
    answers = _answers("math_accuracy", columns, answer_column)
    return [float(answers_match(completion_answer(completion_text(c)), reference_answer(str(a))))
            for c, a in zip(completions, answers)]


BUILTINS: dict[str, Callable] = {"length": length, "accuracy": accuracy, "math_accuracy": math_accuracy}


def check_answer_columns(funcs: list["RewardFunc"], columns: list[str]) -> None:
    """Before any work: the built-ins that read an answer column find one in the dataset."""
    for f in funcs:
        if f.fn in (accuracy, math_accuracy):
            _answers(f.name, dict.fromkeys(columns), f.kwargs.get("answer_column"))


# ---------------------------------------------------------------------------------------
# loading
# ---------------------------------------------------------------------------------------
@dataclass
class RewardFunc:
    name: str
    fn: Callable
    weight: float
    kwargs: dict[str, Any]


# TRL's built-in reward names, and the built-in here that does the same job
TRL_REWARDS = {"accuracy_reward": "math_accuracy", "reasoning_accuracy_reward": "math_accuracy"}


def _import(spec: str) -> tuple[str, Callable]:
    if spec in BUILTINS:
        return spec, BUILTINS[spec]
    target, sep, attr = spec.rpartition(":")
    if not sep or not target or not attr:
        hint = f" (TRL's {spec} is {TRL_REWARDS[spec]} here)" if spec in TRL_REWARDS else ""
        raise RewardError(f"reward_funcs: {spec!r} is not a built-in ({', '.join(BUILTINS)}), "
                          f"'module:function' or 'path/file.py:function'{hint}")
    try:
        return import_callable(spec, "reward_funcs")
    except UserCodeError as e:
        raise RewardError(str(e)) from e.__cause__


def check_kwargs(name: str, fn: Callable, kwargs: dict) -> None:
    """Every kwarg names an argument of the function. A built-in's `**columns` takes the dataset's columns, not
    settings, so a misspelled setting would silently be ignored there; a user function's `**kwargs` may want
    anything, so only one without it is checked."""
    params = inspect.signature(fn).parameters.values()
    named = [p.name for p in params if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)
             and p.name not in RESERVED_COLUMNS]
    takes_any = any(p.kind == p.VAR_KEYWORD for p in params)
    if takes_any and fn not in BUILTINS.values():
        return
    for key in kwargs:
        if key not in named:
            close = difflib.get_close_matches(key, named, n=1)
            hint = f"did you mean {close[0]!r}? " if close else ""
            raise RewardError(f"reward_funcs: {name!r} has no argument {key!r} ({hint}it takes "
                              f"{', '.join(named) or 'none'})")


def load_reward_funcs(specs: list) -> list[RewardFunc]:
    funcs = []
    for spec in specs:
        if isinstance(spec, str) and spec not in BUILTINS and is_model_spec(spec):  # TRL's reward_funcs="org/model"
            spec = {"model": spec}
        if isinstance(spec, str) or callable(spec):  # a name, or the function itself (the Python entry point)
            spec = {"func": spec}
        if not isinstance(spec, dict) or ("func" in spec) == ("model" in spec):
            raise RewardError(f"reward_funcs: each entry is a name or a mapping with 'func' (a function) or 'model' "
                              f"(a reward model), got {spec!r}")
        allowed = {"func", "kwargs"} if "func" in spec else {"model", "tokenizer", "batch_size", "sharded"}
        extra = set(spec) - allowed - {"weight", "name"}
        if extra:
            raise RewardError(f"reward_funcs: unknown key(s) {sorted(extra)} in {spec!r}")
        if "model" in spec:
            if not isinstance(spec.get("sharded", False), bool):
                raise RewardError(f"reward_funcs: sharded of {spec['model']!r} must be true or false, got "
                                  f"{spec['sharded']!r}")
            try:
                fn = ModelReward(str(spec["model"]), spec.get("tokenizer"), int(spec.get("batch_size", 16)),
                                 sharded=spec.get("sharded", False))
            except RewardModelError as e:
                raise RewardError(f"reward_funcs: {e}") from None
            name = fn.__name__
        else:
            name, fn = (spec["func"].__name__, spec["func"]) if callable(spec["func"]) else _import(str(spec["func"]))
        weight = spec.get("weight", 1.0)
        if not isinstance(weight, (int, float)) or isinstance(weight, bool) or not math.isfinite(weight):
            raise RewardError(f"reward_funcs: weight of {name!r} must be a finite number, got {weight!r}")
        kwargs = spec.get("kwargs") or {}
        if not isinstance(kwargs, dict):
            raise RewardError(f"reward_funcs: kwargs of {name!r} must be a mapping, got {kwargs!r}")
        check_kwargs(name, fn, kwargs)
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
    """The function's values as a float tensor, NaN where it returned None (not applicable)."""
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
        if hasattr(v, "item") and getattr(v, "ndim", 0) == 0:  # a numpy scalar or a 0-d tensor, as TRL takes them
            v = v.item()
        if v is None or isinstance(v, float) and math.isnan(v):  # TRL's "not applicable": None, or NaN
            values.append(math.nan)
            continue
        if not isinstance(v, numbers.Real):  # bools count as 0 and 1, as torch.tensor makes them in TRL
            raise RewardError(f"reward {name!r} returned {v!r} at sample {i}, expected a float or None")
        if math.isinf(v):  # TRL would train on it: an infinite advantage is NaN weights a step later
            raise RewardError(f"reward {name!r} returned {v} at sample {i}: rewards must be finite (None or NaN "
                              f"mark a sample the function does not apply to)")
        values.append(float(v))
    out = torch.tensor(values, dtype=torch.float32)
    bad = torch.isinf(out).nonzero()  # (NaN: None, not applicable)
    if len(bad):  # finite as a Python float, but beyond float32's range (about 3.4e38)
        i = int(bad[0])
        raise RewardError(f"reward {name!r} returned {values[i]:g} at sample {i}, which overflows float32 "
                          f"(|reward| must stay below {torch.finfo(torch.float32).max:.3g})")
    return out


_LOOP: asyncio.AbstractEventLoop | None = None


def _event_loop() -> asyncio.AbstractEventLoop:
    """One loop for the whole run, so async clients a reward module keeps (bound to a loop) stay usable."""
    global _LOOP
    if _LOOP is None or _LOOP.is_closed():
        _LOOP = asyncio.new_event_loop()
    return _LOOP


def _call_all(funcs: list[RewardFunc], inputs: dict, timeout_s: float | None = None, where: str = "") -> dict[str, Any]:
    """Each function's raw output. Plain functions run in turn; awaitables (async def) run concurrently. Each
    call (the awaitables together) is bounded by `timeout_s` and cut short by a stop signal (dist/signals.py)."""
    outs: dict[str, Any] = {}
    pending: dict[str, Any] = {}
    # sharded reward models first: their forwards are collectives, which no rank may skip for a function
    # that failed before them on its own (rewards/model.py)
    for f in sorted(funcs, key=lambda f: not getattr(f.fn, "sharded", False)):
        liveness.set_phase(f"{where}reward {f.name!r}")
        try:
            with signals.bounded(f"reward {f.name!r}", timeout_s):
                out = f.fn(**{**inputs, **f.kwargs})
        except signals.Interrupted as e:
            raise interrupted(e) from None
        except RewardError:
            raise
        except KeyboardInterrupt:
            raise
        except BaseException as e:  # sys.exit too: this rank must stay to tell the others, not vanish
            raise RewardError(called_failed(f.name, e)) from e
        (pending if inspect.isawaitable(out) else outs)[f.name] = out
    if pending:
        async def gather():
            return await asyncio.gather(*pending.values(), return_exceptions=True)

        names = ", ".join(repr(n) for n in pending)
        liveness.set_phase(f"{where}rewards {names} (async)")
        try:
            with signals.bounded(f"rewards {names} (async)", timeout_s):
                results = _event_loop().run_until_complete(gather())
        except signals.Interrupted as e:
            raise interrupted(e) from None
        for name, out in zip(pending, results):
            if isinstance(out, RewardError):
                raise out
            if isinstance(out, BaseException):
                raise RewardError(called_failed(name, out)) from out
            outs[name] = out
    return outs


def interrupted(e: signals.Interrupted) -> RewardError:
    """The error a cut-short reward call becomes: a stop (save and exit 75) or a hang (one line, exit 1)."""
    if e.signal is not None:
        return RewardStopped(str(e))
    return RewardError(f"{e} (reward_timeout_s): it hangs or is too slow; fix it, or raise reward_timeout_s")


def is_conversational(prompt) -> bool:
    return isinstance(prompt, list) and all(isinstance(m, dict) and "role" in m for m in prompt)


def score(funcs: list[RewardFunc], prompts: list, completions: list[str], columns: dict[str, list],
          completion_ids: list[list[int]] | None = None, timeout_s: float | None = None,
          where: str = "", turns: list[list[dict]] | None = None) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Total weighted reward per completion, and each function's raw values (NaN where not applicable).

    `completions` are texts; for conversational prompts they reach the functions as [assistant message]; with
    `turns` (multi-turn rollouts) as each completion's messages: assistant turns and tool results, as in TRL.
    Each function call is bounded by `timeout_s` (None: unbounded); `where` prefixes the phase a stuck rank
    is named with (e.g. "rollout 3: ").
    """
    if turns is not None:  # multi-turn rollouts run through the chat template: their messages, whatever the prompts
        completions = turns
    elif prompts and is_conversational(prompts[0]):
        completions = [[{"role": "assistant", "content": c}] for c in completions]
    inputs = {**columns, "prompts": prompts, "completions": completions,
              "completion_ids": completion_ids if completion_ids is not None else [[] for _ in completions]}
    outs = _call_all(funcs, inputs, timeout_s, where)
    per_func = {f.name: _validate(f.name, outs[f.name], len(completions)) for f in funcs}
    values = torch.stack([f.weight * per_func[f.name] for f in funcs])
    missing = values.isnan().all(dim=0)
    if missing.any():
        i = int(missing.nonzero()[0])
        raise RewardError(f"no reward function applies to sample {i}: every one returned None "
                          f"({', '.join(f.name for f in funcs)})")
    total = values.nansum(dim=0)
    check_total(total, funcs)
    return total, per_func


def called_failed(name: str, e: BaseException) -> str:
    if isinstance(e, SystemExit):
        return f"reward {name!r} called sys.exit({e.code!r})"
    return f"reward {name!r} raised {type(e).__name__}: {e}"


def check_total(total: torch.Tensor, funcs: list[RewardFunc]) -> None:
    """Finite values can still overflow once weighted and summed."""
    bad = (~torch.isfinite(total)).nonzero()
    if len(bad):
        weights = ", ".join(f"{f.name} x {f.weight:g}" for f in funcs)
        raise RewardError(f"the weighted sum of the rewards ({weights}) overflows float32 at sample {int(bad[0])}")
