"""Multi-turn rollouts: the model calls tools, reads their results and goes on, as in TRL 1.16's tool loop.

A completion is everything after the prompt: the model's turns and, between them, the tool results the chat
template writes. Only the model's tokens are trained: `Completions.tool_mask` is 0 on the tool results, and the
rollout buffer takes it out of the loss, the old and sampler log-probs, the KL and the token counts (TRL's
`tool_mask`). A completion whose model turn calls a tool gets the results appended, written by the chat
template, and is continued from the concatenated token ids (never re-tokenized) with one more sample, up to
`max_tool_calling_iterations` rounds and `max_completion_length` tokens in all; a round whose results would pass
that budget is dropped and the completion ends with its call, as TRL ends it.

Tools are plain functions with typed arguments and a docstring (transformers' `get_json_schema` makes the schema
the prompt shows). A call that raises, returns something `str()` cannot print, or takes longer than
`tool_timeout_s` gives the model `{'error': ...}` to read, as TRL does, and is counted as a failure; a stop signal
during a call stops the run as it stops a reward function (save and exit 75).
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch

from grpo_recipe.config.schema import Config, ConfigError, resolve_path
from grpo_recipe.config.usercode import UserCodeError, import_callable
from grpo_recipe.dist import signals
from grpo_recipe.dist.collectives import any_rank
from grpo_recipe.generation.base import Completions


class ToolError(ConfigError):
    """A tool or a template that cannot serve multi-turn rollouts; the message names it."""


def round_seed(seed: int, k: int) -> int:
    """The sampling seed of tool round `k` of a rollout seeded `seed`: a round samples afresh from prompts that now
    hold the results, so each has its own (the same wherever the rounds run: trainers, generation ranks, eval)."""
    return (seed + 7_919 * k) % 2**31


def set_templates(tokenizer, cfg: Config) -> None:
    """`chat_template_path` and `response_template_path` replace the tokenizer's own (one-line errors)."""
    if cfg.chat_template_path:
        path = resolve_path(cfg.chat_template_path)
        if not path.is_file():
            raise ToolError(f"chat_template_path: file not found: {cfg.chat_template_path}")
        tokenizer.chat_template = path.read_text()
    if cfg.response_template_path:
        path = resolve_path(cfg.response_template_path)
        try:
            tokenizer.response_template = json.loads(Path(path).read_text())
        except (OSError, ValueError) as e:
            raise ToolError(f"response_template_path: cannot read {cfg.response_template_path}: {e}") from None


@dataclass
class Tool:
    name: str
    fn: Callable
    schema: dict


def schema_of(fn: Callable, where: str) -> dict:
    """The JSON schema transformers' chat templates take for `fn`; refused without type hints or a docstring."""
    from transformers.utils import get_json_schema

    try:
        return get_json_schema(fn)
    except Exception as e:  # transformers' TypeHintParsingException / DocstringParsingException
        raise ToolError(f"{where} has no usable schema: {' '.join(str(e).split())} (it needs a type hint on every "
                        "argument and a docstring with an Args: section)") from None


def load_tools(specs: list[str]) -> list[Tool]:
    """Each `module:function` with its JSON schema."""
    tools = []
    for spec in specs:
        try:
            name, fn = (spec.__name__, spec) if callable(spec) else import_callable(spec, "tools")
        except UserCodeError as e:
            raise ToolError(str(e)) from None
        tools.append(Tool(name, fn, schema_of(fn, f"tools: {name if callable(spec) else spec}")))
    names = [t.name for t in tools]
    if len(set(names)) != len(names):
        raise ToolError(f"tools: two tools share a name: {names}")
    return tools


def check_template(tokenizer, schemas: list[dict]) -> None:
    """The chat template writes the tools into the prompt, and a response template reads calls back."""
    if getattr(tokenizer, "chat_template", None) is None:
        raise ToolError("tools: the tokenizer has no chat template (set chat_template_path)")
    probe = [{"role": "user", "content": "x"}]
    text = tokenizer.apply_chat_template(probe, tools=schemas, tokenize=False, add_generation_prompt=True)
    if schemas[0]["function"]["name"] not in text:
        raise ToolError("tools: the chat template ignores `tools` (the prompt would not show them); set "
                        "chat_template_path, e.g. grpo_recipe/assets/chatml_tools.jinja for ChatML models")
    if getattr(tokenizer, "response_template", None) is None and getattr(tokenizer, "response_schema", None) is None:
        raise ToolError("tools: the tokenizer has no response template to read tool calls with; set "
                        "response_template_path, e.g. grpo_recipe/assets/chatml_tools_response.json")


