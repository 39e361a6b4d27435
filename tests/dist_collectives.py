"""Worker (torchrun, or one process with GRPO_FORCE_COLLECTIVES=1): grpo_recipe/dist/collectives.py's helpers on
real gloo ranks. Writes OUT.json on rank 0."""
import json
import sys

import torch

from grpo_recipe.dist import collectives as c
from grpo_recipe.dist import liveness
from grpo_recipe.dist.group import init_distributed


def main():
    rank, world = init_distributed()
    x = torch.tensor([1.0 + rank, 10.0 * rank])
    before = x.clone()
    named = c.all_reduce_named({"a": torch.tensor(float(rank)), "b": torch.ones(2, 2, dtype=torch.float64)})
    got = {"sum": c.all_reduce(x).tolist(), "max": c.all_reduce(x, "max").tolist(),
           "min": c.all_reduce(x, "min").tolist(), "input_kept": torch.equal(x, before),
           "named_a": named["a"].item(), "named_b": named["b"].tolist(), "named_b_dtype": str(named["b"].dtype),
           "any_last": c.any_rank(rank == world - 1), "every_last": c.every_rank(rank == world - 1),
           "every_true": c.every_rank(True), "any_false": c.any_rank(False),
           "no_error": c.first_error(None), "error": c.first_error(f"bad {rank}" if rank >= world - 1 else None),
           "broadcast": c.broadcast_object({"from": rank}), "gathered": c.all_gather_object(rank * 2),
           # ranks holding different numbers of values (rank r: r + 1 of them)
           "values": c.all_gather_values(torch.arange(rank + 1, dtype=torch.float32) + 10 * rank).tolist(),
           "active": c.active(), "collective_device": str(c.collective_device())}
    c.barrier()
    parts = c.all_gather_object(got)
    if rank == 0:
        json.dump(parts, open(sys.argv[1], "w"))


if __name__ == "__main__":
    liveness.run_and_exit(main)
