"""Tests of the ``horovodrun`` launcher (``python -m horovod_torch.runner``).

The end-to-end tests run the real launcher, including the C++ rendezvous
store (``horovod_torch._C.StoreServer``); the workers are plain
``python -c`` scripts, so no collective operations are involved.
"""
from __future__ import annotations

import importlib.util
import json
import os
import re
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path
from typing import Dict, List

import pytest

from horovod_torch.runner import hosts

PY = sys.executable
TIMEOUT = 120  # every launcher run; importing _C loads torch
LINE = re.compile(r"^\[(\d+)\]<stdout>:(.*)$")


def _package_root() -> str:
    """Directory holding the horovod_torch package this test imports."""
    spec = importlib.util.find_spec("horovod_torch")
    if spec is not None and spec.submodule_search_locations:
        return str(Path(list(spec.submodule_search_locations)[0]).parent)
    return str(Path(__file__).resolve().parents[1])


def _env(**extra: str) -> Dict[str, str]:
    env = dict(os.environ)
    env.pop("HOROVOD_START_TIMEOUT", None)
    env.pop("HOROVOD_LOG_LEVEL", None)
    path = [_package_root()] + [p for p in [env.get("PYTHONPATH")] if p]
    env["PYTHONPATH"] = os.pathsep.join(path)
    env.update(extra)
    return env


def _launcher(*args: str) -> List[str]:
    return [PY, "-m", "horovod_torch.runner", *args]


def _run(*args: str, env: Dict[str, str] | None = None,
         timeout: float = TIMEOUT) -> subprocess.CompletedProcess:
    return subprocess.run(_launcher(*args), capture_output=True, text=True,
                          env=env or _env(), timeout=timeout)


def _worker(script: str) -> List[str]:
    return [PY, "-c", textwrap.dedent(script)]


def _alive(pid: int) -> bool:
    """True if ``pid`` exists and is not a zombie."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


def _assert_gone(pids: List[int], within: float = 10.0) -> None:
    deadline = time.monotonic() + within
    while any(_alive(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.05)
    survivors = [p for p in pids if _alive(p)]
    for pid in survivors:
        os.kill(pid, signal.SIGKILL)
    assert not survivors, f"processes outlived the launcher: {survivors}"


def _prefixed(stdout: str) -> Dict[int, List[str]]:
    """Group prefixed output lines by rank; every line must be prefixed."""
    by_rank: Dict[int, List[str]] = {}
    for line in stdout.splitlines():
        match = LINE.match(line)
        assert match, f"unprefixed or interleaved line: {line!r}"
        by_rank.setdefault(int(match.group(1)), []).append(match.group(2))
    return by_rank


# Worker that records "<pid> <grandchild pid>" in $PID_DIR/<rank> (elastic: the
# first free index) and sleeps.
SLEEPER = """
    import os, signal, subprocess, sys, time
    if os.environ.get("IGNORE_TERM"):
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
    child = subprocess.Popen([sys.executable, "-c",
                              "import time; time.sleep(60)"])
    name, i = os.environ.get("HOROVOD_RANK"), 0
    while name is None:  # elastic workers learn their rank only at rendezvous
        try:
            os.close(os.open(os.path.join(os.environ["PID_DIR"], f"claim{i}"),
                             os.O_CREAT | os.O_EXCL))
            name = str(i)
        except FileExistsError:
            i += 1
    path = os.path.join(os.environ["PID_DIR"], name)
    with open(path + ".tmp", "w") as f:
        f.write(f"{os.getpid()} {child.pid}")
    os.rename(path + ".tmp", path)
    time.sleep(60)
