"""Loopback only: nothing a test run opens is reachable from the network.

Ranks of one machine need no network, and a socket listening beyond loopback lets
anyone who can reach the machine overwrite rendezvous keys, steer gloo connections,
or feed object collectives something to unpickle. Three kinds of socket listen:

- the spawn mode's rendezvous store: torch's ``TCPStore`` server listens on every
  interface whatever host it is given, so it gets a socket already bound to
  127.0.0.1 (:func:`loopback_store`);
- gloo devices, one per group, made inside the ranks, including the groups user code
  makes: they listen on the address the host name resolves to, or on the interface
  ``GLOO_SOCKET_IFNAME`` names. c10d hands gloo no device options (torch 2.11-2.15),
  so that variable is the one switch that reaches every group: set it to the
  loopback interface (:func:`loopback_environment`);
- NCCL's bootstrap and socket transport, in spawned GPU ranks: ``NCCL_SOCKET_IFNAME``.

Not covered: ``--multigpu-static``, whose rendezvous is torchrun's and whose job may
span machines.
"""

from __future__ import annotations

import datetime
import os
import re
import socket

# torch.distributed.TCPStore, from where the stubs define it (mypy sees no re-export)
from torch._C._distributed_c10d import TCPStore

__all__ = ["LOOPBACK_HOST", "loopback_environment", "loopback_interface", "loopback_store"]

LOOPBACK_HOST = "127.0.0.1"
_IFF_LOOPBACK = 0x8  # <net/if.h>
_LOOPBACK_NAME = re.compile(r"lo\d*")  # "lo" on Linux, "lo0" on macOS and the BSDs


def loopback_interface() -> str | None:
    """The name of this machine's loopback network interface.

    Linux says which interface is loopback in ``/sys/class/net/<name>/flags``;
    elsewhere the conventional names (``lo``, ``lo0``) are looked for.

    Returns:
        the interface's name, or None where the machine lists no such interface.
    """
    try:
        names = [name for _, name in socket.if_nameindex()]
    except OSError:
        return None
    for name in names:
        if _interface_flags(name) & _IFF_LOOPBACK:
            return name
    return next((name for name in names if _LOOPBACK_NAME.fullmatch(name)), None)


def _interface_flags(name: str) -> int:
    """The interface's flags as Linux's sysfs shows them; 0 where it cannot tell."""
    try:
        with open(f"/sys/class/net/{name}/flags") as f:
            return int(f.read(), 16)
    except (OSError, ValueError):
        return 0


def loopback_environment(*, nccl: bool) -> dict[str, str]:
    """The environment variables that keep gloo (and NCCL) ranks on the loopback interface.

    They replace any value the user set (for a multi-machine job, say): ranks simulated
    on one machine never need another interface.

    Keyword args:
        nccl: include ``NCCL_SOCKET_IFNAME`` (processes that may start NCCL groups).

    Returns:
        the variables to set; empty where no loopback interface is found, which leaves
        gloo on its default (the host name's address).
    """
    name = loopback_interface()
    if name is None:
        return {}
    env = {"GLOO_SOCKET_IFNAME": name}  # a comma-separated list of exact interface names
    if nccl:
        env["NCCL_SOCKET_IFNAME"] = f"={name}"  # "=": this exact name, not every name it prefixes
    return env


def loopback_store(world_size: int, *, timeout: float) -> TCPStore:
    """A ``TCPStore`` server that listens on 127.0.0.1 only, on a port the OS picks.

    ``TCPStore(host, port, is_master=True)`` binds its own socket to every interface,
    whatever ``host`` says; given ``master_listen_fd`` (torch 2.11-2.15, either server
    backend) it listens on that socket instead.

    Args:
        world_size: the number of processes that will use the store, this one included.

    Keyword args:
        timeout: seconds a store operation may wait.

    Returns:
        the server store; its ``port`` is where clients connect, on :data:`LOOPBACK_HOST`.
    """
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as listener:
        listener.bind((LOOPBACK_HOST, 0))
        listener.listen()
        # The store owns the descriptor it is given and closes it with itself, so it
        # gets a duplicate; this one closes on leaving. (Should the constructor raise,
        # whether it closed the duplicate is unknown: closing it again could close an
        # unrelated descriptor that took its number, so it is left alone.)
        return TCPStore(
            LOOPBACK_HOST,
            listener.getsockname()[1],
            world_size,
            True,
            timeout=datetime.timedelta(seconds=timeout),
            wait_for_workers=False,
            master_listen_fd=os.dup(listener.fileno()),
        )
