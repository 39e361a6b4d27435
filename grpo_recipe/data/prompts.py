"""Prompts: loading (datasets), formatting (chat template), left truncation and padding, rank sharding, epoch order.

The prompt stream is a pure function of the rollout index: epoch e visits the dataset in a permutation
seeded by (seed, e), and rollout k takes the next `world x prompts_per_rank` prompts of that endless
stream, rank r its own contiguous slice. Nothing but the rollout index needs saving to resume.
"""
from __future__ import annotations

import os
from dataclasses import dataclass

import torch

from grpo_recipe.config.schema import Config, resolve_path


class DataError(ValueError):
    """The dataset cannot feed the recipe; the message says why."""


# Names the reward functions receive as arguments: a dataset column of that name would collide with them.
RESERVED_COLUMNS = ("prompts", "completions", "completion_ids", "environments")


def _one_line(e: Exception) -> str:
    return " ".join(str(e).split())[:400]


def _field_named_by(message: str) -> str:
    """Which field a `datasets` loading error is about, so the one-line message names it."""
    low = message.lower()
    if "split" in low or "slice" in low:
        return "dataset_split"
    return "dataset_config" if "config" in low else "dataset_name"


def load_prompt_dataset(cfg: Config, for_eval: bool = False):
    """The prompt dataset: a local file in any format `datasets` reads, a local dataset folder (data files,
    a README.md with `configs:`, or a `save_to_disk` folder), or a hub dataset; `dataset_split` may slice.
    With `for_eval`: eval_dataset_name, eval_dataset_split and eval_dataset_config (null: dataset_config's)."""
    import datasets

    datasets.disable_progress_bars()
    name, config, split = cfg.dataset_name, cfg.dataset_config, cfg.dataset_split
    named = lambda f: f  # noqa: E731 (the field an error names)
    own_config = not for_eval or cfg.eval_dataset_config is not None  # an inherited config does not bind a file
    if for_eval:
        name, split = cfg.eval_dataset_name, cfg.eval_dataset_split
        config = cfg.eval_dataset_config if own_config else cfg.dataset_config
        named = lambda f: f"eval_{f}" if own_config or f != "dataset_config" else f  # noqa: E731
    path = resolve_path(os.path.expanduser(name))
    if split is None:  # eval_dataset_split null: a file's rows are its one split, "train"; a dataset's test split
        split = "train" if path.is_file() else "test"
    where = f"{name!r}" + (f" config {config!r}" if config else "") + f" split {split!r}"
    try:
        if path.is_file():
            if config and own_config:
                raise DataError(f"{named('dataset_config')}: {name} is a single file, it has no configs "
                                f"(got {config!r})")
            check_not_empty(path, name, named("dataset_name"))
            # the folder-based loader infers the format from the file's extension (compressed ones too)
            ds = datasets.load_dataset(str(path.parent.resolve()), data_files=path.name, split=split)
        elif path.is_dir() and ((path / "state.json").is_file() or (path / "dataset_dict.json").is_file()):
            ds = _load_saved(path, split)
        else:
            ds = datasets.load_dataset(str(path) if path.is_dir() else name, config, split=split)
    except DataError:
        raise
    except Exception as e:
        msg = _one_line(e)
        raise DataError(f"{named(_field_named_by(msg))}: cannot load {where}: {type(e).__name__}: {msg}") from e
    check_columns(ds, cfg.prompt_column, name)
    if len(ds) == 0:
        raise DataError(f"{named('dataset_split')}: {where} has no rows")
    return ds


def load_datasets(cfg: Config, train=None, eval_set=None):
    """(train prompts, eval prompts or None): the eval set is eval_dataset_name, or eval_holdout_size train rows.
    `train`, `eval_set`: `datasets.Dataset` objects given in Python instead of dataset_name and eval_dataset_name
    (checked the same way)."""
    if train is not None:
        check_dataset(train, cfg.prompt_column, "train_dataset")
        if eval_set is not None:
            check_dataset(eval_set, cfg.prompt_column, "eval_dataset")
            return train, eval_set
        return hold_out(train, cfg.eval_holdout_size, cfg.seed) if cfg.eval_holdout_size else (train, None)
    ds = load_prompt_dataset(cfg)
    if cfg.eval_holdout_size:
        return hold_out(ds, cfg.eval_holdout_size, cfg.seed)
    return ds, load_prompt_dataset(cfg, for_eval=True) if cfg.eval_dataset_name else None


def check_dataset(ds, prompt_column: str, name: str) -> None:
    import datasets

    if not isinstance(ds, datasets.Dataset):
        raise DataError(f"{name}: expected a datasets.Dataset, got {type(ds).__name__}")
    check_columns(ds, prompt_column, name)
    if len(ds) == 0:
        raise DataError(f"{name}: has no rows")


