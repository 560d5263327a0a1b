"""Nothing a test run opens is reachable from the network: every listening socket is on loopback.

The sockets are read the way ``ss -ltnp`` reads them: listening TCP sockets from
``/proc/net/tcp`` and ``/proc/net/tcp6``, matched to processes by the socket inodes
behind ``/proc/<pid>/fd``. Linux only.
"""

from __future__ import annotations

import datetime
import ipaddress
import os
import socket
import struct
import sys

import pytest
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh

import meshsim
from meshsim._process.loopback import loopback_environment, loopback_interface, loopback_store

pytestmark = pytest.mark.skipif(
    not sys.platform.startswith("linux"),
    reason="reads listening sockets from Linux's /proc/net/tcp* and /proc/<pid>/fd",
)

_LISTEN = "0A"  # TCP_LISTEN in /proc/net/tcp's "st" column
_IFF_UP, _IFF_LOOPBACK = 0x1, 0x8
_SIOCGIFADDR = 0x8915


def _address(hex_address: str) -> str:
    """``/proc/net/tcp*``'s ``0100007F:1F90`` as ``127.0.0.1:8080`` (words are in host byte order)."""
    host, port = hex_address.split(":")
    words = [int(host[i : i + 8], 16).to_bytes(4, sys.byteorder) for i in range(0, len(host), 8)]
    ip = ipaddress.ip_address(b"".join(words))
    return f"[{ip}]:{int(port, 16)}" if ip.version == 6 else f"{ip}:{int(port, 16)}"


def _listening_by_inode() -> dict[str, str]:
    """Every listening TCP socket of this network namespace: inode -> address."""
    found = {}
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        with open(table) as f:
            for line in f.readlines()[1:]:
                fields = line.split()
                if fields[3] == _LISTEN:
                    found[fields[9]] = _address(fields[1])
    return found


def _socket_inodes(pid: int) -> set[str]:
    inodes = set()
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            target = os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:
            continue  # closed since the listing
        if target.startswith("socket:["):
            inodes.add(target[len("socket:[") : -1])
    return inodes


def listening(pids: list[int]) -> dict[int, list[str]]:
    """The addresses each process of ``pids`` listens on (TCP), by pid."""
    sockets = _listening_by_inode()
    return {pid: sorted(sockets[i] for i in _socket_inodes(pid) if i in sockets) for pid in pids}


def children(parent: int) -> list[int]:
    """The processes whose parent is ``parent``."""
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                stat = f.read()
        except OSError:
            continue  # exited since the listing
        if int(stat.rsplit(")", 1)[1].split()[1]) == parent:  # the field after the state
            found.append(int(entry))
    return found


def is_loopback(address: str) -> bool:
    ip = ipaddress.ip_address(address.rsplit(":", 1)[0].strip("[]"))
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
        ip = ip.ipv4_mapped
    return ip.is_loopback


def _ipv4_address(name: str) -> str | None:
    """The interface's IPv4 address, or None where it has none."""
    import fcntl  # POSIX only: imported here, so that elsewhere the module is skipped, not an error

    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        try:
            answer = fcntl.ioctl(probe.fileno(), _SIOCGIFADDR, struct.pack("256s", name.encode()[:15]))
        except OSError:
            return None
    return socket.inet_ntoa(answer[20:24])  # struct ifreq: the name, then sockaddr_in's family, port, address


def _non_loopback_interface() -> str | None:
    """An interface that is up, not loopback, and has an IPv4 address, if the machine has one."""
    for _, name in socket.if_nameindex():
        try:
            with open(f"/sys/class/net/{name}/flags") as f:
                flags = int(f.read(), 16)
        except OSError:
            continue
        if flags & _IFF_UP and not flags & _IFF_LOOPBACK and _ipv4_address(name) is not None:
            return name
    return None


@pytest.fixture
def gloo_asked_for_the_network(monkeypatch: pytest.MonkeyPatch) -> str | None:
    """Point ``GLOO_SOCKET_IFNAME`` at a network interface, as a user's multi-node setup might.

    Gloo would then listen on that interface's address unless meshsim keeps its ranks on
    loopback. On a machine with no such interface, gloo's default (the address the host
    name resolves to) is what is checked.
    """
    name = _non_loopback_interface()
    if name is not None:
        monkeypatch.setenv("GLOO_SOCKET_IFNAME", name)
    return name


def _groups_the_user_makes() -> None:
    """Gloo groups made inside the ranks open sockets of their own."""
    ws = dist.get_world_size()
    dist.all_reduce(torch.ones(1), group=dist.new_group(list(range(ws))))
    init_device_mesh("cpu", (ws,))


def _assert_on_loopback_only(found: dict[int, list[str]]) -> None:
    exposed = {pid: [a for a in addresses if not is_loopback(a)] for pid, addresses in found.items()}
    assert not {pid: a for pid, a in exposed.items() if a}, f"listening beyond loopback: {found}"


@pytest.mark.world(2, backend="spawn")
@pytest.mark.usefixtures("gloo_asked_for_the_network")
def test_a_spawned_run_listens_on_loopback_only() -> None:
    _groups_the_user_makes()
    parent = os.getppid()  # the pytest process: it holds the rendezvous store
    found = listening([parent, *children(parent)])
    assert found[parent], f"the rendezvous store was not found listening: {found}"
    assert found.get(os.getpid()), f"this rank's gloo groups were not found listening: {found}"
    _assert_on_loopback_only(found)


@pytest.mark.world(2, backend="gloo")
@pytest.mark.usefixtures("gloo_asked_for_the_network")
def test_gloo_thread_ranks_listen_on_loopback_only() -> None:
    _groups_the_user_makes()
    found = listening([os.getpid()])  # the ranks are threads of this process
    assert found[os.getpid()], f"the ranks' gloo groups were not found listening: {found}"
    _assert_on_loopback_only(found)


def test_the_loopback_interface_is_found() -> None:
    name = loopback_interface()
    assert name is not None and _ipv4_address(name) == "127.0.0.1"
    assert loopback_environment(nccl=False) == {"GLOO_SOCKET_IFNAME": name}
    assert loopback_environment(nccl=True) == {"GLOO_SOCKET_IFNAME": name, "NCCL_SOCKET_IFNAME": f"={name}"}


def _listening_on(port: int) -> list[str]:
    return sorted(a for a in _listening_by_inode().values() if a.endswith(f":{port}"))


def test_the_rendezvous_store_listens_on_loopback_only_and_closes_with_itself() -> None:
    store = loopback_store(2, timeout=10)
    port = store.port
    assert _listening_on(port) == [f"127.0.0.1:{port}"]
    client = dist.TCPStore("127.0.0.1", port, 2, False, timeout=datetime.timedelta(seconds=10))
    store.set("key", "value")
    assert client.get("key") == b"value"
    del client, store  # the store owns its socket: nothing of it stays open
    assert _listening_on(port) == []


@pytest.mark.usefixtures("gloo_asked_for_the_network")
def test_a_gloo_world_points_gloo_at_loopback_and_gives_the_variable_back() -> None:
    before = os.environ.get("GLOO_SOCKET_IFNAME")
    seen = meshsim.run(lambda: os.environ.get("GLOO_SOCKET_IFNAME"), 2, backend="gloo")
    assert seen == [loopback_interface()] * 2
    assert os.environ.get("GLOO_SOCKET_IFNAME") == before
