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


class LaunchError(RuntimeError):
    """The environment a rank was started in cannot make a run (a launcher variable missing, a port taken, the
    other ranks never came); the message says what and what to do, in one line (exit code 2)."""


LAUNCH_VARS = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


def launch_env_problem(env) -> str | None:
    """What is wrong with the launcher variables of `env`, or None. No RANK: a plain process (a world of one).
    RANK alone (a cluster shell's or a notebook's leftover): not a launch. A world of one needs no address."""
    if "RANK" not in env:
        return None
    missing = [k for k in LAUNCH_VARS[1:] if not env.get(k)]
    bad = [k for k in ("RANK", "WORLD_SIZE", "MASTER_PORT", "LOCAL_RANK") if env.get(k) and not env[k].isdigit()]
    if bad:
        return f"{bad[0]}={env[bad[0]]!r} is not a whole number"
    if "WORLD_SIZE" in missing or (int(env["WORLD_SIZE"]) > 1 and missing):
        return (f"RANK={env['RANK']} is set but {', '.join(missing)} {'is' if len(missing) == 1 else 'are'} not: "
                f"this process was not started by a launcher; unset RANK to run as one process, or start it with "
                f"launch/local.sh, torchrun or deepspeed")
    if int(env["RANK"]) >= int(env["WORLD_SIZE"]):
        return f"RANK={env['RANK']} is not below WORLD_SIZE={env['WORLD_SIZE']}"
    return None


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