def hold_out(ds, size: int, seed: int):
    """(train, held-out): `size` rows picked by the seed leave the train set for evaluation."""
    if size >= len(ds):
        raise DataError(f"eval_holdout_size: {size} leaves no training prompts (the dataset has {len(ds)} rows)")
    perm = torch.randperm(len(ds), generator=torch.Generator().manual_seed(seed + 104_729)).tolist()
    return ds.select(sorted(perm[size:])), ds.select(sorted(perm[:size]))


def _load_saved(path, split: str):
    """A `Dataset.save_to_disk` / `DatasetDict.save_to_disk` folder, with the same split syntax."""
    import datasets

    saved = datasets.load_from_disk(str(path))
    if isinstance(saved, datasets.Dataset):
        saved = datasets.DatasetDict({"train": saved})
    instruction = datasets.ReadInstruction.from_spec(split)
    sizes = {k: len(v) for k, v in saved.items()}
    parts = []
    for rel in instruction.to_absolute(sizes):
        parts.append(saved[rel.splitname].select(range(rel.from_, rel.to)))
    return parts[0] if len(parts) == 1 else datasets.concatenate_datasets(parts)


def check_columns(ds, prompt_column: str, name: str) -> None:
    """The prompt column exists and holds text or chat messages; no column collides with a reward argument."""
    import datasets

    if prompt_column not in ds.column_names:
        raise DataError(f"prompt_column: dataset {name} has no column {prompt_column!r} (has {ds.column_names})")
    clash = [c for c in ds.column_names if c in RESERVED_COLUMNS]
    if clash:
        raise DataError(f"dataset_name: column(s) {clash} of {name} collide with the reward functions' arguments "
                        f"{list(RESERVED_COLUMNS)}; rename them")
    feature = ds.features[prompt_column]
    text = isinstance(feature, datasets.Value) and feature.dtype in ("string", "large_string")
    mixed = type(feature).__name__ == "Json"  # rows of different shapes: each row is checked when it is used
    if not (text or mixed or _holds_messages(feature)):
        raise DataError(f"prompt_column: column {prompt_column!r} of {name} holds {feature}, expected text or a "
                        "list of chat messages ({role, content})")


def _holds_messages(feature) -> bool:
    """A list feature (datasets.List / Sequence, or [feature]) of {role, content, ...} records."""
    inner = feature[0] if isinstance(feature, list) and feature else getattr(feature, "feature", None)
    return isinstance(inner, dict) and {"role", "content"} <= set(inner)


def check_not_empty(path, name: str, field: str = "dataset_name") -> None:
    """A file with nothing in it (datasets would say only `StopIteration`)."""
    size = path.stat().st_size
    if size == 0 or size <= 1 << 16 and not path.read_bytes().strip():
        raise DataError(f"{field}: {name} is empty ({size} bytes, no rows)")


def uses_chat_template(tokenizer, cfg: Config) -> bool:
    """Whether prompts go through the tokenizer's chat template (`chat_template: true` demands one)."""
    mode = str(cfg.chat_template).lower()
    has_template = getattr(tokenizer, "chat_template", None) is not None
    if mode == "true" and not has_template:
        raise DataError("chat_template: true, but the tokenizer has no chat template")
    if cfg.chat_template_kwargs and not (has_template and mode != "false"):
        raise DataError("chat_template_kwargs: given, but no chat template is applied (chat_template: "
                        f"{cfg.chat_template}, tokenizer template: {'yes' if has_template else 'none'})")
    return has_template and mode != "false"


def check_prompts(ds, cfg: Config, chat: bool, name: str | None = None) -> None:
    """Every row's prompt, when the data loads (not when a rollout uses it, inside the loop): text or chat
    messages ({role, content}), none null or empty, chat messages only when a chat template applies them.
    `name`: the dataset the messages name (default dataset_name)."""
    column, name = cfg.prompt_column, name or cfg.dataset_name
    start = 0
    for batch in ds.select_columns([column]).iter(batch_size=10_000):
        for i, prompt in enumerate(batch[column], start):
            if prompt is None:
                raise DataError(f"prompt_column: row {i} of {name} has no {column!r} (null); every row needs a prompt")
            if isinstance(prompt, str) and not prompt.strip():
                raise DataError(f"prompt_column: row {i} of {name} has an empty {column!r}")
            if not isinstance(prompt, (str, list)):  # str() would train on "{'text': ...}" or "5"
                raise DataError(f"prompt_column: row {i} of {name} has a {column!r} of type {type(prompt).__name__} "
                                f"({str(prompt)[:60]!r}); a prompt is text or a list of chat messages")
            if isinstance(prompt, list) and not prompt:
                raise DataError(f"prompt_column: row {i} of {name} has an empty list of chat messages")
            messages = prompt if isinstance(prompt, list) else []
            bad = [m for m in messages if not (isinstance(m, dict) and isinstance(m.get("role"), str)
                                               and m.get("content") is not None)]
            if bad:
                raise DataError(f"prompt_column: row {i} of {name} has a chat message without a 'role' and "
                                f"'content': {str(bad[0])[:60]!r}")
            if isinstance(prompt, list) and not chat:
                why = "chat_template: false" if str(cfg.chat_template).lower() == "false" else \
                    f"the tokenizer of {cfg.model_name_or_path} has no chat template"
                raise DataError(f"prompt_column: row {i} of {name} holds chat messages, but {why}; give text "
                                "prompts or a model with a chat template")
        start += len(batch[column])


