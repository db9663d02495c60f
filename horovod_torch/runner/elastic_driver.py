"""The elastic driver: keeps a job running while workers fail and hosts come and go.

The hosts it may use come from a HostBook (discovery.py: the host discovery script run
in the background every second, and the blacklist of failed hosts). Hosts that
resolve to this machine are started locally, so several "hosts" can be tested on
one machine; other hosts through the launcher's remote-exec command (ssh), like
static jobs. A remote host that does not answer within the start timeout counts
as a failed host. On any change (a worker failed, a host appeared or vanished) it forms a
new *generation*: an ordered list of workers with ranks, written to the store under
``elastic/`` (the keys: horovod_torch/common/elastic_keys.py; the worker's side:
horovod_torch/common/elastic_worker.py). Survivors keep their relative order, so the new
rank 0 is an old worker holding the training state. Which workers leave, and when
they are stopped (unreachable or vanished hosts, hung workers, evicted stragglers), is
elastic_removal.py's.
"""
from __future__ import annotations

import contextlib
import itertools
import signal
import subprocess
import threading
import time
from dataclasses import dataclass
from typing import Callable, Dict, List, Optional, Sequence, Set, Tuple

from horovod_torch.common import config, elastic_keys
from horovod_torch.runner import discovery, driver, hosts, output
from horovod_torch.runner.elastic_removal import WorkerRemoval
from horovod_torch.runner.elastic_removal import (  # noqa: F401  (moved there; names kept)
    HUNG_CHECK_PERIOD_S, HUNG_GRACE_S, REMOVED_GRACE_S, with_suppress_kill)

# Horovod's words at these events (users grep for them).
WORKER_EXIT_MESSAGE = "Process {rank} exit with status code {code}."
RESET_LIMIT_EXCEEDED_MESSAGE = ("Horovod was shutdown because number of resets during "
                                "elastic job exceeded limit: {}")
JOB_FAILED_MESSAGE = ("Horovod detected that one or more processes exited with non-zero "
                      "status, thus causing the job to be terminated. The first process to "
                      "do so was:\nProcess name: {name}\nExit code: {code}")

POLL_S = 0.1
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
    left_behind_at: Optional[float] = None  # removed, and a generation without it joined
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


