"""horovodrun across hosts, with real hosts on one machine.

The ``lab`` fixture makes four "hosts": network namespaces joined to the root
namespace by veth pairs on one bridge (10.99.0.1/24 on the bridge, 10.99.0.11 ...
in the namespaces), each running its own sshd on port 2222 with a key made for
the run. The launcher runs in the root namespace; workers reach its store over
the bridge, and rank-to-rank traffic between namespaces crosses the veth links.
Needs root, ``ip netns`` and openssh-server (``/usr/sbin/sshd``); the tests that
need the lab skip with the reason otherwise.
"""
from __future__ import annotations

import json
import os
import pwd
import re
import shutil
import signal
import socket
import subprocess
import sys
import textwrap
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Dict, Iterator, List, Optional

import pytest

from horovod_torch.runner import hosts, network, remote
from tests.harness import ROOT

pytestmark = pytest.mark.multihost

PY = sys.executable
PREFIX = "hvdmh"          # every namespace and link of the lab starts with this
SUBNET = "10.99.0"
SSH_PORT = 2222
TIMEOUT = 120             # every launcher run
PROBE = os.path.join(ROOT, "tests", "multihost_probe.py")
ELASTIC = os.path.join(ROOT, "tests", "multihost_elastic.py")
NETNS_EXEC = os.path.join(ROOT, "tests", "multihost_netns_exec.sh")
LINE = re.compile(r"^\[(\d+)\]<stdout>:(.*)$")


# -- the lab ------------------------------------------------------------------

def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    return subprocess.run(["ip", *args], capture_output=True, text=True, check=check,
                          timeout=30)


def _why_no_lab() -> Optional[str]:
    if sys.platform != "linux" or os.geteuid() != 0:
        return "needs root on Linux (creates network namespaces)"
    if shutil.which("ip") is None:
        return "needs iproute2 ('ip')"
    if subprocess.run(["ip", "netns", "list"], capture_output=True).returncode != 0:
        return "'ip netns' is not available"
    for tool in ("/usr/sbin/sshd", shutil.which("ssh"), shutil.which("ssh-keygen")):
        if not tool or not os.path.exists(tool):
            return "needs openssh-server and openssh-client (apt-get install openssh-server)"
    return None


def _owner_alive(pid: int) -> bool:
    try:
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return False
    return b"pytest" in cmdline


def _kill_netns_processes(ns: str) -> None:
    out = _ip("netns", "pids", ns, check=False).stdout.split()
    for pid in out:
        try:
            os.kill(int(pid), signal.SIGKILL)
        except (ProcessLookupError, ValueError):
            pass


def _clean_stale() -> Optional[str]:
    """Removes the leftovers of a crashed run; returns a reason if a live run owns them."""
    names = re.compile(rf"^{PREFIX}(\d+)[a-z]?$")
    namespaces = [line.split()[0] for line in _ip("netns", "list").stdout.splitlines() if line]
    links = [m.group(1) for m in re.finditer(r"^\d+: ([^:@]+)", _ip("-o", "link").stdout,
                                             re.M)]
    for name in namespaces + links:
        m = names.match(name)
        if not m or int(m.group(1)) == os.getpid():
            continue
        if _owner_alive(int(m.group(1))):
            return f"another multihost test run (pid {m.group(1)}) is using {SUBNET}.0/24"
    for name in namespaces:
        if names.match(name) and int(names.match(name).group(1)) != os.getpid():
            _kill_netns_processes(name)
            _ip("netns", "del", name, check=False)
    for name in links:
        if names.match(name) and int(names.match(name).group(1)) != os.getpid():
            _ip("link", "del", name, check=False)
    return None


@dataclass
class Host:
    """One namespace "host": its address, root-side veth and sshd."""

    ns: str
    addr: str
    veth: str
    sshd: subprocess.Popen

    def link_bytes(self) -> int:
        """Bytes that crossed this host's veth link, both directions."""
        base = Path("/sys/class/net") / self.veth / "statistics"
        return sum(int((base / f).read_text()) for f in ("rx_bytes", "tx_bytes"))

    def pids(self) -> List[int]:
        return [int(p) for p in _ip("netns", "pids", self.ns).stdout.split()]


