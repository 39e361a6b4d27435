"""Where a run listens: the rendezvous store on the launcher's address and port only, the collective
backend's sockets on the interface of that address (loopback for single-node runs), nothing on `*`.

torch's TCPStore and torchrun's store bind every interface whatever address they are given; a store built
on a socket we bound ourselves (`master_listen_fd`) listens only there. Gloo and NCCL listen on the
interface named by GLOO_SOCKET_IFNAME / NCCL_SOCKET_IFNAME (default: the host name's address, reachable
from the network), so a single-node run names the loopback interface.
"""
from __future__ import annotations

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
    addr, port = os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"])
    if rank == 0:
        return host_store(listening_socket(addr, port), world_size, timeout_s)
    return dist.TCPStore(addr, port, world_size, False, timeout=datetime.timedelta(seconds=timeout_s))
