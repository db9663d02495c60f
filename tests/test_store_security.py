"""The rendezvous store against outsiders (issue #21, items 3 and 4).

- Idle unauthenticated connections cost no thread each and do not delay the job's
  clients; they are dropped after a short deadline, and the rejections are logged
  as one line with a count per interval, not one line each.
- A request above the store's frame cap is refused before anything is allocated, and
  a client that tries to store such a value gets a clear error.
- Under torchrun (and with SLURM's variables) rank 0's store listens on MASTER_ADDR's
  address only, and its secret is no longer one derived from public values.

Every connection goes to 127.0.0.1.
"""
from __future__ import annotations

import hashlib
import hmac
import json
import os
import resource
import secrets
import socket
import struct
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

from tests.harness import ROOT, master_port

PROBE = os.path.join(ROOT, "tests", "store_security_probe.py")
HANDSHAKE_LINE = "failed the job-secret handshake"


def _threads() -> int:
    return len(os.listdir("/proc/self/task"))


def _closed(sock: socket.socket) -> bool:
    """True if the peer has closed `sock` (EOF or reset); reads what is pending."""
    sock.setblocking(False)
    try:
        while sock.recv(4096):
            pass
        return True
    except BlockingIOError:
        return False
    except OSError:
        return True


def _recv_exact(sock: socket.socket, n: int) -> bytes:
    data = b""
    while len(data) < n:
        chunk = sock.recv(n - len(data))
        if not chunk:
            raise ConnectionError(f"closed after {len(data)} of {n} bytes")
        data += chunk
    return data


def _authenticated_socket(port: int, secret: str) -> socket.socket:
    sock = socket.create_connection(("127.0.0.1", port), timeout=10)
    (n,) = struct.unpack("<Q", _recv_exact(sock, 8))
    nonce = _recv_exact(sock, n)
    digest = hmac.new(secret.encode(), nonce + b"store", hashlib.sha256).digest()
    reply = digest + b"store"
    sock.sendall(struct.pack("<Q", len(reply)) + reply)
    (n,) = struct.unpack("<Q", _recv_exact(sock, 8))
    assert _recv_exact(sock, n) == b"Y"
    return sock


def _raise_fd_limit(need: int) -> None:
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft >= need:
        return
    if hard != resource.RLIM_INFINITY and hard < need:
        pytest.skip(f"needs {need} file descriptors; the hard limit is {hard}")
    resource.setrlimit(resource.RLIMIT_NOFILE, (need, hard))


def test_idle_connections_hold_no_threads_and_do_not_delay_clients(capfd) -> None:
    from horovod_torch import _C
    n_idle = 1000
    _raise_fd_limit(n_idle + 256)
    secret = secrets.token_hex(16)
    server = _C.StoreServer("127.0.0.1", 0, secret)
    port = server.port()
    idle = []
    try:
        early = _C.StoreClient("127.0.0.1", port, secret, 10.0)
        early.set("warm", b"1")
        time.sleep(0.2)
        before = _threads()
        deadline = time.monotonic() + 60
        for _ in range(n_idle):  # connect and never speak
            assert time.monotonic() < deadline, f"only {len(idle)} connections in 60 s"
            idle.append(socket.create_connection(("127.0.0.1", port), timeout=10))
        time.sleep(0.5)
        during = _threads()
        # Before: one thread per connection (1,000 more).
        assert during <= before + 8, (before, during)

        t0 = time.monotonic()
        early.set("k", b"v")
        assert early.get("k", 1.0) == b"v"
        took = time.monotonic() - t0
        assert took < 0.5, f"a connected client's set/get took {took:.2f} s"

        t0 = time.monotonic()
        late = _C.StoreClient("127.0.0.1", port, secret, 10.0)
        late.set("k2", b"v2")
        assert late.get("k", 1.0) == b"v"
        took = time.monotonic() - t0
        assert took < 2.0, f"connect + set/get during the flood took {took:.2f} s"

        # The server keeps at most a few in the handshake and drops each after a few
        # seconds: all are closed well before 15 s.
        deadline = time.monotonic() + 15
        open_ = list(idle)
        while open_ and time.monotonic() < deadline:
            open_ = [s for s in open_ if not _closed(s)]
            time.sleep(0.2)
        assert not open_, f"{len(open_)} idle connections still open after 15 s"
        assert _threads() <= before + 8
        late.set("k3", b"v3")  # clients keep working
    finally:
        for s in idle:
            s.close()
        server.stop()
    err = capfd.readouterr().err
    # One line for the first rejection, then counts (one per 10 s, and one at stop),
    # not a line per connection.
    lines = [line for line in err.splitlines() if HANDSHAKE_LINE in line]
    assert 1 <= len(lines) <= 4, "\n".join(lines[:10])
    counted = sum(1 if "rejected a connection" in line else
                  int(line.split("rejected ", 1)[1].split()[0]) for line in lines)
    assert counted == n_idle, "\n".join(lines)


