"""A real Slurm cluster on this host for launcher tests: munged, slurmctld and N slurmd emulating N nodes.

Everything (config, state, logs, munge socket and key) lives in one private folder and every daemon runs
in the foreground as our child, so two clusters can run side by side and `stop()` ends exactly what
`start()` started. Ports are picked free, and the first job id is random, so that ports derived from
SLURM_JOB_ID do not clash between clusters either. The settings are those that worked in a container
without systemd or cgroups (see FACTS.md): proctrack/linuxproc, task/none, no accounting.

    with LocalSlurm(nodes=2) as cluster:
        proc = cluster.run("sbatch", "--wait", "job.sbatch")

Needs root (slurmd runs as root, the controller as the `slurm` user) and the Debian packages
`slurmctld slurmd slurm-client munge` (tests/run.sh installs them when missing).
"""
from __future__ import annotations

import os
import pwd
import random
import shutil
import socket
import subprocess
import tempfile
import time
from pathlib import Path

from grpo_recipe.dist.env import free_port

PACKAGES = ("slurmctld", "slurmd", "slurm-client", "munge")
BINARIES = ("munged", "slurmctld", "slurmd", "sbatch", "scontrol", "runuser")


def _bin(name: str) -> str:
    """Daemons live in /usr/sbin, which a non-login PATH may lack."""
    return shutil.which(name) or str(Path("/usr/sbin", name))


def missing_reason() -> str | None:
    """Why a local cluster cannot start here (None when it can)."""
    if os.geteuid() != 0:
        return "a local Slurm cluster needs root (slurmd runs jobs as their user)"
    missing = [b for b in BINARIES if not Path(_bin(b)).exists()]
    if missing:
        return f"Slurm/munge not installed (missing {', '.join(missing)}): apt-get install {' '.join(PACKAGES)}"
    for user in ("slurm", "munge"):
        try:
            pwd.getpwnam(user)
        except KeyError:
            return f"user {user!r} missing (created by the Debian packages)"
    return None


def _ensure_hosts(names: list[str]) -> None:
    """Emulated node names must resolve (the launcher uses the first one as the master address)."""
    unresolved = []
    for name in names:
        try:
            socket.gethostbyname(name)
        except OSError:
            unresolved.append(name)
    if unresolved:
        with open("/etc/hosts", "a") as f:
            f.write(f"127.0.0.1 {' '.join(unresolved)}\n")


