"""The elastic driver: keeps a job running while workers fail and hosts come and go.

Every second it runs the host-discovery script (``host:slots`` lines), in a thread
of its own and the script in a session of its own (a run that hangs is killed with
its process group after DISCOVERY_TIMEOUT_S; the last good host list stays in use
meanwhile, and the driver goes on watching its workers). Hosts that
resolve to this machine are started locally, so several "hosts" can be tested on
one machine; other hosts through the launcher's remote-exec command (ssh), like
static jobs. A remote host that does not answer within the start timeout counts
as a failed host. On any change (a worker failed, a host appeared or vanished) it forms a
new *generation*: an ordered list of workers with ranks, written to the store under
``elastic/`` (the keys: horovod_torch/elastic_keys.py; the worker's side:
horovod_torch/elastic/worker.py). Survivors keep their relative order, so the new
rank 0 is an old worker holding the training state.
"""
from __future__ import annotations

import collections
import contextlib
import itertools
import os
import random
import signal
import subprocess
import threading
import time
from dataclasses import dataclass
from typing import Callable, Dict, List, Optional, Sequence, Set, Tuple

from horovod_torch import config, elastic_keys
from horovod_torch.runner import driver, hosts

# Horovod's words at these events (users grep for them).
WORKER_EXIT_MESSAGE = "Process {rank} exit with status code {code}."
RESET_LIMIT_EXCEEDED_MESSAGE = ("Horovod was shutdown because number of resets during "
                                "elastic job exceeded limit: {}")
JOB_FAILED_MESSAGE = ("Horovod detected that one or more processes exited with non-zero "
                      "status, thus causing the job to be terminated. The first process to "
                      "do so was:\nProcess name: {name}\nExit code: {code}")

POLL_S = 0.1
DISCOVERY_PERIOD_S = 1.0  # from the end of one discovery run to the start of the next
DISCOVERY_TIMEOUT_S = 30.0  # a run taking longer is killed (its whole process group)
REMOVED_GRACE_S = 30.0
# A worker of a failed generation that has not said so this long after the first of
# the others did, while every other one has, is stopped or hung: it is killed.
HUNG_GRACE_S = 10.0
HUNG_CHECK_PERIOD_S = 1.0
# ElasticOptions.max_np when none was given (horovodrun without --max-np, Ray's
# max_workers=None): the job grows to every slot found.
UNBOUNDED = 1 << 20


@dataclass
class _Worker:
    worker_id: str
    host: str
    proc: "subprocess.Popen[bytes]"
    reader: threading.Thread
    started_at: float = 0.0
    rank: int = -1  # in the latest generation that has it
    seq: int = 0  # order of starting
    slot: Optional[hosts.SlotInfo] = None  # the place it was started for
    removed_at: Optional[float] = None
    done: bool = False
    ready: bool = False  # it reached hvd.init() (elastic_keys.ready_key)
    admitted: bool = False  # ready, and so are the other new workers of its host


@dataclass
class ElasticOptions:
    num_proc: int
    min_np: int
    max_np: int
    discovery_script: Optional[str]
    slots: int = 1
    fixed_hosts: Optional[Dict[str, int]] = None  # instead of a discovery script
    reset_limit: Optional[int] = None  # most generations after the first; None: no limit
    cooldown: Optional[Tuple[float, float]] = None
    elastic_timeout: float = 600.0
    verbose: bool = False
    evict_stragglers: bool = False  # --straggler-policy evict
    start_timeout: float = float(config.DEFAULT_START_TIMEOUT_S)
    # Instead of a discovery script: a function returning {host: slots} (raises on
    # failure), run in the background like the script (horovod_torch.ray: Ray's nodes).
    discover: Optional[Callable[[], Dict[str, int]]] = None


def cooldown_s(lo: float, hi: float, n: int, u: float) -> float:
    """Horovod's blacklist schedule: a host's n-th blacklisting (n >= 1) keeps it out
    for LO * 2**n + u * LO seconds (u: uniform in 0..1), bounded to LO..HI, so a host
    that keeps failing is tried less and less often."""
    return max(lo, min(hi, lo * 2 ** min(n, 32) + u * lo))


