"""Starting workers on other hosts: ssh (or a command that replaces it) plus a small
wrapper that runs on the remote host.

The local end is a :class:`RemoteProcess`: the ssh client, run as
``PREFIX HOST 'SHELL COMMAND'`` where PREFIX is ``ssh -o BatchMode=yes -o
StrictHostKeyChecking=no [-p PORT] [-i FILE]`` or the user's ``--ssh-command``.
The shell command starts :data:`WRAPPER` with Python on the remote host. The
launcher then talks to the wrapper over the session's stdin:

1. one JSON line: working directory, environment (the job secret included, so
   it never appears on a command line) and the worker's argv;
2. then any number of lines, each a signal number for the worker's process
   group (this is how SIGINT/SIGTERM/SIGKILL of ``horovodrun`` reach it).

The wrapper prints :data:`START_MARKER` on stdout once it runs (the launcher
drops that line and counts the host as reachable), starts the worker in its own
session, and exits with the worker's exit code (128+signal if it was killed).
When its stdin closes (``horovodrun`` died, the ssh client was killed, the
connection broke) it sends the worker's group SIGTERM, then SIGKILL after the
grace period, so no worker outlives its launcher. Only the standard library is
used on either side.
"""
from __future__ import annotations

import base64
import contextlib
import json
import os
import secrets
import shlex
import signal
import subprocess
import sys
import threading
import time
from typing import IO, List, Mapping, Optional, Sequence

START_MARKER = b"horovodrun-remote: worker started"
KILL_WAIT_S = 2.0
"""How long a SIGKILL request may take to reach the remote worker before the
local ssh client is killed as well."""

# Variables that describe this machine or this login session, not the job: the
# remote host's own values are kept for these. Everything else is forwarded.
_NOT_FORWARDED = frozenset({
    "HOSTNAME", "HOME", "USER", "LOGNAME", "SHELL", "PWD", "OLDPWD", "SHLVL", "_",
    "MAIL", "TERM", "DISPLAY", "LS_COLORS", "PS1", "COLUMNS", "LINES", "TMUX",
    "TMUX_PANE", "STY", "WINDOW"})
_NOT_FORWARDED_PREFIXES = ("SSH_", "XDG_", "BASH_FUNC_", "DBUS_")

# Runs on the remote host with its python3; keep it compatible with old Pythons.
WRAPPER = r'''
import json, os, signal, subprocess, sys, threading, time
def main():
    buf = b""
    while b"\n" not in buf:
        chunk = os.read(0, 65536)
        if not chunk:
            return 1
        buf += chunk
    line, buf = buf.split(b"\n", 1)
    job = json.loads(line.decode("utf-8"))
    where = "horovodrun: on host %s: " % job["host"]
    try:
        os.chdir(job["cwd"])
    except OSError as e:
        sys.stderr.write(where + "cannot change to %s: %s\n" % (job["cwd"], e.strerror))
        return 1
    sys.stdout.write(job["marker"] + "\n")
    sys.stdout.flush()
    try:
        proc = subprocess.Popen(job["argv"], env=job["env"], stdin=subprocess.DEVNULL,
                                start_new_session=True)
    except OSError as e:
        sys.stderr.write(where + "cannot run %s: %s\n" % (job["argv"][0], e.strerror))
        return 127 if e.errno == 2 else 126
    def group(signum):
        try:
            os.killpg(proc.pid, signum)
        except OSError:
            pass
    def control(buf):
        while True:
            while b"\n" in buf:
                line, buf = buf.split(b"\n", 1)
                if line.strip().isdigit():
                    group(int(line))
            try:
                chunk = os.read(0, 4096)
            except OSError:
                chunk = b""
            if not chunk:
                break
            buf += chunk
        group(signal.SIGTERM)
        end = time.time() + job["grace"]
        while proc.poll() is None and time.time() < end:
            time.sleep(0.05)
        group(signal.SIGKILL)
    for s in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        signal.signal(s, lambda n, f: group(n))
    t = threading.Thread(target=control, args=(buf,))
    t.daemon = True
    t.start()
    rc = proc.wait()
    group(signal.SIGKILL)
    return 128 - rc if rc < 0 else rc
code = main()
sys.stdout.flush()
os._exit(code)
'''


def forwarded_env(env: Mapping[str, str]) -> dict:
    """The part of a worker's environment sent to a remote host."""
    return {k: v for k, v in env.items()
            if k not in _NOT_FORWARDED and not k.startswith(_NOT_FORWARDED_PREFIXES)}


def ssh_prefix(port: Optional[int] = None, identity_file: Optional[str] = None) -> List[str]:
    """The built-in remote-exec command (host and command are appended)."""
    argv = ["ssh", "-o", "BatchMode=yes", "-o", "StrictHostKeyChecking=no",
            "-o", "LogLevel=ERROR"]
    if port is not None:
        argv += ["-p", str(port)]
    if identity_file:
        argv += ["-i", identity_file]
    return argv


