"""The worker's side of the elastic protocol with the driver (runner/elastic_driver.py).

Store keys written by the driver (all under ``elastic/``):
  ``gen``                       current generation number (bumped last, after the rest)
  ``<gen>/assign/<worker_id>``  "rank,size,local_rank,local_size,cross_rank,cross_size"
  ``<gen>/added``               "1" if that generation brought in new workers
A worker not assigned in a new generation was removed from the job and exits.
"""
import enum
import os
import sys
import threading
import time
from typing import Optional, Tuple

from horovod_torch.exceptions import HorovodInternalError

_client = None
_gen = -1  # generation of the last init of this process


def is_elastic() -> bool:
    return os.environ.get("HOROVOD_ELASTIC") == "1"


def _store():
    global _client
    if _client is None:
        from horovod_torch import _C
        _client = _C.StoreClient(os.environ["HOROVOD_STORE_ADDR"],
                                 int(os.environ["HOROVOD_STORE_PORT"]),
                                 os.environ.get("HOROVOD_SECRET", ""),
                                 float(os.environ.get("HOROVOD_START_TIMEOUT", "30")))
    return _client


def current_generation() -> int:
    v = _store().get("elastic/gen", 0.0)
    return int(v) if v is not None else -1


def next_assignment(timeout_s: float) -> Tuple[dict, str]:
    """Waits for a generation newer than the one this process last used that
    assigns this worker, and returns (world, rendezvous prefix). A worker that was
    assigned before and is left out of a new generation was removed: it exits."""
    global _gen
    worker_id = os.environ["HOROVOD_ELASTIC_WORKER_ID"]
    deadline = time.monotonic() + timeout_s
    while True:
        gen = current_generation()
        if gen > _gen:
            raw = _store().get(f"elastic/{gen}/assign/{worker_id}", 0.0)
            if raw is not None:
                rank, size, lrank, lsize, crank, csize = (int(x) for x in raw.decode().split(","))
                _gen = gen
                world = dict(rank=rank, size=size, local_rank=lrank, local_size=lsize,
                             cross_rank=crank, cross_size=csize,
                             store_host=os.environ["HOROVOD_STORE_ADDR"],
                             store_port=int(os.environ["HOROVOD_STORE_PORT"]),
                             secret=os.environ.get("HOROVOD_SECRET", ""))
                return world, f"elastic/{gen}"
            if _gen >= 0:
                print(f"horovod_torch: worker {worker_id} is not part of generation {gen} "
                      "(its host was removed); exiting", file=sys.stderr, flush=True)
                sys.exit(0)
            # else: a new worker whose generation is still being formed
        if time.monotonic() > deadline:
            raise HorovodInternalError(
                f"no new generation of workers was formed within {timeout_s:.0f} s "
                "(HOROVOD_ELASTIC_TIMEOUT); the driver may have given up")
        time.sleep(0.05)


class HostUpdateResult(enum.IntFlag):
    """What changed in the set of hosts (Horovod's flags): ``removed`` alone means the
    survivors need no state sync."""
    no_update = 0
    removed = 1
    added = 2
    mixed = removed | added


def poll_host_update() -> Optional[Tuple[int, HostUpdateResult]]:
    """(newest generation, what changed) when the driver formed a generation newer than
    the one this process joined at its last init; None when nothing changed or the job
    is not elastic. The generation number serves as the update's timestamp."""
    if not is_elastic() or _gen < 0:
        return None
    gen = current_generation()
    if gen <= _gen:
        return None
    added = any(_store().get(f"elastic/{g}/added", 0.0) == b"1" for g in range(_gen + 1, gen + 1))
    return gen, (HostUpdateResult.added if added else HostUpdateResult.removed)


class WorkerNotificationManager:
    """Horovod's registry of objects told about host updates
    (``listener.on_hosts_updated(timestamp, HostUpdateResult)``). Horovod's driver
    pushes these to a service in each worker; here the worker asks the driver's store
    instead (``poll_host_update``, called by ``State.check_host_updates`` on rank 0),
    so ``init()`` starts nothing. ``handle_hosts_updated`` forwards an update to every
    listener."""

    def __init__(self):
        self._lock = threading.Lock()
        self._listeners = set()

    def init(self, rendezvous_addr=None, rendezvous_port=None, nic=None, hostname=None,
             local_rank=None) -> None:
        pass

    def register_listener(self, listener) -> None:
        with self._lock:
            self._listeners.add(listener)

    def remove_listener(self, listener) -> None:
        with self._lock:
            self._listeners.discard(listener)

    def handle_hosts_updated(self, timestamp, update_res) -> None:
        with self._lock:
            listeners = list(self._listeners)
        for listener in listeners:
            listener.on_hosts_updated(timestamp, update_res)


notification_manager = WorkerNotificationManager()
