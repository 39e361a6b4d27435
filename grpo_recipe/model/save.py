"""Saving HF-format weights: gathered from the ZeRO-3 shards onto rank 0 a group of layers at a time and written
as safetensors shards, atomically (a LoRA adapter in peft's format, optionally merged too). No rank ever holds a
second copy of the whole model: a save adds at most one shard (SHARD_BYTES) to a rank's memory."""
from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

from grpo_recipe.model.engine import is_zero3


def follow_umask(folder: Path) -> None:
    """Give every file and folder under `folder` the mode the user's umask asks for: safetensors writes its
    weights 0600, everything else follows the umask, and a folder with mixed modes surprises whoever shares it."""
    umask = os.umask(0)  # reading the umask means setting it; put it straight back
    os.umask(umask)
    for p in [folder, *folder.rglob("*")]:
        if not p.is_symlink():
            os.chmod(p, (0o777 if p.is_dir() else 0o666) & ~umask)


SHARD_BYTES = 512 << 20  # one safetensors file of the saved model; what a save adds to a rank's memory


def save_hf_model(engine, tokenizer, out_dir: Path, rank: int, save_merged: bool = False) -> None:
    """Write an HF folder of the policy atomically; every rank calls it (ZeRO-3 gathers are collective).

    With LoRA, out_dir gets the adapter in peft's format (only the adapter is gathered), and with save_merged
    also OUT_DIR-merged the full model with the adapter merged in.
    """
    from grpo_recipe.model import lora

    if lora.is_peft(engine.module):
        state = lora.adapter_state(engine, rank)
        if rank != 0:
            return
        write_atomically(out_dir, lambda tmp: (engine.module.save_pretrained(tmp, state_dict=state),
                                                tokenizer.save_pretrained(tmp)))
        if save_merged:
            merged = lora.merged_model(engine.module, out_dir)
            write_atomically(out_dir.with_name(out_dir.name + "-merged"),
                              lambda tmp: (merged.save_pretrained(tmp), tokenizer.save_pretrained(tmp)))
        return
    if not is_zero3(engine):
        if rank == 0:
            write_atomically(out_dir, lambda tmp: (engine.module.save_pretrained(tmp), tokenizer.save_pretrained(tmp)))
        return
    tmp = out_dir.with_name(out_dir.name + ".tmp")
    if rank == 0:
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
    error = write_gathered(engine.module, tmp, rank)
    if rank != 0:
        return
    if error is not None:
        raise error
    save_model_files(engine.module, tmp)
    tokenizer.save_pretrained(tmp)
    publish(tmp, out_dir)


def shards(named: list[tuple[str, object]], limit: int | None = None) -> list[list[tuple[str, object]]]:
    """Parameters in order, cut into groups of at most `limit` bytes (SHARD_BYTES; a larger tensor is a group
    alone)."""
    limit = SHARD_BYTES if limit is None else limit
    groups, size = [[]], 0
    for name, p in named:
        nbytes = getattr(p, "ds_numel", p.numel()) * p.element_size()
        if groups[-1] and size + nbytes > limit:
            groups.append([])
            size = 0
        groups[-1].append((name, p))
        size += nbytes
    return [g for g in groups if g]


def write_gathered(module, folder: Path, rank: int) -> Exception | None:
    """Every parameter (a tied one once, under its first name, as transformers saves it), gathered a shard at a
    time; rank 0 writes each shard and then the index. Rank 0 keeps gathering after a failed write (the other
    ranks are in the same collectives) and returns the error."""
    import deepspeed
    from safetensors.torch import save_file

    groups = shards(list(module.named_parameters()))
    names = ["model.safetensors"] if len(groups) == 1 else \
        [f"model-{i + 1:05d}-of-{len(groups):05d}.safetensors" for i in range(len(groups))]
    weight_map, total, error = {}, 0, None
    for name, group in zip(names, groups):
        with deepspeed.zero.GatheredParameters([p for _, p in group], modifier_rank=None):
            if rank != 0 or error is not None:
                continue
            tensors = {n: p.detach().to("cpu", copy=True).contiguous() for n, p in group}
        try:
            save_file(tensors, str(folder / name), metadata={"format": "pt"})
        except Exception as e:  # noqa: BLE001 -- a full disk, permissions: reported after the last collective
            error = e
        weight_map |= dict.fromkeys(tensors, name)
        total += sum(t.numel() * t.element_size() for t in tensors.values())
        del tensors
    if rank == 0 and error is None and len(names) > 1:
        index = {"metadata": {"total_size": total}, "weight_map": weight_map}
        try:
            (folder / "model.safetensors.index.json").write_text(json.dumps(index, indent=2, sort_keys=True) + "\n")
        except OSError as e:
            error = e
    return error


def save_model_files(module, folder: Path) -> None:
    """config.json (with the dtype the weights were written in) and generation_config.json, as save_pretrained."""
    first = next(module.parameters())
    module.config.dtype = first.dtype
    module.config.architectures = [type(module).__name__]
    module.config.save_pretrained(folder)
    if getattr(module, "generation_config", None) is not None and module.can_generate():
        module.generation_config.save_pretrained(folder)


def write_atomically(out_dir: Path, write) -> None:
    """Call write(tmp) on OUT_DIR.tmp, then put it in place of out_dir (a reader never sees half a folder)."""
    tmp = out_dir.with_name(out_dir.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    write(tmp)
    publish(tmp, out_dir)


def publish(tmp: Path, out_dir: Path) -> None:
    """A complete OUT_DIR.tmp becomes out_dir, with the modes the umask asks for."""
    follow_umask(tmp)
    if out_dir.exists():
        shutil.rmtree(out_dir)
    os.rename(tmp, out_dir)
