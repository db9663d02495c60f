"""The torch.distributed backend "hvd": ``dist.init_process_group("hvd")`` runs DDP,
FSDP2 and plain ``dist.*`` calls on this package's engine (docs/torch_distributed.md).

torch registers the backend for CPU and CUDA tensors on ``import torch``, through this
package's entry point (c10d_autoload.py), which loads this module when a group is first
created; importing this module (or any of horovod_torch's API: ``import horovod.torch as
hvd``) registers it too, for a torch whose entry points are off. The collectives are in C++
(csrc/python/c10d_backend.cc); this module brings the engine up when the group is
created:

- when hvd.init() already ran (by the script, or under horovodrun), the backend uses
  that engine; the group must then be its whole world, in the same rank order;
- otherwise it starts one through the store torch gives the group (torchrun's,
  ``init_method="tcp://..."``, a FileStore): every rank publishes its host there,
  rank 0 starts the engine's rendezvous store and publishes its address and a fresh
  secret, and the engine it starts belongs to the backend: destroying the group and
  creating a new one (say, with the survivors of a failure) starts a new engine.

A group over a subset of ranks (``new_group(ranks=...)``, a device mesh's dimensions)
runs on a process set of that engine, which its members register when torch creates
the group (torch creates it on its members only; the engine's other ranks learn of it
through the global set, so that every rank's registry stays the same). Groups of the
same ranks share one set.
An engine the backend started outlives each rank's own work: at exit a rank waits (up to
the default group's timeout) until every rank has exited or destroyed its groups, since
the others' groups still negotiate through it. Without that wait, the first rank to
finish (say, one replica of an HSDP mesh) would stop the engine under ranks whose groups
are still running.
"""
import atexit
import secrets
import socket
import sys
import threading
import time
from typing import List

import torch  # noqa: F401  (loads libtorch before the extension)
import torch.distributed as dist

from horovod_torch.engine import extension as _ext, basics, rendezvous
from horovod_torch.common import launch_env
from horovod_torch.collectives.submit import _submit_control, poll, synchronize

NAME = "hvd"
_KEY = "horovod_torch/c10d"  # the keys this module writes in the group's store
_lock = threading.Lock()
_owned = False  # the running engine was started by a backend, not by hvd.init()
_server = None  # rank 0: the engine's rendezvous store, while its engine runs
_exit_wait_s = 1800.0  # the default group's timeout: the longest wait at exit
_exit_registered = False


def _hostname() -> str:
    return launch_env.read().hostname or socket.gethostname()


def _placement(hosts: List[str], rank: int) -> dict:
    """rank's local and cross coordinates among ranks on `hosts` (one per rank), as
    horovodrun assigns them (hosts in order of their first rank)."""
    order = list(dict.fromkeys(hosts))
    counts = {h: hosts.count(h) for h in order}
    host = hosts[rank]
    local_rank = hosts[:rank].count(host)
    return dict(rank=rank, size=len(hosts), local_rank=local_rank, local_size=counts[host],
                cross_rank=sum(1 for h in order[:order.index(host)] if counts[h] > local_rank),
                cross_size=sum(1 for h in order if counts[h] > local_rank))


def _start_through_store(store, rank: int, size: int) -> None:
    """Starts the engine for ranks that share torch's store `store` (module doc)."""
    global _server
    store.set(f"{_KEY}/host/{rank}", _hostname())
    hosts = [store.get(f"{_KEY}/host/{r}").decode() for r in range(size)]
    world = _placement(hosts, rank)
    if rank == 0:
        try:
            secret = secrets.token_hex(16)
            # One host: loopback; else MASTER_ADDR (or this host's name), not loopback.
            address = "127.0.0.1"
            if world["local_size"] < size:
                master = launch_env.read().master_addr or socket.gethostname()
                address = rendezvous.store_address(master, multi_host=True)
            _server = _ext._C.StoreServer(address, 0, secret)
        except (ValueError, RuntimeError) as exc:
            # The others would wait for the address until torch's store times out.
            store.set(f"{_KEY}/store", f"error {exc}")
            raise
        store.set(f"{_KEY}/store", f"{address} {_server.port()} {secret}")
    published = store.get(f"{_KEY}/store").decode()
    if published.startswith("error "):
        raise RuntimeError(f"hvd backend: rank 0 could not start the engine's rendezvous "
                           f"store: {published[len('error '):]}")
    host, port, secret = published.split(" ")
    world.update(store_host=host, store_port=int(port), secret=secret)
    try:
        basics.init_world(world, prefix="c10d")
    finally:
        if rank == 0:  # every rank has read the keys: it has joined (or given up)
            for key in [f"{_KEY}/store"] + [f"{_KEY}/host/{r}" for r in range(size)]:
                store.delete_key(key)