"""


def _read_pids(pid_dir: Path, ranks: List[int]) -> List[int]:
    pids: List[int] = []
    for rank in ranks:
        pids += [int(p) for p in (pid_dir / str(rank)).read_text().split()]
    return pids


def _wait_for_files(pid_dir: Path, ranks: List[int],
                    proc: subprocess.Popen, within: float = 90.0) -> None:
    deadline = time.monotonic() + within
    while not all((pid_dir / str(r)).exists() for r in ranks):
        assert proc.poll() is None, "launcher exited before workers started"
        assert time.monotonic() < deadline, "workers did not start"
        time.sleep(0.05)


# -- pure rank assignment -----------------------------------------------------

def test_parse_hosts() -> None:
    parsed = hosts.parse_hosts("localhost:2, node1 ,[::1]:3")
    assert parsed == [hosts.HostInfo("localhost", 2),
                      hosts.HostInfo("node1", 1), hosts.HostInfo("::1", 3)]
    for bad in ("a:0", "a:x", "a:2,,b", ":3", "a:1,a:2"):
        with pytest.raises(ValueError):
            hosts.parse_hosts(bad)


def test_assign_ranks_horovod_semantics() -> None:
    spec = hosts.parse_hosts("a:2,b:3,c:4")
    got = [(s.hostname, s.rank, s.local_rank, s.local_size, s.cross_rank,
            s.cross_size) for s in hosts.assign_ranks(spec, 6)]
    assert got == [
        ("a", 0, 0, 2, 0, 3), ("a", 1, 1, 2, 0, 2),
        ("b", 2, 0, 3, 1, 3), ("b", 3, 1, 3, 1, 2), ("b", 4, 2, 3, 0, 1),
        ("c", 5, 0, 1, 2, 3),
    ]
    with pytest.raises(ValueError):
        hosts.assign_ranks(spec, 10)
    with pytest.raises(ValueError):
        hosts.assign_ranks(spec, 0)


def test_is_local_host() -> None:
    import socket
    for name in ("localhost", "127.0.0.1", "127.1.2.3", "::1",
                 socket.gethostname()):
        assert hosts.is_local_host(name), name
    assert not hosts.is_local_host("remote-host.invalid")


def test_addresses_of_either_family() -> None:
    """The store's address is chosen among IPv4 and IPv6 ones (IPv4 first, as the C++
    side resolves); before, an IPv6-only host had "no address"."""
    from horovod_torch.runner import network
    assert network.resolve("127.0.0.1") == "127.0.0.1"
    assert network.resolve("::1") == network.resolve("[::1]") == network.resolve("u@[::1]") == "::1"
    assert network.resolve("localhost") == "127.0.0.1"  # IPv4 first for a name with both
    assert network.route_source("::1") == "::1"
    assert network.route_source("[::1]") == "::1"
    assert network.is_own_address("::1") and network.is_own_address("127.0.0.1")
    assert not network.is_own_address("2001:db8::1")  # documentation prefix: not ours
    assert network.interface_ipv6("lo") is None  # loopback and link-local are not offered
    with pytest.raises(ValueError, match="cannot resolve"):
        network.resolve("no-such-host.invalid")
    assert hosts.parse_hosts("[::1]:2")[0].hostname == "::1"


# -- command line -------------------------------------------------------------

def test_help_is_fast_and_does_not_load_the_extension() -> None:
    start = time.monotonic()
    result = _run("--help", timeout=60)
    assert result.returncode == 0
    assert "usage: horovodrun" in result.stdout and "-np" in result.stdout
    assert time.monotonic() - start < 20
    probe = textwrap.dedent("""
        import sys
        import horovod_torch
        before = set(sys.modules)
        from horovod_torch.runner import launch
        try:
            launch.main(["--help"])
        except SystemExit:
            pass
        new = set(sys.modules) - before
        print(sorted(m for m in new if m == "torch" or m.endswith("._C")))
    """)
    out = subprocess.run([PY, "-c", probe], capture_output=True, text=True,
                         env=_env(), timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.splitlines()[-1] == "[]"


@pytest.mark.parametrize("args, needle", [
    (["--bogus", "-np", "2", "true"], "--bogus"),
    (["-np", "0", "true"], "-np"),
    (["-np", "-1", "true"], "-np"),
    (["-np", "two", "true"], "invalid int value"),
    (["-np", "2"], "no command"),
    (["true"], "-np/--num-proc is required"),
    (["-np", "2", "-H", "localhost:0", "true"], "slot count"),
    (["-np", "1", "--log-level", "LOUD", "true"], "--log-level"),
    (["-np", "1", "--start-timeout", "0", "true"], "timeout"),
    (["-np", "3", "-H", "localhost:2", "true"], "exceeds the 2 slot"),
    (["-np", "1", "-H", "remote-host.invalid:1", "true"],
     "cannot resolve host 'remote-host.invalid'"),
])
def test_usage_errors_are_one_line(args: List[str], needle: str) -> None:
    result = _run(*args, timeout=60)
    assert result.returncode == 2
    assert result.stdout == ""
    lines = result.stderr.splitlines()
    assert len(lines) == 1, result.stderr
    assert lines[0].startswith("horovodrun: error: ")
    assert needle in lines[0] and "--help" in lines[0]
    assert "usage:" not in result.stderr


def test_command_not_found() -> None:
    result = _run("-np", "2", "no-such-command-4f2a", "--flag", timeout=60)
    assert result.returncode == 127
    assert result.stdout == ""
    assert result.stderr == (
        "horovodrun: command not found: no-such-command-4f2a\n")


def test_check_build() -> None:
    result = _run("--check-build")
    assert result.returncode == 0, result.stderr
    for needle in ("[X] PyTorch", "[X] TCP (Gloo-compatible)", "] MPI",
                   "] NCCL", "Available Tensor Operations:"):
        assert needle in result.stdout
    # NCCL is ticked only where it can run: built and a GPU visible (#22).
    import torch
    import horovod_torch
    if horovod_torch.nccl_built() and not torch.cuda.is_available():
        assert "[ ] NCCL (built, no GPU visible)" in result.stdout, result.stdout


# -- topology and environment -------------------------------------------------

ENV_DUMP = """
    import json, os
    print(json.dumps({k: v for k, v in os.environ.items()
                      if k.startswith("HOROVOD_") or k == "PYTHONUNBUFFERED"}))