class ToolRunner:
    """Calls the model's tool calls, each bounded by `timeout_s`, and counts them."""

    def __init__(self, tools: list[Tool], timeout_s: float):
        self.tools = {t.name: t.fn for t in tools}
        self.schemas = [t.schema for t in tools]
        self.timeout_s = timeout_s or None

    def call(self, call: dict, tools: dict[str, Callable] | None = None) -> tuple[str, str, bool]:
        """(tool name, the result as the model reads it, whether the call failed); `tools`: this completion's own
        (an environment's methods), else the configured ones."""
        tools = self.tools if tools is None else tools
        fn_call = call.get("function") or {}
        name = str(fn_call.get("name", "unknown")) if isinstance(fn_call, dict) else "unknown"
        try:
            if call.get("type") != "function" or not isinstance(fn_call, dict):
                raise ValueError(f"Unsupported tool call type: {call.get('type')}")
            if name not in tools:
                raise ValueError(f"Tool {name} not found.")
            args = fn_call.get("arguments") or {}
            if not isinstance(args, dict):
                raise ValueError(f"arguments must be an object, got {type(args).__name__}")
            with signals.bounded(f"tool {name!r}", self.timeout_s):
                result = tools[name](**args)
            return name, result if isinstance(result, str) else str(result), False
        except signals.Interrupted as e:
            if e.signal is not None:  # a stop signal: the run saves and exits
                raise
            return name, str({"error": f"timed out after {self.timeout_s:g} s"}), True
        except Exception as e:  # noqa: BLE001 - the model reads the failure, as in TRL
            return name, str({"error": str(e)}), True


def context_length(cfg: Config, model_config) -> int:
    """The longest sequence generation may be asked to continue: vLLM's context, or the model's positions."""
    if cfg.generation_backend == "vllm":
        return cfg.vllm_max_model_len or cfg.max_prompt_length + cfg.max_completion_length
    return model_config.max_position_embeddings


def tool_suffix(tokenizer, tool_messages: list[dict], template_kwargs: dict) -> list[int]:
    """The tokens the chat template writes after an assistant turn that called tools: the results and the next
    assistant header (the difference between two renderings of a short conversation, as TRL takes it)."""
    calls = [{"type": "function", "function": {"name": tool_messages[0]["name"], "arguments": {}}}]
    before = [{"role": "user", "content": "x"}, {"role": "assistant", "content": "", "tool_calls": calls}]
    kw = dict(tokenize=True, return_dict=False, **template_kwargs)
    prefix = tokenizer.apply_chat_template(before, add_generation_prompt=False, **kw)
    full = tokenizer.apply_chat_template(before + tool_messages, add_generation_prompt=True, **kw)
    eos = [i for i, t in enumerate(prefix) if t == tokenizer.eos_token_id]
    prefix = prefix[:eos[-1] + 1] if eos else prefix  # the turn ends at EOS: what follows belongs to the suffix
    if full[:len(prefix)] != prefix:
        raise ToolError("tools: the chat template renders an assistant turn differently once tool results follow "
                        "it, so the results cannot be appended to the sampled tokens")
    return full[len(prefix):]


def _check_calls(calls) -> None:
    """Calls as the loop runs them: each a dict naming a function (TRL's rule); no arguments reads as {}."""
    if not isinstance(calls, list):
        raise ValueError("tool_calls must be a list")
    for call in calls:
        body = call.get("function", call) if isinstance(call, dict) else None
        if not isinstance(body, dict) or not isinstance(body.get("name"), str):
            raise ValueError("a tool call without a function name")
        if body.get("arguments") is None:
            body["arguments"] = {}


def parse(tokenizer, ids: list[int], prefix: list[int], schemas: list[dict]) -> dict:
    """The assistant message of a model turn (content, tool_calls), read by the tokenizer's response template.
    A turn the template cannot read, or whose calls are malformed, is plain text without a call, as in TRL."""
    try:
        turn = tokenizer.parse_response(ids, prefix=prefix, tools=schemas)
        if turn is None:  # a turn truncated before any field
            raise ValueError("nothing parsed")
        content = turn.get("content")
        turn["content"] = content.removesuffix(tokenizer.eos_token) if isinstance(content, str) else (content or "")
        if "tool_calls" in turn:
            _check_calls(turn["tool_calls"])
        return turn
    except (ValueError, TypeError):
        return {"role": "assistant", "content": tokenizer.decode(ids, skip_special_tokens=True)}