class ElasticDriver(WorkerRemoval):
    def __init__(self, opts: ElasticOptions, store, command: Sequence[str],
                 env_for: Callable[[str, hosts.SlotInfo], Dict[str, str]],
                 forwarder: output.OutputForwarder,
                 spawner: Optional[driver.HostSpawner] = None) -> None:
        self._o = opts
        self._store = store
        self._command = list(command)
        self._env_for = env_for
        self._forwarder = forwarder
        self._spawner = spawner or driver.HostSpawner()
        self._workers: Dict[str, _Worker] = {}
        self._evict_asked: Set[int] = set()  # generations whose straggler key was read
        self._ids = itertools.count()
        self._gen = -1
        self._members: List[str] = []  # worker ids of the last generation, in rank order
        self._first_failure: Optional[Tuple[str, int]] = None  # (Horovod's name, code)
        self._signal: Optional[int] = None
        self._book = discovery.HostBook(
            opts.discovery_script if opts.discovery_script is not None else opts.discover,
            opts.slots, opts.fixed_hosts, opts.cooldown,
            local_only=self._spawner.remote is None,
            waiting=f"waiting up to --elastic-timeout {opts.elastic_timeout:g} s for --min-np "
                    f"{opts.min_np} slots")
        self._next_hung_check = 0.0
        self._failure_seen: Optional[Tuple[int, float]] = None  # (generation, when)
        self._vanished_since: Optional[float] = None  # see _remove_vanished
        self._formed_gen = -1  # the latest generation every member joined (see _formed)
        self._history: Dict[int, List[str]] = {}  # each generation's members, in rank order
        self._complete: Set[int] = set()  # generations whose rendezvous completed
        self._finished_at: Optional[float] = None  # when the first worker finished

    def _live(self) -> List[_Worker]:
        return [w for w in self._workers.values() if w.removed_at is None and not w.done]

    def _free_slots(self) -> List[str]:
        """One entry per free slot on usable hosts, in discovery order."""
        used: Dict[str, int] = {}
        for w in self._workers.values():
            if w.removed_at is None and w.proc.poll() is None:
                used[w.host] = used.get(w.host, 0) + 1
        free = []
        for h, slots in self._book.listed.items():
            if self._book.usable(h):
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
            output.log(f"cannot start a worker on host {slot.hostname}: {exc}")
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
        if self._gen >= 0 and self._o.reset_limit is not None and self._gen >= self._o.reset_limit:
            return False
        self._members = members
        self._gen += 1
        self._history[self._gen] = members
        per_host: Dict[str, List[_Worker]] = {}
        for w in live:
            per_host.setdefault(w.host, []).append(w)
        for w, s in zip(live, hosts.assign([w.host for w in live], [self._home(w) for w in live])):
            w.rank = s.rank
            value = (f"{s.rank},{s.size},{s.local_rank},{s.local_size},{s.cross_rank},"
                     f"{s.cross_size}")
            self._store.set(elastic_keys.assign_key(self._gen, w.worker_id), value.encode())
        self._store.set(elastic_keys.added_key(self._gen), b"1" if added else b"0")
        self._store.set(elastic_keys.GEN_KEY, str(self._gen).encode())
        if self._o.verbose or self._gen > 0:
            output.log(f"generation {self._gen}: {len(live)} workers on "
                       f"{', '.join(f'{h}:{len(ws)}' for h, ws in per_host.items())}")
        return True

    def _grow(self, limit: int) -> bool:
        """Starts workers on free slots up to `limit` live workers; True if any."""
        # Workers on hosts no longer listed still run (see _remove_vanished) but are
        # on their way out: they do not count towards the limit.
        live = sorted((w for w in self._live() if w.host in self._book.listed),
                      key=self._rank_order)
        new = self._free_slots()[:max(0, limit - len(live))]
        planned = hosts.assign([w.host for w in live] + new,
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
                self._book.close()  # a discovery run still going, and what it started
                self._kill_all()

    def _run(self) -> int:
        deadline = time.monotonic() + self._o.elastic_timeout
        while True:
            self._book.poll()
            if sum(self._book.listed.values()) >= self._o.min_np:
                break
            if self._signal:
                return 128 + self._signal
            if time.monotonic() > deadline:
                output.log(f"only {sum(self._book.listed.values())} slots were discovered, "
                           f"fewer than --min-np {self._o.min_np}, within --elastic-timeout")
                return 1
            time.sleep(POLL_S)
        self._grow(self._o.num_proc)
        next_grow = time.monotonic() + discovery.DISCOVERY_PERIOD_S
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
                    self._finished_at = self._finished_at or time.monotonic()
                    continue
                code = driver.exit_code(rc)
                self._say(WORKER_EXIT_MESSAGE.format(rank=w.slot.rank if w.slot else w.rank,
                                                     code=code))
                done = [d for d in self._workers.values()
                        if d.done and (self._gen < 0 or d.rank >= 0)]
                if done and (self._gen < 0 or self._trained(w)):
                    # The training is over (nothing re-forms after a worker finished):
                    # a worker that fails now, e.g. saving the model, fails the job.
                    output.log(f"worker {w.worker_id} (rank {w.rank}) exited with code "
                               f"{code} after worker {done[0].worker_id} finished; the "
                               "job fails")
                    local = w.slot.local_rank if w.slot else 0
                    output.log(JOB_FAILED_MESSAGE.format(name=f"{w.host}[{local}]", code=code))
                    return code
                fatal = self._store.get(elastic_keys.FATAL_KEY)
                if fatal is not None:  # e.g. the committed state was lost: no retry helps
                    output.log(f"worker {w.worker_id} (rank {w.rank}) exited with code "
                               f"{code}: {fatal.decode(errors='replace')}; stopping the job")
                    return 1
                output.log(f"worker {w.worker_id} (rank {w.rank}) exited with code "
                           f"{code}{driver.describe_start_failure(w.proc)}; "
                           "re-forming the job without it")
                self._cancel_rendezvous(w, code)
                if self._first_failure is None:
                    local = w.slot.local_rank if w.slot else 0
                    self._first_failure = (f"{w.host}[{local}]", code)
                del self._workers[w.worker_id]
                self._book.blacklist(w.host)
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
            if not finished and self._book.poll():
                next_grow = 0.0  # new hosts: grow now
            vanished = self._remove_vanished()
            if vanished is None:
                return 1
            changed = self._evict_straggler() or changed or vanished
            if time.monotonic() >= next_grow and not finished:
                next_grow = time.monotonic() + discovery.DISCOVERY_PERIOD_S
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
                if len(self._live()) < self._o.min_np and self._book.all_out_for_good():
                    output.log(f"every host has failed and is blacklisted "
                               f"({', '.join(self._book.listed)}); fewer than --min-np "
                               f"{self._o.min_np} workers remain; stopping")
                    if self._first_failure is not None:
                        name, code = self._first_failure
                        output.log(JOB_FAILED_MESSAGE.format(name=name, code=code))
                    return 1
                if len(self._live()) < self._o.min_np:
                    waiting_since = waiting_since or time.monotonic()
                    if time.monotonic() - waiting_since > self._o.elastic_timeout:
                        output.log(f"fewer than --min-np {self._o.min_np} workers for "
                                   f"{self._o.elastic_timeout:.0f} s; stopping")
                        return 1
                    continue
                waiting_since = None
                if not self._publish(added=added or any(w.rank < 0 for w in self._live())):
                    output.log(RESET_LIMIT_EXCEEDED_MESSAGE.format(self._o.reset_limit) +
                               f" (the job was re-formed {self._gen} times, and --reset-limit "
                               f"{self._o.reset_limit} allows no more); stopping")
                    return 1
                changed, added = False, False
            self._reap_removed()

    def _training_over(self, finished: List[_Worker]) -> bool:
        """Training is over once every assigned worker is done, or once a worker
        finished without reaching the latest generation's rendezvous: it ended the
        training in an older generation (a host was added or removed just as training
        ended), so the latest one can never form and its new workers would wait
        forever. Either way the job ends only once every other worker that trained
        (see _trained) has finished too, or waits at the latest generation's
        rendezvous, or --elastic-timeout after the first finished: those may still be
        storing a result or saving the model. That includes the workers of a host
        removed after the last commit: the generation without them never formed, so
        they trained to the end with the others. Before any generation formed, the
        workers did not use horovod (as under horovod.runner.run): it is over once
        every worker is done, or waits in hvd.init() for a generation that cannot
        form now that one has finished."""
        if self._gen < 0:
            return all(w.ready for w in self._live())
        ranked = [w for w in self._live() if w.rank >= 0]
        if ranked:
            if len(self._members) < 2 or self._gen < 1:
                return False  # generation 0: a worker that never called hvd.init() is done
            if not [w for w in finished if w.worker_id in self._members
                    and not self._at_rendezvous(w)]:
                return False
        finishing = [w for w in ranked if w.worker_id in self._members
                     and not self._at_rendezvous(w) and self._trained(w)]
        finishing += [w for w in self._workers.values() if w.removed_at is not None
                      and w.left_behind_at is None and w.proc.poll() is None
                      and self._trained(w)]
        waited = time.monotonic() - (self._finished_at or 0.0)
        if finishing:
            if waited <= self._o.elastic_timeout:
                return False
            output.log(f"workers still running {waited:.0f} s (--elastic-timeout) after "
                       f"the first finished ({', '.join(w.worker_id for w in finishing)}); "
                       "stopping them")
            return True
        if ranked:
            ended = next(w for w in finished if w.worker_id in self._members)
            output.log(f"worker {ended.worker_id} finished the training before generation "
                       f"{self._gen} formed; stopping the workers that wait for it")
        return True

    def _trained(self, w: _Worker) -> bool:
        """`w` was a member of a generation whose rendezvous completed (every member
        reached it: trained, or is training), rather than only of ones that never
        formed (a new worker waiting at a rendezvous)."""
        for gen, members in self._history.items():
            if w.worker_id not in members:
                continue
            if gen not in self._complete:
                keys = ([elastic_keys.joined_key(gen, members[0])] if len(members) == 1 else
                        [elastic_keys.addr_key(gen, rank) for rank in range(len(members))])
                if any(self._store.get(key) is None for key in keys):
                    continue
                self._complete.add(gen)
            return True
        return False

    def _at_rendezvous(self, w: _Worker) -> bool:
        """`w`, a member of the latest generation, has reached its rendezvous."""
        return self._store.get(elastic_keys.addr_key(
            self._gen, self._members.index(w.worker_id))) is not None

    def _cancel_rendezvous(self, w: _Worker, code: int) -> None:
        """`w` exited with `code`: if it was a member of the latest generation and had
        not reached that generation's rendezvous (its address is not in the store),
        tells the others, which otherwise wait there for HOROVOD_START_TIMEOUT."""
        if w.worker_id not in self._members:
            return
        if not self._at_rendezvous(w):
            rank = self._members.index(w.worker_id)
            self._store.set(elastic_keys.init_error_key(self._gen), (
                f"worker {w.worker_id} (rank {rank} of generation {self._gen}) exited with "
                f"code {code} before reaching the rendezvous").encode())

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
