"""SmolLM2-135M-Instruct learns multi-term arithmetic with a calculator tool: held-out greedy accuracy before and after.

    python bench/smollm2_tools.py            # every step below that has no output yet, then the summary
    python bench/smollm2_tools.py --summarize-only

Steps (each skipped when its output exists, so an interrupted run continues): prepare the model; build the data
(grpo_recipe.examples.calculator: 400 train, 60 held-out questions of three terms with +, - and *, and 200 warm-up
conversations on other questions); the untrained model's accuracy without tools (its own template); whether the
untrained model calls the tool when the shipped tool template shows it (greedy, one turn per held-out question);
a supervised warm-up on the conversations (grpo_recipe.tools.sft); GRPO with grpo_recipe/configs/smollm2_tools.yaml
on 2 CPU ranks, whose evaluation (greedy, with the tool) runs before the first step and after the last.
Writes bench/results/smollm2_tools.json.
"""
from __future__ import annotations

import argparse
import json
import os
import shlex
import subprocess
import sys
import time
from pathlib import Path

from common import REPO, machine, read_metrics, save_json

CONFIG = "grpo_recipe/configs/smollm2_tools.yaml"
MODEL = "output/models/smollm2-135m-instruct"
WARM = "output/models/smollm2-calculator"
DATA = "output/data/calculator"
RUN = "output/smollm2_tools"
LOGS = "output/smollm2_tools_bench"
TEMPLATES = ["--chat-template", "grpo_recipe/assets/chatml_tools.jinja",
             "--response-template", "grpo_recipe/assets/chatml_tools_response.json"]
WARM_STEPS = 12  # at batch 4: a few minutes of CPU for a 135M model, enough to learn the call format
MAX_NEW_TOKENS = 64  # = the config's max_completion_length

COMMANDS = {
    "prepare_model": [sys.executable, "-m", "grpo_recipe.tools.prepare_model", "--source", "smollm2", "--out", MODEL],
    "prepare_data": [sys.executable, "-m", "grpo_recipe.examples.calculator", "--out", DATA],
    "untrained_no_tools": [sys.executable, "-m", "grpo_recipe.tools.evaluate", "--model", MODEL, "--data",
                           f"{DATA}/eval.jsonl", "--reward", "grpo_recipe.examples.calculator:correct_final_answer",
                           "--max-new-tokens", str(MAX_NEW_TOKENS), "--out", f"{LOGS}/untrained_no_tools.json"],
    "untrained_tool_calls": [sys.executable, "bench/smollm2_tools.py", "--probe-calls", MODEL,
                             f"{LOGS}/untrained_tool_calls.json"],
    "warm_up": [sys.executable, "-m", "grpo_recipe.tools.sft", "--model", MODEL, "--data", f"{DATA}/demos.jsonl",
                "--out", WARM, "--steps", str(WARM_STEPS), "--batch-size", "4", "--learning-rate", "1e-4", *TEMPLATES],
    "warm_tool_calls": [sys.executable, "bench/smollm2_tools.py", "--probe-calls", WARM, f"{LOGS}/warm_tool_calls.json"],
    # not done until its final model exists: an interrupted run starts over
    "train": ["bash", "launch/local.sh", "--config", CONFIG, "--disable_tqdm", "true", "--overwrite_output_dir", "true"],
}
DONE = {"prepare_model": f"{MODEL}/config.json", "prepare_data": f"{DATA}/demos.jsonl",
        "untrained_no_tools": f"{LOGS}/untrained_no_tools.json",
        "untrained_tool_calls": f"{LOGS}/untrained_tool_calls.json", "warm_up": f"{WARM}/warm_up.json",
        "warm_tool_calls": f"{LOGS}/warm_tool_calls.json", "train": f"{RUN}/final/config.json"}


def run_steps() -> None:
    (REPO / LOGS).mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "PYTHONPATH": str(REPO), "TOKENIZERS_PARALLELISM": "false",
           "VENV_PY": os.environ.get("VENV_PY", sys.executable)}
    for name, cmd in COMMANDS.items():
        if (REPO / DONE[name]).exists():
            continue
        print(f"[{name}] {shlex.join(cmd)}", flush=True)
        t0 = time.perf_counter()
        with open(REPO / LOGS / f"{name}.log", "w") as log:
            subprocess.run(cmd, cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT, check=True)
        (REPO / LOGS / f"{name}.wall_s").write_text(f"{time.perf_counter() - t0:.1f}\n")


