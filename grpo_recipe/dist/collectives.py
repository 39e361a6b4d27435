"""Every collective the recipe calls itself (DeepSpeed's own stay DeepSpeed's), and the one rule for where their
tensors live.

NCCL takes CUDA tensors only, gloo CPU tensors: each helper here moves its tensors to the device of the group's
backend and hands results back on the caller's device, so no module chooses a device for a collective (tests
fail when one outside `grpo_recipe/dist/` calls torch.distributed's collectives directly). On CUDA the process
group is `cpu:gloo,cuda:nccl` as well (group.py), so a CPU tensor that reached a collective anyway would take
gloo rather than crash.

At a world of one every helper skips its collective, unless GRPO_FORCE_COLLECTIVES=1 (bench/gpu_check.sh):
then they run on a single device too, so one GPU proves the device placement a multi-GPU run needs.
"""
from __future__ import annotations

import os

import torch
import torch.distributed as dist

FORCE_ENV = "GRPO_FORCE_COLLECTIVES"
_OPS = {"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX, "min": dist.ReduceOp.MIN}


def device() -> torch.device:
    """This rank's compute device: its GPU (set from LOCAL_RANK by init_distributed), else the CPU."""
    return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")


def backend_device(backend: str, compute: torch.device) -> torch.device:
    """Where a collective's tensors go for a process group of `backend` (as `dist.get_backend()` names it) on a
    rank computing on `compute`: that GPU wherever NCCL serves CUDA tensors, else the CPU (gloo)."""
    return compute if compute.type == "cuda" and "nccl" in backend else torch.device("cpu")


def collective_device(group=None) -> torch.device:
    return backend_device(dist.get_backend(group), device())


def world(group=None) -> int:
    return dist.get_world_size(group) if dist.is_initialized() else 1


def active(group=None) -> bool:
    """Whether a collective runs: a process group of several ranks, or any group when collectives are forced."""
    return dist.is_initialized() and (dist.get_world_size(group) > 1 or os.environ.get(FORCE_ENV) == "1")


def all_reduce(tensor: torch.Tensor, op: str = "sum", group=None) -> torch.Tensor:
    """`tensor` reduced over the ranks (`op`: sum, max or min), on `tensor`'s device; `tensor` is not modified."""
    if not active(group):
        return tensor
    work = tensor.detach().to(collective_device(group), copy=True)
    dist.all_reduce(work, op=_OPS[op], group=group)
    return work.to(tensor.device)


def all_reduce_named(values: dict[str, torch.Tensor], op: str = "sum") -> dict[str, torch.Tensor]:
    """Named per-rank tensors (one dtype) reduced over all ranks in ONE all-reduce: stacked in the dict's order,
    split back by name, each on its own input device."""
    if not active():
        return values
    flat = all_reduce(torch.cat([v.detach().reshape(-1).to(collective_device()) for v in values.values()]), op)
    out, start = {}, 0
    for name, v in values.items():
        out[name] = flat[start:start + v.numel()].reshape(v.shape).to(v.device)
        start += v.numel()
    return out


def any_rank(flag: bool) -> bool:
    """Whether `flag` holds on some rank (the same answer on every rank)."""
    return bool(all_reduce(torch.tensor([float(flag)]), "max").item())


def every_rank(flag: bool) -> bool:
    """Whether `flag` holds on every rank (so that every rank takes the same branch)."""
    return bool(all_reduce(torch.tensor([float(flag)]), "min").item())


def barrier() -> None:
    if active():
        if collective_device().type == "cuda":  # NCCL's barrier guesses the device from the rank otherwise
            dist.barrier(device_ids=[collective_device().index])
        else:
            dist.barrier()


def broadcast_object(obj, src: int = 0):
    """Rank `src`'s `obj` on every rank (picklable)."""
    if not active():
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=src, device=collective_device())
    return box[0]


def all_gather_object(obj, group=None) -> list:
    """Every rank's `obj` of `group`, in rank order."""
    if not active(group):
        return [obj]
    parts = [None] * dist.get_world_size(group)
    dist.all_gather_object(parts, obj, group=group)
    return parts


def all_gather_values(values: torch.Tensor) -> torch.Tensor:
    """Every rank's 1-D `values` (their lengths may differ), concatenated in rank order, on `values`' device."""
    if not active():
        return values
    dev = collective_device()
    count = torch.tensor([values.numel()], device=dev)
    counts = [torch.zeros_like(count) for _ in range(dist.get_world_size())]
    dist.all_gather(counts, count)
    counts = [int(c.item()) for c in counts]
    padded = torch.zeros(max(counts), dtype=values.dtype, device=dev)
    padded[:values.numel()] = values.detach().reshape(-1)
    parts = [torch.empty_like(padded) for _ in counts]
    dist.all_gather(parts, padded)
    return torch.cat([part[:n] for part, n in zip(parts, counts)]).to(values.device)


def first_error(error: str | None) -> tuple[int, str] | None:
    """(rank, message) of the lowest rank that reports an error, the same on every rank; None when none does.
    Every rank must call it: a rank that failed must not just leave (the others would hang in their next
    collective, or lose the reason). One tiny all-reduce; the messages are gathered only after a failure."""
    if not active():
        return None if error is None else (0, error)
    if not any_rank(error is not None):
        return None
    return next((r, e) for r, e in enumerate(all_gather_object(error)) if e is not None)