class LocalSlurm:
    def __init__(self, nodes: int = 2, cpus_per_node: int = 2):
        self.nodes = [f"node{i}" for i in range(nodes)]
        self.cpus = cpus_per_node
        self.root = Path(tempfile.mkdtemp(prefix="grpo-slurm-"))
        self.procs: list[subprocess.Popen] = []

    # -------------------------------------------------------------------------------------
    @property
    def conf(self) -> Path:
        return self.root / "slurm.conf"

    def env(self, **extra) -> dict:
        """Environment for client commands (sbatch, squeue, scontrol...) talking to this cluster."""
        env = dict(os.environ, SLURM_CONF=str(self.conf))
        env.update({k: str(v) for k, v in extra.items()})
        return env

    def run(self, *cmd: str, timeout: float = 600, env: dict | None = None, **kw) -> subprocess.CompletedProcess:
        return subprocess.run(list(cmd), env=env or self.env(), capture_output=True, text=True, timeout=timeout, **kw)

    # -------------------------------------------------------------------------------------
    def _write_config(self) -> None:
        r = self.root
        for d in ("state", "spool", "log", "munge"):
            (r / d).mkdir(exist_ok=True)
        os.chmod(r, 0o755)
        slurm, munge = pwd.getpwnam("slurm"), pwd.getpwnam("munge")
        for d in ("state", "log"):
            os.chown(r / d, slurm.pw_uid, slurm.pw_gid)
        # Our own munge key and socket: nothing shared with a system munged or another cluster.
        key = r / "munge" / "munge.key"
        key.write_bytes(os.urandom(128))
        os.chmod(key, 0o400)
        os.chmod(r / "munge", 0o755)  # the socket must be reachable by the slurm user; the key is 0400
        for p in (r / "munge", key):
            os.chown(p, munge.pw_uid, munge.pw_gid)
        host = socket.gethostname().split(".")[0]
        self.ctld_port = free_port()
        node_lines = "\n".join(
            f"NodeName={n} NodeAddr=127.0.0.1 NodeHostName={host} Port={free_port()} CPUs={self.cpus} State=UNKNOWN"
            for n in self.nodes)
        self.conf.write_text(f"""\
ClusterName=grpotest
SlurmctldHost={host}(127.0.0.1)
SlurmctldPort={self.ctld_port}
AuthType=auth/munge
CredType=cred/munge
AuthInfo=socket={r}/munge/munge.sock,cred_expire=10
SlurmUser=slurm
SlurmdUser=root
StateSaveLocation={r}/state
SlurmdSpoolDir={r}/spool/%n
SlurmctldPidFile={r}/log/slurmctld.pid
SlurmdPidFile={r}/spool/slurmd.%n.pid
SlurmctldLogFile={r}/log/slurmctld.log
SlurmdLogFile={r}/spool/slurmd.%n.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
SlurmdParameters=config_overrides
MpiDefault=none
MailProg=/bin/true
ReturnToService=2
MinJobAge=4
KillWait=10
FirstJobId={random.randrange(1000, 60000)}
SchedulerType=sched/backfill
SchedulerParameters=sched_interval=2,bf_interval=2
{node_lines}
PartitionName=debug Nodes={','.join(self.nodes)} Default=YES MaxTime=INFINITE State=UP
""")

    def _spawn(self, cmd: list[str], log: str) -> None:
        out = open(self.root / "log" / log, "ab")
        self.procs.append(subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=self.env(),
                                           start_new_session=True))
        out.close()

    def start(self, timeout: float = 60) -> "LocalSlurm":
        self._write_config()
        _ensure_hosts(self.nodes)
        m = self.root / "munge"
        self._spawn([_bin("runuser"), "-u", "munge", "--", _bin("munged"), "-F", "--force", f"--socket={m}/munge.sock",
                     f"--key-file={m}/munge.key", f"--pid-file={m}/munged.pid", f"--log-file={m}/munged.log",
                     f"--seed-file={m}/munged.seed"], "munged.out")
        self._wait(lambda: (m / "munge.sock").exists(), timeout, "munged did not create its socket")
        self._spawn([_bin("slurmctld"), "-D", "-c", "-f", str(self.conf)], "slurmctld.out")
        self._wait(lambda: self.run("scontrol", "ping", timeout=10).stdout.count("UP") > 0, timeout,
                   "slurmctld did not answer `scontrol ping`")
        for n in self.nodes:
            (self.root / "spool" / n).mkdir(exist_ok=True)
            self._spawn([_bin("slurmd"), "-D", "-N", n, "-f", str(self.conf)], f"slurmd.{n}.out")
        self._wait(self._nodes_idle, timeout, "nodes did not become idle")
        return self

    def _nodes_idle(self) -> bool:
        out = self.run("sinfo", "-h", "-N", "-o", "%N %T", timeout=10).stdout.split()
        states = dict(zip(out[::2], out[1::2]))
        return all(states.get(n) == "idle" for n in self.nodes)

    def _wait(self, ok, timeout: float, what: str) -> None:
        end = time.monotonic() + timeout
        while time.monotonic() < end:
            for p in self.procs:
                if p.poll() is not None:
                    raise RuntimeError(f"{what}: {p.args[0]} exited with {p.returncode}\n{self.log_tails()}")
            try:
                if ok():
                    return
            except (OSError, subprocess.SubprocessError):
                pass
            time.sleep(0.3)
        raise RuntimeError(f"{what} within {timeout:.0f} s\n{self.log_tails()}")

    def stop(self) -> None:
        """Cancel every job, end the daemons we started (slurmd first, munged last), remove the folder."""
        if self.procs:
            try:
                self.run("scancel", "--full", "-p", "debug", timeout=10)
            except (OSError, subprocess.SubprocessError):
                pass
        for p in reversed(self.procs):
            if p.poll() is None:
                p.terminate()
        for p in reversed(self.procs):
            try:
                p.wait(timeout=15)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
        self.procs = []
        shutil.rmtree(self.root, ignore_errors=True)

    def log_tails(self, lines: int = 8) -> str:
        """The end of every daemon log, for error messages."""
        out = []
        for path in sorted(self.root.rglob("*.log")):
            tail = path.read_text(errors="replace").splitlines()[-lines:]
            out.append(f"--- {path.name}\n" + "\n".join(tail))
        return "\n".join(out)

    def __enter__(self) -> "LocalSlurm":
        try:
            return self.start()
        except BaseException:
            self.stop()
            raise

    def __exit__(self, *exc) -> None:
        self.stop()
