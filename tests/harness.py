"""Starts N real worker processes against a local rendezvous store.

Each worker runs `python -m tests.run_worker module:function [args]` with the
environment horovodrun would give it. run_workers() waits with a timeout, kills
everything on a hang and says which ranks did not finish.
"""
import contextlib
import os
import secrets
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from typing import Dict, List, Optional, Sequence

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@dataclass
class WorkerResult:
    rank: int
    returncode: Optional[int]
    output: str


def _port_pair(reuse: bool):
    """(P, sockets bound to P and P + 1 on 127.0.0.1, not listening; with `reuse`,
    SO_REUSEADDR, so that a store binding with it too may take them while they stay)."""
    for _ in range(100):
        a, b = socket.socket(), socket.socket()
        for s in (a, b):
            if reuse:
                s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        a.bind(("127.0.0.1", 0))
        port = a.getsockname()[1]
        try:
            if port >= 65535:
                raise OSError("no P + 1")
            b.bind(("127.0.0.1", port + 1))
        except OSError:
            a.close()
            b.close()
            continue
        return port, (a, b)
    raise RuntimeError("no pair of free ports on 127.0.0.1")


def master_port() -> int:
    """A MASTER_PORT for a job started without horovodrun: a port P such that P and
    P + 1 (where rank 0's store listens) are both free on 127.0.0.1 now. A free port
    alone, with P + 1 left to chance, failed in CI when another socket held P + 1."""
    port, held = _port_pair(reuse=False)
    for s in held:
        s.close()
    return port


@contextlib.contextmanager
def held_master_port():
    """master_port(), with P and P + 1 held until the block ends: bound, never listening,
    with SO_REUSEADDR, so that the kernel gives them to no other socket (a bind to port
    0, an outgoing connection) while the stores, which bind with SO_REUSEADDR too, can
    take them. For a port chosen long before it is used (a group rebuilt later)."""
    port, held = _port_pair(reuse=True)
    try:
        yield port
    finally:
        for s in held:
            s.close()


def worker_env(rank: int, size: int, port: int, secret: str,
               extra: Optional[Dict[str, str]] = None) -> Dict[str, str]:
    env = dict(os.environ)
    env.update({
        "HOROVOD_RANK": str(rank), "HOROVOD_SIZE": str(size),
        "HOROVOD_LOCAL_RANK": str(rank), "HOROVOD_LOCAL_SIZE": str(size),
        "HOROVOD_CROSS_RANK": "0", "HOROVOD_CROSS_SIZE": "1",
        "HOROVOD_STORE_ADDR": "127.0.0.1", "HOROVOD_STORE_PORT": str(port),
        "HOROVOD_SECRET": secret, "PYTHONUNBUFFERED": "1",
        "OMP_NUM_THREADS": "1",
        "PYTHONPATH": ROOT + os.pathsep + env.get("PYTHONPATH", ""),
    })
    env.update(extra or {})
    return env


def start_workers(target: str, size: int, args: Sequence[str] = (),
                  env: Optional[Dict[str, str]] = None, per_rank_env=None):
    """Starts the store and the workers; returns (server, procs)."""
    from horovod_torch import _C
    secret = secrets.token_hex(16)
    server = _C.StoreServer("127.0.0.1", 0, secret)
    procs = []
    for r in range(size):
        e = worker_env(r, size, server.port(), secret, env)
        if per_rank_env:
            e.update(per_rank_env(r))
        procs.append(subprocess.Popen(
            [sys.executable, "-m", "tests.run_worker", target, *map(str, args)], cwd=ROOT,
            env=e, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
    return server, procs


def collect(server, procs, timeout: float) -> List[WorkerResult]:
    deadline = time.monotonic() + timeout
    results = []
    hung = []
    for r, p in enumerate(procs):
        try:
            out, _ = p.communicate(timeout=max(0.1, deadline - time.monotonic()))
            results.append(WorkerResult(r, p.returncode, out))
        except subprocess.TimeoutExpired:
            hung.append(r)
            results.append(WorkerResult(r, None, ""))
    for r in hung:
        procs[r].kill()
        out, _ = procs[r].communicate()
        results[r] = WorkerResult(r, None, out)
    server.stop()
    if hung:
        raise AssertionError(f"ranks {hung} did not finish within {timeout} s:\n" +
                             describe(results))
    return results


def describe(results: List[WorkerResult]) -> str:
    return "\n".join(f"--- rank {r.rank} (exit {r.returncode}) ---\n{r.output[-3000:]}"
                     for r in results)


def run_workers(target: str, size: int, args: Sequence[str] = (), timeout: float = 90,
                env: Optional[Dict[str, str]] = None, expect_ok: bool = True,
                per_rank_env=None) -> List[WorkerResult]:
    """Runs `target` on `size` ranks. With expect_ok, asserts every rank exited 0."""
    server, procs = start_workers(target, size, args, env, per_rank_env)
    results = collect(server, procs, timeout)
    if expect_ok:
        bad = [r.rank for r in results if r.returncode != 0]
        assert not bad, f"ranks {bad} failed:\n" + describe(results)
    return results
