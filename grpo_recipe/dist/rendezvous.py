"""Where a run listens: the rendezvous store on the launcher's address and port only, the collective
backend's sockets on the interface of that address (loopback for single-node runs), nothing on `*`.

torch's TCPStore and torchrun's store bind every interface whatever address they are given; a store built
on a socket we bound ourselves (`master_listen_fd`) listens only there. Gloo and NCCL listen on the
interface named by GLOO_SOCKET_IFNAME / NCCL_SOCKET_IFNAME (default: the host name's address, reachable
from the network), so a single-node run names the loopback interface.
"""
from __future__ import annotations

import contextlib
import datetime
import fcntl
import ipaddress
import os
import socket
import struct

SIOCGIFADDR = 0x8915  # Linux ioctl: an interface's IPv4 address


def resolve(host: str) -> str:
    """The IPv4 address of a host name or address."""
    return socket.gethostbyname(host)


def is_loopback(ip: str) -> bool:
    return ipaddress.ip_address(ip).is_loopback


def _interface_addresses() -> dict[str, str]:
    """IPv4 address of each interface that has one."""
    found = {}
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        for _, name in socket.if_nameindex():
            try:
                packed = fcntl.ioctl(s.fileno(), SIOCGIFADDR, struct.pack("256s", name.encode()[:15]))
            except OSError:
                continue
            found[name] = socket.inet_ntoa(packed[20:24])
    return found


def interface_for(master_ip: str) -> str | None:
    """The interface this host reaches `master_ip` through: loopback for a loopback address, else the one
    holding the local address the kernel routes from. None when it cannot be told."""
    addresses = _interface_addresses()
    if is_loopback(master_ip):
        return next((n for n, a in addresses.items() if is_loopback(a)), None)
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            s.connect((master_ip, 9))  # UDP: picks a route, sends nothing
            local = s.getsockname()[0]
        except OSError:
            return None
    return next((n for n, a in addresses.items() if a == local), None)


def backend_env(master_addr: str) -> dict[str, str]:
    """Socket-interface settings for the collective backends, unless the user set them: gloo (CPU) always
    listens on the interface of the launcher's address; NCCL is pinned to loopback for single-node runs
    only (on a multi-node GPU cluster its own interface choice is kept: set NCCL_SOCKET_IFNAME to change it)."""
    try:
        ip = resolve(master_addr)
    except OSError:  # an unresolvable address: the rendezvous itself will say so
        return {}
    iface = interface_for(ip)
    if iface is None:
        return {}
    env = {"GLOO_SOCKET_IFNAME": iface}
    if is_loopback(ip):
        env["NCCL_SOCKET_IFNAME"] = iface
    return {k: v for k, v in env.items() if k not in os.environ}


def listening_socket(master_addr: str, port: int) -> socket.socket:
    """A TCP socket listening on master_addr:port only (port 0: a free one), for `host_store`."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((resolve(master_addr), port))
    sock.listen(128)  # clients that connect before the store serves wait in this backlog
    return sock


def host_store(sock: socket.socket, world_size: int, timeout_s: float):
    """A TCPStore server on a socket from `listening_socket`; keep it referenced while ranks may use it."""
    import torch.distributed as dist

    addr, port = sock.getsockname()
    store = dist.TCPStore(addr, port, world_size, True, timeout=datetime.timedelta(seconds=timeout_s),
                          wait_for_workers=False, master_listen_fd=sock.fileno())
    sock.detach()  # the store serves on this descriptor now: Python must not close it
    return store


def store_for_rank(rank: int, world_size: int, timeout_s: float):
    """The store a rank joins: None to let torch's env:// connect to a launcher-hosted store (torchrun, our
    launchers), else one hosted by rank 0 on MASTER_ADDR only, or an in-memory one for a world of one."""
    import torch.distributed as dist

    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True":
        return None
    if world_size == 1:
        return dist.HashStore()
    from grpo_recipe.dist.env import LaunchError

    addr, port = os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"])
    if rank == 0:
        try:
            sock = listening_socket(addr, port)
        except OSError as e:
            raise LaunchError(f"MASTER_ADDR:MASTER_PORT {addr}:{port} cannot be listened on ({e.strerror}): another "
                              f"process holds it, or the address is not this host's; choose another MASTER_PORT "
                              f"(launch/local.sh picks a free one when it is unset)") from None
        return host_store(sock, world_size, timeout_s)
    return dist.TCPStore(addr, port, world_size, False, timeout=datetime.timedelta(seconds=timeout_s))


WAIT_NOTE_S = 20.0  # after this long in the rendezvous, each rank says what it waits for


@contextlib.contextmanager
def waiting_said(rank: int, world: int, timeout_s: float):
    """The rendezvous of `world` ranks: after WAIT_NOTE_S a line saying what this rank waits for (a rank started by
    hand, or whose peers never started, would otherwise wait in silence for `timeout_s`), and the timeout as one
    line (LaunchError, exit code 2) instead of a traceback."""
    import sys
    import threading

    from grpo_recipe.dist.env import LaunchError

    where = f"{os.environ.get('MASTER_ADDR')}:{os.environ.get('MASTER_PORT')}"
    done = threading.Event()

    def note():
        if not done.wait(WAIT_NOTE_S):
            sys.stderr.write(f"rank {rank}: still waiting at {where} for the other of WORLD_SIZE={world} ranks "
                             f"(gives up after collective_timeout_s = {timeout_s:g} s); were they started?\n")
            sys.stderr.flush()

    if world > 1:
        threading.Thread(target=note, daemon=True).start()
    try:
        yield
    except (RuntimeError, ValueError) as e:  # torch's DistStoreError / DistNetworkError, gloo's connect failures
        raise LaunchError(f"rank {rank}: the rendezvous of WORLD_SIZE={world} ranks at {where} failed "
                          f"({' '.join(str(e).split())[:160]}): start every rank, with the same MASTER_ADDR, "
                          f"MASTER_PORT and WORLD_SIZE, or unset RANK to run as one process") from None
    finally:
        done.set()

