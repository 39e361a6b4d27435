"""Worker (torchrun): what init_distributed leaves for DeepSpeed on CPU. Writes OUT.json on rank 0."""
import json
import os
import subprocess
import sys

import torch
import torch.distributed as dist

from grpo_recipe.dist import liveness
from grpo_recipe.dist.group import init_distributed


def main():
    rank, world = init_distributed()
    from deepspeed.accelerator import get_accelerator

    spawned = []
    real = subprocess.Popen.__init__

    def counting(self, *a, **k):
        spawned.append(a[0] if a else k.get("args"))
        real(self, *a, **k)

    subprocess.Popen.__init__ = counting
    count = get_accelerator().device_count()  # what ZeRO-3 asks at every gradient reduction
    subprocess.Popen.__init__ = real
    # ZeRO-3's collectives over gloo, as replaced (gather_parameters_in_place, reduce_scatter_gradients_in_place)
    from deepspeed.runtime.comm.coalesced_collectives import reduce_scatter_coalesced
    from deepspeed.runtime.zero import partition_parameters

    shard = torch.arange(6.0) + 10 * rank
    whole = torch.cat([torch.arange(6.0) + 10 * r for r in range(world)])
    out = torch.full((6 * world,), -1.0)
    partition_parameters._dist_allgather_fn(shard, out).wait()
    flat = torch.full((6 * world,), -1.0)  # DeepSpeed's coalesced gather: the input is the output's own chunk
    flat.narrow(0, 6 * rank, 6).copy_(shard)
    partition_parameters._dist_allgather_fn(flat.narrow(0, 6 * rank, 6), flat).wait()
    grads = [torch.arange(8.0) * (rank + 1), torch.arange(7.0) * (rank + 1)]  # the second one is padded
    parts = reduce_scatter_coalesced([grads[0].clone()]) + reduce_scatter_coalesced([g.clone() for g in grads])
    mean = sum(r + 1 for r in range(world)) / world
    want = [(torch.arange(8.0) * mean).chunk(world)[rank], (torch.arange(8.0) * mean).chunk(world)[rank],
            (torch.arange(7.0) * mean).tensor_split([4])[rank]]
    got = [None] * world
    dist.all_gather_object(got, {"local_size": os.environ.get("LOCAL_SIZE"), "device_count": count,
                                 "spawned": [str(x) for x in spawned], "all_gather": torch.equal(out, whole),
                                 "all_gather_aliased": torch.equal(flat, whole),
                                 "reduce_scatter": all(torch.allclose(p, w) for p, w in zip(parts, want))})
    if rank == 0:
        json.dump(got, open(sys.argv[1], "w"))
    dist.barrier()


if __name__ == "__main__":
    liveness.run_and_exit(main)
