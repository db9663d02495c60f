"""Where this process is in the job, and how it reaches the rendezvous store when no
horovodrun gave one (docs/launchers.md): the launcher's placement (launch_env), rank 0's
store next to torch's (MASTER_PORT + 1, on MASTER_ADDR's address only), and the job
secret, which never comes from public values (passed through torchrun's store, or a
file private to this user on one host; several hosts need HOROVOD_SECRET)."""
import atexit
import hashlib
import ipaddress
import os
import secrets
import socket
import stat
import tempfile
import time
from typing import Optional, Tuple

from horovod_torch import _C
from horovod_torch.common import config, launch_env

_store_server = None  # a store this process hosts (rank 0 under a foreign launcher)
_torchrun_store = None  # (port, secret) of the store under torchrun, once known
_derived_secret: Optional[str] = None  # the job secret when no launcher gave one (cached)
_SECRET_KEY = "horovod_torch/job_secret"  # in torchrun's store, + restart count and port


def detect_world(env: launch_env.LaunchEnv) -> dict:
    """The world and its rendezvous store (docs/launchers.md)."""
    global _store_server
    if env.placement is None:
        return dict(rank=0, size=1, local_rank=0, local_size=1, cross_rank=0, cross_size=1,
                    store_host="", store_port=0, secret="")
    launcher, world = env.placement.launcher, env.placement.world()
    if not 0 <= world["rank"] < world["size"]:
        raise ValueError(f"rank {world['rank']} is out of range for size {world['size']} "
                         f"(from {launcher})")
    host, port, secret = env.store_host, env.store_port, env.secret
    if launcher != "horovodrun" and world["size"] > 1 and not host:
        # No horovodrun: rank 0 hosts the store next to torch's (MASTER_PORT + 1).
        master, master_port = env.master_addr, env.master_port
        if not master or master_port is None:
            raise ValueError(f"started by {launcher} without a rendezvous address: set "
                             "MASTER_ADDR and MASTER_PORT (rank 0's host and a free port), "
                             "or HOROVOD_STORE_ADDR and HOROVOD_STORE_PORT, or use horovodrun")
        host, port = master, master_port + 1
        if not secret and launcher == "torchrun" and env.torchrun_agent_store:
            port, secret = _store_through_torchrun(world, master, master_port,
                                                   env.torchrun_restart_count)
        else:
            secret = secret or _job_secret(env, world, master, master_port)
            if world["rank"] == 0 and _store_server is None:
                _store_server = _start_store(master, port, secret, world)
    if world["size"] > 1 and not host:
        raise ValueError("HOROVOD_SIZE > 1 but HOROVOD_STORE_ADDR is not set; "
                         "start the job with horovodrun")
    world.update(store_host=host, store_port=port or 0, secret=secret)
    return world


def _start_timeout() -> float:
    return config.start_timeout_s(lenient=True)


def _multi_host(world: dict) -> bool:
    return world["local_size"] < world["size"]


def store_address(master: str, multi_host: bool) -> str:
    """The address rank 0's store listens on: MASTER_ADDR's (`master`, a name or an IPv4
    or IPv6 address) as resolved on rank 0's host, IPv4 first as the store resolves it,
    and never loopback when ranks run on other hosts."""
    name = master[1:-1] if master.startswith("[") and master.endswith("]") else master
    try:
        infos = socket.getaddrinfo(name, None, socket.AF_UNSPEC, socket.SOCK_STREAM)
    except OSError as exc:
        raise ValueError(f"MASTER_ADDR={master!r} does not resolve on rank 0's host: "
                         f"{exc}") from None
    addrs = sorted((i for i in infos if i[0] in (socket.AF_INET, socket.AF_INET6)),
                   key=lambda i: i[0] != socket.AF_INET)
    if not addrs:
        raise ValueError(f"MASTER_ADDR={master!r} has no IPv4 or IPv6 address on rank 0's host")
    bind = addrs[0][4][0]
    if ipaddress.ip_address(bind.split("%")[0]).is_loopback and multi_host:
        raise ValueError(
            f"MASTER_ADDR={master!r} resolves to {bind} on rank 0's host, a loopback address "
            "the other hosts cannot reach; set MASTER_ADDR to rank 0's address on the network "
            "the job uses (torchrun: --master-addr, or --local-addr with a c10d rendezvous)")
    return bind


def _start_store(master: str, port: int, secret: str, world: dict):
    """Rank 0's store, listening on MASTER_ADDR's address only (never 0.0.0.0)."""
    bind = store_address(master, _multi_host(world))
    try:
        return _C.StoreServer(bind, port, secret)
    except RuntimeError as exc:
        raise RuntimeError(
            f"rank 0 cannot start the rendezvous store on {bind}:{port} (MASTER_ADDR={master}, "
            f"MASTER_PORT + 1): {exc}; rank 0 must run on the host MASTER_ADDR names and "
            "that port must be free (or point HOROVOD_STORE_ADDR/HOROVOD_STORE_PORT at a "
            "store already running)") from exc


def _job_secret(env: launch_env.LaunchEnv, world: dict, master: str, master_port: int) -> str:
    """The store's secret when neither horovodrun nor HOROVOD_SECRET gave one, outside
    torchrun (_store_through_torchrun). It never comes from public values
    (docs/launchers.md): on one host it passes through a file only this user can read;
    several hosts need HOROVOD_SECRET."""
    global _derived_secret
    if _derived_secret is None:
        _derived_secret = _secret_through_file(env, world, master, master_port + 1)
    return _derived_secret


