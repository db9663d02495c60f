"""Which hosts an elastic job may use: the host discovery script (or a function, or
fixed hosts) run in the background, and the blacklist of hosts whose workers failed.

The script runs once a second (DISCOVERY_PERIOD_S after the previous run ended), in a
thread of its own and in a session of its own: a run that hangs is killed with its
process group after DISCOVERY_TIMEOUT_S, and the last good host list stays in use
meanwhile, so the driver (elastic_driver.py) goes on watching its workers. A failed
host is blacklisted for good, or, with --blacklist-cooldown-range, on Horovod's
schedule (cooldown_s).
"""
from __future__ import annotations

import contextlib
import os
import random
import signal
import subprocess
import threading
import time
from typing import Callable, Dict, Optional, Tuple

from horovod_torch.runner import hosts, output

DISCOVERY_PERIOD_S = 1.0  # from the end of one discovery run to the start of the next
DISCOVERY_TIMEOUT_S = 30.0  # a run taking longer is killed (its whole process group)


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
    is called with the process once it runs (BackgroundDiscovery kills the group when
    it is closed)."""
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


class HostBook:
    """The hosts the job may use: ``listed`` (what discovery printed last, or the
    fixed hosts), less those blacklisted for now (``usable``).

    source: the discovery script's path, or a function returning {host: slots}, or
    None with ``fixed`` hosts. ``local_only``: the store listens on loopback, so remote
    hosts are dropped (said once a host). ``waiting``: what the job does while no host
    is known (for the message of a failing first run)."""

    def __init__(self, source, default_slots: int, fixed: Optional[Dict[str, int]],
                 cooldown: Optional[Tuple[float, float]], local_only: bool,
                 waiting: str) -> None:
        self.listed: Dict[str, int] = {}
        self._fixed = dict(fixed or {})
        self._cooldown = cooldown
        self._local_only = local_only
        self._waiting = waiting
        self._runs = BackgroundDiscovery(source, default_slots) if source is not None else None
        self._next_run = 0.0  # when the next discovery run (or fixed-host look) is due
        self._trouble: Optional[str] = None  # the failure last logged, if any
        self._refused: set = set()  # remote hosts dropped, logged once
        self._until: Dict[str, float] = {}  # blacklisted host -> time it may be used again
        self._failures: Dict[str, int] = {}

    def poll(self) -> bool:
        """Never blocks: takes the hosts of a discovery run that ended since the last
        call (a run that failed changes nothing), and starts the next run when one is
        due; with fixed hosts, looks at them once a period. True if ``listed`` changed."""
        found = self._take()
        if found is None or found == self.listed:
            return False
        self.listed = found
        return True

    def close(self) -> None:
        """Kills a discovery run still going, and what it started (the job is over)."""
        if self._runs is not None:
            self._runs.close()

    def usable(self, host: str) -> bool:
        return self._until.get(host, 0.0) <= time.monotonic()

    def blacklist(self, host: str) -> float:
        """Keeps `host` out: for good without --blacklist-cooldown-range, else for
        cooldown_s(). A failure while the host is already out (its other workers
        failing with it) neither counts nor extends the time. Returns the seconds
        until it may be used again (inf: never)."""
        now = time.monotonic()
        if self._until.get(host, 0.0) <= now:
            if not self._cooldown:
                self._until[host] = float("inf")
            else:
                self._failures[host] = self._failures.get(host, 0) + 1
                lo, hi = self._cooldown
                self._until[host] = now + cooldown_s(lo, hi, self._failures[host],
                                                     random.random())
        return self._until[host] - now

    def all_out_for_good(self) -> bool:
        """Every listed host is blacklisted for good."""
        return bool(self.listed) and all(self._until.get(h) == float("inf")
                                         for h in self.listed)

    def _take(self) -> Optional[Dict[str, int]]:
        now = time.monotonic()
        if self._runs is None:
            if now < self._next_run:
                return None
            self._next_run = now + DISCOVERY_PERIOD_S
            return self._drop_remote(dict(self._fixed))
        outcome = self._runs.take()
        found: Optional[Dict[str, int]] = None
        if outcome is not None:
            self._next_run = now + DISCOVERY_PERIOD_S
            found, error, timed_out = outcome
            if found is not None:
                if self._trouble is not None:
                    output.log("host discovery works again")
                self._trouble = None
                found = self._drop_remote(found)
            else:
                self._failed(str(error), timed_out)
        if not self._runs.running() and now >= self._next_run:
            self._runs.start()
        return found

    def _failed(self, error: str, timed_out: bool) -> None:
        """Says so once (until discovery works again, or fails differently)."""
        trouble = "timeout" if timed_out else error
        if trouble == self._trouble:
            return
        self._trouble = trouble
        if self.listed:
            known = ", ".join(f"{h}:{n}" for h, n in self.listed.items())
            plan = f"keeping the last host list ({known}) meanwhile"
        else:
            plan = f"no host known yet: {self._waiting}"
        output.log(f"host discovery failed: {error}; {plan}" +
                   ("; will keep trying, without saying so again" if timed_out else ""))

    def _drop_remote(self, found: Dict[str, int]) -> Dict[str, int]:
        if self._local_only:
            remote = [h for h in found if not hosts.is_local_host(h)]
            new = [h for h in remote if h not in self._refused]
            if new:
                output.log(f"ignoring remote hosts {','.join(new)}: the rendezvous store "
                           "listens on 127.0.0.1 (no remote host was known at start); "
                           "pass --network-interface to allow them")
                self._refused.update(new)
            for h in remote:
                del found[h]
        return found
