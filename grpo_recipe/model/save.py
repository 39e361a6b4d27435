"""Saving HF-format weights: gathered from the ZeRO-3 shards onto rank 0 and written atomically (a LoRA adapter
in peft's format, optionally merged too)."""
from __future__ import annotations

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


def save_hf_model(engine, tokenizer, out_dir: Path, rank: int, save_merged: bool = False) -> None:
    """Gather the ZeRO-3 weights layer by layer onto rank 0 and write an HF folder atomically.

    With LoRA, out_dir gets the adapter in peft's format (only the adapter is gathered), and with save_merged
    also OUT_DIR-merged the full model with the adapter merged in.
    """
    from grpo_recipe.model import lora

    peft = lora.is_peft(engine.module)
    if peft:
        state = lora.adapter_state(engine, rank)
    else:
        state = engine._zero3_consolidated_16bit_state_dict() if is_zero3(engine) else engine.module.state_dict()
    if rank != 0:
        return
    write_atomically(out_dir, lambda tmp: (engine.module.save_pretrained(tmp, state_dict=state),
                                            tokenizer.save_pretrained(tmp)))
    if peft and save_merged:
        merged = lora.merged_model(engine.module, out_dir)
        write_atomically(out_dir.with_name(out_dir.name + "-merged"),
                          lambda tmp: (merged.save_pretrained(tmp), tokenizer.save_pretrained(tmp)))


def write_atomically(out_dir: Path, write) -> None:
    """Call write(tmp) on OUT_DIR.tmp, then put it in place of out_dir (a reader never sees half a folder)."""
    tmp = out_dir.with_name(out_dir.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    write(tmp)
    follow_umask(tmp)
    if out_dir.exists():
        shutil.rmtree(out_dir)
    os.rename(tmp, out_dir)
