"""Only processes holding the job's secret can join the rendezvous store or the mesh.

A real 2-worker job runs against a store in this process (as tests/harness.py does).
While rank 0 waits in init for rank 1, the test dials rank 0's mesh port (published
in the store under ``job/init0/addr/0``); once both ranks are initialised it dials
the store. Each bad client (garbage bytes, a wrong secret, a frame header claiming
terabytes) must be turned away, and the job must then finish with correct results.

The handshake (csrc/common/net.cc): the server sends a frame (u64 little-endian
length + bytes) holding a nonce; the client answers with a frame holding
HMAC-SHA256(key=secret, nonce | tag) followed by the tag; the server answers with a
one-byte frame, ``Y`` or ``N``, and closes the connection on ``N``.
"""
from __future__ import annotations

import hashlib
import hmac
import os
import secrets
import socket
import struct
import subprocess
import sys
import time
from pathlib import Path
from typing import Tuple

import pytest

from tests import harness

TIMEOUT = 120
START_TIMEOUT = "60"  # rank 0 waits this long for rank 1 while the test attacks it


# -- the job (runs in the workers) ---------------------------------------------

def _wait_for(path: Path, within: float = 90.0) -> None:
    deadline = time.monotonic() + within
    while not path.exists():
        if time.monotonic() > deadline:
            raise TimeoutError(f"{path} did not appear")
        time.sleep(0.02)


def victim(ctl_dir: str) -> None:
    """Rank 1 joins only when told; both ranks then wait for 'go', reduce and check."""
    import torch

    import horovod_torch as hvd
    ctl = Path(ctl_dir)
    rank = int(os.environ["HOROVOD_RANK"])
    if rank == 1:
        _wait_for(ctl / "go_init")
    hvd.init()
    (ctl / f"init_done_{rank}").write_text("1")
    _wait_for(ctl / "go")
    for i in range(5):
        out = hvd.allreduce(torch.full((100_000,), float(rank + 1)), op=hvd.Sum, name=f"t{i}")
        assert torch.equal(out, torch.full((100_000,), 3.0)), out[:4]
    assert hvd.broadcast_object({"from": rank}, root_rank=0) == {"from": 0}
    sys.stdout.write(f"JOB_OK rank={rank} size={hvd.size()}\n")
    sys.stdout.flush()


# -- a client speaking the handshake --------------------------------------------

def _recv_exact(sock: socket.socket, n: int) -> bytes:
    data = b""
    while len(data) < n:
        chunk = sock.recv(n - len(data))
        if not chunk:
            raise ConnectionError(f"closed after {len(data)} of {n} bytes")
        data += chunk
    return data


def _recv_frame(sock: socket.socket) -> bytes:
    (n,) = struct.unpack("<Q", _recv_exact(sock, 8))
    assert n <= 4096, n
    return _recv_exact(sock, n)


def _frame(data: bytes) -> bytes:
    return struct.pack("<Q", len(data)) + data


def _closed_by_peer(sock: socket.socket, within: float = 15.0) -> bool:
    """True once the server has closed the connection (EOF or reset)."""
    sock.settimeout(within)
    try:
        while sock.recv(4096):
            pass
        return True
    except ConnectionResetError:
        return True
    except socket.timeout:
        return False


def _connect(addr: Tuple[str, int]) -> socket.socket:
    return socket.create_connection(addr, timeout=10)


def _handshake(addr: Tuple[str, int], secret: str, tag: bytes) -> Tuple[bytes, socket.socket]:
    """Does the client side of the handshake; returns (verdict, socket)."""
    sock = _connect(addr)
    nonce = _recv_frame(sock)
    digest = hmac.new(secret.encode(), nonce + tag, hashlib.sha256).digest()
    sock.sendall(_frame(digest + tag))
    return _recv_frame(sock), sock


def _garbage(addr: Tuple[str, int]) -> bool:
    """Sends bytes that are no handshake; True if the server then hung up."""
    with _connect(addr) as sock:
        sock.sendall(b"GET / HTTP/1.0\r\n\r\n" + os.urandom(64))
        return _closed_by_peer(sock)


def _huge_frame(addr: Tuple[str, int]) -> bool:
    """Claims a 1 TiB handshake frame; True if the server hung up (and did not
    try to allocate it)."""
    with _connect(addr) as sock:
        _recv_frame(sock)
        sock.sendall(struct.pack("<Q", 1 << 40) + b"x" * 32)
        return _closed_by_peer(sock)


def _wrong_secret(addr: Tuple[str, int], tag: bytes) -> Tuple[bytes, bool]:
    verdict, sock = _handshake(addr, "not-the-secret", tag)
    with sock:
        return verdict, _closed_by_peer(sock)


# -- the test ---------------------------------------------------------------------

