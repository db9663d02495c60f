"""Spawning and supervision of ``horovodrun`` workers (their output: output.py).

Every worker runs in its own session (hence its own process group), so a
signal sent with ``os.killpg`` reaches the worker and anything it started.
Process creation goes through a :class:`Spawner`: :class:`HostSpawner` runs
workers of local hosts directly (:class:`LocalSpawner`) and those of other
hosts through ssh (:mod:`horovod_torch.runner.remote`); signals always go
through :func:`signal_worker`, which knows both kinds.
"""
from __future__ import annotations

import atexit
import contextlib
import os
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from typing import (Callable, Dict, Iterator, List, Mapping, Optional,
                    Protocol, Sequence)

from horovod_torch.runner import hosts, reaper
from horovod_torch.runner.hosts import SlotInfo
from horovod_torch.runner.output import OutputForwarder, log
from horovod_torch.runner.remote import RemoteExec, RemoteProcess

GRACE_PERIOD_S = 5.0
"""Time between forwarding SIGTERM/SIGINT and escalating to SIGKILL."""

POLL_INTERVAL_S = 0.05
READER_JOIN_TIMEOUT_S = 2.0
FORWARDED_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)


def signal_name(signum: int) -> str:
    """Return ``"SIGTERM"`` style name for ``signum``."""
    try:
        return signal.Signals(signum).name
    except ValueError:
        return f"signal {signum}"


def exit_code(returncode: int) -> int:
    """Map a ``Popen.returncode`` to a shell-style exit code (128+signum)."""
    return 128 - returncode if returncode < 0 else returncode


class Spawner(Protocol):
    """Strategy that starts one worker process (local now, ssh later)."""

    def spawn(self, slot: SlotInfo, command: Sequence[str],
              env: Mapping[str, str]) -> "subprocess.Popen[bytes]":
        """Start ``command`` for ``slot``; output must go to ``stdout``."""


class LocalSpawner:
    """Run workers on this machine, each in a new session, and register each
    session with a reaper process that stops them if horovodrun is killed."""

    def __init__(self) -> None:
        self._reaper: Optional["subprocess.Popen[bytes]"] = None
        self._reaper_tried = False
        self._reaper_pipe = -1  # write end; only horovodrun holds it

    def spawn(self, slot: SlotInfo, command: Sequence[str],
              env: Mapping[str, str]) -> "subprocess.Popen[bytes]":
        """Start ``command``; only rank 0 inherits stdin (like mpirun)."""
        proc = subprocess.Popen(
            list(command), env=dict(env),
            stdin=None if slot.rank == 0 else subprocess.DEVNULL,
            stdout=subprocess.PIPE, stderr=subprocess.PIPE,
            start_new_session=True)
        self._register(proc.pid)
        return proc

    def close(self) -> None:
        """Lets the reaper go (the job's local workers have ended)."""
        if self._reaper_pipe >= 0:
            os.close(self._reaper_pipe)
            self._reaper_pipe = -1
        if self._reaper is not None:
            with contextlib.suppress(subprocess.TimeoutExpired):
                self._reaper.wait(timeout=READER_JOIN_TIMEOUT_S)

    def _register(self, pgid: int) -> None:
        if not self._reaper_tried:
            self._start_reaper()
        if self._reaper_pipe >= 0:
            try:
                os.write(self._reaper_pipe, f"{pgid}\n".encode())
            except OSError as e:
                log(f"warning: lost the worker reaper ({e.strerror}); local workers "
                    "will outlive horovodrun if it is killed")
                os.close(self._reaper_pipe)
                self._reaper_pipe = -1

    def _start_reaper(self) -> None:
        self._reaper_tried = True
        read, write = os.pipe()
        try:
            # By path, not as a module: the package's __init__ loads torch.
            self._reaper = subprocess.Popen(
                [sys.executable, "-I", os.path.abspath(reaper.__file__),
                 str(GRACE_PERIOD_S)],
                stdin=read, stdout=subprocess.DEVNULL, start_new_session=True)
            self._reaper_pipe = write
        except OSError as e:
            log(f"warning: cannot start the worker reaper ({e.strerror}); local "
                "workers will outlive horovodrun if it is killed")
            os.close(write)
        finally:
            os.close(read)


MAX_CONNECTING_PER_HOST = 8
"""Remote workers of one host whose ssh session may be starting at once: sshd
refuses unauthenticated connections beyond ``MaxStartups`` (10 by default)."""
CONNECTING_WAIT_S = 10.0