def parse_discovery(output: str, default_slots: int) -> Dict[str, int]:
    """``host[:slots]`` per line (``[v6addr]:slots`` for an IPv6 address), in order;
    blank lines and # comments ignored."""
    found: Dict[str, int] = {}
    for line in output.splitlines():
        line = line.split("#", 1)[0].strip()
        if not line:
            continue
        entry = hosts.parse_entry(line, default_slots)
        found[entry.hostname] = entry.slots
    return found


def assign(host_per_rank: Sequence[str],
           home: Optional[Sequence[Optional[int]]] = None) -> List[hosts.SlotInfo]:
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
        slots.append(hosts.SlotInfo(host, rank, lrank, cross.index(host), len(host_per_rank),
                                    per_host[host], len(cross)))
    return slots


class DiscoveryTimeout(ValueError):
    """The discovery script did not finish within DISCOVERY_TIMEOUT_S."""


def kill_script_group(proc: "subprocess.Popen[str]") -> None:
    """SIGKILLs a discovery script's process group (it and whatever it started),
    unless it has been reaped (its group id may be someone else's by then)."""
    if proc.returncode is None:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(proc.pid, signal.SIGKILL)


def discover_hosts(script: str, default_slots: int, timeout: Optional[float] = None,
                   started: Optional[Callable[["subprocess.Popen[str]"], None]] = None
                   ) -> Dict[str, int]:
    """Runs the discovery script once; raises OSError/ValueError on failure
    (DiscoveryTimeout after ``timeout``, default DISCOVERY_TIMEOUT_S s). The script
    runs in a session of its own: on a timeout its whole process group is killed,
    so nothing it started (a hung ``ssh``, a ``sleep``) is left behind. ``started``
    is called with the process once it runs (ElasticDriver kills the group at the
    end of the job)."""
    timeout = DISCOVERY_TIMEOUT_S if timeout is None else timeout
    proc = subprocess.Popen([script], stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True)
    if started is not None:
        started(proc)
    try:
        stdout, stderr = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        kill_script_group(proc)
        # What the group started in a session of its own may still hold the pipes.
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.communicate(timeout=1.0)
        for pipe in (proc.stdout, proc.stderr):
            with contextlib.suppress(OSError):
                pipe.close()  # type: ignore[union-attr]
        proc.wait()
        raise DiscoveryTimeout(f"the host discovery script did not finish within "
                               f"{timeout:g} s; killed it and what it started") from None
    finally:
        if proc.returncode is None:  # an exception other than the timeout
            kill_script_group(proc)
            proc.wait()
    if proc.returncode != 0:
        said = stderr.strip()[:200]
        raise ValueError(f"host discovery script exited with {proc.returncode}" +
                         (f": {said}" if said else " and wrote nothing on stderr"))
    found = parse_discovery(stdout, default_slots)
    for name in found:
        hosts.check_hostname(name)
    return found


class BackgroundDiscovery:
    """Runs the discovery script in a thread, one run at a time, so that the driver
    goes on watching its workers while a run is outstanding (a script may take up
    to DISCOVERY_TIMEOUT_S s). ``take()`` returns each finished run's outcome once:
    ``(hosts, None, False)``, or ``(None, error, timed_out)``. ``script`` may also be
    a function returning ``{host: slots}`` (called in the thread instead)."""

    def __init__(self, script, default_slots: int) -> None:
        self._script = script
        self._slots = default_slots
        self._lock = threading.Lock()
        self._thread: Optional[threading.Thread] = None
        self._proc: Optional["subprocess.Popen[str]"] = None
        self._outcome: Optional[Tuple[Optional[Dict[str, int]], Optional[str], bool]] = None
        self._closed = False

    def running(self) -> bool:
        """A run has started and its outcome has not been taken yet."""
        with self._lock:
            return self._thread is not None

    def start(self) -> None:
        """Starts a run (if none is outstanding)."""
        with self._lock:
            if self._thread is not None or self._closed:
                return
            self._thread = threading.Thread(target=self._run, daemon=True,
                                            name="horovodrun-discovery")
            self._thread.start()

    def take(self) -> Optional[Tuple[Optional[Dict[str, int]], Optional[str], bool]]:
        """The outcome of the run that finished since the last call, else None."""
        with self._lock:
            outcome, self._outcome = self._outcome, None
            if outcome is not None:
                self._thread = None
            return outcome

    def close(self) -> None:
        """Kills the process group of a run still going (the job is over)."""
        with self._lock:
            self._closed = True
            proc, thread = self._proc, self._thread
        if proc is not None:
            kill_script_group(proc)
        if thread is not None:
            thread.join(timeout=5.0)

    def _started(self, proc: "subprocess.Popen[str]") -> None:
        with self._lock:
            self._proc = proc
            closed = self._closed
        if closed:
            kill_script_group(proc)

    def _run(self) -> None:
        outcome: Tuple[Optional[Dict[str, int]], Optional[str], bool]
        try:
            if callable(self._script):
                outcome = (dict(self._script()), None, False)
            else:
                outcome = (discover_hosts(self._script, self._slots, started=self._started),
                           None, False)
        except DiscoveryTimeout as exc:
            outcome = (None, str(exc), True)
        except (OSError, ValueError) as exc:
            outcome = (None, str(exc), False)
        except Exception as exc:  # pylint: disable=broad-except
            outcome = (None, f"{type(exc).__name__}: {exc}", False)
        with self._lock:
            self._proc = None
            self._outcome = outcome


