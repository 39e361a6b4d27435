"""Worker (torchrun): TR-DPO's reference mix (model/engine.py) on real ZeRO-3 shards, against the same mix of the
gathered full tensors in plain PyTorch; and a synced reference's checkpoint shard, saved and restored.

    torchrun --nproc_per_node N tests/dist_engine.py OUT.pt
"""
import sys

import torch
from dist_update import BASE, run_case

from grpo_recipe.config.schema import Config
from grpo_recipe.dist import liveness
from grpo_recipe.dist.group import init_distributed
from grpo_recipe.model import engine as eng


def full_state(engine) -> dict:
    """Every parameter whole, on every rank (gathered one at a time)."""
    import deepspeed

    out = {}
    for name, p in engine.module.named_parameters():
        with deepspeed.zero.GatheredParameters([p] if hasattr(p, "ds_id") else []):
            out[name] = p.data.detach().clone()
    return out


def main():
    rank, world = init_distributed()
    cfg = Config(**{**BASE, "beta": 0.1, "learning_rate": 0.05})
    engine, ref, *_ = run_case(cfg, rank, world)  # one optimizer step: the policy has left the reference
    policy, before = full_state(engine), full_state(ref)
    shard = eng.reference_shard(ref)
    eng.mix_into_reference(ref, engine, 0.3)
    mixed = full_state(ref)
    eng.mix_into_reference(ref, engine, 0.3)  # mixed twice: the restore below must undo this
    eng.load_reference_shard(ref, shard)
    restored = full_state(ref)
    persistent = [n for n, p in ref.module.named_parameters() if getattr(p, "ds_persist", False)]
    if rank == 0:
        torch.save({"policy": policy, "before": before, "mixed": mixed, "restored": restored,
                    "persistent": persistent, "zero3": eng.is_zero3(ref)}, sys.argv[1])


if __name__ == "__main__":
    liveness.run_and_exit(main)