def probe_calls(model_dir: str, out: str) -> None:
    """Greedy first turns on the held-out questions with the tool shown: how many call it, and correctly."""
    import torch
    from transformers import AutoModelForCausalLM

    from grpo_recipe.algo.buffer import left_pad
    from grpo_recipe.config.schema import Config
    from grpo_recipe.examples.calculator import calculator
    from grpo_recipe.generation.tools import load_tools, parse, set_templates
    from grpo_recipe.model.load import load_tokenizer

    tok = load_tokenizer(model_dir)
    set_templates(tok, Config(chat_template_path=TEMPLATES[1], response_template_path=TEMPLATES[3]))
    schemas = [t.schema for t in load_tools(["grpo_recipe.examples.calculator:calculator"])]
    rows = [json.loads(line) for line in (REPO / DATA / "eval.jsonl").read_text().splitlines()]
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    calls = right = 0
    samples = []
    for start in range(0, len(rows), 20):
        prompts = [tok.apply_chat_template([{"role": "user", "content": r["prompt"]}], tools=schemas, tokenize=True,
                                           add_generation_prompt=True, return_dict=False) for r in rows[start:start + 20]]
        ids, attn = left_pad(prompts, tok.pad_token_id)
        with torch.no_grad():
            gen = model.generate(input_ids=ids, attention_mask=attn, do_sample=False, max_new_tokens=MAX_NEW_TOKENS,
                                 eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
        for row, prompt, new in zip(rows[start:start + 20], prompts, gen[:, ids.shape[1]:].tolist()):
            new = new[:new.index(tok.eos_token_id) + 1] if tok.eos_token_id in new else new
            turn = parse(tok, new, prompt, schemas)
            call = (turn.get("tool_calls") or [None])[0]
            calls += call is not None
            try:
                ok = call is not None and calculator(**call["function"]["arguments"]) == row["answer"]
            except Exception:  # noqa: BLE001 - a malformed call is a wrong one
                ok = False
            right += ok
            samples.append({"prompt": row["prompt"], "turn": tok.decode(new, skip_special_tokens=False)})
    Path(REPO / out).write_text(json.dumps({"model": model_dir, "n": len(rows), "calls": calls,
                                            "calls_giving_the_answer": right, "samples": samples[:5]}, indent=1))


def summarize() -> dict:
    import yaml

    logs = REPO / LOGS
    records = read_metrics(REPO / RUN)
    train = [r for r in records if "reward_mean" in r]
    evals = {r["step"]: r for r in records if "eval/greedy/reward" in r}
    quarter = max(1, len(train) // 4)
    mean = lambda rows, k: sum(r[k] for r in rows) / len(rows)  # noqa: E731
    untrained = json.loads((logs / "untrained_no_tools.json").read_text())
    first, last = min(evals), max(evals)
    out = {
        "what": "held-out greedy accuracy of SmolLM2-135M-Instruct on three-term arithmetic (+, -, *; "
                "grpo_recipe.examples.calculator), without a tool, and with a calculator tool before and after GRPO",
        "untrained_without_tools": {"accuracy": untrained["accuracy"], "n": untrained["n"]},
        "untrained_with_tool_template": json.loads((logs / "untrained_tool_calls.json").read_text()),
        "warm_up": {**json.loads((REPO / WARM / "warm_up.json").read_text()),
                    "tool_calls_after": json.loads((logs / "warm_tool_calls.json").read_text())},
        "grpo": {"config": CONFIG, "config_values": yaml.safe_load((REPO / CONFIG).read_text()),
                 "eval_accuracy_before": evals[first]["eval/greedy/reward"],
                 "eval_accuracy_after": evals[last]["eval/greedy/reward"], "eval_steps": [first, last],
                 "eval_n": evals[first]["eval/prompts"], "steps": len(train),
                 "reward_first_quarter": mean(train[:quarter], "reward_mean"),
                 "reward_last_quarter": mean(train[-quarter:], "reward_mean"),
                 "tool_calls_per_completion_first_quarter": mean(train[:quarter], "tool_calls_per_completion"),
                 "tool_calls_per_completion_last_quarter": mean(train[-quarter:], "tool_calls_per_completion"),
                 "tool_failure_fraction_mean": mean(train, "tool_failure_fraction"),
                 "wall_s": float((logs / "train.wall_s").read_text()) if (logs / "train.wall_s").exists() else None},
        "machine": machine(load_1m_at_end=os.getloadavg()[0]),
        "notes": "Measured beside other work on the same 2 cores (load in machine); the accuracies do not depend "
                 "on the clock. Accuracy: grpo_recipe.examples.calculator:correct_final_answer on the last "
                 "assistant turn, greedy decoding; with the tool the evaluation runs the tool loop.",
        "commands": {k: shlex.join(v).replace(sys.executable, "python") for k, v in COMMANDS.items()},
    }
    save_json("smollm2_tools.json", out, REPO / "bench" / "results")
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--summarize-only", action="store_true")
    p.add_argument("--probe-calls", nargs=2, metavar=("MODEL", "OUT"), help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.probe_calls:
        probe_calls(*args.probe_calls)
        return 0
    if not args.summarize_only:
        run_steps()
    out = summarize()
    g = out["grpo"]
    print(f"untrained, no tools: {out['untrained_without_tools']['accuracy']:.3f}; untrained tool calls "
          f"{out['untrained_with_tool_template']['calls']}/{out['untrained_with_tool_template']['n']}; with the tool "
          f"after the warm-up {g['eval_accuracy_before']:.3f} -> after GRPO {g['eval_accuracy_after']:.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
