"""Where a run listens: the store on the given address only, the backend on that address's interface."""
import os

from procs import listening

from grpo_recipe.dist.rendezvous import (
    _interface_addresses,
    backend_env,
    host_store,
    interface_for,
    is_loopback,
    listening_socket,
)


def test_store_listens_on_the_given_address_only():
    store = host_store(listening_socket("127.0.0.1", 0), 2, 10.0)
    store.set("k", "v")
    mine = [a for _, a in listening([os.getpid()])]
    assert mine and all(a.startswith("127.0.0.1:") for a in mine), mine


def test_backend_interface_follows_the_launchers_address():
    addresses = _interface_addresses()
    lo = interface_for("127.0.0.1")
    assert lo is not None and is_loopback(addresses[lo])
    for name, addr in addresses.items():  # a node's own address is reached through its own interface
        assert interface_for(addr) == (lo if is_loopback(addr) else name)
    env = backend_env("127.0.0.1")  # single node: both backends on loopback, unless the user chose
    assert env.get("GLOO_SOCKET_IFNAME", os.environ.get("GLOO_SOCKET_IFNAME")) is not None
    if "GLOO_SOCKET_IFNAME" not in os.environ:
        assert env["GLOO_SOCKET_IFNAME"] == lo and env["NCCL_SOCKET_IFNAME"] == lo


def recipe(tmp_path, timeout=300, **env):
    """grpo_recipe.train started by hand (no launcher) with these environment variables."""
    import subprocess
    import sys

    from conftest import REPO

    from grpo_recipe.dist.env import rank_env

    base = {k: v for k, v in rank_env().items() if k not in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT",
                                                              "LOCAL_RANK", "TORCHELASTIC_USE_AGENT_STORE")}
    cmd = [sys.executable, "-m", "grpo_recipe.train", "--config", "grpo_recipe/configs/quickstart.yaml", "--max_steps",
           "1", "--output_dir", str(tmp_path / "out"), "--collective_timeout_s", "25"]
    return subprocess.run(cmd, cwd=REPO, env={**base, **env}, capture_output=True, text=True, timeout=timeout)


def one_line(proc, needle):
    lines = [ln for ln in proc.stderr.splitlines() if needle in ln]
    assert proc.returncode == 2 and len(lines) == 1 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    return lines[0]


def test_rank_without_a_launcher_is_one_line_before_anything_starts(tmp_path):
    """Issue #60.9: RANK left in a cluster shell or notebook gave a KeyError traceback."""
    line = one_line(recipe(tmp_path, RANK="0"), "launch environment")
    assert "RANK=0 is set but WORLD_SIZE, MASTER_ADDR, MASTER_PORT are not" in line and "unset RANK" in line
    assert "is not below" in one_line(recipe(tmp_path, RANK="2", WORLD_SIZE="2", MASTER_ADDR="127.0.0.1",
                                             MASTER_PORT="29999"), "launch environment")
    assert not (tmp_path / "out").exists()


def test_a_taken_port_and_peers_that_never_come_are_one_line_each(tmp_path):
    """Issue #60.9: a MASTER_PORT in use gave a traceback; a rank whose peers were never started waited in
    silence for collective_timeout_s, then a traceback. Now: one line each, exit 2, and a note while waiting."""
    import socket
    import time

    from grpo_recipe.dist import rendezvous
    from grpo_recipe.dist.env import free_port

    taken = socket.socket()
    taken.bind(("127.0.0.1", 0))
    taken.listen(1)
    port = taken.getsockname()[1]
    line = one_line(recipe(tmp_path, RANK="0", WORLD_SIZE="2", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port)),
                    "cannot be listened on")
    assert f"127.0.0.1:{port}" in line and "choose another MASTER_PORT" in line
    taken.close()
    started = time.monotonic()
    proc = recipe(tmp_path, RANK="0", WORLD_SIZE="2", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
    assert time.monotonic() - started < 25 + 60 + rendezvous.WAIT_NOTE_S
    line = one_line(proc, "the rendezvous of WORLD_SIZE=2 ranks")
    assert "start every rank" in line
    assert "rank 0: still waiting at 127.0.0.1:" in proc.stderr and "were they started?" in proc.stderr
