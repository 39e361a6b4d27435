"""Greedy accuracy of a saved model on a held-out prompt/answer file.

    python -m grpo_recipe.tools.evaluate --model output/smollm2_arith/final --data data/arith/eval.jsonl \
        [--reward grpo_recipe.examples.arith_rewards:correctness] [--max-new-tokens 64] [--out result.json]

Prompts are formatted exactly as in training (the same chat-template code path); a sample counts as right
when the reward function gives it >= --threshold. Prints accuracy with its binomial standard error
sqrt(p (1 - p) / n), and writes the per-sample completions with --samples.
"""
from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path

import torch

from grpo_recipe.algo.buffer import left_pad
from grpo_recipe.config.schema import Config
from grpo_recipe.data.prompts import DataError, PromptStream, check_prompts, load_prompt_dataset
from grpo_recipe.model.load import load_tokenizer
from grpo_recipe.model.source import model_path as resolve_model
from grpo_recipe.rewards.funcs import RewardError, load_reward_funcs, score

DEFAULT_REWARD = "grpo_recipe.examples.arith_rewards:correctness"


@torch.no_grad()
def greedy(model, tok, texts: list[str], max_new_tokens: int, batch_size: int, add_special: bool) -> list[str]:
    """Greedy completions, batched by similar length (left padding) for speed; returned in input order."""
    enc = [tok(t, add_special_tokens=add_special)["input_ids"] for t in texts]
    order = sorted(range(len(enc)), key=lambda i: len(enc[i]))
    out: list[str] = [""] * len(enc)
    for start in range(0, len(order), batch_size):
        idx = order[start:start + batch_size]
        ids, attn = left_pad([enc[i] for i in idx], tok.pad_token_id)
        width = ids.shape[1]
        gen = model.generate(input_ids=ids.to(model.device), attention_mask=attn.to(model.device), do_sample=False, max_new_tokens=max_new_tokens,
                             eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id, top_p=None, top_k=None,
                             temperature=None)
        for row, i in enumerate(idx):
            out[i] = tok.decode(gen[row, width:].tolist(), skip_special_tokens=True)
    return out


def evaluate(model_path: str, data: str, reward: str = DEFAULT_REWARD, prompt_column: str = "prompt",
             max_new_tokens: int = 64, batch_size: int = 32, limit: int | None = None, threshold: float = 1.0,
             chat_template: str = "auto", max_prompt_length: int = 512) -> dict:
    from transformers import AutoModelForCausalLM

    cfg = Config(model_name_or_path=model_path, dataset_name=data, prompt_column=prompt_column,
                 chat_template=chat_template, max_prompt_length=max_prompt_length)
    funcs = load_reward_funcs([reward])
    ds = load_prompt_dataset(cfg)
    if limit is not None:
        ds = ds.select(range(min(limit, len(ds))))
    path = resolve_model(cfg)
    tok = load_tokenizer(path)
    stream = PromptStream(ds, tok, cfg, rank=0, world_size=1)  # the training path's prompt formatting
    check_prompts(ds, cfg, stream.use_chat)
    if (Path(path) / "adapter_config.json").is_file():  # a LoRA run's OUTPUT_DIR/final: base + adapter
        from peft import AutoPeftModelForCausalLM

        model = AutoPeftModelForCausalLM.from_pretrained(path, dtype=torch.float32).merge_and_unload().eval()
    else:
        model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    model.to("cuda" if torch.cuda.is_available() else "cpu")
    rows = ds[:]
    prompts = rows[prompt_column]
    t0 = time.perf_counter()
    completions = greedy(model, tok, [stream.format(p) for p in prompts], max_new_tokens, batch_size,
                         add_special=not stream.use_chat)
    seconds = time.perf_counter() - t0
    scores, _ = score(funcs, prompts, completions, {k: v for k, v in rows.items() if k != prompt_column})
    right = (scores >= threshold).float()
    n, acc = len(right), right.mean().item()
    return {"model": model_path, "data": data, "reward": reward, "n": n, "correct": int(right.sum().item()),
            "accuracy": acc, "stderr": math.sqrt(acc * (1 - acc) / n), "max_new_tokens": max_new_tokens,
            "seconds": round(seconds, 1),
            "samples": [{"prompt": p, "completion": c, "score": s.item()} for p, c, s in zip(prompts, completions, scores)]}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", required=True, help="a model folder (e.g. OUTPUT_DIR/final, a LoRA adapter folder too) or hub name")
    p.add_argument("--data", required=True, help="a jsonl/json/parquet/csv file with the prompt and answer columns")
    p.add_argument("--reward", default=DEFAULT_REWARD, help="a reward spec (built-in, module:function, file.py:function)")
    p.add_argument("--prompt-column", default="prompt")
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--limit", type=int, default=None, help="only the first N rows")
    p.add_argument("--threshold", type=float, default=1.0, help="a reward >= this counts as right")
    p.add_argument("--chat-template", default="auto")
    p.add_argument("--out", default=None, help="write the summary JSON here")
    p.add_argument("--samples", default=None, help="write per-sample completions (jsonl) here")
    args = p.parse_args(argv)
    try:
        res = evaluate(args.model, args.data, args.reward, args.prompt_column, args.max_new_tokens, args.batch_size,
                       args.limit, args.threshold, args.chat_template)
    except (DataError, RewardError, OSError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    samples = res.pop("samples")
    if args.samples:
        Path(args.samples).write_text("".join(json.dumps(s) + "\n" for s in samples))
    if args.out:
        Path(args.out).write_text(json.dumps(res, indent=2) + "\n")
    print(f"accuracy {res['accuracy']:.4f} +- {res['stderr']:.4f} (binomial s.e.) = {res['correct']}/{res['n']} "
          f"on {args.data} [{res['seconds']} s]")
    return 0


if __name__ == "__main__":
    sys.exit(main())