def test_a_value_above_the_cap_is_a_clear_error_and_is_never_allocated() -> None:
    from horovod_torch import _C
    secret = secrets.token_hex(16)
    server = _C.StoreServer("127.0.0.1", 0, secret)
    large = _C.StoreServer("127.0.0.1", 0, secret, max_frame=16 << 20)
    try:
        client = _C.StoreClient("127.0.0.1", server.port(), secret, 10.0)
        with pytest.raises(ValueError, match=r"'big' is 5242880 bytes: this store accepts "
                                             r"requests of at most 4194304 bytes"):
            client.set("big", b"x" * (5 << 20))
        assert server.get("big") is None
        client.set("small", b"ok")  # the connection is still fine
        assert client.get("small", 1.0) == b"ok"
        client.set("1MB", b"y" * (1 << 20))  # what the rendezvous store needs, and more

        # A store built with a larger cap (horovod.run's) takes more; its clients learn it.
        big_client = _C.StoreClient("127.0.0.1", large.port(), secret, 10.0)
        big_client.set("big", b"x" * (5 << 20))
        assert large.get("big") == b"x" * (5 << 20)

        # A member that sends a header above the cap anyway is cut off at once, without
        # the server allocating (or waiting for) 64 MiB.
        with _authenticated_socket(server.port(), secret) as sock:
            sock.sendall(struct.pack("<Q", 64 << 20) + b"S")
            deadline = time.monotonic() + 3
            while not _closed(sock):
                assert time.monotonic() < deadline, "the server waited for a 64 MiB request"
                time.sleep(0.05)
        assert client.get("small", 1.0) == b"ok"
    finally:
        server.stop()
        large.stop()


# -- rank 0's store under other launchers ------------------------------------------

def _clean_env(**extra) -> dict:
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("HOROVOD_", "OMPI_", "SLURM_", "TORCHELASTIC_", "PMIX_")) and
           k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK",
                     "MASTER_ADDR", "MASTER_PORT")}
    env.update(PYTHONPATH=ROOT, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1",
               HOROVOD_START_TIMEOUT="60", **extra)
    return env


def _listen_addresses(port: int) -> set:
    """Local addresses of the TCP sockets listening on `port` (from /proc/net/tcp*)."""
    found = set()
    for path, v6 in (("/proc/net/tcp", False), ("/proc/net/tcp6", True)):
        try:
            rows = Path(path).read_text().splitlines()[1:]
        except FileNotFoundError:
            continue
        for row in rows:
            fields = row.split()
            addr, hexport = fields[1].split(":")
            if fields[3] != "0A" or int(hexport, 16) != port:  # 0A: LISTEN
                continue
            if v6:
                found.add("[" + addr + "]")
            else:
                found.add(socket.inet_ntoa(struct.pack("<I", int(addr, 16))))
    return found


def _wait_ready(ctl: Path, procs, within: float = 90) -> dict:
    deadline = time.monotonic() + within
    ready = ctl / "ready.json"
    while not ready.exists():
        for p in procs:
            if p.poll() is not None:
                out = p.stdout.read() if p.stdout else ""
                raise AssertionError(f"a process exited ({p.returncode}) before init:\n{out}")
        assert time.monotonic() < deadline, "rank 0 did not initialise in time"
        time.sleep(0.1)
    return json.loads(ready.read_text())


def _kill(procs) -> None:
    for p in procs:
        if p.poll() is None:
            p.kill()
        p.communicate()


def _finish(ctl: Path, procs, timeout: float = 90) -> str:
    (ctl / "go").write_text("1")
    outs = []
    try:
        for p in procs:
            outs.append(p.communicate(timeout=timeout)[0])
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.communicate()
    text = "\n".join(outs)
    assert all(p.returncode == 0 for p in procs), text
    return text


