"""Stops local workers that outlive a killed horovodrun.

horovodrun starts this process once, in a session of its own, with a pipe on
stdin whose write end only horovodrun holds, and writes each local worker's
process-group id to it as a line. The pipe ends when horovodrun exits. Normally
its workers have ended before that, and nothing is left to do. If horovodrun was
killed (SIGKILL, the OOM killer), its workers would run on with nobody to stop
them or read their output, holding their GPUs. So each registered group whose
leader is still the process that was registered (same start time) gets SIGTERM,
then SIGKILL after the grace period. Remote workers need no reaper: their ssh
session's stdin ends as well, and the wrapper on that host stops them.

Only the standard library: horovodrun must not load torch.
"""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import time
from typing import Dict, List, Optional


def _stat(pid: int) -> Optional[List[str]]:
    """Fields 3 onwards of /proc/<pid>/stat (state first), or None if it is gone."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()
    except OSError:
        return None


def start_time(pid: int) -> Optional[str]:
    """The process's start time (clock ticks after boot), or None if it is gone."""
    fields = _stat(pid)
    return fields[19] if fields else None  # field 22


def _running(pid: int) -> bool:
    fields = _stat(pid)
    return fields is not None and fields[0] != "Z"


def _signal_groups(groups: Dict[int, str], signum: int) -> None:
    for pgid in groups:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(pgid, signum)


def main(grace_s: float) -> int:
    groups: Dict[int, str] = {}
    buf = b""
    while True:
        try:
            chunk = os.read(0, 4096)
        except InterruptedError:
            continue
        if not chunk:
            break
        buf += chunk
        *lines, buf = buf.split(b"\n")
        for line in lines:
            if line.strip().isdigit():
                started = start_time(int(line))
                if started is not None:
                    groups[int(line)] = started
    left = {g: s for g, s in groups.items() if start_time(g) == s and _running(g)}
    if not left:
        return 0
    with contextlib.suppress(OSError):
        sys.stderr.write(f"horovodrun: the launcher is gone; stopping its {len(left)} "
                         "remaining local worker(s)\n")
        sys.stderr.flush()
    _signal_groups(left, signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    while any(_running(g) for g in left) and time.monotonic() < deadline:
        time.sleep(0.05)
    _signal_groups(left, signal.SIGKILL)
    return 0


if __name__ == "__main__":
    # Terminal signals are for horovodrun, which forwards them to the workers.
    for s in (signal.SIGINT, signal.SIGHUP, signal.SIGTERM):
        signal.signal(s, signal.SIG_IGN)
    sys.exit(main(float(sys.argv[1]) if len(sys.argv) > 1 else 5.0))