def _start_job(tmp_path: Path, start_timeout: str = START_TIMEOUT):
    from horovod_torch import _C
    secret = secrets.token_hex(16)
    server = _C.StoreServer("127.0.0.1", 0, secret)
    procs = []
    for rank in range(2):
        env = harness.worker_env(rank, 2, server.port(), secret, {
            "HOROVOD_START_TIMEOUT": start_timeout, "HOROVOD_LOG_LEVEL": "warning"})
        procs.append(subprocess.Popen(
            [sys.executable, "-m", "tests.run_worker", "tests.test_secret:victim",
             str(tmp_path)], cwd=harness.ROOT, env=env, stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT, text=True))
    return secret, server, procs


def _wait_key(server, key: str, procs, within: float = 60.0) -> bytes:
    deadline = time.monotonic() + within
    while True:
        value = server.get(key)
        if value is not None:
            return value
        assert all(p.poll() is None for p in procs), "a worker exited early"
        assert time.monotonic() < deadline, f"store key {key} never appeared"
        time.sleep(0.05)


def test_bad_clients_are_turned_away_and_the_job_completes(tmp_path: Path) -> None:
    secret, server, procs = _start_job(tmp_path)
    try:
        store = ("127.0.0.1", server.port())
        # 1. The mesh, while rank 0 waits in init for rank 1 to connect.
        host, port = _wait_key(server, "job/init0/addr/0", procs).decode().rsplit(":", 1)
        mesh = (host, int(port))
        assert _garbage(mesh), "rank 0 kept a connection that sent garbage"
        verdict, closed = _wrong_secret(mesh, b"1")
        assert verdict == b"N" and closed, (verdict, closed)
        assert _huge_frame(mesh), "rank 0 kept a connection that sent a huge frame"
        (tmp_path / "go_init").write_text("1")
        for rank in range(2):
            _wait_for(tmp_path / f"init_done_{rank}", within=60)

        # 2. The store, while the job runs.
        ok, sock = _handshake(store, secret, b"store")  # our client speaks it right
        sock.close()
        assert ok == b"Y"
        assert _garbage(store), "the store kept a connection that sent garbage"
        verdict, closed = _wrong_secret(store, b"store")
        assert verdict == b"N" and closed, (verdict, closed)
        assert _huge_frame(store), "the store kept a connection that sent a huge frame"
        silent = _connect(store)  # one client that never speaks must block nobody
        from horovod_torch import _C
        with pytest.raises(RuntimeError, match="rejected our job secret"):
            _C.StoreClient("127.0.0.1", server.port(), "not-the-secret", 5.0)
        good = _C.StoreClient("127.0.0.1", server.port(), secret, 5.0)
        good.set("probe", b"1")
        assert server.get("probe") == b"1"
        # After init the mesh port stays open (peers connect on first use), and
        # still turns away a client that does not speak the handshake.
        assert _garbage(mesh), "rank 0 kept a late connection that sent garbage"

        (tmp_path / "go").write_text("1")
        results = harness.collect(server, procs, TIMEOUT)
        silent.close()
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
        server.stop()
    outputs = {r.rank: r.output for r in results}
    assert all(r.returncode == 0 for r in results), harness.describe(results)
    for rank in range(2):
        assert f"JOB_OK rank={rank} size=2" in outputs[rank], harness.describe(results)
    # Rank 0 said who it turned away: the first at once, the others counted in one
    # line per interval (or at shutdown).
    lines = [line for line in outputs[0].splitlines()
             if "that failed the job-secret handshake" in line]
    counted = sum(1 if "rejected a connection" in line else
                  int(line.split("rejected ", 1)[1].split()[0]) for line in lines)
    assert counted == 4, outputs[0]
    assert "Traceback" not in outputs[0] + outputs[1]


def test_store_warns_about_a_client_without_the_secret(capfd: pytest.CaptureFixture) -> None:
    from horovod_torch import _C
    server = _C.StoreServer("127.0.0.1", 0, secrets.token_hex(16))
    try:
        verdict, closed = _wrong_secret(("127.0.0.1", server.port()), b"store")
        assert verdict == b"N" and closed
        time.sleep(0.2)
    finally:
        server.stop()
    assert "secret" in capfd.readouterr().err


def test_silent_clients_cannot_stall_mesh_setup(tmp_path: Path) -> None:
    secret, server, procs = _start_job(tmp_path, start_timeout="3")
    silent = []
    try:
        host, port = _wait_key(server, "job/init0/addr/0", procs).decode().rsplit(":", 1)
        for _ in range(2):  # queued before rank 1's connection
            silent.append(_connect((host, int(port))))
            time.sleep(0.2)
        (tmp_path / "go_init").write_text("1")
        (tmp_path / "go").write_text("1")
        results = harness.collect(server, procs, TIMEOUT)
    finally:
        for sock in silent:
            sock.close()
        for p in procs:
            if p.poll() is None:
                p.kill()
        server.stop()
    assert all(r.returncode == 0 for r in results), harness.describe(results)