"""


def _env_by_rank(stdout: str) -> Dict[int, Dict[str, str]]:
    return {rank: json.loads(lines[-1])
            for rank, lines in _prefixed(stdout).items()}


def test_rank_assignment_and_env() -> None:
    result = _run("-np", "3", "-H", "localhost:2,127.0.0.1:2", "--verbose",
                  *_worker(ENV_DUMP))
    assert result.returncode == 0, result.stderr
    envs = _env_by_rank(result.stdout)
    assert sorted(envs) == [0, 1, 2]
    expected = {  # hostname, local_rank, local_size, cross_rank, cross_size
        0: ("localhost", 0, 2, 0, 2),
        1: ("localhost", 1, 2, 0, 1),
        2: ("127.0.0.1", 0, 1, 1, 2),
    }
    for rank, env in envs.items():
        got = (env["HOROVOD_HOSTNAME"], int(env["HOROVOD_LOCAL_RANK"]),
               int(env["HOROVOD_LOCAL_SIZE"]), int(env["HOROVOD_CROSS_RANK"]),
               int(env["HOROVOD_CROSS_SIZE"]))
        assert got == expected[rank]
        assert env["HOROVOD_RANK"] == str(rank)
        assert env["HOROVOD_SIZE"] == "3"
        assert env["HOROVOD_STORE_ADDR"] == "127.0.0.1"
        assert env["HOROVOD_CONTROLLER"] == "tcp"
        assert env["HOROVOD_START_TIMEOUT"] == "30"
        assert env["PYTHONUNBUFFERED"] == "1"
        assert "HOROVOD_LOG_LEVEL" not in env
        assert re.fullmatch(r"[0-9a-f]{32}", env["HOROVOD_SECRET"])
        assert 0 < int(env["HOROVOD_STORE_PORT"]) < 65536
    assert len({e["HOROVOD_SECRET"] for e in envs.values()}) == 1
    ports = {e["HOROVOD_STORE_PORT"] for e in envs.values()}
    assert len(ports) == 1
    assert f"127.0.0.1:{ports.pop()}" in result.stderr  # --verbose
    assert "cross_size=2" in result.stderr


def test_default_hosts_timeout_and_log_level() -> None:
    result = _run("-np", "2", "--start-timeout", "7", "--log-level", "debug",
                  *_worker(ENV_DUMP))
    assert result.returncode == 0, result.stderr
    for env in _env_by_rank(result.stdout).values():
        assert env["HOROVOD_HOSTNAME"] == "localhost"
        assert env["HOROVOD_LOCAL_SIZE"] == "2"
        assert env["HOROVOD_CROSS_SIZE"] == "1"
        assert env["HOROVOD_START_TIMEOUT"] == "7"
        assert env["HOROVOD_LOG_LEVEL"] == "DEBUG"
    result = _run("-np", "1", *_worker(ENV_DUMP),
                  env=_env(HOROVOD_START_TIMEOUT="11"))
    assert result.returncode == 0, result.stderr
    assert _env_by_rank(result.stdout)[0]["HOROVOD_START_TIMEOUT"] == "11"


# -- output -------------------------------------------------------------------

CHATTY = """
    import os, sys
    rank = os.environ["HOROVOD_RANK"]
    for i in range(300):
        print(f"line {i} of rank {rank}")
    sys.stdout.write(f"no newline from {rank}")
