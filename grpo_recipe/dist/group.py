"""The process group: joining the launcher's (or a world of one), its backends, and ZeRO-3's gloo collectives
without staging copies. The recipe's own collectives are in collectives.py. Knows nothing of models."""
from __future__ import annotations

import atexit
import os

import torch

from grpo_recipe.dist.env import LaunchError, free_port


# A collective that times out: NCCL's watchdog aborts the communicators but leaves the process (mode 2, "clean up
# only"), so the rank's next collective raises in Python and liveness names the rank that stopped answering.
# torch's default (3) ends the process from the watchdog thread: exit 134 and no line saying why.
NCCL_ENV = {"TORCH_NCCL_ASYNC_ERROR_HANDLING": "2"}


def own_gpu() -> int:
    """This rank's GPU among those the process sees: LOCAL_RANK's, or the only one where the launcher gave each
    task a GPU of its own (srun --gpus-per-task=1), whatever LOCAL_RANK is; LOCAL_RANK is then rewritten to 0,
    for DeepSpeed and vLLM pick their device from it too. No CUDA context is made."""
    local, count = int(os.environ.get("LOCAL_RANK", 0)), torch.cuda.device_count()
    if count == 1 and local != 0:
        os.environ["LOCAL_RANK"] = "0"
        return 0
    if local >= count:
        raise LaunchError(f"LOCAL_RANK is {local} but this process sees {count} GPU(s) (CUDA_VISIBLE_DEVICES="
                          f"{os.environ.get('CUDA_VISIBLE_DEVICES', 'unset')}): start one rank per visible GPU")
    return local


def bf16_capable() -> bool:
    """Whether this rank's GPU computes bf16 natively (compute capability 8.0, Ampere, or later; a V100 or T4
    would emulate it, slowly, and vLLM refuses it), asked without a CUDA context. False without a GPU."""
    return torch.cuda.is_available() and torch.cuda.get_device_capability(own_gpu()) >= (8, 0)


def backend_name(cuda: bool) -> str:
    """NCCL for CUDA tensors and gloo for any CPU tensor on GPU machines (collectives.py puts the recipe's own
    on the GPU; a CPU tensor from a library then takes gloo instead of crashing NCCL); gloo alone on CPU."""
    return "cpu:gloo,cuda:nccl" if cuda else "gloo"


def init_distributed(timeout_s: float = 600.0, generation_ranks: int = 0) -> tuple[int, int]:
    """Join the launcher's process group (local.sh, the Slurm script, torchrun, deepspeed) or make a 1-rank one.

    Collectives give up after `timeout_s` (a stopped rank then ends the run, grpo_recipe/dist/liveness.py); the store and
    the backend listen on the launcher's address only (dist/rendezvous.py). With `generation_ranks` N the
    process group is the training ranks' alone (the launch's first WORLD_SIZE - N ranks), and the link to the
    generation ranks is made (dist/link.py). Returns this rank and the process group's size.
    """
    import datetime
    import warnings

    import deepspeed

    from grpo_recipe.dist import liveness, rendezvous

    # torch deprecates the collective names DeepSpeed calls on every step; one warning per call floods logs.
    warnings.filterwarnings("ignore", message=r".*is deprecated\. Please use `torch\.distributed", category=FutureWarning)
    if "RANK" not in os.environ:  # plain `python -m grpo_recipe.train`: a world of one, with an in-memory store
        os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", LOCAL_WORLD_SIZE="1",
                          MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
    os.environ.update(rendezvous.backend_env(os.environ.get("MASTER_ADDR", "127.0.0.1")))
    if not torch.cuda.is_available():
        os.environ.setdefault("DS_ACCELERATOR", "cpu")
        from grpo_recipe.dist.buildlock import load_comm_op

        load_comm_op()  # built once per environment under a lock that cannot go stale
    backend = backend_name(torch.cuda.is_available())
    timeout = datetime.timedelta(seconds=timeout_s)
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    if torch.cuda.is_available():
        torch.cuda.set_device(own_gpu())
        for key, value in NCCL_ENV.items():  # a user's own setting wins
            os.environ.setdefault(key, value)
    store = rendezvous.store_for_rank(rank, world, timeout_s)
    lay = None
    with rendezvous.waiting_said(rank, world, timeout_s):
        if generation_ranks:
            from grpo_recipe.dist import link

            lay = link.layout(generation_ranks)
            store = store if store is not None else link.launch_store(timeout_s)
            link.trainer_arrived(store, rank)  # the generation ranks wait for this, hearing stop signals meanwhile
            os.environ.update(link.role_env(lay))  # DeepSpeed reads them: the training ranks' world
            torch.distributed.init_process_group(backend, store=torch.distributed.PrefixStore("grpo/train/", store),
                                                 rank=rank, world_size=lay.trainers, timeout=timeout)
        elif store is None:
            torch.distributed.init_process_group(backend, timeout=timeout)
        else:
            torch.distributed.init_process_group(backend, store=store, rank=rank, world_size=world, timeout=timeout)
    deepspeed.init_distributed(dist_backend=backend, auto_mpi_discovery=False, timeout=timeout)  # wraps the group
    if not torch.cuda.is_available():
        # DeepSpeed's CPU accelerator counts its devices (this node's ranks) at every gradient reduction, by
        # running numactl in a subprocess, unless LOCAL_SIZE says (the deepspeed launcher sets it, torchrun and
        # Slurm do not): a tenth of a small model's step. Set after DeepSpeed's init, whose CPU comm op would
        # also read it, to start a shared-memory all-reduce that training never uses.
        os.environ.setdefault("LOCAL_SIZE", str(min(int(os.environ.get("LOCAL_WORLD_SIZE", "1")),
                                                    torch.distributed.get_world_size())))
        gather_parameters_in_place()
        reduce_scatter_gradients_in_place()
    # a group left to interpreter teardown can abort the process ("terminate called without an active
    # exception") after its work is done; atexit runs this after liveness stops its heartbeat (registered later)
    atexit.register(_destroy_process_group)
    if lay is not None:
        link.connect(lay, timeout_s, store)
        _keep.append(store)  # rank 0 may host it: it must outlive every rank's use
    liveness.start(rank, world, timeout_s)  # the launch's ranks: a silent generation rank is named too
    return torch.distributed.get_rank(), torch.distributed.get_world_size()


