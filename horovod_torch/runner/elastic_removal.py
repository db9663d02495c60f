"""Which workers of an elastic job leave, and when they are stopped: remote hosts
that never answered (blacklisted), the one worker of a failed generation that never left
it (stopped or hung: killed), workers on hosts discovery no longer lists, the host of a
straggler rank 0 asked to evict (--straggler-policy evict), and removed workers still
running a grace period after the job went on without them. Never below --min-np workers
able to form a generation.

A mixin of ElasticDriver (elastic_driver.py), whose state it reads and marks: ``_o``
(ElasticOptions), ``_store``, ``_workers``, ``_book`` (discovery.HostBook), ``_gen``,
``_members``, ``_live()``, ``_eligible()``, and the bookkeeping of these checks
(``_evict_asked``, ``_next_hung_check``, ``_failure_seen``, ``_vanished_since``,
``_formed_gen``).
"""
from __future__ import annotations

import signal
import subprocess
import time
from typing import Optional

from horovod_torch.common import elastic_keys
from horovod_torch.runner import driver, output

REMOVED_GRACE_S = 30.0
# A worker of a failed generation that has not said so this long after the first of
# the others did, while every other one has, is stopped or hung: it is killed.
HUNG_GRACE_S = 10.0
HUNG_CHECK_PERIOD_S = 1.0


class WorkerRemoval:
    """ElasticDriver's removal policy (see the module's docstring)."""

    def _stop_unreachable(self) -> None:
        """Stops remote workers whose host has not answered within the start timeout
        and blacklists the host. They were never part of a generation (see _publish),
        so the job itself is unchanged."""
        now = time.monotonic()
        for w in list(self._workers.values()):
            if (driver.waiting_to_start(w.proc) and w.proc.poll() is None
                    and now - w.started_at > self._o.start_timeout):
                output.log(f"host {w.host} did not answer within --start-timeout "
                           f"{self._o.start_timeout:g} s; blacklisting it")
                with_suppress_kill(w.proc)
                w.proc.wait()
                w.reader.join(timeout=driver.READER_JOIN_TIMEOUT_S)
                del self._workers[w.worker_id]
                self._book.blacklist(w.host)

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
        output.log(f"worker {w.worker_id} (rank {w.rank}) is still running but never left "
                   f"generation {self._gen}, which failed "
                   f"({failure.decode(errors='replace')}), as the other {len(members) - 1} "
                   "workers did: it is stopped or hung; killing it")
        with_suppress_kill(w.proc)

    def _remove_vanished(self) -> Optional[bool]:
        """Marks removed the live workers on hosts discovery no longer lists; True if
        any. Not while that would leave fewer than --min-np workers able to form a
        generation: discovery may have blinked (a script that printed nothing for a
        moment), and removing every worker that holds the committed state would lose
        it. Those workers train on meanwhile; if their hosts come back, nothing
        happened. None (stop the job) once it has lasted --elastic-timeout."""
        live = self._live()
        gone = [w for w in live if w.host not in self._book.listed]
        if not gone:
            if self._vanished_since is not None:
                output.log("the hosts are listed again; the job goes on unchanged")
            self._vanished_since = None
            return False
        now = time.monotonic()
        staying = [w for w in self._eligible() if w.host in self._book.listed]
        if len(staying) >= self._o.min_np:
            for w in gone:
                w.removed_at = now
            self._vanished_since = None
            return True
        if self._vanished_since is None:
            self._vanished_since = now
            names = ", ".join(sorted({w.host for w in gone}))
            output.log(f"host discovery no longer lists {names}; without their workers fewer "
                       f"than --min-np {self._o.min_np} would remain, so they train on until "
                       f"the hosts come back, other workers can take over, or "
                       f"--elastic-timeout {self._o.elastic_timeout:g} s")
        elif now - self._vanished_since > self._o.elastic_timeout:
            output.log(f"fewer than --min-np {self._o.min_np} workers on listed hosts for "
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
            output.log(f"not evicting host {host} ({reason}): fewer than --min-np "
                       f"{self._o.min_np} workers would remain")
            return False
        until = self._book.blacklist(host)
        back = ("for good (no --blacklist-cooldown-range)" if until == float("inf") else
                f"for {until:.0f} s (blacklist cool-down)")
        output.log(f"evicting host {host} {back}: {reason}")
        return self._remove_host(host)

    def _can_remove_host(self, host: str) -> bool:
        """At least --min-np workers able to form a generation stay without `host`."""
        staying = [w for w in self._eligible() if w.host != host and w.host in self._book.listed]
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
        """Kills removed workers still running REMOVED_GRACE_S after the job went on
        without them: once every member of a generation without them has joined it
        (left the generation before), no collective waits for them. Until then they
        train on, and leave on their own at the commit that tells every worker of the
        new generation (before, the grace ran from the removal: a worker that commits
        less often was killed mid-step, and the others went back to their last
        commit)."""
        now = time.monotonic()
        for w in self._workers.values():
            if w.removed_at is None or w.proc.poll() is not None:
                continue
            if w.left_behind_at is None:
                if w.worker_id in self._members or not self._formed():
                    continue
                w.left_behind_at = now
            if now - w.left_behind_at > REMOVED_GRACE_S:
                with_suppress_kill(w.proc)

    def _formed(self) -> bool:
        """Every member of the latest generation has joined it (elastic_keys.joined_key)."""
        if self._formed_gen != self._gen:
            if self._gen < 0 or any(
                    self._store.get(elastic_keys.joined_key(self._gen, wid)) is None
                    for wid in self._members):
                return False
            self._formed_gen = self._gen
        return True


def with_suppress_kill(proc: "subprocess.Popen[bytes]", signum: int = signal.SIGKILL) -> None:
    """Signals the worker's process group (local or remote) if it is still running."""
    if proc.poll() is None:
        driver.signal_worker(proc, signum)