def _store_through_torchrun(world: dict, master: str, master_port: int,
                            restart: str) -> Tuple[int, str]:
    """The store's port and secret under torchrun, whose agent serves a TCPStore at
    MASTER_ADDR:MASTER_PORT to its workers (TORCHELASTIC_USE_AGENT_STORE=True;
    torch/distributed/rendezvous.py connects to it as a client the same way). Rank 0
    draws a fresh random secret, starts the store at MASTER_PORT + 1 (or, when another
    process holds that port, at a free one) and puts both there; the others read them."""
    global _store_server, _torchrun_store
    if _torchrun_store is not None:  # a later init in this process: the same store
        return _torchrun_store
    from datetime import timedelta  # pylint: disable=import-outside-toplevel
    import torch.distributed as dist  # pylint: disable=import-outside-toplevel
    timeout = _start_timeout()
    key = "/".join((_SECRET_KEY, restart, str(master_port + 1)))
    try:
        store = dist.TCPStore(master, master_port, is_master=False,
                              timeout=timedelta(seconds=timeout))
        if world["rank"] == 0:
            secret = secrets.token_hex(16)
            try:
                _store_server = _start_store(master, master_port + 1, secret, world)
            except RuntimeError as exc:
                if "in use" not in str(exc):
                    raise
                _store_server = _start_store(master, 0, secret, world)
            port = _store_server.port()
            store.set(key + "/port", str(port))
            store.set(key, secret)
        else:
            secret = store.get(key).decode()
            port = int(store.get(key + "/port").decode())
    except RuntimeError as exc:  # DistStoreError (a timeout) is one
        if world["rank"] == 0 and "rendezvous store" in str(exc):
            raise
        raise RuntimeError(
            f"cannot pass the job secret through torchrun's store at {master}:{master_port} "
            f"within {timeout:g} s (HOROVOD_START_TIMEOUT): {exc}. Does rank 0 reach "
            "hvd.init()? Setting HOROVOD_SECRET (the same random value on every rank) "
            "avoids this step") from exc
    _torchrun_store = (port, secret)
    return _torchrun_store


def _private_dir() -> str:
    """A directory only this user can use: <tmp>/horovod_torch-<uid>, mode 0700."""
    path = os.path.join(tempfile.gettempdir(), f"horovod_torch-{os.getuid()}")
    try:
        os.mkdir(path, 0o700)
    except FileExistsError:
        pass
    info = os.lstat(path)
    if not stat.S_ISDIR(info.st_mode) or info.st_uid != os.getuid() or info.st_mode & 0o077:
        raise RuntimeError(f"{path} is not a directory private to this user (owner uid "
                           f"{info.st_uid}, mode {oct(info.st_mode & 0o777)}); remove it, or "
                           "set HOROVOD_SECRET (the same random value on every rank)")
    return path


def _secret_through_file(env: launch_env.LaunchEnv, world: dict, master: str,
                         store_port: int) -> str:
    """mpirun, srun, or RANK/WORLD_SIZE without torchrun: no store of the launcher's to
    pass a secret through. On one host rank 0 writes a random secret into a file in
    a directory only this user can read and the others read it; across hosts the
    secret must be given (HOROVOD_SECRET)."""
    launcher = env.placement.launcher
    if _multi_host(world):
        raise ValueError(
            f"started by {launcher} on several hosts without a job secret: export "
            "HOROVOD_SECRET with the same random value on every rank, e.g. "
            "HOROVOD_SECRET=$(python3 -c 'import secrets; print(secrets.token_hex(16))') "
            "(mpirun: add -x HOROVOD_SECRET; srun passes the environment on), or start the "
            "job with horovodrun or torchrun (docs/launchers.md)")
    job = "|".join([launcher, master, str(store_port), *env.job_ids])
    path = os.path.join(_private_dir(), "secret-" + hashlib.sha256(job.encode()).hexdigest()[:32])
    if world["rank"] == 0:
        value = secrets.token_hex(16)
        tmp = f"{path}.{os.getpid()}"
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write(value)
        os.replace(tmp, path)
        atexit.register(_remove_quietly, path)
        return value
    # A file left by an earlier job with the same ids may be read before rank 0
    # replaces it: a value the store turns down is read again.
    timeout = _start_timeout()
    deadline = time.monotonic() + timeout
    while True:
        try:
            with open(path, encoding="ascii") as f:
                value = f.read().strip()
        except FileNotFoundError:
            value = ""
        if value:
            try:
                _C.StoreClient(master, store_port, value, max(1.0, deadline - time.monotonic()))
                return value
            except RuntimeError as exc:
                if "rejected our job secret" not in str(exc):
                    raise
        if time.monotonic() > deadline:
            raise RuntimeError(
                f"rank 0 did not leave this job's secret in {path} within {timeout:g} s "
                "(HOROVOD_START_TIMEOUT); if the ranks run on several hosts, set "
                "HOROVOD_SECRET (the same random value on every rank)")
        time.sleep(0.05)


def _remove_quietly(path: str) -> None:
    try:
        os.unlink(path)
    except OSError:
        pass