"""


def test_output_is_prefixed_per_line() -> None:
    result = _run("-np", "2", *_worker(CHATTY))
    assert result.returncode == 0, result.stderr
    by_rank = _prefixed(result.stdout)
    for rank in (0, 1):
        assert by_rank[rank] == [f"line {i} of rank {rank}"
                                 for i in range(300)] + [
                                     f"no newline from {rank}"]


def test_disable_prefix() -> None:
    result = _run("-np", "2", "--disable-prefix", *_worker(
        "import os; print('plain', os.environ['HOROVOD_RANK'])"))
    assert result.returncode == 0, result.stderr
    assert sorted(result.stdout.splitlines()) == ["plain 0", "plain 1"]


@pytest.mark.parametrize("prefix", [True, False])
def test_progress_bar_is_live(prefix: bool) -> None:
    """tqdm's redraws (a carriage return and the bar, no newline) reach our output while
    the worker still runs, each prefixed (before: all of them at once, after the
    script's last line, as the launcher forwarded whole lines only)."""
    script = """
        import sys, time
        from tqdm import tqdm
        for _ in tqdm(range(5), file=sys.stderr, mininterval=0, ascii=True, ncols=60):
            time.sleep(0.6)
        sys.stderr.write("DONE\\n")
    """
    args = ["-np", "1"] + ([] if prefix else ["--disable-prefix"])
    proc = subprocess.Popen(_launcher(*args, *_worker(script)), env=_env(),
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    seen = b""
    arrived = {}  # what -> when it first arrived
    deadline = time.monotonic() + TIMEOUT
    try:
        while time.monotonic() < deadline:
            chunk = os.read(proc.stderr.fileno(), 65536)
            if not chunk:
                break
            seen += chunk
            for what in (b"3/5", b"DONE"):
                if what in seen and what not in arrived:
                    arrived[what] = time.monotonic()
    finally:
        proc.kill()
        proc.wait()
    assert b"3/5" in arrived and b"DONE" in arrived, seen
    # The bar at 3 of 5 was drawn two sleeps (1.2 s) before the script's last line (a
    # margin for a stalled reader on a loaded machine).
    assert arrived[b"DONE"] - arrived[b"3/5"] > 0.5, seen
    bar = seen[:seen.index(b"3/5")].rsplit(b"\r", 1)[1]
    assert bar.startswith(b"[0]<stderr>:") == prefix, seen


def test_two_workers_with_one_label_keep_their_lines_apart() -> None:
    """Under elastic horovodrun a replacement may carry the label of a worker that
    still runs: their unfinished lines must not be joined into one (seen as
    "FINAL rank=1 ...FINAL rank=2 ..." when the forwarder kept one buffer per label)."""
    import io
    import threading
    from horovod_torch.runner.output import OutputForwarder
    out = io.BytesIO()
    forwarder = OutputForwarder(out, err_stream=io.BytesIO())
    code = ("import sys, time; sys.stdout.write('line %s'); sys.stdout.flush(); "
            "time.sleep(%s); sys.stdout.write(' ends\\n')")
    procs = [subprocess.Popen([PY, "-c", code % (name, delay)], stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE) for name, delay in (("a", 1.0), ("b", 0.3))]
    threads = [threading.Thread(target=forwarder.pump, args=(2, p)) for p in procs]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=TIMEOUT)
    assert sorted(out.getvalue().decode().splitlines()) == [
        "[2]<stdout>:line a ends", "[2]<stdout>:line b ends"], out.getvalue()


# -- failures and signals -----------------------------------------------------

def test_failure_exit_code_and_others_killed(tmp_path: Path) -> None:
    script = """
        import os, sys, time
        if os.environ["HOROVOD_RANK"] == "1":
            d = os.environ["PID_DIR"]
            deadline = time.time() + 60
            while not all(os.path.exists(os.path.join(d, r)) for r in "02"):
                if time.time() > deadline:
                    sys.exit(99)
                time.sleep(0.05)
            print("rank 1 failing")
            sys.exit(3)
    """
    script = textwrap.dedent(script) + textwrap.dedent(SLEEPER)
    start = time.monotonic()
    result = _run("-np", "3", *_worker(script),
                  env=_env(PID_DIR=str(tmp_path)))
    assert result.returncode == 3, result.stderr
    assert time.monotonic() - start < 60
    assert "[1]<stdout>:rank 1 failing" in result.stdout
    assert re.search(r"horovodrun: rank 1 \(pid \d+\) exited with code 3; terminating "
                     r"the other 2 workers", result.stderr), result.stderr
    _assert_gone(_read_pids(tmp_path, [0, 2]))


def test_worker_killed_by_signal(tmp_path: Path) -> None:
    script = """
        import os, signal, time
        if os.environ["HOROVOD_RANK"] == "1":
            while not os.path.exists(os.path.join(os.environ["PID_DIR"], "0")):
                time.sleep(0.05)
            os.kill(os.getpid(), signal.SIGKILL)
    """
    script = textwrap.dedent(script) + textwrap.dedent(SLEEPER)
    result = _run("-np", "2", *_worker(script),
                  env=_env(PID_DIR=str(tmp_path)))
    assert result.returncode == 128 + signal.SIGKILL, result.stderr
    assert re.search(r"rank 1 \(pid \d+\) exited with code 137 \(signal SIGKILL\)",
                     result.stderr), result.stderr
    _assert_gone(_read_pids(tmp_path, [0]))


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT])
def test_signal_is_forwarded(tmp_path: Path, signum: int) -> None:
    proc = subprocess.Popen(
        _launcher("-np", "2", *_worker(SLEEPER)), stdout=subprocess.PIPE,
        stderr=subprocess.PIPE, text=True, env=_env(PID_DIR=str(tmp_path)))
    try:
        _wait_for_files(tmp_path, [0, 1], proc)
        proc.send_signal(signum)
        _, stderr = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=10)
    assert proc.returncode == 128 + signum, stderr
    _assert_gone(_read_pids(tmp_path, [0, 1]))


