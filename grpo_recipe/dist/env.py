"""What launchers share with the recipe: its preemption exit code, a free port, and ranks started from Python
(their environment and torchrun command line, for the tests and the benchmarks).

Standard library only: launch/slurm/node.py, grpo.sbatch and launch/local.sh read it before anything heavy.
"""
from __future__ import annotations

import os
import socket
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
PREEMPTED_EXIT_CODE = 75  # EX_TEMPFAIL: stopped by SIGTERM/SIGUSR1 after a checkpoint; requeue to continue


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def rank_env(accelerator: str | None = "auto", **extra) -> dict[str, str]:
    """This process's environment for ranks started from it: DeepSpeed's `accelerator` ("auto": the CPU's where
    torch sees no GPU, else DeepSpeed picks; None: DeepSpeed picks), one thread per rank (two ran ~10x slower per
    step on CPU), no tokenizer threads, the repository first on PYTHONPATH; then `extra`."""
    path = os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))
    env = dict(os.environ, OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false", PYTHONPATH=path)
    if accelerator == "auto":
        import torch  # the callers (tests, benchmarks) have it; launchers do not call this

        accelerator = None if torch.cuda.is_available() else "cpu"
    if accelerator is not None:
        env["DS_ACCELERATOR"] = accelerator
    elif env.get("DS_ACCELERATOR") == "cpu":  # a GPU rank must not inherit the CPU accelerator
        del env["DS_ACCELERATOR"]
    env.update({k: str(v) for k, v in extra.items()})
    return env


def torchrun(nproc: int, args: list[str], python: str = sys.executable) -> list[str]:
    """The command line that runs `args` (a script or `-m module`, then its arguments) as nproc ranks here."""
    return [python, "-m", "torch.distributed.run", "--nnodes", "1", "--nproc_per_node", str(nproc),
            "--master_addr", "127.0.0.1", "--master_port", str(free_port()), *args]