class Lab:
    """The bridge, the namespaces and their sshds; see the module docstring."""

    def __init__(self, tmp: Path, count: int) -> None:
        self.tmp = tmp
        self.tag = f"{PREFIX}{os.getpid()}"
        self.bridge = self.tag
        self.bridge_addr = f"{SUBNET}.1"
        self.key = str(tmp / "id_ed25519")
        self.hosts: List[Host] = []
        self._count = count
        home = Path(pwd.getpwuid(os.getuid()).pw_dir) / ".ssh"
        self._known_hosts = home / "known_hosts"
        self._had_ssh_dir = home.exists()
        self._known_before = (self._known_hosts.read_bytes()
                              if self._known_hosts.exists() else None)

    def start(self) -> None:
        subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", self.key],
                       check=True, timeout=30)
        hostkey = self.tmp / "host_ed25519"
        subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(hostkey)],
                       check=True, timeout=30)
        authorized = self.tmp / "authorized_keys"
        shutil.copy(self.key + ".pub", authorized)
        os.makedirs("/run/sshd", exist_ok=True)  # sshd's privilege separation directory
        _ip("link", "add", self.bridge, "type", "bridge")
        _ip("addr", "add", f"{self.bridge_addr}/24", "dev", self.bridge)
        _ip("link", "set", self.bridge, "up")
        for i in range(self._count):
            name = f"{self.tag}{chr(ord('a') + i)}"
            addr = f"{SUBNET}.{11 + i}"
            _ip("netns", "add", name)
            _ip("link", "add", name, "type", "veth", "peer", "name", "eth0", "netns", name)
            _ip("link", "set", name, "master", self.bridge, "up")
            _ip("-n", name, "addr", "add", f"{addr}/24", "dev", "eth0")
            _ip("-n", name, "link", "set", "eth0", "up")
            _ip("-n", name, "link", "set", "lo", "up")
            _ip("-n", name, "route", "add", "default", "via", self.bridge_addr)
            log = open(self.tmp / f"sshd-{name}.log", "wb")
            sshd = subprocess.Popen(
                ["ip", "netns", "exec", name, "/usr/sbin/sshd", "-D", "-e", "-f", "/dev/null",
                 "-h", str(hostkey), "-p", str(SSH_PORT), "-o", f"ListenAddress={addr}",
                 "-o", f"AuthorizedKeysFile={authorized}", "-o", "StrictModes=no",
                 "-o", "PasswordAuthentication=no", "-o", "KbdInteractiveAuthentication=no",
                 "-o", "UsePAM=no", "-o", "PermitRootLogin=prohibit-password",
                 "-o", "PidFile=none", "-o", "UseDNS=no",
                 "-o", "LogLevel=ERROR"],
                stdout=log, stderr=subprocess.STDOUT)
            log.close()
            self.hosts.append(Host(name, addr, name, sshd))
        for host in self.hosts:
            _wait_for_port(host.addr, SSH_PORT, host.sshd)

    def stop(self) -> None:
        for host in self.hosts:
            with _suppress():
                host.sshd.send_signal(signal.SIGCONT)
            _kill_netns_processes(host.ns)
            with _suppress():
                host.sshd.kill()
                host.sshd.wait(timeout=10)
            _ip("netns", "del", host.ns, check=False)
        _ip("link", "del", self.bridge, check=False)
        # ssh recorded the namespaces' host keys; put known_hosts back as it was.
        if self._known_before is not None:
            self._known_hosts.write_bytes(self._known_before)
        elif self._known_hosts.exists():
            self._known_hosts.unlink()
            if not self._had_ssh_dir:
                with _suppress():
                    self._known_hosts.parent.rmdir()

    def ssh_args(self) -> List[str]:
        return ["--ssh-port", str(SSH_PORT), "--ssh-identity-file", self.key]