def test_sigkill_after_grace_period(tmp_path: Path) -> None:
    proc = subprocess.Popen(
        _launcher("-np", "2", *_worker(SLEEPER)), stdout=subprocess.PIPE,
        stderr=subprocess.PIPE, text=True,
        env=_env(PID_DIR=str(tmp_path), IGNORE_TERM="1"))
    try:
        _wait_for_files(tmp_path, [0, 1], proc)
        start = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        _, stderr = proc.communicate(timeout=60)
        elapsed = time.monotonic() - start
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=10)
    assert proc.returncode == 143, stderr
    assert 4.0 <= elapsed < 30, elapsed
    _assert_gone(_read_pids(tmp_path, [0, 1]))


@pytest.mark.parametrize("mode,ignore_term", [("static", False), ("static", True),
                                              ("elastic", False)],
                         ids=["term", "kill-after-grace", "elastic"])
def test_workers_stop_when_the_launcher_is_killed(tmp_path: Path, mode: str,
                                                  ignore_term: bool) -> None:
    """SIGKILL gives horovodrun no chance to stop its workers: its reaper does."""
    extra = {"PID_DIR": str(tmp_path)}
    if ignore_term:
        extra["IGNORE_TERM"] = "1"
    args = ["-np", "2"]
    if mode == "elastic":
        discover = tmp_path / "discover.sh"
        discover.write_text("#!/bin/sh\necho localhost:2\n")
        discover.chmod(0o755)
        args += ["--min-np", "1", "--max-np", "2", "--host-discovery-script", str(discover)]
    proc = subprocess.Popen(
        _launcher(*args, *_worker(SLEEPER)), stdout=subprocess.PIPE,
        stderr=subprocess.PIPE, text=True, env=_env(**extra))
    try:
        _wait_for_files(tmp_path, [0, 1], proc)
        proc.kill()
        _, stderr = proc.communicate(timeout=60)  # ends when the reaper is done too
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=10)
    assert proc.returncode == -signal.SIGKILL
    assert "the launcher is gone; stopping its 2 remaining local worker(s)" in stderr, stderr
    _assert_gone(_read_pids(tmp_path, [0, 1]), within=5.0)


