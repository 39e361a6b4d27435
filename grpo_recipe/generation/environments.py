"""Environments, as TRL 1.16's `environment_factory` has them: one instance per completion, reset from the
completion's dataset row, its public methods the tools that completion may call, and an optional `get_reward()`
that scores it (a reward source of weight 1 named after the class, beside `reward_funcs`).

`environment_factory: module:Class` gives every example the same environment; a mapping `{name: module:Class}`
picks one per example by its `environment` column, and only that environment's tools are shown in its prompt.
When `reset` returns a string, it is appended to the prompt's last user message, as in TRL. Instances are pooled
and reset for each rollout. Before each `reset`, Python's `random` is seeded from (seed, rollout, sample), so an
environment that draws its task with `random` draws the same one when a resumed run generates a rollout again.
"""
from __future__ import annotations

import inspect
import random
from dataclasses import replace
from typing import Any, Callable

from grpo_recipe.config.usercode import UserCodeError, import_callable
from grpo_recipe.dist import signals
from grpo_recipe.generation.tools import Tool, ToolError, schema_of


def _public_methods(cls) -> list[str]:
    """The methods exposed as tools: public functions of the class (on the class: properties are not called)."""
    return [n for n, _ in inspect.getmembers(cls, predicate=inspect.isfunction)
            if not n.startswith("_") and n not in ("reset", "get_reward")]


class Environments:
    def __init__(self, spec: str | dict, tools: list[Tool], timeout_s: float | None = None):
        self.multi = isinstance(spec, dict)
        specs = spec if self.multi else {None: spec}
        self.standalone, self.timeout_s = tools, timeout_s or None
        self.factories: dict[Any, Callable] = {}
        self.pool: dict[Any, list] = {}
        self.schemas: dict[Any, list[dict]] = {}
        self.rewarded: list[type] = []  # classes whose get_reward scores their completions
        for name, target in specs.items():
            where = "environment_factory" + (f" {name!r}" if self.multi else "")
            try:
                factory = target if callable(target) else import_callable(str(target), "environment_factory")[1]
            except UserCodeError as e:
                raise ToolError(str(e)) from None
            try:
                instance = factory()
            except Exception as e:  # noqa: BLE001 - a user's constructor: one line naming it
                raise ToolError(f"{where}: {target}() failed: {type(e).__name__}: {e}") from None
            cls = type(instance)
            if not callable(getattr(instance, "reset", None)):
                raise ToolError(f"{where}: {cls.__name__} has no reset method (each environment needs one)")
            methods = _public_methods(cls)
            self.factories[name], self.pool[name] = factory, [instance]
            self.schemas[name] = [t.schema for t in tools] + [
                schema_of(getattr(instance, m), f"{where}: {cls.__name__}.{m}") for m in methods]
            if callable(getattr(instance, "get_reward", None)) and cls not in self.rewarded:
                self.rewarded.append(cls)
        if not any(self.schemas[n] for n in self.schemas):
            raise ToolError("environment_factory: no environment has a public method and no tools are given: the "
                            "model would have nothing to call")

    def names(self, columns: dict[str, list], n: int) -> list:
        """Each sample's environment name (its `environment` column), checked."""
        if not self.multi:
            return [None] * n
        chosen = columns.get("environment")
        if chosen is None:
            raise ToolError("environment_factory: a mapping of environments needs an 'environment' column in the "
                            "dataset naming each example's")
        unknown = sorted({str(c) for c in chosen if c not in self.factories})
        if unknown:
            raise ToolError(f"environment_factory: examples name environment(s) {unknown}, which are not among "
                            f"{sorted(self.factories)}")
        return list(chosen)

    def start(self, prompts: list, columns: dict[str, list], prompt_column: str, seed: int) -> tuple[list, list]:
        """One reset environment per sample (instances reused), and each sample's prompt with its observation."""
        names = self.names(columns, len(prompts))
        cursor: dict[Any, int] = {}
        envs, out = [], []
        for i, (name, prompt) in enumerate(zip(names, prompts)):
            k = cursor.get(name, 0)
            if k == len(self.pool[name]):
                self.pool[name].append(self.factories[name]())
            cursor[name] = k + 1
            env = self.pool[name][k]
            row = {prompt_column: prompt, **{c: v[i] for c, v in columns.items() if not (self.multi and c == "environment")}}
            random.seed(seed * 1_000_003 + i)
            try:
                with signals.bounded(f"{type(env).__name__}.reset", self.timeout_s):
                    observation = env.reset(**row)
            except signals.Interrupted:
                raise
            except Exception as e:  # noqa: BLE001 - a user's environment: one line naming it
                raise ToolError(f"environment {type(env).__name__}: reset failed on sample {i}: "
                                f"{type(e).__name__}: {e}") from None
            if observation is not None:
                if not isinstance(prompt, list):
                    prompt = [{"role": "user", "content": str(prompt)}]
                prompt = prompt[:-1] + [{**prompt[-1], "content": str(prompt[-1]["content"]) + str(observation)}]
            envs.append(env)
            out.append(prompt)
        return envs, out

    def tools_of(self, env) -> dict[str, Callable]:
        return {t.name: t.fn for t in self.standalone} | {m: getattr(env, m) for m in _public_methods(type(env))}

    def schemas_of(self, columns: dict[str, list], n: int) -> list[list[dict]]:
        return [self.schemas[name] for name in self.names(columns, n)]

    def prepare(self, stream, rows, seed: int):
        """`rows` (a PromptBatch, one row per completion) with each completion's environment reset: its prompt
        (with the observation) re-encoded, `environments` among its columns; and each one's (tools, schemas)."""
        envs, prompts = self.start(rows.prompts, rows.columns, stream.cfg.prompt_column, seed)
        schemas = self.schemas_of(rows.columns, len(prompts))
        rows = replace(rows, prompts=prompts, prompt_ids=stream.encode(prompts, schemas)[0],
                       columns=rows.columns | {"environments": envs})
        return rows, [(self.tools_of(e), s) for e, s in zip(envs, schemas)]

    def reward_funcs(self) -> list[tuple[str, Callable]]:
        """(class name, reward function) for each environment class with get_reward: it scores the completions
        whose environment is exactly that class, and returns None (not applicable) for the others, as in TRL."""
        funcs = []
        for cls in self.rewarded:
            def get_reward(environments, _cls=cls, **_):
                return [e.get_reward() if type(e) is _cls else None for e in environments]

            funcs.append((cls.__name__, get_reward))
        return funcs