class _suppress:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: object) -> bool:
        return True


def _wait_for_port(addr: str, port: int, proc: subprocess.Popen, within: float = 20) -> None:
    deadline = time.monotonic() + within
    while True:
        try:
            socket.create_connection((addr, port), timeout=1).close()
            return
        except OSError:
            assert proc.poll() is None, f"sshd on {addr} exited with {proc.returncode}"
            assert time.monotonic() < deadline, f"sshd on {addr} did not start"
            time.sleep(0.1)


@pytest.fixture(scope="module")
def lab(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Lab]:
    why = _why_no_lab()
    if why:
        pytest.skip(why)
    busy = _clean_stale()
    if busy:
        pytest.skip(busy)
    the_lab = Lab(tmp_path_factory.mktemp("lab"), count=4)
    try:
        the_lab.start()
        yield the_lab
    finally:
        the_lab.stop()


# -- helpers -----------------------------------------------------------------

def _env(**extra: str) -> Dict[str, str]:
    env = dict(os.environ)
    for k in ("HOROVOD_START_TIMEOUT", "HOROVOD_LOG_LEVEL", "HOROVOD_SSH_COMMAND"):
        env.pop(k, None)
    env.update(PYTHONPATH=ROOT, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    env.update(extra)
    return env


def _horovodrun(*args: str, env: Optional[Dict[str, str]] = None,
                timeout: float = TIMEOUT) -> subprocess.CompletedProcess:
    return subprocess.run([PY, "-m", "horovod_torch.runner", *args], cwd=ROOT,
                          capture_output=True, text=True, env=env or _env(), timeout=timeout)


def _probes(stdout: str) -> Dict[int, dict]:
    """The probe reports by rank, from prefixed ``[rank]<stdout>:PROBE {...}`` lines."""
    found = {}
    for line in stdout.splitlines():
        m = LINE.match(line)
        if m and m.group(2).startswith("PROBE "):
            report = json.loads(m.group(2)[len("PROBE "):])
            assert report["rank"] == int(m.group(1)), line
            found[report["rank"]] = report
    return found


def _processes_with(token: str) -> List[int]:
    """PIDs (any namespace) whose command line holds ``token``, except ourselves."""
    pids = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit() or int(entry) == os.getpid():
            continue
        try:
            cmdline = Path(f"/proc/{entry}/cmdline").read_bytes()
            state = Path(f"/proc/{entry}/stat").read_text().rsplit(")", 1)[1].split()[0]
        except OSError:
            continue
        if token.encode() in cmdline and state != "Z":
            pids.append(int(entry))
    return pids


def _assert_none_left(token: str, within: float = 10.0) -> None:
    deadline = time.monotonic() + within
    while _processes_with(token) and time.monotonic() < deadline:
        time.sleep(0.1)
    left = _processes_with(token)
    for pid in left:
        with _suppress():
            os.kill(pid, signal.SIGKILL)
    assert not left, f"processes outlived horovodrun: {left}"


# Sleeps with a child, both carrying TOKEN on their command line; writes a file per rank.
SLEEPER = """
    import os, signal, subprocess, sys, time
    if os.environ.get("IGNORE_TERM"):
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)", sys.argv[1]])
    d = os.environ.get("PID_DIR")
    if d:
        with open(os.path.join(d, os.environ["HOROVOD_RANK"]), "w") as f:
            f.write(f"{os.getpid()} {child.pid}")
    time.sleep(120)
"""


def _sleeper(token: str) -> List[str]:
    return [PY, "-c", textwrap.dedent(SLEEPER), token]


# -- without the lab ----------------------------------------------------------

def test_hostfile_formats(tmp_path: Path) -> None:
    text = "# cluster\nnode1 slots=4\n\nnode2:2  # two GPUs\nnode3\n"
    assert hosts.parse_hostfile(text) == [hosts.HostInfo("node1", 4),
                                          hosts.HostInfo("node2", 2),
                                          hosts.HostInfo("node3", 1)]
    for bad, needle in (("node1 slots=x", "slot count"), ("node1 gpus=2", "expected"),
                        ("a:1\na slots=2", "more than once"), ("# nothing\n", "no hosts"),
                        ("-oProxyCommand=x:1", "invalid host name")):
        with pytest.raises(ValueError, match=needle):
            hosts.parse_hostfile(bad)
    path = tmp_path / "hosts"
    path.write_text("localhost slots=2\n")
    result = _horovodrun("-np", "2", "--hostfile", str(path), PY, "-c",
                         "import os; print(os.environ['HOROVOD_LOCAL_SIZE'])")
    assert result.returncode == 0, result.stderr
    assert sorted(result.stdout.splitlines()) == ["[0]<stdout>:2", "[1]<stdout>:2"]


def test_local_host_detection_and_forwarded_env() -> None:
    own = [a for a in (network.interface_ipv4(n) for n in network.interface_names()) if a]
    assert own and all(hosts.is_local_host(a) for a in own), own
    assert not hosts.is_local_host("192.0.2.254") or "192.0.2.254" in own
    env = remote.forwarded_env({"HOROVOD_SECRET": "s", "PATH": "/bin", "HOME": "/root",
                                "SSH_CLIENT": "x", "HOSTNAME": "me", "MY_VAR": "1"})
    assert env == {"HOROVOD_SECRET": "s", "PATH": "/bin", "MY_VAR": "1"}


@pytest.mark.parametrize("flag", ["--network-interface", "--nics"])
def test_wrong_interface_name_is_a_clear_error(flag: str) -> None:
    result = _horovodrun("-np", "2", "-H", "localhost:2", flag, "nosuch0", "true",
                         timeout=60)
    assert result.returncode == 2, result.stderr
    lines = result.stderr.splitlines()
    assert len(lines) == 1, result.stderr
    assert "network interface 'nosuch0' does not exist" in lines[0]
    assert "lo" in lines[0].split("it has:")[1], lines[0]


def test_ssh_options_conflict_with_ssh_command() -> None:
    result = _horovodrun("-np", "1", "--ssh-command", "myssh", "--ssh-port", "22", "true",
                         timeout=60)
    assert result.returncode == 2
    assert "--ssh-port/--ssh-identity-file apply to the built-in ssh" in result.stderr


# -- with the lab -------------------------------------------------------------

def test_two_hosts_two_slots_over_ssh(lab: Lab, tmp_path: Path) -> None:
    a, b = lab.hosts[0], lab.hosts[1]
    hostfile = tmp_path / "hostfile"
    hostfile.write_text(f"# two namespaces\n{a.addr} slots=2\n{b.addr}:2\n")
    numel = 1 << 18  # 1 MiB of float32 per rank
    before = {h.ns: h.link_bytes() for h in (a, b)}
    result = _horovodrun("-np", "4", "--hostfile", str(hostfile), "--nics", lab.bridge,
                         *lab.ssh_args(), "--verbose", PY, PROBE,
                         env=_env(PROBE_NUMEL=str(numel)))
    assert result.returncode == 0, result.stdout + result.stderr
    reports = _probes(result.stdout)
    assert sorted(reports) == [0, 1, 2, 3], result.stdout + result.stderr
    expected = {0: (a, 0, 0), 1: (a, 1, 0), 2: (b, 0, 1), 3: (b, 1, 1)}
    for rank, (host, local_rank, cross_rank) in expected.items():
        r = reports[rank]
        assert (r["size"], r["local_size"], r["cross_size"]) == (4, 2, 2), r
        assert (r["local_rank"], r["cross_rank"], r["host"]) == (local_rank, cross_rank,
                                                                 host.addr), r
        assert r["sum_min"] == r["sum_max"] == 1 + 2 + 3 + 4, r
        assert r["allgather_ok"], r
        assert r["store"] == lab.bridge_addr, r
        # Each rank listens for its peers on its own namespace's address.
        assert [m.rsplit(":", 1)[0] for m in r["mesh"]] == [a.addr, a.addr, b.addr, b.addr]
    own_ns = os.readlink("/proc/self/ns/net")
    assert reports[0]["netns"] == reports[1]["netns"] != own_ns
    assert reports[2]["netns"] == reports[3]["netns"] != reports[0]["netns"]
    for host in (a, b):  # the reduction crossed both veth links
        assert host.link_bytes() - before[host.ns] > numel * 4, host.ns
    assert f"rendezvous store at {lab.bridge_addr}:" in result.stderr


def test_hierarchical_allgather_crosses_each_link_less(lab: Lab, tmp_path: Path) -> None:
    """2 hosts x 2 ranks, an allgather of 1-4 MiB blocks: through the hierarchy each rank
    receives one block per other host over the network; flat Bruck routes some blocks
    over the link twice (5 remote blocks into the first host instead of 2)."""
    a, b = lab.hosts[0], lab.hosts[1]
    hostfile = tmp_path / "hostfile"
    hostfile.write_text(f"{a.addr} slots=2\n{b.addr} slots=2\n")
    crossed = {}
    for knob in ("0", "1"):
        before = a.link_bytes()
        result = _horovodrun("-np", "4", "--hostfile", str(hostfile), "--nics", lab.bridge,
                             *lab.ssh_args(), PY, PROBE,
                             env=_env(PROBE_NUMEL="1", PROBE_AG_COLS=str(1 << 18),
                                      HOROVOD_HIERARCHICAL_ALLGATHER=knob))
        assert result.returncode == 0, result.stdout + result.stderr
        reports = _probes(result.stdout)
        assert sorted(reports) == [0, 1, 2, 3], result.stdout + result.stderr
        assert all(r["allgather_ok"] for r in reports.values()), reports
        crossed[knob] = a.link_bytes() - before
    block = 1 << 20  # rank r's block is (r + 1) MiB
    # Host a's link, both ways: flat, in 3 + 4 (rank 0) + 3 + 4 + 1 (rank 1, its own
    # host's block 0 among them) and out 1 + 3 (rank 0) + 5 (rank 1): 21 MiB;
    # hierarchical, in 3 + 4 and out 1 + 2: 10 MiB. Set-up and the launcher add little
    # (measured: 25.3 MB flat, 10.6 MB hierarchical).
    assert crossed["1"] < crossed["0"] - 8 * block, crossed


def test_ssh_command_replacement_with_a_local_host(lab: Lab, tmp_path: Path) -> None:
    a, c = lab.hosts[0], lab.hosts[2]
    log = tmp_path / "exec.log"
    env = _env(MULTIHOST_NETNS_MAP=f"{a.addr}={a.ns} {c.addr}={c.ns}",
               MULTIHOST_EXEC_LOG=str(log), HOROVOD_SSH_COMMAND=NETNS_EXEC,
               PROBE_NUMEL="4096")
    # No --nics: the store takes the address of the route to the first remote host.
    result = _horovodrun("-np", "3", "-H", f"localhost:1,{a.addr}:1,{c.addr}:1", PY, PROBE,
                         env=env)
    assert result.returncode == 0, result.stdout + result.stderr
    reports = _probes(result.stdout)
    assert sorted(reports) == [0, 1, 2], result.stdout + result.stderr
    assert all(r["sum_min"] == r["sum_max"] == 6 and r["store"] == lab.bridge_addr
               for r in reports.values()), reports
    assert [m.rsplit(":", 1)[0] for m in reports[0]["mesh"]] == [lab.bridge_addr, a.addr,
                                                                 c.addr]
    assert reports[0]["netns"] == os.readlink("/proc/self/ns/net")  # started directly
    assert sorted(log.read_text().split()) == sorted([a.addr, c.addr])


def test_unreachable_host_times_out_without_orphans(lab: Lab) -> None:
    a, d = lab.hosts[0], lab.hosts[3]
    token = f"hvd-orphan-check-{os.getpid()}-{time.monotonic_ns()}"
    d.sshd.send_signal(signal.SIGSTOP)  # d accepts TCP connections but never answers
    try:
        start = time.monotonic()
        result = _horovodrun("-np", "3", "-H", f"{a.addr}:2,{d.addr}:1",
                             "--start-timeout", "8", *lab.ssh_args(), *_sleeper(token))
        elapsed = time.monotonic() - start
    finally:
        d.sshd.send_signal(signal.SIGCONT)
    assert result.returncode == 1, result.stdout + result.stderr
    assert (f"horovodrun: could not start workers on host {d.addr} within --start-timeout "
            "8 s") in result.stderr, result.stderr
    assert f"-p {SSH_PORT}" in result.stderr  # says how to check the host by hand
    assert elapsed < 45, elapsed
    _assert_none_left(token)           # a's workers and their children
    _assert_none_left(f" {d.addr} ")  # the ssh client to d


def test_more_slots_than_sshd_accepts_at_once(lab: Lab) -> None:
    """sshd (default MaxStartups 10) drops connections beyond 10 that are still
    authenticating: horovodrun must pace the ssh sessions of a host with many slots."""
    a = lab.hosts[0]
    result = _horovodrun("-np", "16", "-H", f"{a.addr}:16", *lab.ssh_args(), PY, "-c",
                         "import os; print(os.environ['HOROVOD_LOCAL_RANK'])")
    assert result.returncode == 0, result.stderr
    assert sorted(int(line.split(":")[-1]) for line in result.stdout.splitlines()) == list(
        range(16))


def test_refused_connection_is_a_clear_error(lab: Lab) -> None:
    a = lab.hosts[0]
    result = _horovodrun("-np", "1", "-H", f"{a.addr}:1", "--ssh-port", str(SSH_PORT + 1),
                         "--ssh-identity-file", lab.key, PY, "-c", "pass", timeout=60)
    assert result.returncode == 255, result.stderr
    assert (f"rank 0 exited with code 255 before it could start on host {a.addr}"
            in result.stderr), result.stderr
    assert "Connection refused" in result.stderr


@pytest.mark.parametrize("signum, ignore_term", [
    (signal.SIGINT, ""),
    (signal.SIGTERM, "1"),  # the workers ignore it: SIGKILL after the grace period
    (signal.SIGKILL, ""),   # horovodrun itself dies: the remote wrappers clean up
])
def test_signal_stops_remote_workers(lab: Lab, tmp_path: Path, signum: int,
                                     ignore_term: str) -> None:
    a, b = lab.hosts[0], lab.hosts[1]
    token = f"hvd-signal-check-{os.getpid()}-{signum}"
    proc = subprocess.Popen(
        [PY, "-m", "horovod_torch.runner", "-np", "3", "-H", f"{a.addr}:1,{b.addr}:2",
         *lab.ssh_args(), *_sleeper(token)], cwd=ROOT,
        env=_env(PID_DIR=str(tmp_path), IGNORE_TERM=ignore_term),
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 60
        while not all((tmp_path / str(r)).exists() for r in range(3)):
            assert proc.poll() is None, proc.communicate()
            assert time.monotonic() < deadline, "remote workers did not start"
            time.sleep(0.1)
        pids = [int(p) for r in range(3) for p in (tmp_path / str(r)).read_text().split()]
        assert {p for p in pids} <= set(a.pids()) | set(b.pids())
        proc.send_signal(signum)
        _, stderr = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == (-signum if signum == signal.SIGKILL else 128 + signum), stderr
    _assert_none_left(token)


class _ElasticJob:
    """An elastic horovodrun of multihost_elastic.py whose discovery script prints
    a file the test rewrites; its output is followed line by line."""

    def __init__(self, tmp_path: Path, hosts_text: str, *args: str) -> None:
        self.hosts_file = tmp_path / "hosts.txt"
        self.hosts_file.write_text(hosts_text)
        discover = tmp_path / "discover.sh"
        discover.write_text(f"#!/bin/sh\ncat {self.hosts_file}\n")
        discover.chmod(0o755)
        self.stop_file = tmp_path / "stop"
        self.proc = subprocess.Popen(
            [PY, "-m", "horovod_torch.runner", "--host-discovery-script", str(discover),
             *args, PY, ELASTIC], cwd=ROOT, env=_env(STOP_FILE=str(self.stop_file)),
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        self.lines: List[str] = []
        self._reader = threading.Thread(
            target=lambda: self.lines.extend(iter(self.proc.stdout.readline, "")),
            daemon=True)
        self._reader.start()

    def wait_for(self, pattern: str, after: int = 0, within: float = 90) -> int:
        """Index of the first line from ``after`` on that matches ``pattern``."""
        deadline = time.monotonic() + within
        while time.monotonic() < deadline:
            ended = not self._reader.is_alive()
            for i in range(after, len(self.lines)):
                if re.search(pattern, self.lines[i]):
                    return i
            if ended:
                break
            time.sleep(0.1)
        raise AssertionError(f"no line matching {pattern!r}:\n" + self.output())

    def finish(self, within: float = 90) -> int:
        """Tells the workers to stop; returns horovodrun's exit code."""
        self.stop_file.write_text("done")
        try:
            return self.proc.wait(timeout=within)
        finally:
            self.kill()

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
        self._reader.join(timeout=10)

    def output(self) -> str:
        return "".join(self.lines)


def test_elastic_across_namespaces(lab: Lab, tmp_path: Path) -> None:
    """Workers on namespaces a and b; b's processes are killed (as if the host died);
    namespace c appears in the discovery output and joins; training finishes."""
    a, b, c = lab.hosts[0], lab.hosts[1], lab.hosts[2]
    job = _ElasticJob(tmp_path, f"{a.addr}:1\n{b.addr}:1\n", "-np", "2", "--min-np", "1",
                      "--max-np", "2", *lab.ssh_args())
    try:
        at = job.wait_for(r"STEP \d+ size=2 hosts=" + re.escape(f"{a.addr},{b.addr}"))
        victims = [p for p in b.pids() if p != b.sshd.pid]
        assert victims
        for pid in victims:
            with _suppress():
                os.kill(pid, signal.SIGKILL)
        at = job.wait_for(r"STEP \d+ size=1 ", after=at)
        job.hosts_file.write_text(f"{a.addr}:1\n{b.addr}:1\n{c.addr}:1\n")
        job.wait_for(r"STEP \d+ size=2 hosts=" + re.escape(f"{a.addr},{c.addr}"), after=at)
        rc = job.finish()
    finally:
        job.kill()
    out = job.output()
    assert rc == 0, out
    assert re.search(rf"worker {re.escape(b.addr)}/\d+ \(rank 1\) exited", out), out
    finals = [dict(re.findall(r"(\w+)=(\S+)", line)) for line in job.lines if "FINAL" in line]
    assert sorted(f["host"] for f in finals) == [a.addr, c.addr], out
    assert all(f["size"] == "2" and f["same"] == "True" for f in finals), out


def test_elastic_unreachable_host_is_blacklisted(lab: Lab, tmp_path: Path) -> None:
    """A discovered host whose sshd hangs never joins a generation: after
    --start-timeout it is blacklisted and the running job is not disturbed."""
    a, d = lab.hosts[0], lab.hosts[3]
    d.sshd.send_signal(signal.SIGSTOP)
    try:
        job = _ElasticJob(tmp_path, f"{a.addr}:1\n{d.addr}:1\n", "-np", "1", "--min-np",
                          "1", "--max-np", "2", "--start-timeout", "5", *lab.ssh_args())
        try:
            at = job.wait_for(rf"host {re.escape(d.addr)} did not answer within "
                              r"--start-timeout 5 s; blacklisting it")
            job.wait_for(r"STEP \d+ size=1 ", after=at)
            rc = job.finish()
        finally:
            job.kill()
    finally:
        d.sshd.send_signal(signal.SIGCONT)
    out = job.output()
    assert rc == 0, out
    assert "generation 1" not in out, out  # the job never re-formed
    _assert_none_left(f" {d.addr} ")       # the ssh client to d