# --- start-up is not serialised (issue #22 item 9) ---------------------------------

BARRIER = """
    import os, sys, time
    folder, size = sys.argv[1], int(os.environ["HOROVOD_SIZE"])
    open(os.path.join(folder, os.environ["HOROVOD_RANK"]), "w").close()
    deadline = time.monotonic() + 60
    while len(os.listdir(folder)) < size:
        if time.monotonic() > deadline:
            sys.exit(3)
        time.sleep(0.01)
"""

SPAWN_ORDER_PROBE = """
    import json, sys
    from horovod_torch.runner import driver, launch
    events = []
    spawn, start_store = driver.LocalSpawner.spawn, launch._start_store
    def spawning(self, slot, command, env):
        events.append(["spawn", slot.rank, int(env["HOROVOD_STORE_PORT"])])
        return spawn(self, slot, command, env)
    def starting(secret, addr, port=0):
        events.append(["store", sys.modules.get("torch") is not None, port])
        return start_store(secret, addr, port)
    driver.LocalSpawner.spawn, launch._start_store = spawning, starting
    code = launch.main(sys.argv[1:])
    print(json.dumps([code, events]))
"""


def test_all_workers_start_before_the_launcher_loads_torch(tmp_path: Path) -> None:
    """horovodrun starts every worker before its own `import torch` (the store's
    extension), on the port held for the store, and waits on none of them: the
    workers here only end once all of them have started. Started store first, every
    worker waited for the launcher's import (seconds); a per-rank wait in the spawn
    loop would hang this barrier."""
    n = 8
    folder = tmp_path / "started"
    folder.mkdir()
    out = subprocess.run(
        [PY, "-c", textwrap.dedent(SPAWN_ORDER_PROBE), "-np", str(n),
         *_worker(BARRIER), str(folder)],
        capture_output=True, text=True, env=_env(), timeout=TIMEOUT)
    assert out.returncode == 0, out.stderr
    code, events = json.loads(out.stdout.splitlines()[-1])
    assert code == 0, out.stderr
    assert [e[:2] for e in events[:n]] == [["spawn", r] for r in range(n)], events
    assert events[n][0] == "store" and len(events) == n + 1, events
    assert events[n][1] is False, "torch was loaded before the workers started"
    assert {e[2] for e in events} == {events[n][2]} and events[n][2] > 0, events
    assert sorted(os.listdir(folder)) == sorted(str(r) for r in range(n))


STORE_FAILS_PROBE = """
    import os, sys, time
    from horovod_torch.runner import launch
    def failing(secret, addr, port=0):
        folder = os.environ["PID_DIR"]
        deadline = time.monotonic() + 60
        while not all(os.path.exists(os.path.join(folder, r)) for r in ("0", "1")):
            assert time.monotonic() < deadline, "workers did not start"
            time.sleep(0.05)
        raise RuntimeError("no store today")
    launch._start_store = failing
    sys.exit(launch.main(sys.argv[1:]))
"""


def test_store_that_fails_after_the_workers_started_stops_them(tmp_path: Path) -> None:
    """The workers run before the store does: if it cannot start, they are stopped
    and horovodrun exits with 1, saying why."""
    out = subprocess.run([PY, "-c", textwrap.dedent(STORE_FAILS_PROBE), "-np", "2",
                          *_worker(SLEEPER)], capture_output=True, text=True,
                         env=_env(PID_DIR=str(tmp_path)), timeout=TIMEOUT)
    assert out.returncode == 1, out.stderr
    assert "horovodrun: failed to start the rendezvous store on 127.0.0.1:" in out.stderr
    assert "no store today" in out.stderr
    _assert_gone(_read_pids(tmp_path, [0, 1]), within=5.0)


