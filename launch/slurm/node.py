"""One node of a Slurm job: start this node's ranks of recipe.train, wait for them, exit with their code.

Run by grpo.sbatch as `srun --ntasks-per-node=1 python launch/slurm/node.py [recipe args]`, with MASTER_ADDR
and MASTER_PORT exported. Ranks per node: NPROC_PER_NODE, else the GPUs Slurm gave this node, else 1 CPU rank.

Why not torchrun: it reports any failed worker as exit code 1, and the requeue contract needs the ranks'
own code (PREEMPTED_EXIT_CODE, 75 = "checkpointed because of a signal, requeue me").

Signals: Slurm signals every process of the step (USR1 as the time-limit warning, TERM at the end, on
scancel or preemption), so the ranks receive them directly and nothing is forwarded. This process outlives
TERM to collect the ranks' exit codes (when it dies, Slurm ends the step and kills a rank still saving).
USR1 is ignored, and stays ignored in a rank that installs no handler: a warning must not kill training.
"""
from __future__ import annotations

import os
import signal
import subprocess
import sys

from recipe.launch import PREEMPTED_EXIT_CODE  # the recipe saved a checkpoint on a signal: requeue it


def gpus_on_node() -> int:
    if os.environ.get("SLURM_GPUS_ON_NODE", "").isdigit():
        return int(os.environ["SLURM_GPUS_ON_NODE"])
    visible = os.environ.get("CUDA_VISIBLE_DEVICES", "")
    return len([d for d in visible.split(",") if d.strip()]) if visible not in ("", "NoDevFiles") else 0


def recipe_args(argv: list[str]) -> list[str]:
    """The user's args, plus `--resume_from_checkpoint $RESUME` unless they name it themselves."""
    resume = os.environ.get("RESUME", "auto")
    if not resume or any(a.split("=")[0] in ("--resume_from_checkpoint", "--resume-from-checkpoint") for a in argv):
        return argv
    return [*argv, "--resume_from_checkpoint", resume]


def main() -> int:
    node, nnodes = int(os.environ["SLURM_NODEID"]), int(os.environ["SLURM_NNODES"])
    gpus = gpus_on_node()
    nproc = int(os.environ.get("NPROC_PER_NODE") or gpus or 1)
    args = recipe_args(sys.argv[1:])
    env = dict(os.environ, WORLD_SIZE=str(nnodes * nproc), LOCAL_WORLD_SIZE=str(nproc))
    if gpus == 0:
        env["DS_ACCELERATOR"] = "cpu"
    env.setdefault("OMP_NUM_THREADS", "1")  # two threads per CPU rank ran ~10x slower here
    print(f"node {node}/{nnodes}: ranks {node * nproc}..{node * nproc + nproc - 1} of {nnodes * nproc} "
          f"({f'{gpus} GPUs' if gpus else 'CPU'}), rendezvous {env['MASTER_ADDR']}:{env['MASTER_PORT']}", flush=True)

    signal.signal(signal.SIGUSR1, signal.SIG_IGN)
    procs = [subprocess.Popen([sys.executable, "-m", "recipe.train", *args],
                              env={**env, "RANK": str(node * nproc + i), "LOCAL_RANK": str(i)})
             for i in range(nproc)]
    running = {p.pid: p for p in procs}
    signal.signal(signal.SIGTERM, lambda *_: None)  # set after the ranks started: theirs stays the default
    rc = 0
    while running:
        pid, status = os.wait()
        if running.pop(pid, None) is None:
            continue
        code = os.waitstatus_to_exitcode(status)
        code = 128 - code if code < 0 else code  # killed by signal N -> 128 + N, as a shell reports it
        if code and not rc:
            rc = code
            # A failed rank leaves its peers stuck in a collective: stop them. Ranks exit with PREEMPTED_EXIT_CODE only after
            # their checkpoint is complete, so their peers are left to finish theirs.
            if code != PREEMPTED_EXIT_CODE:
                for p in running.values():
                    p.kill()
    return rc


if __name__ == "__main__":
    sys.exit(main())