_keep: list = []


class _Done:
    """The handle of a collective that has already completed (DeepSpeed waits on its all-gathers' handles)."""

    def wait(self, timeout=None) -> bool:
        return True

    def is_completed(self) -> bool:
        return True


def gather_parameters_in_place() -> None:
    """ZeRO-3's parameter all-gathers over gloo as one broadcast per rank, each into its own chunk of the output.

    gloo's all_gather_into_tensor stages the output through a copy of its own: 1.0x the gathered bytes on top
    (measured, 2 ranks: 0.51 GiB for a 0.51 GiB output, in 0.53 s; the broadcasts 0.26 s). At the end of a
    backward the tied [V, H] embedding is gathered for its gradient while that gradient exists, so the copy was a
    rank's peak. A broadcast writes in place."""
    from deepspeed.runtime.zero import partition_parameters

    def all_gather(input_tensor, output_tensor, group=None):
        world, rank = torch.distributed.get_world_size(group), torch.distributed.get_rank(group)
        n = input_tensor.numel()
        own = output_tensor.narrow(0, rank * n, n)
        if own.data_ptr() != input_tensor.data_ptr():  # DeepSpeed's coalesced gather puts it there already
            own.copy_(input_tensor.reshape(-1))
        for r in range(world):
            src = r if group is None else torch.distributed.get_global_rank(group, r)
            torch.distributed.broadcast(output_tensor.narrow(0, r * n, n), src=src, group=group)
        return _Done()

    partition_parameters._dist_allgather_fn = all_gather


def reduce_scatter_gradients_in_place() -> None:
    """ZeRO-3's gradient reduce-scatter over gloo as an in-place all-reduce and a copy of this rank's chunk.

    gloo's reduce_scatter_tensor works on copies: 1.5x its input in extra memory (measured, 2 ranks: 0.76 GiB
    for a 0.51 GiB gradient), the all-reduce 0.5x. The input is DeepSpeed's scratch (reduce_scatter_coalesced
    divides it in place first), so overwriting it costs nothing; the all-reduce moves twice the bytes."""
    from deepspeed.runtime.comm import coalesced_collectives

    def reduce_scatter(input_tensor, output_tensor, group=None, async_op=False, prof=False):
        torch.distributed.all_reduce(input_tensor, group=group)
        chunks = input_tensor.chunk(torch.distributed.get_world_size(group))
        output_tensor.copy_(chunks[torch.distributed.get_rank(group)])

    coalesced_collectives._torch_reduce_scatter_fn = reduce_scatter


def _destroy_process_group() -> None:
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()