def multi_turn(generate: Callable[[list[list[int]], int | None, int], Completions], tokenizer, cfg: Config,
               prompt_ids: list[list[int]], runner: ToolRunner, max_model_len: int,
               per_sample: list[tuple[dict, list[dict]]] | None = None, synced: bool = True) -> Completions:
    """Sample G completions per prompt with `generate(prompts, n, round)`, then run the tool rounds.

    `per_sample` (environments): `prompt_ids` are already one per completion, each with its own (tools, schemas).
    `synced`: every rank calls `generate` the same number of times (hf generation under ZeRO-3 gathers the weights
    on every rank): a rank with no call left generates one throw-away sample while another still has calls. A
    generation rank generates alone (synced False).
    """
    first = generate(prompt_ids, 1 if per_sample else None, 0)
    n = len(first.ids) // len(prompt_ids)
    prompts = [p for p in prompt_ids for _ in range(n)]
    per_sample = per_sample or [(runner.tools, runner.schemas)] * len(prompts)
    ids = [list(x) for x in first.ids]
    mask = [[1] * len(x) for x in ids]  # 1: the model's tokens, 0: tool results
    logps = [row[:len(x)].tolist() if first.logps is not None else None for row, x in zip(
        first.logps if first.logps is not None else [None] * len(ids), ids)]
    truncated = first.truncated.tolist()
    turns = [[parse(tokenizer, x, p, schemas)] for x, p, (_, schemas) in zip(ids, prompts, per_sample)]
    calls = failures = rounds = 0
    pending = [i for i, t in enumerate(turns) if t[-1].get("tool_calls") and not truncated[i]]
    limit = cfg.max_tool_calling_iterations or float("inf")
    while rounds < limit and (any_rank(bool(pending)) if synced else bool(pending)):
        rounds += 1
        cont, keep = [], []
        for i in pending:
            results = []
            for call in turns[i][-1]["tool_calls"]:
                name, content, failed = runner.call(call, per_sample[i][0])
                calls, failures = calls + 1, failures + failed
                results.append({"role": "tool", "name": name, "content": content})
            suffix = tool_suffix(tokenizer, results, cfg.chat_template_kwargs)
            extended = prompts[i] + ids[i] + suffix
            if len(ids[i]) + len(suffix) >= cfg.max_completion_length or len(extended) >= max_model_len:
                continue  # the results do not fit: the completion ends with its call
            turns[i] += results
            mask[i] += [0] * len(suffix)
            if logps[i] is not None:
                logps[i] += [0.0] * len(suffix)
            ids[i] += suffix
            cont.append(extended)
            keep.append(i)
        out = generate(cont or [prompts[0]], 1, rounds)  # a rank with nothing left keeps the others company
        if not cont:
            pending = []
            continue
        pending = []
        for j, i in enumerate(keep):
            room = cfg.max_completion_length - len(ids[i])
            new = list(out.ids[j])[:room]
            ids[i] += new
            mask[i] += [1] * len(new)
            if logps[i] is not None:
                logps[i] += out.logps[j, :len(new)].tolist() if out.logps is not None else [0.0] * len(new)
            truncated[i] = bool(out.truncated[j]) or len(out.ids[j]) > room
            turns[i].append(parse(tokenizer, new, cont[j], per_sample[i][1]) if new else {})
            if turns[i][-1].get("tool_calls") and not truncated[i]:
                pending.append(i)
    return completions_of(tokenizer, ids, mask, logps, truncated, turns, {"tool_calls": calls,
                          "tool_failures": failures, "tool_rounds": rounds})


def completions_of(tokenizer, ids, mask, logps, truncated, turns, counts) -> Completions:
    width = max(1, max(len(x) for x in ids))
    extent, tool_mask = torch.zeros(len(ids), width), torch.zeros(len(ids), width)
    for i, (x, m) in enumerate(zip(ids, mask)):
        extent[i, :len(x)] = 1.0
        tool_mask[i, :len(m)] = torch.tensor(m, dtype=torch.float)
    sampled = None
    if all(lp is not None for lp in logps):
        sampled = torch.zeros(len(ids), width)
        for i, lp in enumerate(logps):
            sampled[i, :len(lp)] = torch.tensor(lp)
    texts = tokenizer.batch_decode(ids, skip_special_tokens=True)
    return Completions(ids, extent, torch.tensor(truncated, dtype=torch.bool), texts, sampled, tool_mask,
                       [[m for m in t if m] for t in turns], counts)