class ElasticDriver:
    def __init__(self, opts: ElasticOptions, store, command: Sequence[str],
                 env_for: Callable[[str, hosts.SlotInfo], Dict[str, str]],
                 forwarder: driver.OutputForwarder,
                 spawner: Optional[driver.HostSpawner] = None) -> None:
        self._o = opts
        self._store = store
        self._command = list(command)
        self._env_for = env_for
        self._forwarder = forwarder
        self._spawner = spawner or driver.HostSpawner()
        self._refused: set = set()  # remote hosts refused (no remote exec), logged once
        self._workers: Dict[str, _Worker] = {}
        self._hosts: Dict[str, int] = {}
        self._blacklist: Dict[str, float] = {}  # host -> time it may be used again
        self._evict_asked: Set[int] = set()  # generations whose straggler key was read
        self._failures: Dict[str, int] = {}
        self._ids = itertools.count()
        self._gen = -1
        self._members: List[str] = []  # worker ids of the last generation, in rank order
        self._first_failure: Optional[Tuple[str, int]] = None  # (Horovod's name, code)
        self._signal: Optional[int] = None
        script = opts.discovery_script if opts.discovery_script is not None else opts.discover
        self._discovery = (BackgroundDiscovery(script, opts.slots)
                           if script is not None else None)
        self._next_discovery = 0.0  # when the next discovery run (or fixed-host look) is due
        self._discovery_trouble: Optional[str] = None  # the failure last logged, if any
        self._next_hung_check = 0.0
        self._failure_seen: Optional[Tuple[int, float]] = None  # (generation, when)
        self._vanished_since: Optional[float] = None  # see _remove_vanished

    # -- discovery ---------------------------------------------------------------

    def _discover(self) -> Optional[Dict[str, int]]:
        """Never blocks: the hosts found by a discovery run that ended since the last
        call (None if none did, or it failed: the last good list stays), starting the
        next run when one is due. With fixed hosts, those, once a period."""
        now = time.monotonic()
        if self._discovery is None:
            if now < self._next_discovery:
                return None
            self._next_discovery = now + DISCOVERY_PERIOD_S
            return self._filter_remote(dict(self._o.fixed_hosts or {}))
        outcome = self._discovery.take()
        found: Optional[Dict[str, int]] = None
        if outcome is not None:
            self._next_discovery = now + DISCOVERY_PERIOD_S
            found, error, timed_out = outcome
            if found is not None:
                if self._discovery_trouble is not None:
                    driver.log("host discovery works again")
                self._discovery_trouble = None
                found = self._filter_remote(found)
            else:
                self._discovery_failed(str(error), timed_out)
        if not self._discovery.running() and now >= self._next_discovery:
            self._discovery.start()
        return found

    def _discovery_failed(self, error: str, timed_out: bool) -> None:
        """Says so once (until discovery works again, or fails differently)."""
        trouble = "timeout" if timed_out else error
        if trouble == self._discovery_trouble:
            return
        self._discovery_trouble = trouble
        if self._hosts:
            known = ", ".join(f"{h}:{n}" for h, n in self._hosts.items())
            plan = f"keeping the last host list ({known}) meanwhile"
        else:
            plan = (f"no host known yet: waiting up to --elastic-timeout "
                    f"{self._o.elastic_timeout:g} s for --min-np {self._o.min_np} slots")
        driver.log(f"host discovery failed: {error}; {plan}" +
                   ("; will keep trying, without saying so again" if timed_out else ""))

    def _filter_remote(self, found: Dict[str, int]) -> Dict[str, int]:
        """Drops remote hosts when the store listens on loopback (said once a host)."""
        if self._spawner.remote is None:
            remote = [h for h in found if not hosts.is_local_host(h)]
            new = [h for h in remote if h not in self._refused]
            if new:
                driver.log(f"ignoring remote hosts {','.join(new)}: the rendezvous store "
                           "listens on 127.0.0.1 (no remote host was known at start); "
                           "pass --network-interface to allow them")
                self._refused.update(new)
            for h in remote:
                del found[h]
        return found

    def _usable(self, host: str) -> bool:
        return self._blacklist.get(host, 0.0) <= time.monotonic()

    def _live(self) -> List[_Worker]:
        return [w for w in self._workers.values() if w.removed_at is None and not w.done]

    def _free_slots(self) -> List[str]:
        """One entry per free slot on usable hosts, in discovery order."""
        used: Dict[str, int] = {}
        for w in self._workers.values():
            if w.removed_at is None and w.proc.poll() is None:
                used[w.host] = used.get(w.host, 0) + 1
        free = []
        for h, slots in self._hosts.items():
            if self._usable(h):
                free += [h] * max(0, slots - used.get(h, 0))
        return free

    # -- generations -------------------------------------------------------------

    def _spawn(self, slot: hosts.SlotInfo) -> _Worker:
        """Starts a worker for ``slot``: the place it will have in the next generation
        if nothing else changes (its HOROVOD_RANK, and the label of its output)."""
        seq = next(self._ids)
        wid = f"{slot.hostname}/{seq}"
        env = self._env_for(wid, slot)
        try:
            proc = self._spawner.spawn(slot, self._command, env)
        except OSError as exc:
            driver.log(f"cannot start a worker on host {slot.hostname}: {exc}")
            # A stand-in that has failed, so the host is blacklisted like any other.
            proc = subprocess.Popen(["false"], start_new_session=True)
        reader = threading.Thread(target=self._forwarder.pump,
                                  args=(slot.rank, proc), daemon=True)
        reader.start()
        w = _Worker(wid, slot.hostname, proc, reader, started_at=time.monotonic(), seq=seq,
                    slot=slot)
        self._workers[wid] = w
        return w

    @staticmethod
    def _home(w: _Worker) -> Optional[int]:
        """The local rank `w` was started with (see assign)."""
        return w.slot.local_rank if w.slot else None

    @staticmethod
    def _rank_order(w: _Worker) -> Tuple[bool, int, int]:
        """Survivors first, in their rank order, then new workers as they started."""
        return (w.rank < 0, w.rank, w.seq)

    def _pending(self) -> List[_Worker]:
        """Live workers on remote hosts that have not answered yet."""
        return [w for w in self._live() if driver.waiting_to_start(w.proc)]

    def _eligible(self) -> List[_Worker]:
        """Live workers a new generation may have: those of the last one, and new ones
        that have reached hvd.init(). A new worker spends seconds importing torch
        first; the workers already training go on meanwhile instead of waiting for it
        in a generation it cannot join yet. The new workers of a host join together
        (see _note_ready)."""
        return [w for w in self._live() if w.rank >= 0 or w.admitted]

    def _note_ready(self) -> bool:
        """Marks the new workers that have reached hvd.init(), and admits those of a
        host once every new worker of that host is ready or has had the start timeout
        to get there: a host added with several slots re-forms the job once, as in
        Horovod, not once per arriving worker. True if any was admitted now."""
        new = [w for w in self._live() if w.rank < 0]
        for w in new:
            if not w.ready and self._store.get(elastic_keys.ready_key(w.worker_id)) is not None:
                w.ready = True
        now = time.monotonic()
        any_now = False
        for host in {w.host for w in new if w.ready and not w.admitted}:
            batch = [w for w in new if w.host == host]
            if all(w.ready or now - w.started_at >= self._o.start_timeout for w in batch):
                for w in batch:
                    if w.ready and not w.admitted:
                        w.admitted = any_now = True
        return any_now

    def _starting(self) -> bool:
        """Before the first generation: some worker has not reached hvd.init() yet and
        started less than the start timeout ago (the first generation has them all,
        rather than a second one following at once)."""
        now = time.monotonic()
        return self._gen < 0 and any(
            not w.ready and now - w.started_at < self._o.start_timeout for w in self._live())

    def _publish(self, added: bool) -> bool:
        """Writes a new generation: survivors first (old rank order), then new ones
        that have reached hvd.init() (see _eligible). Called only while no worker is
        pending: a generation never waits for a host that may not be reachable.
        False, publishing nothing, when the generation would be one reset more than
        --reset-limit allows: as Horovod counts, every generation after the first is a
        reset, whatever caused it (a failure, hosts added or removed, an eviction)."""
        live = sorted(self._eligible(), key=self._rank_order)
        members = [w.worker_id for w in live]
        if members == self._members:
            return True  # e.g. a new host failed before it ever joined: nothing to tell
        if self._o.reset_limit is not None and self._gen >= self._o.reset_limit:
            return False
        self._members = members
        self._gen += 1
        per_host: Dict[str, List[_Worker]] = {}
        for w in live:
            per_host.setdefault(w.host, []).append(w)
        for w, s in zip(live, assign([w.host for w in live], [self._home(w) for w in live])):
            w.rank = s.rank
            value = (f"{s.rank},{s.size},{s.local_rank},{s.local_size},{s.cross_rank},"
                     f"{s.cross_size}")
            self._store.set(elastic_keys.assign_key(self._gen, w.worker_id), value.encode())
        self._store.set(elastic_keys.added_key(self._gen), b"1" if added else b"0")
        self._store.set(elastic_keys.GEN_KEY, str(self._gen).encode())
        if self._o.verbose or self._gen > 0:
            driver.log(f"generation {self._gen}: {len(live)} workers on "
                       f"{', '.join(f'{h}:{len(ws)}' for h, ws in per_host.items())}")
        return True

    def _grow(self, limit: int) -> bool:
        """Starts workers on free slots up to `limit` live workers; True if any."""
        # Workers on hosts no longer listed still run (see _remove_vanished) but are
        # on their way out: they do not count towards the limit.
        live = sorted((w for w in self._live() if w.host in self._hosts), key=self._rank_order)
        new = self._free_slots()[:max(0, limit - len(live))]
        planned = assign([w.host for w in live] + new,
                         [self._home(w) for w in live] + [None] * len(new))
        for slot in planned[len(live):]:
            self._spawn(slot)
        return bool(new)

    # -- main loop ---------------------------------------------------------------

    def run(self) -> int:
        with self._forwarding_signals():
            try:
                return self._run()
            finally:
                if self._discovery is not None:
                    self._discovery.close()  # a run still going, and what it started
                self._kill_all()

    def _run(self) -> int:
        deadline = time.monotonic() + self._o.elastic_timeout
        while True:
            found = self._discover()
            if found is not None:
                self._hosts = found
            if sum(self._hosts.values()) >= self._o.min_np:
                break
            if self._signal:
                return 128 + self._signal
            if time.monotonic() > deadline:
                driver.log(f"only {sum(self._hosts.values())} slots were discovered, fewer than "
                           f"--min-np {self._o.min_np}, within --elastic-timeout")
                return 1
            time.sleep(POLL_S)
        self._grow(self._o.num_proc)
        next_grow = time.monotonic() + DISCOVERY_PERIOD_S
        waiting_since: Optional[float] = None
        # A change stays pending until enough workers exist to publish it, and every
        # new remote worker's host has answered (or failed to, within the start timeout).
        changed, added = True, True
        while True:
            if self._signal:
                return 128 + self._signal
            time.sleep(POLL_S)
            self._stop_unreachable()
            self._stop_hung()
            for w in list(self._workers.values()):
                rc = w.proc.poll()
                if rc is None or w.done:
                    continue
                if w.removed_at is not None:
                    del self._workers[w.worker_id]
                    continue
                if rc == 0:
                    w.done = True
                    continue
                code = driver.exit_code(rc)
                self._say(WORKER_EXIT_MESSAGE.format(rank=w.slot.rank if w.slot else w.rank,
                                                     code=code))
                fatal = self._store.get(elastic_keys.FATAL_KEY)
                if fatal is not None:  # e.g. the committed state was lost: no retry helps
                    driver.log(f"worker {w.worker_id} (rank {w.rank}) exited with code "
                               f"{code}: {fatal.decode(errors='replace')}; stopping the job")
                    return 1
                driver.log(f"worker {w.worker_id} (rank {w.rank}) exited with code "
                           f"{code}{driver.describe_start_failure(w.proc)}; "
                           "re-forming the job without it")
                self._cancel_rendezvous(w, code)
                if self._first_failure is None:
                    local = w.slot.local_rank if w.slot else 0
                    self._first_failure = (f"{w.host}[{local}]", code)
                del self._workers[w.worker_id]
                self._blacklist_host(w.host)
                # As in Horovod, the host leaves with its failed worker (its other
                # workers too), unless that leaves fewer than --min-np workers.
                if self._can_remove_host(w.host):
                    self._remove_host(w.host)
                changed = True
            finished = [w for w in self._workers.values() if w.done]
            # Workers started for a generation that never formed are stopped in run().
            if finished and self._training_over(finished):
                return 0
            # Discovery runs in the background: a slow or hung script never keeps
            # this loop from noticing a failed worker.
            found = None if finished else self._discover()
            if found is not None and found != self._hosts:
                self._hosts = found
                next_grow = 0.0  # new hosts: grow now
            vanished = self._remove_vanished()
            if vanished is None:
                return 1
            changed = self._evict_straggler() or changed or vanished
            if time.monotonic() >= next_grow and not finished:
                next_grow = time.monotonic() + DISCOVERY_PERIOD_S
                if self._grow(self._o.max_np):
                    changed = added = True
            if self._note_ready():
                changed = added = True
            if changed and not finished and not self._pending() and not self._starting():
                if len(self._eligible()) < self._o.min_np and \
                        len(self._live()) >= self._o.min_np:
                    continue  # enough workers, some still starting
                if len(self._live()) < self._o.min_np:
                    self._grow(self._o.max_np)
                    if self._pending():
                        continue
                if len(self._live()) < self._o.min_np and self._all_hosts_blacklisted_for_good():
                    driver.log(f"every host has failed and is blacklisted "
                               f"({', '.join(self._hosts)}); fewer than --min-np "
                               f"{self._o.min_np} workers remain; stopping")
                    if self._first_failure is not None:
                        name, code = self._first_failure
                        driver.log(JOB_FAILED_MESSAGE.format(name=name, code=code))
                    return 1
                if len(self._live()) < self._o.min_np:
                    waiting_since = waiting_since or time.monotonic()
                    if time.monotonic() - waiting_since > self._o.elastic_timeout:
                        driver.log(f"fewer than --min-np {self._o.min_np} workers for "
                                   f"{self._o.elastic_timeout:.0f} s; stopping")
                        return 1
                    continue
                waiting_since = None
                if not self._publish(added=added or any(w.rank < 0 for w in self._live())):
                    driver.log(RESET_LIMIT_EXCEEDED_MESSAGE.format(self._o.reset_limit) +
                               f" (the job was re-formed {self._gen} times, and --reset-limit "
                               f"{self._o.reset_limit} allows no more); stopping")
                    return 1
                changed, added = False, False
            self._reap_removed()

    def _training_over(self, finished: List[_Worker]) -> bool:
        """Training is over once every assigned worker is done, or once a worker
        finished without reaching the latest generation's rendezvous: it ended the
        training in an older generation (a host was added just as training ended),
        so the latest one can never form and its new workers would wait forever.
        (In generation 0 there is no older one: the worker did not use horovod, and
        the others finish on their own, as under horovod.runner.run.)"""
        if not [w for w in self._live() if w.rank >= 0]:
            return True
        if len(self._members) < 2 or self._gen < 1:
            return False  # generation 0: a worker that never called hvd.init() is done
        for w in finished:
            if (w.worker_id in self._members and self._store.get(elastic_keys.addr_key(
                    self._gen, self._members.index(w.worker_id))) is None):
                driver.log(f"worker {w.worker_id} finished the training before generation "
                           f"{self._gen} formed; stopping the workers that wait for it")
                return True
        return False

    def _blacklist_host(self, host: str) -> None:
        """Without --blacklist-cooldown-range a failed host is never used again; with
        it, for cooldown_s(). A failure while the host is already out (its other
        workers failing with it) neither counts nor extends the time."""
        now = time.monotonic()
        if self._blacklist.get(host, 0.0) > now:
            return
        if not self._o.cooldown:
            self._blacklist[host] = float("inf")
            return
        self._failures[host] = self._failures.get(host, 0) + 1
        lo, hi = self._o.cooldown
        self._blacklist[host] = now + cooldown_s(lo, hi, self._failures[host], random.random())

    def _all_hosts_blacklisted_for_good(self) -> bool:
        return bool(self._hosts) and all(self._blacklist.get(h) == float("inf")
                                         for h in self._hosts)

    def _stop_unreachable(self) -> None:
        """Stops remote workers whose host has not answered within the start timeout
        and blacklists the host. They were never part of a generation (see _publish),
        so the job itself is unchanged."""
        now = time.monotonic()
        for w in list(self._workers.values()):
            if (driver.waiting_to_start(w.proc) and w.proc.poll() is None
                    and now - w.started_at > self._o.start_timeout):
                driver.log(f"host {w.host} did not answer within --start-timeout "
                           f"{self._o.start_timeout:g} s; blacklisting it")
                with_suppress_kill(w.proc)
                w.proc.wait()
                w.reader.join(timeout=driver.READER_JOIN_TIMEOUT_S)
                del self._workers[w.worker_id]
                self._blacklist_host(w.host)

    def _stop_hung(self) -> None:
        """Kills the one worker of a failed generation that never left it.

        A worker stopped (SIGSTOP) or hung does not exit, so no exit tells the driver
        to re-form the job: the others fail (after HOROVOD_TCP_TIMEOUT without word from
        it), say so, leave the generation (elastic_keys.failed_key, left_key) and wait
        for one without it. When no worker of the generation exited (an exit explains
        the failure, and a new generation follows it), every other live worker has
        left, and HUNG_GRACE_S have passed since the failure was seen, the one left is
        killed and handled as any failed worker. Two or more are left alone: a healthy
        worker busy outside collectives leaves at its next one."""
        now = time.monotonic()
        if self._gen < 0 or now < self._next_hung_check:
            return
        self._next_hung_check = now + HUNG_CHECK_PERIOD_S
        failure = self._store.get(elastic_keys.failed_key(self._gen))
        if failure is None:
            return
        if self._failure_seen is None or self._failure_seen[0] != self._gen:
            self._failure_seen = (self._gen, now)
        members = [self._workers.get(wid) for wid in self._members]
        if any(w is None or w.removed_at is not None or w.done or w.proc.poll() is not None
               for w in members) or len(members) < 2:
            return
        stayed = [w for w in members if self._store.get(
            elastic_keys.left_key(self._gen, w.worker_id)) is None]
        if len(stayed) != 1 or now - self._failure_seen[1] < HUNG_GRACE_S:
            return
        w = stayed[0]
        driver.log(f"worker {w.worker_id} (rank {w.rank}) is still running but never left "
                   f"generation {self._gen}, which failed "
                   f"({failure.decode(errors='replace')}), as the other {len(members) - 1} "
                   "workers did: it is stopped or hung; killing it")
        with_suppress_kill(w.proc)

    def _cancel_rendezvous(self, w: _Worker, code: int) -> None:
        """`w` exited with `code`: if it was a member of the latest generation and had
        not reached that generation's rendezvous (its address is not in the store),
        tells the others, which otherwise wait there for HOROVOD_START_TIMEOUT."""
        if w.worker_id not in self._members:
            return
        rank = self._members.index(w.worker_id)
        if self._store.get(elastic_keys.addr_key(self._gen, rank)) is None:
            self._store.set(elastic_keys.init_error_key(self._gen), (
                f"worker {w.worker_id} (rank {rank} of generation {self._gen}) exited with "
                f"code {code} before reaching the rendezvous").encode())

    def _remove_vanished(self) -> Optional[bool]:
        """Marks removed the live workers on hosts discovery no longer lists; True if
        any. Not while that would leave fewer than --min-np workers able to form a
        generation: discovery may have blinked (a script that printed nothing for a
        moment), and removing every worker that holds the committed state would lose
        it. Those workers train on meanwhile; if their hosts come back, nothing
        happened. None (stop the job) once it has lasted --elastic-timeout."""
        live = self._live()
        gone = [w for w in live if w.host not in self._hosts]
        if not gone:
            if self._vanished_since is not None:
                driver.log("the hosts are listed again; the job goes on unchanged")
            self._vanished_since = None
            return False
        now = time.monotonic()
        staying = [w for w in self._eligible() if w.host in self._hosts]
        if len(staying) >= self._o.min_np:
            for w in gone:
                w.removed_at = now
            self._vanished_since = None
            return True
        if self._vanished_since is None:
            self._vanished_since = now
            names = ", ".join(sorted({w.host for w in gone}))
            driver.log(f"host discovery no longer lists {names}; without their workers fewer "
                       f"than --min-np {self._o.min_np} would remain, so they train on until "
                       f"the hosts come back, other workers can take over, or "
                       f"--elastic-timeout {self._o.elastic_timeout:g} s")
        elif now - self._vanished_since > self._o.elastic_timeout:
            driver.log(f"fewer than --min-np {self._o.min_np} workers on listed hosts for "
                       f"{self._o.elastic_timeout:.0f} s; stopping")
            return None
        return False

    def _evict_straggler(self) -> bool:
        """--straggler-policy evict: once rank 0 of the current generation asks
        (elastic_keys.straggler_key), removes the straggler's host as a failed host is
        removed (blacklisted, back after the cool-down) and marks its workers removed;
        True if it did. Never below --min-np: then it says so and leaves the host in."""
        if not self._o.evict_stragglers or self._gen < 0 or self._gen in self._evict_asked:
            return False
        raw = self._store.get(elastic_keys.straggler_key(self._gen))
        if raw is None:
            return False
        self._evict_asked.add(self._gen)
        host, _, reason = raw.decode(errors="replace").partition("\t")
        if not any(w.host == host for w in self._live()):
            return False
        if not self._can_remove_host(host):
            driver.log(f"not evicting host {host} ({reason}): fewer than --min-np "
                       f"{self._o.min_np} workers would remain")
            return False
        self._blacklist_host(host)
        until = self._blacklist.get(host, 0.0) - time.monotonic()
        back = ("for good (no --blacklist-cooldown-range)" if until == float("inf") else
                f"for {until:.0f} s (blacklist cool-down)")
        driver.log(f"evicting host {host} {back}: {reason}")
        return self._remove_host(host)

    def _can_remove_host(self, host: str) -> bool:
        """At least --min-np workers able to form a generation stay without `host`."""
        staying = [w for w in self._eligible() if w.host != host and w.host in self._hosts]
        return len(staying) >= self._o.min_np

    def _remove_host(self, host: str) -> bool:
        """Marks removed the live workers of `host` (they leave at the next generation);
        True if there were any."""
        victims = [w for w in self._live() if w.host == host]
        now = time.monotonic()
        for w in victims:
            w.removed_at = now
        return bool(victims)

    def _reap_removed(self) -> None:
        now = time.monotonic()
        for w in self._workers.values():
            if w.removed_at is not None and now - w.removed_at > REMOVED_GRACE_S:
                with_suppress_kill(w.proc)

    def _kill_all(self) -> None:
        for w in self._workers.values():
            with_suppress_kill(w.proc, signal.SIGTERM)
        end = time.monotonic() + driver.GRACE_PERIOD_S
        while time.monotonic() < end and any(w.proc.poll() is None
                                             for w in self._workers.values()):
            time.sleep(0.05)
        for w in self._workers.values():
            with_suppress_kill(w.proc)
        for w in self._workers.values():
            w.reader.join(timeout=driver.READER_JOIN_TIMEOUT_S)

    def _say(self, line: str) -> None:
        """A line on stdout, between the workers' lines (Horovod prints these there)."""
        self._forwarder.write_line("stdout", line)

    @contextlib.contextmanager
    def _forwarding_signals(self):
        """SIGINT/SIGTERM/SIGHUP end the job: the loop returns, workers are stopped.
        (Not in a thread other than the main one, which cannot take signals.)"""
        def handler(signum, _frame):
            self._signal = signum
        if threading.current_thread() is not threading.main_thread():
            yield
            return
        old = {s: signal.signal(s, handler) for s in driver.FORWARDED_SIGNALS}
        try:
            yield
        finally:
            for s, h in old.items():
                signal.signal(s, h)


def with_suppress_kill(proc: "subprocess.Popen[bytes]", signum: int = signal.SIGKILL) -> None:
    """Signals the worker's process group (local or remote) if it is still running."""
    if proc.poll() is None:
        driver.signal_worker(proc, signum)
