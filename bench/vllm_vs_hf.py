"""Generation throughput: vLLM (colocated, synced from ZeRO-3) vs transformers `generate`, in one run.

Both backends sample the same prompts (the recipe's own prompt stream) with the same sampling settings
and lengths, from the same ZeRO-3 engine, alternating rollout by rollout. Between rollouts a real GRPO
optimizer step moves the weights and vLLM is synced, so the sync time is that of a real rollout.
Run it like the recipe (one process per rank; each rank measures its own share, tokens are summed):

    DS_ACCELERATOR=cpu OMP_NUM_THREADS=1 torchrun --nproc_per_node 2 bench/vllm_vs_hf.py \\
        [--rollouts 10] [--out bench/results/vllm_vs_hf.json] [--config FILE] [--key value ...]

Extra `--key value` pairs override the recipe config (e.g. `--max_completion_length 64`).
Writes the JSON on rank 0 and prints it.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "bench"))


def parse() -> tuple[argparse.Namespace, list[str]]:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    p.add_argument("--rollouts", type=int, default=10, help="measured rollouts per backend (after one warm-up)")
    p.add_argument("--config", default="grpo_recipe/configs/quickstart.yaml", help="recipe config (model, prompts, lengths)")
    p.add_argument("--out", default=str(REPO / "bench/results/vllm_vs_hf.json"))
    return p.parse_known_args()


def timed(fn):
    t0 = time.perf_counter()
    out = fn()
    return out, time.perf_counter() - t0


def main() -> None:
    args, overrides = parse()
    from common import machine, save_json

    from grpo_recipe import train
    from grpo_recipe.algo.buffer import RolloutBuffer
    from grpo_recipe.algo.loss import group_advantages
    from grpo_recipe.algo.update import train_on_rollout
    from grpo_recipe.config.load import load_config
    from grpo_recipe.dist.collectives import all_reduce_named
    from grpo_recipe.generation import rollout_seed
    from grpo_recipe.generation.hf import HFGenerator
    from grpo_recipe.rewards.funcs import score
    from grpo_recipe.run.preflight import preflight

    cfg = load_config(["--config", args.config, *overrides, "--generation_backend", "vllm",
                       "--output_dir", "/tmp/bench_vllm_vs_hf"])
    preflight(cfg)  # as grpo_recipe.train.main: before the process group starts
    run, _ = train.setup(cfg)  # engine, prompt stream and the vLLM generator, exactly as the recipe builds them
    one_step = dataclasses.replace(cfg, num_iterations=1)  # the first optimizer step of each rollout only
    backends = {"hf": HFGenerator(cfg, run.engine, run.tokenizer), "vllm": run.generator}
    totals = {name: {"tokens": 0.0, "seconds": 0.0, "sequences": 0.0} for name in backends}
    sync_s = []
    for r in range(args.rollouts + 1):  # rollout 0 warms both up and is not counted
        batch = run.stream.batch(r)
        seed = rollout_seed(cfg.seed, r, run.rank, run.world)
        for name, gen in backends.items():
            dist.barrier()
            comp, dt = timed(lambda: gen.generate(batch.prompt_ids, seed=seed))
            if r > 0:
                totals[name]["tokens"] += comp.mask.sum().item()
                totals[name]["seconds"] += dt
                totals[name]["sequences"] += len(comp.ids)
        # one real GRPO step on the vLLM rollout, then the sync the recipe does before the next rollout
        rows = batch.repeat(cfg.num_generations)
        rewards, _ = score(run.rewards, rows.prompts, comp.texts, rows.columns)
        buf = RolloutBuffer.build(rows.prompt_ids, comp.ids, group_advantages(rewards, cfg.num_generations),
                                  comp.mask, run.tokenizer.pad_token_id, order_seed=r, sampling_logps=comp.logps)
        next(train_on_rollout(run.engine, None, buf, one_step))
        dist.barrier()
        _, dt = timed(lambda: run.generator.sync(run.engine))
        if r > 0:
            sync_s.append(dt)
    # sum tokens over ranks; time is the slowest rank's (the ranks generate side by side)
    counts = all_reduce_named({f"{name}/{k}": torch.tensor(t[k], dtype=torch.float64) for name, t in totals.items()
                               for k in ("tokens", "sequences")})
    secs = torch.tensor([t["seconds"] for t in totals.values()] + [max(sync_s)], dtype=torch.float64)
    dist.all_reduce(secs, op=dist.ReduceOp.MAX)
    result = {}
    for i, name in enumerate(totals):
        tokens, sequences = counts[f"{name}/tokens"].item(), counts[f"{name}/sequences"].item()
        result[name] = {"tokens_per_s": tokens / secs[i].item(), "tokens": int(tokens), "seconds": secs[i].item(),
                        "mean_completion_tokens": tokens / sequences}
    report = {
        "what": "generation tokens/s (all ranks) of vLLM vs transformers generate; vLLM weight sync per rollout",
        "command": "torchrun --nproc_per_node {} bench/vllm_vs_hf.py {}".format(run.world, " ".join(sys.argv[1:])),
        "machine": machine(ranks=run.world, torch_threads_per_rank=torch.get_num_threads(),
                           vllm=__import__("vllm").__version__),
        "setup": {"model": cfg.model_name_or_path, "prompts_per_rank_per_rollout": cfg.prompts_per_rollout,
                  "num_generations": cfg.num_generations, "max_completion_length": cfg.max_completion_length,
                  "temperature": cfg.temperature, "rollouts_measured": args.rollouts},
        **result,
        "vllm_speedup": result["vllm"]["tokens_per_s"] / result["hf"]["tokens_per_s"],
        "sync_s_per_rollout": {"mean": sum(sync_s) / len(sync_s), "max_slowest_rank": secs[-1].item()},
        "sync_share_of_vllm_rollout": (sum(sync_s) / len(sync_s)) / (result["vllm"]["seconds"] / args.rollouts),
    }
    if run.rank == 0:
        save_json(Path(args.out).resolve(), report)
        print(json.dumps(report, indent=2))
    dist.barrier()
    run.generator.close()  # last: vLLM's shutdown tears the process group down


if __name__ == "__main__":
    from grpo_recipe.dist import liveness

    liveness.run_and_exit(main)  # no gloo/DeepSpeed teardown, which occasionally aborts a finished rank
