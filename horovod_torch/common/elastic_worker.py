"""The worker's side of the elastic protocol with the driver (runner/elastic_driver.py).

The store keys both sides use, who writes and who reads each, and their values are
listed in horovod_torch/common/elastic_keys.py. A worker not assigned in a new generation
was removed from the job and exits.
"""
import enum
import json
import sys
import threading
import time
from typing import Dict, Optional, Tuple

from horovod_torch.common import config, elastic_keys, launch_env
from horovod_torch.common.exceptions import HorovodInternalError

_client = None
_gen = -1  # generation of the last init of this process


def is_elastic() -> bool:
    return launch_env.current().elastic


def _store():
    global _client
    if _client is None:
        from horovod_torch import _C
        env = launch_env.current()
        if not env.has_store:
            raise RuntimeError("no rendezvous store: HOROVOD_STORE_ADDR/HOROVOD_STORE_PORT "
                               "are not set (start the job with horovodrun)")
        _client = _C.StoreClient(env.store_host, env.store_port, env.secret,
                                 config.start_timeout_s())
    return _client


def current_generation() -> int:
    v = _store().get(elastic_keys.GEN_KEY, 0.0)
    return int(v) if v is not None else -1


def next_assignment(env: launch_env.LaunchEnv) -> Tuple[dict, str]:
    """Waits (up to HOROVOD_ELASTIC_TIMEOUT) for a generation newer than the one this
    process last used that assigns this worker, and returns (world, rendezvous
    prefix). A worker that was assigned before and is left out of a new generation
    was removed: it exits."""
    global _gen
    worker_id, timeout_s = env.elastic_worker_id, env.elastic_timeout_s
    if _gen < 0:
        # A new worker tells the driver it is here: the driver puts it in a
        # generation only now, and the running workers trained on meanwhile.
        _store().set(elastic_keys.ready_key(worker_id), b"1")
    deadline = time.monotonic() + timeout_s
    while True:
        gen = current_generation()
        if gen > _gen:
            raw = _store().get(elastic_keys.assign_key(gen, worker_id), 0.0)
            if raw is not None:
                rank, size, lrank, lsize, crank, csize = (int(x) for x in raw.decode().split(","))
                _gen = gen
                _store().set(elastic_keys.joined_key(gen, worker_id), b"1")
                world = dict(rank=rank, size=size, local_rank=lrank, local_size=lsize,
                             cross_rank=crank, cross_size=csize,
                             store_host=env.store_host, store_port=env.store_port,
                             secret=env.secret)
                return world, elastic_keys.rendezvous_prefix(gen)
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


def assigned_in(generation: int) -> bool:
    """Whether the driver put this worker in `generation` (False: it leaves the job)."""
    worker_id = launch_env.current().elastic_worker_id
    return _store().get(elastic_keys.assign_key(generation, worker_id), 0.0) is not None


def current_generation_of_this_worker() -> int:
    """The generation this process joined at its last init (-1 before the first)."""
    return _gen


def _has_store() -> bool:
    return launch_env.current().has_store


def publish_commit(commit: int, counters: Dict[str, int]) -> None:
    """Records in the store that every worker of the job holds commit `commit`
    (rank 0 calls this once per commit: one store write, no collective)."""
    if not _has_store():  # not started by the elastic driver: nobody to tell
        return
    value = str(int(commit))
    if counters:
        value += " " + json.dumps(counters, separators=(",", ":"))
    _store().set(elastic_keys.COMMIT_KEY, value.encode())


def last_commit() -> Tuple[int, Dict[str, int]]:
    """(number of the newest commit the job made, its counters); (0, {}) before any."""
    raw = _store().get(elastic_keys.COMMIT_KEY, 0.0) if _has_store() else None
    if raw is None:
        return 0, {}
    num, _, counters = raw.decode().partition(" ")
    try:
        return int(num), (json.loads(counters) if counters else {})
    except ValueError:
        return int(num), {}


def _tell_driver(*items: Tuple[str, bytes]) -> None:
    """Writes (key, value) pairs to the driver's store, in order; if the driver is gone,
    says so once on stderr (there is nobody to tell)."""
    try:
        for key, value in items:
            _store().set(key, value)
    except RuntimeError as exc:
        print(f"horovod_torch: could not report to the driver: {exc}", file=sys.stderr,
              flush=True)


# Rank 0 under --straggler-policy evict: the rank its reports name, since when, and
# the generation in which it asked the driver to evict a host.
_named = {"rank": None, "since": 0.0, "asked_gen": -1}


def watch_straggler(report) -> None:
    """Rank 0 of an elastic job, at each commit: once the same rank has been named a
    straggler (hvd.straggler_report()) for HOROVOD_STRAGGLER_EVICT_AFTER seconds, asks
    the driver, once per generation, to evict its host (elastic_keys.straggler_key).
    Nothing without --straggler-policy evict."""
    after = launch_env.current().straggler_evict_after_s
    if after is None or not is_elastic() or not _has_store() or _gen < 0:
        return
    now = time.monotonic()
    if report.straggler is None or report.straggler != _named["rank"]:
        _named.update(rank=report.straggler, since=now)
        return
    if _named["asked_gen"] == _gen or now - _named["since"] < after:
        return
    lag = report.ranks[report.straggler]
    reason = (f"rank {report.straggler} was named a straggler for {now - _named['since']:.0f} s: "
              f"last in {lag.last_share:.0%} of the {report.samples} cycles (of the last "
              f"{report.cycles}) in which a rank was behind, "
              f"{lag.median_s * 1e3:.1f} ms behind the first rank (median; a step takes "
              f"{report.step_s * 1e3:.1f} ms)")
    _tell_driver((elastic_keys.straggler_key(_gen), f"{lag.host}\t{reason}".encode()))
    _named["asked_gen"] = _gen


def report_fatal(message: str) -> None:
    """Tells the driver that the job cannot go on: it stops the job (status 1) when
    this worker exits non-zero, instead of starting replacements."""
    if _has_store():
        _tell_driver((elastic_keys.FATAL_KEY, message.encode()))


def report_leaving(failure: Optional[str]) -> None:
    """Tells the driver that this worker leaves its generation to re-form the job,
    after `failure` (a collective's error) or a host update (None). See
    elastic_keys.left_key: a worker of a failed generation that never leaves it is
    stopped or hung, and the driver kills it so that the job can re-form without it."""
    if not is_elastic() or not _has_store() or _gen < 0:
        return
    failed = [] if failure is None else [
        (elastic_keys.failed_key(_gen), failure.encode(errors="replace")[:4096])]
    _tell_driver(*failed,
                 (elastic_keys.left_key(_gen, launch_env.current().elastic_worker_id), b"1"))


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
    added = any(_store().get(elastic_keys.added_key(g), 0.0) == b"1"
                for g in range(_gen + 1, gen + 1))
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
