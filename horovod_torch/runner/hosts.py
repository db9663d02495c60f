"""Host lists (``-H``, ``--hostfile``), locality checks and rank assignment
(``assign_ranks`` for a static job, ``assign`` for each generation of an elastic one).

Rank assignment follows Horovod's static-mode semantics: hosts are filled
in the order given, each host taking as many ranks as it has slots until
``num_proc`` ranks are placed.  For every rank:

* ``local_rank`` is its index among the ranks on its host and
  ``local_size`` the number of ranks on that host;
* ``cross_rank`` is the index of its host among the hosts that have a rank
  with the same ``local_rank`` and ``cross_size`` the number of such hosts.
"""
from __future__ import annotations

import collections
import functools
import ipaddress
import socket
from dataclasses import dataclass
from typing import Dict, List, Optional, Sequence

from horovod_torch.runner import network

_LOCAL_NAMES = frozenset(
    {"localhost", "localhost.localdomain", "ip6-localhost"})


@dataclass(frozen=True)
class HostInfo:
    """One ``-H`` entry: a host name and the number of slots it offers."""

    hostname: str
    slots: int


@dataclass(frozen=True)
class SlotInfo:
    """Placement of one rank (the same fields Horovod hands its workers)."""

    hostname: str
    rank: int
    local_rank: int
    cross_rank: int
    size: int
    local_size: int
    cross_size: int

    def to_env(self) -> Dict[str, str]:
        """Return the ``HOROVOD_*`` topology variables for this rank."""
        return {
            "HOROVOD_HOSTNAME": self.hostname,
            "HOROVOD_RANK": str(self.rank),
            "HOROVOD_SIZE": str(self.size),
            "HOROVOD_LOCAL_RANK": str(self.local_rank),
            "HOROVOD_LOCAL_SIZE": str(self.local_size),
            "HOROVOD_CROSS_RANK": str(self.cross_rank),
            "HOROVOD_CROSS_SIZE": str(self.cross_size),
        }


def _parse_slots(text: str, item: str) -> int:
    """Parse the slot count of host entry ``item``; it must be >= 1."""
    try:
        slots = int(text)
    except ValueError:
        raise ValueError(
            f"invalid slot count in host entry {item!r}") from None
    if slots < 1:
        raise ValueError(f"slot count must be >= 1 in host entry {item!r}")
    return slots


def parse_entry(item: str, default_slots: int = 1) -> HostInfo:
    """Parse ``host``, ``host:slots``, ``[v6addr]`` or ``[v6addr]:slots`` (a bare IPv6
    address has no slot count); without a count, ``default_slots``."""
    if item.startswith("["):
        host, sep, rest = item[1:].partition("]")
        if not sep or not host:
            raise ValueError(f"malformed host entry {item!r}")
        if not rest:
            return HostInfo(host, default_slots)
        if not rest.startswith(":"):
            raise ValueError(f"malformed host entry {item!r}")
        return HostInfo(host, _parse_slots(rest[1:], item))
    if item.count(":") > 1:  # bare IPv6 address, no slot count
        return HostInfo(item, default_slots)
    host, sep, slots_text = item.partition(":")
    if not host:
        raise ValueError(f"missing host name in host entry {item!r}")
    check_hostname(host)
    return HostInfo(host, _parse_slots(slots_text, item) if sep else default_slots)


def check_hostname(host: str) -> str:
    """Reject names ssh would read as an option, or that hold blanks; returns host."""
    if host.startswith("-") or any(c.isspace() for c in host) or not host:
        raise ValueError(f"invalid host name {host!r}")
    return host


def _unique(hosts: List[HostInfo]) -> List[HostInfo]:
    seen = set()
    for host in hosts:
        key = host.hostname.lower()
        if key in seen:
            raise ValueError(f"host {host.hostname!r} listed more than once")
        seen.add(key)
    return hosts


def parse_hosts(spec: str) -> List[HostInfo]:
    """Parse a ``-H`` value such as ``"localhost:2,node1:4"``.

    A host without ``:slots`` has one slot.  Raises ``ValueError`` with a
    one-line message on malformed input or a repeated host name.
    """
    hosts: List[HostInfo] = []
    for raw in spec.split(","):
        item = raw.strip()
        if not item:
            raise ValueError(f"empty entry in host list {spec!r}")
        hosts.append(parse_entry(item))
    return _unique(hosts)