def test_reserved_port_refuses_until_the_store_listens() -> None:
    """The store's port is held (bound, not listening) while the workers start: a
    connection is refused (workers retry), nobody else gets the port, and the store
    binds it."""
    import socket

    from horovod_torch import _C
    from horovod_torch.runner import launch

    reservation = launch.reserve_port("127.0.0.1")
    port = reservation.getsockname()[1]
    try:
        with pytest.raises(ConnectionRefusedError):
            socket.create_connection(("127.0.0.1", port), timeout=5).close()
        with socket.socket() as other:  # the kernel hands out other ports
            other.bind(("127.0.0.1", 0))
            assert other.getsockname()[1] != port
        server = _C.StoreServer("127.0.0.1", port, "s" * 32)
    finally:
        reservation.close()
    try:
        assert server.port() == port
        socket.create_connection(("127.0.0.1", port), timeout=5).close()
    finally:
        server.stop()


FAKE_LIBCUDA = r"""
#include <stdio.h>
#include <stdlib.h>
/* Entry points the CUDA runtime looks up in libcuda.so.1 first; each call is
   written to $FAKE_CUDA_CALLS, and fails as on a host without a GPU. */
static int note(const char* what) {
  const char* path = getenv("FAKE_CUDA_CALLS");
  FILE* f = path ? fopen(path, "a") : NULL;
  if (f) { fprintf(f, "%s\n", what); fclose(f); }
  return 100; /* CUDA_ERROR_NO_DEVICE */
}
int cuInit(unsigned flags) { (void)flags; return note("cuInit"); }
int cuDriverGetVersion(int* v) { if (v) *v = 0; return note("cuDriverGetVersion"); }
int cuGetProcAddress(const char* s, void** p, int v, unsigned long long f) {
  (void)s; (void)v; (void)f; if (p) *p = 0; return note("cuGetProcAddress");
}
int cuGetProcAddress_v2(const char* s, void** p, int v, unsigned long long f, void* st) {
  (void)s; (void)v; (void)f; (void)st; if (p) *p = 0; return note("cuGetProcAddress_v2");
}
"""

CPU_JOB = """
    import torch
    import horovod_torch as hvd
    hvd.init()
    t = hvd.allreduce(torch.ones(4), name="first")
    assert t.tolist() == [1.0] * 4, t
"""


def test_cpu_job_start_up_never_calls_the_cuda_driver(tmp_path: Path) -> None:
    """Neither horovodrun nor hvd.init() and a CPU allreduce may ask the CUDA driver
    anything: its first call (cuInit) costs each process about 0.1 s, serialised
    across the host's processes, so 128 local ranks spent about 15 s in hvd.init()
    on a GPU host (issue #22 item 9). A stand-in libcuda.so.1 records the calls."""
    import shutil

    compiler = shutil.which("cc") or shutil.which("gcc")
    if compiler is None:
        pytest.skip("no C compiler for the stand-in libcuda.so.1")
    source = tmp_path / "fake_libcuda.c"
    source.write_text(FAKE_LIBCUDA)
    subprocess.run([compiler, "-shared", "-fPIC", "-o", str(tmp_path / "libcuda.so.1"),
                    str(source)], check=True, timeout=60)
    calls = tmp_path / "calls"
    library_path = os.pathsep.join(
        [str(tmp_path)] + [p for p in [os.environ.get("LD_LIBRARY_PATH")] if p])
    env = _env(LD_LIBRARY_PATH=library_path, FAKE_CUDA_CALLS=str(calls))
    env.pop("HOROVOD_SPIN_US", None)
    # The stand-in is reached when CUDA is asked (else this torch has no CUDA).
    subprocess.run([PY, "-c", "import torch; torch._C._cuda_getDeviceCount()"],
                   env=env, timeout=60, capture_output=True)
    if not calls.exists():
        pytest.skip("this torch does not load libcuda.so.1 (a build without CUDA)")
    calls.unlink()
    result = _run("-np", "2", *_worker(CPU_JOB), env=env)
    assert result.returncode == 0, result.stderr
    assert not calls.exists(), ("the CUDA driver was called: "
                                + ", ".join(sorted(set(calls.read_text().split()))))