def _subgroup_set(ranks: List[int], group: str, timeout_s: float) -> int:
    """The id of the engine's process set for torch's group of global `ranks` (this rank
    is one): registered by the group's members, or the set of those ranks already there."""
    if not _ext._C.running():
        raise ValueError(
            f"hvd backend: the group over ranks {ranks} runs on the engine of the whole job, "
            "which is not running: create the default group with init_process_group(\"hvd\") "
            "or call hvd.init() first (docs/torch_distributed.md)")
    if (dist.get_rank(), dist.get_world_size()) != (basics.rank(), basics.size()):
        raise ValueError(
            f"hvd backend: torch's default group (rank {dist.get_rank()} of "
            f"{dist.get_world_size()}) is not hvd's world (rank {basics.rank()} of "
            f"{basics.size()}), so its ranks {ranks} do not name the engine's ranks")
    if ranks != sorted(ranks):
        raise ValueError(f"hvd backend: a group's ranks must be in ascending order, got {ranks} "
                         "(new_group sorts them unless told not to)")
    handle = _submit_control(_ext._C.CONTROL_ADD_PROCESS_SET_OF_MEMBERS,
                             f"c10d.{group}.new_group", ranks=ranks)
    if not _wait(handle, timeout_s):
        raise RuntimeError(
            f"hvd backend: the group over ranks {ranks} was not created by all of them within "
            f"its timeout ({timeout_s:g} s); every rank must call new_group, in the same order")
    return int(synchronize(handle)[0])


def _wait(handle: int, timeout_s: float) -> bool:
    """Waits up to timeout_s for an op (while the engine runs); True once it is done."""
    deadline = time.monotonic() + timeout_s
    while not poll(handle) and time.monotonic() < deadline and _ext._C.running():
        time.sleep(0.01)
    return poll(handle)


def _create(opts, _backend_options):
    """torch.distributed calls this on each rank of a new "hvd" group."""
    global _owned, _server
    rank, size = opts.group_rank, opts.group_size
    ranks = list(opts.global_ranks_in_group or range(size))
    group = str(opts.group_id)
    if dist.is_initialized() and (ranks != list(range(size)) or size != dist.get_world_size()):
        return _ext._C.c10d_backend(rank, size, opts.timeout.total_seconds(),
                                    _subgroup_set(ranks, group, opts.timeout.total_seconds()),
                                    group)
    with _lock:
        if _ext._C.running() and _owned and not dist.is_initialized():
            # A new default group: the one whose engine this is was destroyed.
            basics.shutdown()
            _owned = False
        if not _ext._C.running():
            _server = None
            _start_through_store(opts.store, rank, size)
            _owned = True
            _register_exit_wait(opts.timeout.total_seconds())
        elif (rank, size) != (basics.rank(), basics.size()):
            raise ValueError(
                f"hvd backend: this group (rank {rank} of {size}, global ranks {ranks}) is not "
                f"hvd's world (rank {basics.rank()} of {basics.size()}); only the whole world "
                "is supported yet")
    return _ext._C.c10d_backend(rank, size, opts.timeout.total_seconds(), 0, group)


def _register_exit_wait(timeout_s: float) -> None:
    """Registers _wait_for_every_rank once, after the engine's own atexit shutdown, so
    that it runs before it."""
    global _exit_registered, _exit_wait_s
    _exit_wait_s = timeout_s
    if not _exit_registered:
        atexit.register(_wait_for_every_rank)
        _exit_registered = True


def _wait_for_every_rank() -> None:
    """At exit, for an engine this module started: a barrier of the global set, so that
    the engine stops when every rank is done rather than when the first one is (the
    module doc). A failed engine (a peer died) ends the wait at once. A process that
    exits on an unhandled exception does not wait: its shutdown fails the others' ops
    at once, as a crash should (sys.last_value is set before atexit handlers run)."""
    if not (_owned and _ext._C.running()) or getattr(sys, "last_value", None) is not None:
        return
    try:
        handle = _submit_control(_ext._C.CONTROL_BARRIER, "c10d.exit")
        if _wait(handle, _exit_wait_s):
            synchronize(handle)
    except Exception:  # noqa: BLE001  (exiting: the shutdown that follows reports it)
        pass


def register() -> None:
    """Registers "hvd" with torch.distributed (once; later calls do nothing)."""
    if not dist.is_available() or hasattr(dist.Backend, NAME.upper()):
        return
    dist.Backend.register_backend(NAME, _create, extended_api=True, devices=["cpu", "cuda"])


register()
