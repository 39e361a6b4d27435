"""Worker (torchrun): what init_distributed leaves for DeepSpeed on CPU. Writes OUT.json on rank 0."""
import json
import os
import subprocess
import sys

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
    got = [None] * world
    dist.all_gather_object(got, {"local_size": os.environ.get("LOCAL_SIZE"), "device_count": count,
                                 "spawned": [str(x) for x in spawned]})
    if rank == 0:
        json.dump(got, open(sys.argv[1], "w"))
    dist.barrier()


if __name__ == "__main__":
    liveness.run_and_exit(main)
