"""Worker (torchrun): a ZeRO-3 sharded reward model (rewards/model.py) on uneven batches per rank, listed after a
function that fails on rank 1 only. Rank 0 writes [texts, scores, error] per rank to OUT.json.

    torchrun --nproc_per_node 2 tests/dist_reward_model.py MODEL_DIR OUT.json
"""
import json
import sys

from grpo_recipe.dist import collectives, liveness
from grpo_recipe.dist.group import init_distributed
from grpo_recipe.rewards.funcs import RewardError, load_reward_funcs, score


def fails(prompts, completions, **kw):
    if collectives.dist.get_rank() == 1:
        raise ValueError("only here")
    return [0.0] * len(completions)


def main():
    rank, world = init_distributed()
    n = 3 + 2 * rank
    prompts = [f"TITLE: rank {rank} prompt {i}" + " word" * i for i in range(n)]
    completions = [f" answer {i}" for i in range(n)]
    funcs = load_reward_funcs([{"func": fails, "weight": 0.0},
                               {"model": sys.argv[1], "sharded": True, "batch_size": 2}])
    error = ""
    try:
        score(funcs, prompts, completions, {})
    except RewardError as e:
        error = str(e)
    scores = funcs[1].fn(prompts, completions)  # again, now alone: the scores themselves
    parts = collectives.all_gather_object([[p + c for p, c in zip(prompts, completions)], scores, error])
    if rank == 0:
        json.dump(parts, open(sys.argv[2], "w"))


if __name__ == "__main__":
    liveness.run_and_exit(main)