class HostSpawner:
    """Start workers of local hosts directly, those of other hosts with ``remote``.

    Without ``remote`` every host must be local (``OSError`` otherwise). Each
    remote worker is its own ssh session; at most MAX_CONNECTING_PER_HOST of one
    host's sessions are started before earlier ones have answered, unless the
    host has not answered for CONNECTING_WAIT_S (the start timeout deals with it).
    """

    def __init__(self, remote: Optional[RemoteExec] = None) -> None:
        self.remote = remote
        self._local = LocalSpawner()
        self._connecting: Dict[str, List[RemoteProcess]] = {}
        self._slow_hosts: set = set()

    def spawn(self, slot: SlotInfo, command: Sequence[str],
              env: Mapping[str, str]) -> "subprocess.Popen[bytes]":
        """Start ``command`` for ``slot`` on its host."""
        if hosts.is_local_host(slot.hostname):
            return self._local.spawn(slot, command, env)
        if self.remote is None:
            raise OSError(f"host {slot.hostname} is not this machine and remote "
                          "hosts are not enabled")
        self._wait_for_room(slot.hostname)
        proc = self.remote.spawn(slot.hostname, command, env)
        self._connecting[slot.hostname].append(proc)
        return proc

    def close(self) -> None:
        """Releases what starting local workers took (their reaper)."""
        self._local.close()

    def _wait_for_room(self, host: str) -> None:
        pending = self._connecting.setdefault(host, [])
        deadline = time.monotonic() + CONNECTING_WAIT_S
        while True:
            pending[:] = [p for p in pending if waiting_to_start(p) and p.poll() is None]
            if len(pending) < MAX_CONNECTING_PER_HOST or host in self._slow_hosts:
                return
            if time.monotonic() > deadline:
                self._slow_hosts.add(host)
                return
            time.sleep(0.02)


def signal_worker(proc: "subprocess.Popen[bytes]", signum: int) -> None:
    """Send ``signum`` to a worker's process group, on this host or a remote one.
    A worker object with a ``signal_worker`` method of its own (RemoteProcess, or
    a Ray actor's stand-in in horovod_torch.ray) is signalled through it."""
    hook = getattr(proc, "signal_worker", None)
    if hook is not None:
        hook(signum)
        return
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(proc.pid, signum)


def waiting_to_start(proc: "subprocess.Popen[bytes]") -> bool:
    """True for a remote worker whose host has not answered yet (a worker object
    with a ``started`` event: RemoteProcess, or a Ray actor not yet running)."""
    started = getattr(proc, "started", None)
    return started is not None and not started.is_set()


def describe_start_failure(proc: "subprocess.Popen[bytes]") -> str:
    """A note for a worker that exited before it ran: which host, and why."""
    if not waiting_to_start(proc):
        return ""
    why = getattr(proc, "start_failure", "the remote-exec command failed; its error is above")
    return f" before it could start on host {proc.host} ({why})"


OUTPUT_CLOSE_WINDOW_S = 2.0
"""A worker whose output closed at most this long before its process ended is taken
to have ended when its output closed (see :attr:`Worker.ended_at`)."""


@dataclass
class Worker:
    """A started worker: its placement, process and output thread.

    ``exited_at`` is when its process ended and ``output_closed_at`` when its
    stdout and stderr both closed (``time.monotonic()``), recorded by the threads
    :meth:`watch` starts: the order in which workers ended says which one failed
    first, however late the supervisor looks."""

    slot: SlotInfo
    proc: "subprocess.Popen[bytes]"
    reader: Optional[threading.Thread] = None
    exited_at: Optional[float] = None
    output_closed_at: Optional[float] = None

    @property
    def rank(self) -> int:
        """The worker's global rank."""
        return self.slot.rank

    def watch(self, forwarder: "OutputForwarder") -> None:
        """Starts forwarding the worker's output (``reader``), and a thread that
        waits for its process to end."""
        def forward() -> None:
            try:
                forwarder.pump(self.rank, self.proc)
            finally:
                self.output_closed_at = time.monotonic()

        def wait() -> None:
            with contextlib.suppress(Exception):
                self.proc.wait()
            self.exited_at = time.monotonic()
        self.reader = threading.Thread(target=forward, name=f"horovodrun-output-{self.rank}",
                                       daemon=True)
        self.reader.start()
        threading.Thread(target=wait, name=f"horovodrun-wait-{self.rank}",
                         daemon=True).start()

    @property
    def ended_at(self) -> Optional[float]:
        """When the worker ended: its exit, or the closing of its output if that came
        shortly before. A dying process closes its files (its output first, then its
        sockets) before the kernel reports it as exited, which for a CUDA process
        comes about 0.1 s later: long enough for a peer that lost its connections to
        exit first. (A worker that closes its output and runs on is not fooled: the
        window is OUTPUT_CLOSE_WINDOW_S.)"""
        if self.exited_at is None:
            return None
        closed = self.output_closed_at
        if closed is not None and self.exited_at - OUTPUT_CLOSE_WINDOW_S <= closed:
            return min(closed, self.exited_at)
        return self.exited_at

    def describe(self) -> str:
        """``rank R (pid P)``, or ``rank R (host H)`` for a worker on another host."""
        if isinstance(self.proc, RemoteProcess):
            return f"rank {self.rank} (host {self.proc.host})"
        return f"rank {self.rank} (pid {self.proc.pid})"

    def alive(self) -> bool:
        """Return True while the worker's main process has not exited."""
        return self.proc.poll() is None

    def signal_group(self, signum: int) -> None:
        """Send ``signum`` to the worker's whole process group."""
        signal_worker(self.proc, signum)


