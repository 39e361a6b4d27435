"""Turn a recipe checkpoint into a Hugging Face model folder, unpickling every file with weights_only=True.

    python -m grpo_recipe.tools.export OUTPUT_DIR/checkpoints/step-00000100 OUT [--merged]
    python -m grpo_recipe.tools.export OUTPUT_DIR OUT          # its newest complete checkpoint

DeepSpeed's zero_to_fp32.py (not shipped in the recipe's checkpoints) unpickles with weights_only=False; this
merges the ZeRO shards with DeepSpeed's own functions, but every file goes through checkpoint.safe_load. The
checkpoint is checked against its manifest (sizes and checksums) first. Like OUTPUT_DIR/final: the full
model, or with LoRA the adapter (and with --merged also OUT-merged, the full model with the adapter merged in).
"""
from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import sys
from pathlib import Path

import torch

from grpo_recipe.config.schema import Config, ConfigError
from grpo_recipe.model.load import load_tokenizer
from grpo_recipe.model.save import write_atomically
from grpo_recipe.run.checkpoint import Checkpointer, CheckpointError, safe_load


@contextlib.contextmanager
def _weights_only_torch_load():
    """DeepSpeed's converter calls torch.load(..., weights_only=False) itself: route it through safe_load."""
    original = torch.load
    torch.load = lambda f, map_location=None, mmap=None, **_: safe_load(f, map_location, mmap)
    try:
        yield
    finally:
        torch.load = original


def find_checkpoint(path: Path) -> Path:
    """A complete checkpoint folder (checked against its manifest), or an output folder's newest complete one."""
    checkpointer = Checkpointer(Config(output_dir=str(path), resume_from_checkpoint="auto"), 0, 1)
    if (path / "meta.json").exists() or not path.is_dir():
        problem = checkpointer.verify(path) if path.is_dir() else "not a folder"
        if problem:
            raise CheckpointError(f"{path}: {problem}")
        return path
    found = checkpointer.find()
    if found is None:
        raise CheckpointError(f"{path}: neither a checkpoint nor an output folder with a complete one")
    return found


def run_config(folder: Path) -> Config:
    saved = json.loads((folder / "meta.json").read_text())["config"]
    names = {f.name for f in dataclasses.fields(Config)}
    return Config(**{k: v for k, v in saved.items() if k in names})


def export(checkpoint: Path, out: Path, merged: bool = False) -> Path:
    """Write the checkpoint's policy to `out` (atomically); returns the checkpoint folder used."""
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint
    from transformers import AutoModelForCausalLM

    from grpo_recipe.model.source import model_folder

    folder = find_checkpoint(checkpoint)
    cfg = run_config(folder)
    with _weights_only_torch_load():
        state = get_fp32_state_dict_from_zero_checkpoint(str(folder), tag="ds")
    local = model_folder(cfg.model_name_or_path)  # as training found it: a cached hub model needs no network
    path = str(local) if local is not None else cfg.model_name_or_path
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    if cfg.use_peft:
        from grpo_recipe.model import lora

        model = lora.wrap(model, cfg)
    try:
        model.load_state_dict(state, strict=True)
    except RuntimeError as e:
        raise CheckpointError(f"{folder} does not fit the model {path}: {' '.join(str(e).split())[:300]}") from None
    tokenizer = load_tokenizer(path)
    write_atomically(out, lambda tmp: (model.save_pretrained(tmp), tokenizer.save_pretrained(tmp)))
    if cfg.use_peft and merged:
        from grpo_recipe.model import lora

        full = lora.merged_model(model, out)
        write_atomically(out.with_name(out.name + "-merged"),
                              lambda tmp: (full.save_pretrained(tmp), tokenizer.save_pretrained(tmp)))
    return folder


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m grpo_recipe.tools.export", description=__doc__.split("\n\n")[0])
    p.add_argument("checkpoint", type=Path, help="a checkpoints/step-* folder, or an output_dir (its newest one)")
    p.add_argument("out", type=Path, help="the Hugging Face folder to write")
    p.add_argument("--merged", action="store_true", help="with LoRA: also write OUT-merged, the merged full model")
    args = p.parse_args(argv)
    try:
        folder = export(args.checkpoint, args.out, args.merged)
    except (CheckpointError, ConfigError, OSError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(f"{folder} -> {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