def parse_hostfile(text: str, path: str = "hostfile") -> List[HostInfo]:
    """Parse a ``--hostfile``: one host a line, as ``host slots=N``, ``host:N`` or
    ``host`` (one slot); ``#`` starts a comment, blank lines are skipped."""
    hosts: List[HostInfo] = []
    for lineno, raw in enumerate(text.splitlines(), 1):
        line = raw.split("#", 1)[0].strip()
        if not line:
            continue
        where = f"{path}:{lineno}"
        fields = line.split()
        try:
            if len(fields) == 1:
                hosts.append(parse_entry(fields[0]))
                continue
            key, sep, value = fields[1].partition("=")
            if len(fields) != 2 or key != "slots" or not sep or ":" in fields[0]:
                raise ValueError(f"expected 'host slots=N' or 'host:N', got {line!r}")
            hosts.append(HostInfo(check_hostname(fields[0]), _parse_slots(value, line)))
        except ValueError as exc:
            raise ValueError(f"{where}: {exc}") from None
    if not hosts:
        raise ValueError(f"{path} lists no hosts")
    return _unique(hosts)


@functools.lru_cache(maxsize=1024)
def is_local_host(hostname: str) -> bool:
    """Return True if ``hostname`` names this machine.

    Accepted: ``localhost``, any loopback address (``127.x.y.z``, ``::1``),
    ``socket.gethostname()`` and its fully qualified name, any address of
    one of this machine's interfaces and any name that resolves to one.
    """
    name = hostname.strip().lower()
    if name in _LOCAL_NAMES:
        return True
    try:
        ip = ipaddress.ip_address(name)
        return ip.is_loopback or network.is_own_address(name)
    except ValueError:
        pass
    own = socket.gethostname().lower()
    if name == own or name == own.split(".")[0]:
        return True
    try:
        infos = socket.getaddrinfo(name, None, socket.AF_UNSPEC, socket.SOCK_STREAM)
    except (socket.gaierror, UnicodeError):
        infos = []
    if any(network.is_own_address(str(info[4][0])) for info in infos):
        return True
    # getfqdn() may consult DNS, so it is only tried as a last resort.
    return name == socket.getfqdn().lower()


def total_slots(hosts: Sequence[HostInfo]) -> int:
    """Return the number of slots offered by ``hosts``."""
    return sum(host.slots for host in hosts)


def assign_ranks(hosts: Sequence[HostInfo], num_proc: int) -> List[SlotInfo]:
    """Place ``num_proc`` ranks on ``hosts`` in order (Horovod semantics).

    Raises ``ValueError`` if ``num_proc`` < 1 or the hosts offer fewer than
    ``num_proc`` slots.
    """
    if num_proc < 1:
        raise ValueError(f"-np must be >= 1, got {num_proc}")
    available = total_slots(hosts)
    if available < num_proc:
        names = ",".join(f"{h.hostname}:{h.slots}" for h in hosts)
        raise ValueError(
            f"-np {num_proc} exceeds the {available} slot(s) available on "
            f"hosts {names}")

    host_per_rank: List[str] = []
    for host in hosts:
        host_per_rank += [host.hostname] * min(host.slots, num_proc - len(host_per_rank))
    return assign(host_per_rank)


def assign(host_per_rank: Sequence[str],
           home: Optional[Sequence[Optional[int]]] = None) -> List[SlotInfo]:
    """Placement of ranks 0..n-1 on the given hosts (Horovod's rules: a host's ranks
    have local ranks 0..k-1; cross rank is the host's index among the hosts with that
    local rank, in order of first appearance).

    home: each rank's local rank when its process started, or None for a new one. A
    script picks its GPU once, with torch.cuda.set_device(hvd.local_rank()), so a
    rank keeps its home when it is below its host's count; the others take the local
    ranks left, in rank order. A replacement thus gets the GPU its predecessor freed,
    never a survivor's."""
    home = list(home) if home is not None else [None] * len(host_per_rank)
    per_host = collections.Counter(host_per_rank)
    taken: Dict[str, set] = {h: set() for h in per_host}
    local: List[Optional[int]] = [None] * len(host_per_rank)
    for i, (host, h) in enumerate(zip(host_per_rank, home)):
        if h is not None and h < per_host[host] and h not in taken[host]:
            local[i] = h
            taken[host].add(h)
    for i, host in enumerate(host_per_rank):
        if local[i] is None:
            local[i] = min(set(range(per_host[host])) - taken[host])
            taken[host].add(local[i])
    order = list(dict.fromkeys(host_per_rank))
    slots = []
    for rank, (host, lrank) in enumerate(zip(host_per_rank, local)):
        cross = [h for h in order if per_host[h] > lrank]
        slots.append(SlotInfo(host, rank, lrank, cross.index(host), len(host_per_rank),
                              per_host[host], len(cross)))
    return slots
