"""One node of a Slurm job: start this node's ranks of grpo_recipe.train through launch/node.py, exit with their code.

Run by grpo.sbatch as `srun --ntasks-per-node=1 python launch/slurm/node.py [recipe args]`, with MASTER_ADDR
and MASTER_PORT exported. Ranks per node: NPROC_PER_NODE, else the GPUs Slurm gave this node, else 1 CPU rank.
Node 0 hosts the rendezvous store on MASTER_ADDR:MASTER_PORT (that address only).

Signals: Slurm signals every process of the step (USR1 as the time-limit warning, TERM at the end, on
scancel or preemption); launch/node.py also forwards them to the ranks (a rank's handler only sets a flag, so
twice is once) and outlives TERM to collect the ranks' exit codes. USR1 stays ignored in a rank that installs
no handler: a warning must not kill training.
"""
from __future__ import annotations

import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from node import REPO, env_int, finish, log, rank_environment, run_ranks  # noqa: E402  (launch/node.py: the one owner of the ranks)

sys.path.insert(0, str(REPO))


def gpus_on_node() -> int:
    if os.environ.get("SLURM_GPUS_ON_NODE", "").isdigit():
        return int(os.environ["SLURM_GPUS_ON_NODE"])
    visible = os.environ.get("CUDA_VISIBLE_DEVICES", "")
    return len([d for d in visible.split(",") if d.strip()]) if visible not in ("", "NoDevFiles") else 0


def _given(argv: list[str], key: str) -> str | None:
    """The value of --key in argv (either spelling, `--key value` or `--key=value`), or None."""
    for i, a in enumerate(argv):
        name, eq, val = a.partition("=")
        if name in (f"--{key}", f"--{key.replace('_', '-')}"):
            return val if eq else (argv[i + 1] if i + 1 < len(argv) else "")
    return None


def recipe_args(argv: list[str], restart: int) -> list[str]:
    """The user's args plus `--resume_from_checkpoint $RESUME`. With `--overwrite_output_dir true`, only the
    first start overwrites: a requeued start resumes what that run saved instead of removing it."""
    resume = os.environ.get("RESUME", "auto")
    overwrite = str(_given(argv, "overwrite_output_dir")).lower() == "true"
    if overwrite and restart > 0:
        argv = [*argv, "--overwrite_output_dir", "false"]
    elif overwrite:
        return argv
    if not resume or _given(argv, "resume_from_checkpoint") is not None:
        return argv
    return [*argv, "--resume_from_checkpoint", resume]


def main() -> int:
    node, nnodes = int(os.environ["SLURM_NODEID"]), int(os.environ["SLURM_NNODES"])
    gpus = gpus_on_node()
    nproc = env_int("NPROC_PER_NODE", gpus or 1, minimum=1)
    env = rank_environment(dict(os.environ), gpus, nproc)
    args = recipe_args(sys.argv[1:], int(os.environ.get("SLURM_RESTART_COUNT") or 0))
    log(f"node {node}/{nnodes}: ranks {node * nproc}..{node * nproc + nproc - 1} of {nnodes * nproc} "
        f"({f'{gpus} GPUs' if gpus else 'CPU'}), rendezvous {env['MASTER_ADDR']}:{env['MASTER_PORT']}")
    from grpo_recipe.dist.rendezvous import is_loopback, resolve

    if nnodes > 1 and node == 0 and is_loopback(resolve(env["MASTER_ADDR"])):
        # e.g. Debian's `127.0.1.1 hostname` line: the store would listen where other hosts cannot reach it
        log(f"warning: MASTER_ADDR {env['MASTER_ADDR']} resolves to a loopback address here, so only nodes on "
            f"this host can reach the rendezvous; export MASTER_ADDR as this node's network address")
    return run_ranks(args, nproc, node, nnodes, env, own_session=False)


if __name__ == "__main__":
    finish(main())