def _assert_closed_to_the_old_secret(store_port: int, old_secret: str) -> None:
    from horovod_torch import _C
    with pytest.raises(RuntimeError, match="rejected our job secret"):
        _C.StoreClient("127.0.0.1", store_port, old_secret, 10.0)


def test_torchrun_store_listens_on_master_addr_with_a_secret_from_torchruns_store(
        tmp_path: Path) -> None:
    import torch.distributed as dist
    port = master_port()
    procs = [subprocess.Popen(
        [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
         "--master-addr", "127.0.0.1", "--master-port", str(port), PROBE, str(tmp_path)],
        env=_clean_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)]
    try:
        info = _wait_ready(tmp_path, procs)
        assert info["TORCHELASTIC_USE_AGENT_STORE"] == "True", info
        store_port = port + 1
        # Before: 0.0.0.0, reachable from the network.
        assert _listen_addresses(store_port) == {"127.0.0.1"}
        # Before: the secret was this string of public values.
        old = "|".join([info["TORCHELASTIC_RUN_ID"], "", "", str(port)])
        _assert_closed_to_the_old_secret(store_port, old)
        # What a member of torchrun's store reads there does open it.
        torch_store = dist.TCPStore("127.0.0.1", port, is_master=False)
        key = f"horovod_torch/job_secret/{info['TORCHELASTIC_RESTART_COUNT'] or '0'}/{store_port}"
        secret = torch_store.get(key).decode()
        assert len(secret) == 32 and secret != old
        from horovod_torch import _C
        _C.StoreClient("127.0.0.1", store_port, secret, 10.0).set("probe", b"1")
        del torch_store
    except BaseException:
        _kill(procs)
        raise
    out = _finish(tmp_path, procs, timeout=120)
    assert "PROBE_OK rank=0 size=2" in out and "PROBE_OK rank=1 size=2" in out, out


def test_srun_variables_on_one_host_use_a_private_secret(tmp_path: Path) -> None:
    port = master_port()
    procs = []
    for r in range(2):
        env = _clean_env(SLURM_PROCID=str(r), SLURM_NTASKS="2", SLURM_NNODES="1",
                         SLURM_LOCALID=str(r), SLURM_NODEID="0", SLURM_JOB_ID="42",
                         MASTER_ADDR="localhost", MASTER_PORT=str(port))
        procs.append(subprocess.Popen([sys.executable, PROBE, str(tmp_path)], env=env,
                                      stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                      text=True))
    try:
        _wait_ready(tmp_path, procs)
        assert _listen_addresses(port + 1) == {"127.0.0.1"}  # localhost: 127.0.0.1
        _assert_closed_to_the_old_secret(port + 1, "|".join(["", "42", "", str(port)]))
        private = Path(tempfile.gettempdir()) / f"horovod_torch-{os.getuid()}"
        assert private.stat().st_mode & 0o777 == 0o700
        files = [f for f in private.iterdir() if f.name.startswith("secret-")]
        assert files and all(f.stat().st_mode & 0o777 == 0o600 for f in files)
    except BaseException:
        _kill(procs)
        raise
    out = _finish(tmp_path, procs)
    assert "PROBE_OK rank=0 size=2" in out and "PROBE_OK rank=1 size=2" in out, out


@pytest.mark.parametrize("launcher", ["srun", "plain"])
def test_several_hosts_without_a_secret_is_a_clear_error(launcher: str) -> None:
    """No store of the launcher's to pass a secret through, and the ranks on other
    hosts cannot read rank 0's file: HOROVOD_SECRET is required (and then used)."""
    port = master_port()
    if launcher == "srun":
        extra = dict(SLURM_PROCID="0", SLURM_NTASKS="2", SLURM_NNODES="2", SLURM_JOB_ID="42")
    else:  # RANK/WORLD_SIZE without torchrun (no TORCHELASTIC_USE_AGENT_STORE)
        extra = dict(RANK="0", WORLD_SIZE="2", LOCAL_WORLD_SIZE="1")
    env = _clean_env(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), **extra)
    out = subprocess.run([sys.executable, PROBE, "/nonexistent"], env=env,
                         capture_output=True, text=True, timeout=60)
    assert out.returncode != 0
    assert "without a job secret: export HOROVOD_SECRET" in out.stderr, out.stderr