@dataclass
class PromptBatch:
    prompts: list  # as in the dataset (strings or chat messages), one per prompt
    prompt_ids: list[list[int]]
    columns: dict[str, list]  # every dataset column but the prompt column, one value per prompt
    num_truncated: int

    def repeat(self, g: int) -> "PromptBatch":
        """Each prompt repeated g times, group-contiguous, to line up with its completions."""
        rep = lambda xs: [x for x in xs for _ in range(g)]  # noqa: E731
        return PromptBatch(rep(self.prompts), rep(self.prompt_ids),
                           {k: rep(v) for k, v in self.columns.items()}, self.num_truncated)


class PromptStream:
    def __init__(self, dataset, tokenizer, cfg: Config, rank: int, world_size: int, tools: list[dict] | None = None):
        self.ds, self.tok, self.cfg = dataset, tokenizer, cfg
        self.tools = tools or None  # the schemas of the tools the model may call, written into each prompt
        self.rank, self.world = rank, world_size
        self.use_chat = uses_chat_template(tokenizer, cfg)
        self._perms: dict[int, torch.Tensor] = {}

    def _perm(self, epoch: int) -> torch.Tensor:
        if epoch not in self._perms:
            g = torch.Generator().manual_seed(self.cfg.seed + 7919 * epoch)
            self._perms = {epoch: torch.randperm(len(self.ds), generator=g)}  # keep one epoch cached
        return self._perms[epoch]

    def format(self, prompt, tools: list[dict] | None = None) -> str:
        """The text the model continues: chat-templated messages (system prompt first), or the plain prompt;
        `tools`: the schemas this prompt shows (default: the configured tools')."""
        system = self.cfg.system_prompt
        if self.use_chat:
            messages = list(prompt) if isinstance(prompt, list) else [{"role": "user", "content": str(prompt)}]
            if system and messages[0].get("role") != "system":  # a row's own system message wins
                messages.insert(0, {"role": "system", "content": system})
            return self.tok.apply_chat_template(messages, tools=tools or self.tools, tokenize=False,
                                                add_generation_prompt=True, **self.cfg.chat_template_kwargs)
        if isinstance(prompt, list):
            raise DataError(f"prompt_column: {self.cfg.prompt_column!r} holds chat messages, but no chat template "
                            "is applied (chat_template: false, or the tokenizer has none)")
        return f"{system}\n\n{prompt}" if system else str(prompt)

    def indices(self, rollout_index: int) -> list[int]:
        n, per_rank = len(self.ds), self.cfg.prompts_per_rollout
        start = (rollout_index * self.world + self.rank) * per_rank
        out = []
        for k in range(start, start + per_rank):
            epoch, pos = divmod(k, n)
            out.append(int(self._perm(epoch)[pos]))
        return out

    def batch(self, rollout_index: int) -> PromptBatch:
        return self.rows(self.indices(rollout_index))

    def rows(self, indices: list[int]) -> PromptBatch:
        """The dataset's rows `indices`, formatted, tokenized and truncated as training prompts."""
        rows = self.ds[indices]
        prompts = rows.pop(self.cfg.prompt_column)
        ids, truncated = self.encode(prompts)
        return PromptBatch(list(prompts), ids, dict(rows), truncated)

    def encode(self, prompts: list, tools: list[list[dict]] | None = None) -> tuple[list[list[int]], int]:
        """Prompts formatted (`tools`: each one's tool schemas), tokenized and cut to max_prompt_length; and how
        many were cut."""
        texts = [self.format(p, tools[i] if tools else None) for i, p in enumerate(prompts)]
        add_special = not self.use_chat  # a chat template already writes the special tokens
        ids = self.tok(texts, add_special_tokens=add_special)["input_ids"]
        limit = self.cfg.max_prompt_length
        truncated = sum(len(x) > limit for x in ids)
        ids = [list(x[-limit:]) for x in ids]  # keep the end: it holds the question and the answer cue
        if any(len(x) == 0 for x in ids):
            raise DataError("a prompt tokenized to zero tokens; check prompt_column")
        return ids, truncated
