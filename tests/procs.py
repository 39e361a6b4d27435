"""Real processes of a run, read from /proc: a launcher's descendants, each rank's process, what they listen
on; and waiting for a running job to reach a step."""
from __future__ import annotations

import os
import socket
import struct
import subprocess
import time
from contextlib import contextmanager
from pathlib import Path

from grpo_recipe.run.metrics import read_jsonl


def children(pid: int) -> list[int]:
    try:
        return [int(c) for t in os.listdir(f"/proc/{pid}/task")
                for c in Path(f"/proc/{pid}/task/{t}/children").read_text().split()]
    except (FileNotFoundError, ProcessLookupError):
        return []


def descendants(pid: int) -> list[int]:
    kids = children(pid)
    return kids + [g for k in kids for g in descendants(k)]


def alive(pid: int) -> bool:
    """Running or stopped, not a zombie."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except (FileNotFoundError, ProcessLookupError):
        return False


def rank_pids(launcher: int) -> dict[int, int]:
    """{rank: pid} of the grpo_recipe.train processes below a launcher. A rank's own child (a fork not yet exec'd
    shows the rank's command line and environment) is not the rank: stopping it instead once left the real
    rank running and the stopped child holding the launcher's pipes."""
    found, ranks = {}, set()
    for pid in descendants(launcher):  # parents before their children
        try:
            cmd = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
            env = dict(v.split(b"=", 1) for v in Path(f"/proc/{pid}/environ").read_bytes().split(b"\0") if b"=" in v)
            parent = int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])
        except (FileNotFoundError, ProcessLookupError):
            continue
        if b"grpo_recipe.train" in cmd and b"RANK" in env and parent not in ranks:
            found[int(env[b"RANK"])] = pid
            ranks.add(pid)
    return found


def _address(hex_addr: str) -> str:
    ip, port = hex_addr.split(":")
    raw = bytes.fromhex(ip)
    if len(raw) == 4:
        text = socket.inet_ntop(socket.AF_INET, raw[::-1])
    else:  # /proc stores IPv6 as four little-endian 32-bit words
        text = socket.inet_ntop(socket.AF_INET6, b"".join(struct.pack("<I", w) for w in struct.unpack(">4I", raw)))
    return f"{text}:{int(port, 16)}"


def listening(pids: list[int]) -> list[tuple[int, str]]:
    """(pid, local address) of every listening TCP socket the given processes hold."""
    inodes = {}
    for pid in pids:
        try:
            for fd in os.listdir(f"/proc/{pid}/fd"):
                try:
                    link = os.readlink(f"/proc/{pid}/fd/{fd}")
                except OSError:
                    continue
                if link.startswith("socket:["):
                    inodes[link[8:-1]] = pid
        except (FileNotFoundError, ProcessLookupError):
            continue
    found = []
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for line in Path(table).read_text().splitlines()[1:]:
            f = line.split()
            if f[3] == "0A" and f[9] in inodes:  # 0A = LISTEN
                found.append((inodes[f[9]], _address(f[1])))
    return found


def is_loopback(address: str) -> bool:
    host = address.rsplit(":", 1)[0]
    return host.startswith("127.") or host in ("::1", "::ffff:127.0.0.1") or host.startswith("::ffff:127.")


def wait_for_step(proc, out: Path, step: int, timeout: float = 300) -> None:
    """Wait until a running job's metrics.jsonl reaches `step` (fails at once if the job ended)."""
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if any(r["step"] >= step for r in read_jsonl(Path(out) / "metrics.jsonl")):
            return
        assert proc.poll() is None, proc.communicate()[1][-3000:]
        time.sleep(0.1)
    raise AssertionError(f"step {step} not reached in {timeout}s")


@contextmanager
def running(cmd: list[str], out: Path, step: int = 1, **popen):
    """A job started and waited for until its metrics reach `step`; killed if still running after the block."""
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, **popen)
    try:
        wait_for_step(proc, out, step)
        yield proc
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
