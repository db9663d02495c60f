"""Which address the rendezvous store listens on, so that every worker can reach it.

The store is the one address all workers dial; the C++ TCP mesh then listens on
the local address each worker used to reach the store, so mesh traffic follows
the store's interface without further configuration. The choice, in order:

1. ``--network-interface/--nics IFACE[,IFACE]``: the IPv4 address of the first
   listed interface that has one, else its global IPv6 address (every name must
   exist);
2. remote hosts in the job: the source address of this machine's route to the
   first remote host (the address that host sees us connect from);
3. only local hosts: ``127.0.0.1``.

Addresses are IPv4 or IPv6: a host name is resolved IPv4 first (as the C++ side,
csrc/common/net.cc, resolves it), so IPv6 is used where a host has no IPv4 address
or is given as an IPv6 address.

Only the standard library is used (no torch, no extension).
"""
from __future__ import annotations

import fcntl
import ipaddress
import socket
import struct
from typing import List, Optional, Sequence

LOOPBACK = "127.0.0.1"
_SIOCGIFADDR = 0x8915  # Linux ioctl: primary IPv4 address of an interface


def interface_names() -> List[str]:
    """Names of this machine's network interfaces, in kernel index order."""
    return [name for _, name in socket.if_nameindex()]


def interface_ipv4(name: str) -> Optional[str]:
    """The primary IPv4 address of interface ``name``, or None if it has none."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            req = struct.pack("256s", name.encode()[:15])
            res = fcntl.ioctl(s.fileno(), _SIOCGIFADDR, req)
        except OSError:
            return None
    return socket.inet_ntoa(res[20:24])


def interface_ipv6(name: str) -> Optional[str]:
    """A global IPv6 address of interface ``name`` (Linux: /proc/net/if_inet6), else
    None. Link-local addresses (fe80::/10) are skipped: they need a scope to dial."""
    try:
        with open("/proc/net/if_inet6", encoding="ascii") as f:
            lines = f.read().splitlines()
    except OSError:
        return None
    for line in lines:
        fields = line.split()
        # address, index, prefix length, scope, flags, name; flags 0x40 tentative, 0x01
        # temporary (privacy), 0x20 deprecated: none of them is a stable address to bind.
        if len(fields) == 6 and fields[5] == name and not int(fields[4], 16) & 0x61:
            ip = ipaddress.IPv6Address(int(fields[0], 16))
            if not ip.is_link_local and not ip.is_loopback:
                return str(ip)
    return None


def interface_address(name: str) -> Optional[str]:
    """The IPv4 address of interface ``name``, else a global IPv6 one, else None."""
    return interface_ipv4(name) or interface_ipv6(name)


def _family(addr: str) -> int:
    return socket.AF_INET6 if ":" in addr else socket.AF_INET


def parse_nics(spec: str) -> List[str]:
    """Split ``--nics eth0,eth1`` into names; raises ValueError naming what exists."""
    names = [n.strip() for n in spec.split(",") if n.strip()]
    if not names:
        raise ValueError(f"no interface name in --network-interface {spec!r}")
    existing = interface_names()
    missing = [n for n in names if n not in existing]
    if missing:
        raise ValueError(f"network interface {', '.join(map(repr, missing))} does not exist "
                         f"on this machine (it has: {', '.join(existing)})")
    return names


def resolve(host: str) -> str:
    """The first address of ``host`` (``user@`` ignored; an IPv6 address may be in
    brackets), IPv4 first; raises ValueError if it has none."""
    host = host.rpartition("@")[2]
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
    try:
        return str(ipaddress.ip_address(host))
    except ValueError:
        pass
    try:
        infos = socket.getaddrinfo(host, None, socket.AF_UNSPEC, socket.SOCK_STREAM)
    except socket.gaierror as exc:
        raise ValueError(f"cannot resolve host {host!r}: {exc.strerror}") from None
    infos = sorted((i for i in infos if i[0] in (socket.AF_INET, socket.AF_INET6)),
                   key=lambda i: i[0] != socket.AF_INET)
    if not infos:
        raise ValueError(f"host {host!r} has no IPv4 or IPv6 address")
    return str(infos[0][4][0])


def route_source(host: str) -> str:
    """The local address this machine uses to reach ``host`` (of its family).

    A connected UDP socket sends nothing; the kernel just picks the route.
    """
    addr = resolve(host)
    try:
        with socket.socket(_family(addr), socket.SOCK_DGRAM) as s:
            s.connect((addr, 9))
            return str(s.getsockname()[0])
    except OSError as exc:  # no route, or this kernel has no IPv6
        raise ValueError(f"no route to host {host!r} ({addr}): {exc.strerror}") from None


def is_own_address(addr: str) -> bool:
    """True if IPv4 or IPv6 address ``addr`` belongs to this machine (any interface).

    The kernel routes a packet for one of our own addresses through the local
    table and gives that same address as the source.
    """
    try:
        ip = ipaddress.ip_address(addr)
    except ValueError:
        return False
    if ip.is_loopback:
        return True
    if ip.is_unspecified or ip.is_multicast or ip.is_link_local:
        return False
    try:
        with socket.socket(_family(str(ip)), socket.SOCK_DGRAM) as s:
            s.connect((str(ip), 9))
            return ipaddress.ip_address(s.getsockname()[0].split("%")[0]) == ip
    except OSError:  # no route, or this kernel has no IPv6
        return False


def store_address(nics: Optional[Sequence[str]], remote_hosts: Sequence[str]) -> str:
    """Address the rendezvous store binds to (see the module docstring).

    Raises ValueError with a one-line message when no usable address exists.
    """
    if nics:
        for name in nics:
            addr = interface_address(name)
            if addr:
                return addr
        raise ValueError(f"network interface {', '.join(nics)} has no IPv4 or global IPv6 "
                         "address")
    if remote_hosts:
        try:
            return route_source(remote_hosts[0])
        except ValueError as exc:
            raise ValueError(f"{exc}; cannot choose an address the workers can reach the "
                             "rendezvous store at (pass --network-interface)") from None
    return LOOPBACK
