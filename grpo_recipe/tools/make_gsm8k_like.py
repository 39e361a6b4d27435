"""Write grpo_recipe/assets/gsm8k_like.parquet: GSM8K-shaped rows from reasoning-gym's gsm_symbolic generator.

    python -m grpo_recipe.tools.make_gsm8k_like [--out grpo_recipe/assets/gsm8k_like.parquet] [--size 300] [--seed 0]

Each row has GSM8K's two columns: `question` (a grade-school word problem) and `answer` (the worked
solution ending in `#### <number>`), so a config written for openai/gsm8k runs on it with only
`dataset_name` changed. No network: the generator ships in the reasoning-gym wheel (`pip install reasoning-gym`).
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

DEFAULT_OUT = Path(__file__).parents[1] / "assets" / "gsm8k_like.parquet"
# gsm_symbolic appends an instruction GSM8K questions do not have; the system prompt says it instead
SUFFIX = " Give the result as your final answer. Do not include units."


def rows(size: int, seed: int) -> list[dict]:
    import reasoning_gym

    out = []
    for entry in reasoning_gym.create_dataset("gsm_symbolic", size=size, seed=seed):
        solution = entry["metadata"]["answer_cot"].strip()
        if not solution.endswith(f"#### {entry['answer']}"):  # keep only rows whose solution states the answer
            continue
        out.append({"question": entry["question"].removesuffix(SUFFIX).strip(), "answer": solution})
    return out


def write(path: Path, size: int, seed: int) -> int:
    import datasets

    datasets.disable_progress_bars()
    data = rows(size, seed)
    path.parent.mkdir(parents=True, exist_ok=True)
    datasets.Dataset.from_list(data).to_parquet(str(path))
    return len(data)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, default=DEFAULT_OUT)
    p.add_argument("--size", type=int, default=300)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    print(f"wrote {write(args.out, args.size, args.seed)} rows to {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
