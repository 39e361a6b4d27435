"""A short supervised warm-up: teach a model a turn format (tool calls) before GRPO.

    python -m grpo_recipe.tools.sft --model output/models/smollm2-135m-instruct --data demos.jsonl \
        --out output/models/smollm2-tools [--steps 60] [--learning-rate 5e-5] \
        [--chat-template grpo_recipe/assets/chatml_tools.jinja] \
        [--response-template grpo_recipe/assets/chatml_tools_response.json]

`--data`: one conversation per line, {"messages": [...], "tools": [schemas]} (TRL's conversational format); only
the assistant's tokens are trained (model/sft.py). The output folder is a model folder whose tokenizer carries the
chat and response templates given, so a GRPO config needs no template paths for it.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

from grpo_recipe.config.schema import Config, ConfigError
from grpo_recipe.generation.tools import set_templates
from grpo_recipe.model.load import load_tokenizer
from grpo_recipe.model.sft import warm_up
from grpo_recipe.model.source import model_path


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", required=True)
    parser.add_argument("--data", required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--learning-rate", type=float, default=5e-5)
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--chat-template")
    parser.add_argument("--response-template")
    args = parser.parse_args(argv)
    from transformers import AutoModelForCausalLM

    try:  # a missing model or template: one line, before any work
        path = model_path(Config(model_name_or_path=args.model))
        tok = load_tokenizer(path)
    except (ConfigError, OSError, ValueError) as e:
        print(f"error: --model: cannot load {args.model}: {' '.join(str(e).split())[:300]}", file=sys.stderr)
        return 2
    try:
        set_templates(tok, Config(chat_template_path=args.chat_template, response_template_path=args.response_template))
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    try:
        rows = [json.loads(line) for line in Path(args.data).read_text().splitlines() if line.strip()]
    except (OSError, ValueError) as e:
        print(f"error: --data: cannot read {args.data}: {e}", file=sys.stderr)
        return 2
    if not rows or not all(isinstance(r, dict) and isinstance(r.get("messages"), list) for r in rows):
        print(f"error: --data: {args.data} needs one {{\"messages\": [...]}} object per line", file=sys.stderr)
        return 2
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    losses = warm_up(model, tok, rows, args.steps, args.learning_rate, args.batch_size, args.seed,
                     log=lambda line: print(line, file=sys.stderr, flush=True))
    out = Path(args.out)
    model.save_pretrained(out)
    tok.save_pretrained(out)
    (out / "warm_up.json").write_text(json.dumps({"from": str(args.model), "data": str(args.data),
                                                  "steps": args.steps, "learning_rate": args.learning_rate,
                                                  "batch_size": args.batch_size, "seed": args.seed,
                                                  "first_loss": losses[0], "last_loss": losses[-1]}, indent=1))
    print(f"wrote {out} (loss {losses[0]:.3f} -> {losses[-1]:.3f})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