class RemoteExec:
    """How to start a worker on another host; one per job.

    ``prefix`` is the command that runs a shell command on a host: it is called
    as ``prefix + [host, shell_command]``, like ssh. ``job_id`` appears on every
    remote wrapper's command line (``horovodrun-job=ID``), so the processes of
    one job can be found on a host.
    """

    def __init__(self, prefix: Sequence[str], grace_s: float = 5.0,
                 python: Optional[str] = None, cwd: Optional[str] = None) -> None:
        self.prefix = list(prefix)
        self.grace_s = grace_s
        self.python = python or sys.executable or "python3"
        self.cwd = cwd or os.getcwd()
        self.job_id = secrets.token_hex(6)

    def shell_command(self) -> str:
        """The command line the remote host's shell runs: our Python if the same
        path exists there, else ``python3``, running :data:`WRAPPER`."""
        boot = ("import base64;exec(base64.b64decode('" +
                base64.b64encode(WRAPPER.encode()).decode() + "'))")
        return (f"P={shlex.quote(self.python)}; [ -x \"$P\" ] || P=python3; "
                f"exec \"$P\" -c {shlex.quote(boot)} horovodrun-job={self.job_id}")

    def describe(self, host: str) -> str:
        """How to check by hand that ``host`` can be reached."""
        return " ".join(shlex.quote(a) for a in self.prefix + [host, "true"])

    def spawn(self, host: str, command: Sequence[str],
              env: Mapping[str, str]) -> "RemoteProcess":
        """Start ``command`` on ``host`` with ``env`` (filtered by forwarded_env)."""
        job = {"host": host, "cwd": self.cwd, "argv": list(command),
               "env": forwarded_env(env), "grace": self.grace_s,
               "marker": START_MARKER.decode()}
        line = json.dumps(job).encode() + b"\n"
        return RemoteProcess(self.prefix + [host, self.shell_command()], host, line)


class _StartFilter:
    """The ssh client's stdout, minus the wrapper's start line (which sets ``started``)."""

    def __init__(self, raw: IO[bytes], started: threading.Event) -> None:
        self._raw = raw
        self._started = started

    def readline(self) -> bytes:
        line = self._raw.readline()
        if not self._started.is_set() and line.rstrip(b"\r\n") == START_MARKER:
            self._started.set()
            line = self._raw.readline()
        return line

    def read1(self, size: int) -> bytes:
        """What is there now (at most `size` bytes), as the stream's read1."""
        if not self._started.is_set():
            line = self.readline()  # the start line comes first: wait for it whole
            if line:
                return line
        return self._raw.read1(size)

    def fileno(self) -> int:
        return self._raw.fileno()

    def close(self) -> None:
        self._raw.close()

    def __enter__(self) -> "_StartFilter":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class RemoteProcess(subprocess.Popen):
    """A worker on another host, seen through its local ssh client.

    ``poll()``/``wait()`` and the exit code are the ssh client's, which ends with
    the remote worker's code. ``started`` is set once the remote wrapper runs.
    Signals go to the worker with :meth:`signal_worker`, never straight to the
    ssh client (killing only the client would leave the worker to the wrapper's
    grace period).
    """

    def __init__(self, argv: List[str], host: str, job_line: bytes) -> None:
        super().__init__(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, start_new_session=True)
        self.host = host
        self.started = threading.Event()
        self.stdout = _StartFilter(self.stdout, self.started)  # type: ignore[assignment]
        self._stdin_lock = threading.Lock()
        # The job line may exceed the pipe buffer while ssh is still connecting.
        threading.Thread(target=self._write, args=(job_line,), daemon=True,
                         name=f"horovodrun-ssh-{host}").start()

    def _write(self, data: bytes) -> bool:
        with self._stdin_lock:
            try:
                assert self.stdin is not None
                self.stdin.write(data)
                self.stdin.flush()
                return True
            except (OSError, ValueError):
                return False

    def _close_stdin(self) -> None:
        with self._stdin_lock, contextlib.suppress(OSError, ValueError):
            assert self.stdin is not None
            self.stdin.close()

    def _signal_client(self, signum: int) -> None:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.pid, signum)

    def signal_worker(self, signum: int) -> None:
        """Deliver ``signum`` to the remote worker's process group.

        Before the wrapper is known to run there is no worker yet: the ssh client
        is stopped instead (a wrapper that did start sees its stdin close and
        stops its worker). SIGKILL also closes the control channel and, if the
        client is still there after :data:`KILL_WAIT_S`, kills it.
        """
        if self.poll() is not None:
            return
        delivered = self.started.is_set() and self._write(f"{int(signum)}\n".encode())
        if signum != signal.SIGKILL:
            if not delivered:
                self._signal_client(signal.SIGTERM)
            return
        self._close_stdin()
        if delivered:
            deadline = time.monotonic() + KILL_WAIT_S
            while self.poll() is None and time.monotonic() < deadline:
                time.sleep(0.02)
        if self.poll() is None:
            self._signal_client(signal.SIGTERM)
            deadline = time.monotonic() + 1.0
            while self.poll() is None and time.monotonic() < deadline:
                time.sleep(0.02)
            self._signal_client(signal.SIGKILL)
