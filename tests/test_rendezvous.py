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