class Supervisor:
    """Start all workers, forward signals and tear the job down on failure.

    ``run`` returns the exit code for ``horovodrun``: 0 when every worker
    succeeded, the first failing worker's code (128+signum when it was
    killed by a signal), 1 when a remote host did not answer within
    ``start_timeout_s``, or 128+signum when horovodrun itself got a signal.
    """

    def __init__(self, jobs: Sequence[SlotInfo],
                 env_for: Callable[[SlotInfo], Dict[str, str]],
                 command: Sequence[str], spawner: Spawner,
                 forwarder: OutputForwarder,
                 grace_s: float = GRACE_PERIOD_S,
                 start_timeout_s: Optional[float] = None,
                 after_spawn: Optional[Callable[[], Optional[int]]] = None) -> None:
        self._jobs = list(jobs)
        # Runs once every worker has been started (horovodrun starts the store
        # there); an exit code stops the job.
        self._after_spawn = after_spawn
        self._env_for = env_for
        self._command = list(command)
        self._spawner = spawner
        self._forwarder = forwarder
        self._grace_s = grace_s
        self._start_timeout_s = start_timeout_s
        self._workers: List[Worker] = []
        self._signals: List[int] = []

    def run(self) -> int:
        """Run the job to completion and return horovodrun's exit code."""
        atexit.register(self._kill_all)  # last resort if we crash
        with self._forwarding_signals():
            try:
                code = self._spawn_all()
                if code is None and self._after_spawn is not None and not self._signals:
                    code = self._after_spawn()
                    if code is not None:
                        self._terminate(self._alive_workers(), signal.SIGTERM)
                return code if code is not None else self._supervise()
            finally:
                self._kill_all()
                for worker in self._workers:
                    if worker.reader is not None:
                        worker.reader.join(READER_JOIN_TIMEOUT_S)
                atexit.unregister(self._kill_all)

    # -- signals ---------------------------------------------------------

    def _on_signal(self, signum: int, _frame: object) -> None:
        self._signals.append(signum)

    @contextlib.contextmanager
    def _forwarding_signals(self) -> Iterator[None]:
        if threading.current_thread() is not threading.main_thread():
            yield
            return
        previous = {s: signal.signal(s, self._on_signal)
                    for s in FORWARDED_SIGNALS}
        try:
            yield
        finally:
            for signum, handler in previous.items():
                signal.signal(signum, handler)

    # -- lifecycle -------------------------------------------------------

    def _spawn_all(self) -> Optional[int]:
        """Start every worker; return an exit code if that failed.

        The threads that forward a worker's output and wait for its exit start once
        every worker has been started (the pipes hold what a worker writes in the
        meantime): starting a thread waits until it runs, which on a host busy with
        128 starting workers took milliseconds, and the last worker started later by
        that much per rank."""
        try:
            for slot in self._jobs:
                if self._signals:
                    return None  # _supervise handles the signal
                try:
                    proc = self._spawner.spawn(slot, self._command,
                                               self._env_for(slot))
                except OSError as exc:
                    log(f"failed to start rank {slot.rank}: {exc}")
                    self._terminate(self._alive_workers(), signal.SIGTERM)
                    return 127 if isinstance(exc, FileNotFoundError) else 126
                assert proc.stdout is not None
                self._workers.append(Worker(slot, proc))
            return None
        finally:
            for worker in self._workers:
                worker.watch(self._forwarder)

    def _supervise(self) -> int:
        finished = set()
        start_deadline = (time.monotonic() + self._start_timeout_s
                          if self._start_timeout_s else None)
        while True:
            if self._signals:
                return self._shutdown_on_signal(self._signals[0])
            if start_deadline is not None and time.monotonic() > start_deadline:
                start_deadline = None
                code = self._check_started()
                if code is not None:
                    return code
            # Workers that ended since the last look, in the order they ended: when
            # one fails, the others fail soon after it (they lost a peer), and may
            # all have ended by the time we look.
            ended = [w for w in self._workers
                     if w.rank not in finished and w.exited_at is not None]
            finished.update(w.rank for w in ended)
            failed = [w for w in ended if w.proc.returncode != 0]
            if failed:
                failed = self._settle(failed, finished)
                return self._shutdown_on_failure(failed[0], failed[1:])
            if len(finished) == len(self._workers):
                return 0
            time.sleep(POLL_INTERVAL_S)

    def _settle(self, failed: List[Worker], finished: set) -> List[Worker]:
        """The failed workers, the first to fail first. A worker whose output closed
        before the first of them ended may be on its way out (the one that died
        first, its exit still being torn down): it is given up to
        OUTPUT_CLOSE_WINDOW_S to end, and counts if it fails. So does any other
        worker that failed meanwhile (a peer that lost it, just after our look)."""
        def first_end() -> float:
            return min(w.ended_at or 0.0 for w in failed)

        def take_ended(workers: List[Worker]) -> None:
            for w in workers:
                if w.rank not in finished and w.exited_at is not None:
                    finished.add(w.rank)
                    if w.proc.returncode != 0:
                        failed.append(w)
        deadline = time.monotonic() + OUTPUT_CLOSE_WINDOW_S
        while time.monotonic() < deadline:
            dying = [w for w in self._workers if w.rank not in finished and
                     w.output_closed_at is not None and w.output_closed_at < first_end()]
            if not dying:
                break
            take_ended(dying)
            time.sleep(POLL_INTERVAL_S)
        take_ended(self._workers)
        return sorted(failed, key=lambda w: (w.ended_at or 0.0, w.rank))

    def _check_started(self) -> Optional[int]:
        """After the start timeout: stop the job if a remote host never answered."""
        late = [w for w in self._alive_workers() if waiting_to_start(w.proc)]
        if not late:
            return None
        names = sorted({w.slot.hostname for w in late})
        remote = self._spawner.remote if isinstance(self._spawner, HostSpawner) else None
        check = f" (check with: {remote.describe(names[0])})" if remote else ""
        log(f"could not start workers on host {', '.join(names)} within --start-timeout "
            f"{self._start_timeout_s:g} s{check}; stopping the job")
        self._terminate(self._alive_workers(), signal.SIGTERM)
        return 1

    def _shutdown_on_failure(self, failed: Worker, also: Sequence[Worker] = ()) -> int:
        """Stops the job because ``failed`` was the first worker to fail; ``also``
        failed after it (before we looked), most likely because of it."""
        returncode = failed.proc.returncode
        assert returncode is not None
        code = exit_code(returncode)
        # Let the failed worker's last lines reach stdout before our message.
        if failed.reader is not None:
            failed.reader.join(READER_JOIN_TIMEOUT_S)
        others = [w for w in self._alive_workers() if w is not failed]
        start_failure = describe_start_failure(failed.proc)  # names the host
        message = f"rank {failed.rank}" if start_failure else failed.describe()
        message += f" exited with code {code}{start_failure}"
        if returncode < 0:
            message += f" (signal {signal_name(-returncode)})"
        if also:
            after = ", ".join(f"rank {w.rank} (code {exit_code(w.proc.returncode or 0)})"
                              for w in also)
            message += f", the first to fail; then {after}"
        if others:
            plural = "s" if len(others) != 1 else ""
            message += f"; terminating the other {len(others)} worker{plural}"
        log(message)
        self._terminate(others, signal.SIGTERM)
        return code

    def _shutdown_on_signal(self, signum: int) -> int:
        alive = self._alive_workers()
        log(f"received {signal_name(signum)}; forwarding it to "
            f"{len(alive)} running worker(s)")
        self._terminate(alive, signum)
        return 128 + signum

    def _terminate(self, workers: Sequence[Worker], signum: int) -> None:
        """Signal ``workers``' groups, then SIGKILL what outlives the grace.

        A further signal to horovodrun during the grace period escalates
        to SIGKILL immediately.
        """
        seen_signals = len(self._signals)
        for worker in workers:
            worker.signal_group(signum)
        deadline = time.monotonic() + self._grace_s
        while any(w.alive() for w in workers):
            if (time.monotonic() >= deadline
                    or len(self._signals) > seen_signals):
                break
            time.sleep(POLL_INTERVAL_S)
        for worker in workers:
            if worker.alive():
                worker.signal_group(signal.SIGKILL)
        for worker in workers:
            worker.proc.wait()

    def _alive_workers(self) -> List[Worker]:
        return [w for w in self._workers if w.alive()]

    def _kill_all(self) -> None:
        """SIGKILL every worker group (also strays of finished workers)."""
        for worker in self._workers:
            worker.signal_group(signal.SIGKILL)
        for worker in self._workers:
            with contextlib.suppress(Exception):
                worker.proc.wait(timeout=READER_JOIN_TIMEOUT_S)
