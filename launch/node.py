"""Start one node's ranks of grpo_recipe.train and own them until they end: the launcher behind launch/local.sh
(one node) and launch/slurm/node.py (one per node of a Slurm job).

    NPROC_PER_NODE=2 python launch/node.py --config FILE.yaml [--key value ...]

Env: NPROC_PER_NODE (ranks here; default: the GPUs here, else 2), NNODES (1), NODE_RANK (0), MASTER_ADDR
(127.0.0.1), MASTER_PORT (node 0: a free port when unset).

What it guarantees, and why torchrun is not used (it turns every failure into exit code 1 with a traceback,
dies on SIGUSR1 leaving the ranks training, and its store listens on every interface):
- Exit code: a rank's own failure code (2 = config or input error, 1 = failure), else 75 when the ranks
  checkpointed on a signal (requeue me), else 0. A rank killed by signal N counts as 128 + N.
- Signals: SIGTERM and SIGUSR1 are forwarded to the ranks (they checkpoint and exit 75); SIGINT (Ctrl-C)
  is forwarded as SIGTERM, a second one kills the ranks.
- No orphans: when a rank fails the others are killed (they would wait for it in a collective); the ranks die
  with this process even if it is killed (PR_SET_PDEATHSIG); it returns only after every rank has ended.
- Node 0 hosts the rendezvous store, on MASTER_ADDR:MASTER_PORT only (loopback for one node).
"""
from __future__ import annotations

import signal

_early: list[int] = []  # stop signals that arrive before the ranks exist: forwarded once they do
for _sig in (signal.SIGTERM, signal.SIGUSR1, signal.SIGINT):
    signal.signal(_sig, lambda signum, frame: _early.append(signum))

import ctypes  # noqa: E402
import os  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
import threading  # noqa: E402
from pathlib import Path  # noqa: E402

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from grpo_recipe.dist.env import PREEMPTED_EXIT_CODE as REQUEUE  # noqa: E402  (75: checkpointed on a signal, rerun me)

PR_SET_PDEATHSIG = 1
RESEND_S = 2.0  # how often a stop signal is sent again to ranks that have not ended


_prctl = ctypes.CDLL(None, use_errno=True).prctl  # resolved here: the child only calls it


def _die_with_parent() -> None:  # runs in the child between fork and exec
    _prctl(PR_SET_PDEATHSIG, signal.SIGKILL)


def exit_code(codes: list[int]) -> int:
    """The node's code: the first failure, else 75 if any rank checkpointed on a signal, else 0."""
    failures = [c for c in codes if c not in (0, REQUEUE)]
    return failures[0] if failures else REQUEUE if REQUEUE in codes else 0


def log(msg: str) -> None:
    print(f"{os.environ.get('LAUNCHER_NAME', 'node.py')}: {msg}", file=sys.stderr, flush=True)


def entry(args: list[str]) -> list[str]:
    """What each rank runs: a user's own script (`launch/local.sh my_train.py [--key value ...]`, one that builds a
    grpo_recipe.GRPORun) or `-m grpo_recipe.train`, with the rest of the arguments."""
    if args and args[0].endswith(".py") and not args[0].startswith("-"):
        if not Path(args[0]).is_file():
            log(f"{args[0]}: no such script")
            sys.exit(2)
        return [str(Path(args[0]).resolve()), *args[1:]]
    return ["-m", "grpo_recipe.train", *args]


def run_ranks(args: list[str], nproc: int, node: int, nnodes: int, env: dict, own_session: bool) -> int:
    """Start ranks node * nproc ... of grpo_recipe.train with `args`, supervise them, return the node's exit code.

    own_session: put the ranks in their own session so that a terminal's Ctrl-C reaches only this process
    (which forwards it as SIGTERM); under Slurm they stay in the step's process group, which Slurm signals.
    """
    from grpo_recipe.dist.rendezvous import host_store, listening_socket

    sock = None
    if node == 0:  # the store outlives any rank, so a stopped rank 0 can still be named (grpo_recipe/dist/liveness.py)
        try:
            sock = listening_socket(env["MASTER_ADDR"], int(env.get("MASTER_PORT") or 0))
        except OSError as e:
            log(f"MASTER_ADDR:MASTER_PORT {env['MASTER_ADDR']}:{env.get('MASTER_PORT')} cannot be listened on "
                f"({e.strerror}): another process holds it, or the address is not this host's; choose another "
                f"MASTER_PORT (unset, a free one is picked)")
            sys.exit(2)
        env["MASTER_PORT"] = str(sock.getsockname()[1])
    env.update(WORLD_SIZE=str(nnodes * nproc), LOCAL_WORLD_SIZE=str(nproc), GROUP_RANK=str(node),
               TORCHELASTIC_USE_AGENT_STORE="True")  # the ranks join this store instead of hosting one
    # USR1 and TERM ignored until a rank records them itself (grpo_recipe/dist/signals.py, its first line; the
    # ignoring is inherited across exec): one arriving earlier is sent again (RESEND_S), never fatal
    signal.signal(signal.SIGUSR1, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    # the ranks work in the caller's folder (its relative paths are the user's) and import the package from here
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))
    procs = {}
    for i in range(nproc):
        p = subprocess.Popen([sys.executable, *entry(args)],
                             env={**env, "RANK": str(node * nproc + i), "LOCAL_RANK": str(i)},
                             start_new_session=own_session, preexec_fn=_die_with_parent)
        procs[p.pid] = (node * nproc + i, p)
    # served only now: the store's thread must not exist while forking (ranks wait in the socket's backlog)
    store = host_store(sock, nnodes * nproc, 600.0) if sock is not None else None
    interrupts = 0
    resend, stopped = threading.Event(), threading.Event()

    def send(sig):
        for _, p in list(procs.values()):
            if p.returncode is None:
                try:
                    p.send_signal(sig)
                except ProcessLookupError:
                    pass

    def forward(signum, frame):
        nonlocal interrupts
        sig = signum
        if signum == signal.SIGINT:
            interrupts += 1
            sig = signal.SIGTERM if interrupts == 1 else signal.SIGKILL
        log(f"got {signal.Signals(signum).name}: {'killing' if sig == signal.SIGKILL else 'forwarding it to'} "
            f"the ranks{'' if sig == signal.SIGKILL else ' (they checkpoint and exit 75)'}")
        send(sig)
        if sig != signal.SIGKILL and not resend.is_set():
            # a rank still starting its interpreter ignores the signal (USR1) or has no handler yet: send it
            # again until every rank has ended; a rank records it once and acts at its next safe point
            resend.set()

            def again():
                while not stopped.wait(RESEND_S):
                    send(sig)

            threading.Thread(target=again, daemon=True).start()

    for sig in (signal.SIGTERM, signal.SIGUSR1, signal.SIGINT):
        signal.signal(sig, forward)
    for signum in _early:  # arrived while this launcher was starting
        forward(signum, None)
    codes = []
    while procs:
        pid, code = _next_exit(procs)
        if pid not in procs:
            continue
        rank, _ = procs.pop(pid)
        code = 128 - code if code < 0 else code  # killed by signal N -> 128 + N, as a shell reports it
        codes.append(code)
        if code not in (0, REQUEUE) and procs:
            # its peers would wait for it in a collective: stop them. (Ranks exit 75 only after their
            # checkpoint is complete everywhere, so after a 75 the others are left to finish.)
            log(f"rank {rank} exited with {code}; stopping ranks {sorted(r for r, _ in procs.values())}")
            for _, p in procs.values():
                p.kill()
    stopped.set()
    del store
    return exit_code(codes)


