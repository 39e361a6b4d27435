"""The recipe from Python: a user's own script builds a `GRPORun` and runs it, under `torchrun`, `deepspeed`,
`sbatch` or as one process, exactly as `grpo-train` runs (the CLI is the same `train.execute` on a config read
from the command line).

    from grpo_recipe import GRPORun

    def correct(prompts, completions, answer, **columns):
        return [float(c.strip().endswith(a)) for c, a in zip(completions, answer)]

    if __name__ == "__main__":
        GRPORun("my_config.yaml", reward_funcs=[correct], train_dataset=my_dataset, argv=sys.argv[1:]).run_and_exit()

Exit codes as grpo-train's: 0 done, 1 failed, 2 bad input, 75 stopped after a checkpoint (requeue).
"""
from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

from grpo_recipe import train  # first: stop signals are recorded and the allocator set from here on
from grpo_recipe.config.load import config_from_values, parse_cli, read_yaml
from grpo_recipe.config.schema import Config, ConfigError


class GRPORun:
    """One run: a config, optional reward functions and datasets as Python objects, the same checks as the CLI.

    `config`: a `Config`, a dict of fields (the recipe's names or TRL's), a YAML file's path, or None (the
    defaults). `reward_funcs`: functions (or {func, weight, kwargs} mappings with a function) in place of the
    config's; each takes TRL's arguments and returns one float per completion. `train_dataset`, `eval_dataset`:
    `datasets.Dataset` objects in place of dataset_name / eval_dataset_name (with `prompt_column` and the
    columns the rewards read). `tools`, `environment_factory`: functions and an environment class (or a mapping
    of names to classes) for multi-turn rollouts, as TRL's GRPOTrainer takes them. `overrides`: fields set on top. A bad config raises ConfigError here, before
    anything starts; the run itself reports problems as grpo-train does and returns its exit code. `argv`
    (e.g. sys.argv[1:]): `--key value` fields on top of everything, as a launcher passes them.
    """

    def __init__(self, config: Config | dict | str | Path | None = None, *, reward_funcs: list | None = None,
                 train_dataset=None, eval_dataset=None, tools: list | None = None, environment_factory=None,
                 argv: list[str] | None = None, **overrides: Any):
        if isinstance(config, Config):
            values = {f.name: getattr(config, f.name) for f in dataclasses.fields(Config)}
        elif isinstance(config, dict):
            values = dict(config)
        elif config is None:
            values = {}
        else:
            values = read_yaml(str(config))
        values.update(overrides)
        if argv:  # `--key value` from the command line (a launcher adds --resume_from_checkpoint auto), last
            path, cli = parse_cli(argv)
            if path is not None:
                raise ConfigError("--config: a script's GRPORun gives its config itself; pass fields as --key value")
            values.update(cli)
        if reward_funcs is not None:
            values["reward_funcs"] = list(reward_funcs)
        if tools is not None:  # functions, as TRL's GRPOTrainer(tools=...) takes them
            values["tools"] = list(tools)
        if environment_factory is not None:  # a class (or {name: class}), as TRL's environment_factory
            values["environment_factory"] = environment_factory
        if eval_dataset is not None and train_dataset is None:
            raise ConfigError("eval_dataset: give train_dataset too (or eval_dataset_name with the config's data)")
        if train_dataset is not None:  # its fingerprint stands for it in the config a checkpoint records
            values["dataset_name"] = f"python:datasets.Dataset:{getattr(train_dataset, '_fingerprint', '?')}"
            if eval_dataset is not None:
                values["eval_dataset_name"] = f"python:datasets.Dataset:{getattr(eval_dataset, '_fingerprint', '?')}"
        self.data = None if train_dataset is None else (train_dataset, eval_dataset)
        self.config = config_from_values(values)

    def run(self) -> int:
        """Train to the end (or a stop signal): grpo-train's exit code. Every rank of the launch calls it."""
        return train.execute(self.config, self.data)

    def run_and_exit(self) -> None:
        """`run`, then end the process at once with its code, as grpo-train does (no interpreter teardown, whose
        gloo and DeepSpeed destructors can abort a finished rank; a failed collective is one line naming the
        silent rank)."""
        from grpo_recipe.dist import liveness

        liveness.run_and_exit(self.run)