def _next_exit(procs: dict) -> tuple[int, int]:
    """(pid, exit status) of the next rank to end. Popen reaps a child itself when it polls (send_signal polls
    first), after which os.wait no longer sees it: such a rank's status is its Popen's returncode."""
    while True:
        for pid, (_, p) in procs.items():
            if p.returncode is not None:
                return pid, p.returncode
        try:
            pid, status = os.wait()
            return pid, os.waitstatus_to_exitcode(status)
        except ChildProcessError:  # reaped by Popen meanwhile: its returncode is set now
            continue


def env_int(name: str, default: int, minimum: int = 0, maximum: int | None = None) -> int:
    """A whole-number setting from the environment (unset or empty: `default`); anything else is one line and
    exit code 2, before any rank starts."""
    raw = os.environ.get(name, "")
    if raw.strip() == "":
        return default
    try:
        value = int(raw)
    except ValueError:
        value = None
    if value is None or value < minimum or (maximum is not None and value > maximum):
        bound = f">= {minimum}" if maximum is None else f"in {minimum}..{maximum}"
        shown = "NPROC" if name == "NPROC_PER_NODE" and os.environ.get("LAUNCHER_NAME") == "local.sh" else name
        log(f"{shown} must be a whole number {bound}, got {raw!r}")
        sys.exit(2)
    return value


def rank_environment(env: dict, gpus: int, nproc: int) -> dict:
    """The ranks' environment, unless the user chose: on a node without GPUs DeepSpeed's CPU accelerator and one
    thread per rank (two threads per CPU rank ran ~10x slower here); on a GPU node this node's cores shared among
    its ranks (their CPU work, an offloaded optimizer's Adam above all, is threaded). DS_ACCELERATOR=cpu inherited
    on a GPU node (a shell or an sbatch environment made for CPU runs) would partition on the CPU while the inputs
    are on the GPU: one line and exit 2, before any rank starts."""
    env = dict(env)
    if gpus == 0:
        env["DS_ACCELERATOR"] = "cpu"
        env.setdefault("OMP_NUM_THREADS", "1")
        return env
    if env.get("DS_ACCELERATOR", "").lower() == "cpu":
        log(f"DS_ACCELERATOR=cpu is set, but this node has {gpus} GPU(s): unset it to train on them, or hide them "
            f"(CUDA_VISIBLE_DEVICES=) to train on the CPU")
        sys.exit(2)
    env.setdefault("OMP_NUM_THREADS", str(max(1, len(os.sched_getaffinity(0)) // max(nproc, 1))))
    return env


def gpus_here() -> int:
    try:
        import torch

        return torch.cuda.device_count()
    except ImportError:
        return 0


def main() -> int:
    gpus = gpus_here()
    nproc = env_int("NPROC_PER_NODE", gpus or 2, minimum=1)
    nnodes = env_int("NNODES", 1, minimum=1)
    node = env_int("NODE_RANK", 0, maximum=nnodes - 1)
    env_int("MASTER_PORT", 0, maximum=65535)
    env = rank_environment(dict(os.environ, MASTER_ADDR=os.environ.get("MASTER_ADDR") or "127.0.0.1"), gpus, nproc)
    log(f"{nproc} ranks on {'GPU' if gpus else 'CPU'}, OMP_NUM_THREADS={env['OMP_NUM_THREADS']}")
    return run_ranks(sys.argv[1:], nproc, node, nnodes, env, own_session=True)


def finish(code: int) -> None:
    """Exit with the ranks' code, whatever signal comes now: interpreter teardown would put the default actions
    back (a second SIGTERM a moment after the first, as schedulers and impatient users send, then ended this
    process with 143 after the ranks had checkpointed and exited 75). Nothing is left to do but exit."""
    for sig in (signal.SIGTERM, signal.SIGUSR1, signal.SIGINT):
        signal.signal(sig, signal.SIG_IGN)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


if __name__ == "__main__":
    finish(main())
