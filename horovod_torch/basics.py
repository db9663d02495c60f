"""init / shutdown / topology queries, and the bridge to the C++ core's status codes."""
import atexit
import hashlib
import ipaddress
import os
import secrets
import socket
import stat
import tempfile
import threading
import time
from typing import List, NamedTuple, Optional, Tuple

from horovod_torch import _C, config, launch_env
from horovod_torch.exceptions import HorovodInternalError

# Reduction ops (Horovod's numbering).
Average = 0
Sum = 1
Adasum = 2
Min = 3
Max = 4
Product = 5

_OK, _INVALID, _MISMATCH, _ABORTED = 0, 1, 2, 3

_lock = threading.Lock()
_init_counts: dict = {}  # rendezvous prefix -> static inits this process started under it
_restart_barred: Optional[str] = None  # why init() may not start a new engine now
_dynamic_process_sets = False  # init(process_sets="dynamic") was called in this process
_atexit_registered = False


def raise_for_status(code: int, message: str) -> None:
    """Turns a C++ Status into the Python exception users expect."""
    if code == _OK:
        return
    if code == _INVALID:
        raise ValueError(message)
    if code == _MISMATCH:
        raise RuntimeError(message)
    raise HorovodInternalError(message)


_store_server = None  # a store this process hosts (rank 0 under a foreign launcher)
_derived_secret: Optional[str] = None  # the job secret when no launcher gave one (cached)
_SECRET_KEY = "horovod_torch/job_secret"  # in torchrun's store, + restart count and port


def _detect_world(env: launch_env.LaunchEnv) -> dict:
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
    """The store's secret when neither horovodrun nor HOROVOD_SECRET gave one. It never
    comes from public values (docs/launchers.md): under torchrun rank 0 draws it and
    passes it through torchrun's own store; otherwise, on one host, through a file only
    this user can read; several hosts need HOROVOD_SECRET."""
    global _derived_secret
    if _derived_secret is None:
        if env.placement.launcher == "torchrun" and env.torchrun_agent_store:
            _derived_secret = _secret_through_torchrun(world["rank"], master, master_port,
                                                       env.torchrun_restart_count)
        else:
            _derived_secret = _secret_through_file(env, world, master, master_port + 1)
    return _derived_secret


def _secret_through_torchrun(rank: int, master: str, master_port: int, restart: str) -> str:
    """torchrun's agent serves a TCPStore at MASTER_ADDR:MASTER_PORT to its workers
    (TORCHELASTIC_USE_AGENT_STORE=True; torch/distributed/rendezvous.py connects to it as
    a client the same way). Rank 0 puts a fresh random value there, the others read it."""
    from datetime import timedelta  # pylint: disable=import-outside-toplevel
    import torch.distributed as dist  # pylint: disable=import-outside-toplevel
    timeout = _start_timeout()
    key = "/".join((_SECRET_KEY, restart, str(master_port + 1)))
    try:
        store = dist.TCPStore(master, master_port, is_master=False,
                              timeout=timedelta(seconds=timeout))
        if rank == 0:
            value = secrets.token_hex(16)
            store.set(key, value)
            return value
        return store.get(key).decode()
    except RuntimeError as exc:  # DistStoreError (a timeout) is one
        raise RuntimeError(
            f"cannot pass the job secret through torchrun's store at {master}:{master_port} "
            f"within {timeout:g} s (HOROVOD_START_TIMEOUT): {exc}. Does rank 0 reach "
            "hvd.init()? Setting HOROVOD_SECRET (the same random value on every rank) "
            "avoids this step") from exc


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


def _use_mpi(env: launch_env.LaunchEnv, comm) -> bool:
    """The MPI controller runs when asked for (HOROVOD_CONTROLLER=mpi, init(comm=...)) or
    when mpirun started us and horovodrun did not; HOROVOD_CONTROLLER=gloo (or tcp)
    keeps the TCP transport under mpirun."""
    controller = env.controller
    if controller not in ("", "mpi", "gloo", "tcp"):
        raise ValueError(f"HOROVOD_CONTROLLER={controller!r} is not valid; use mpi or gloo")
    wanted = controller == "mpi" or comm is not None or (
        controller == "" and env.mpirun_size is not None
        and not env.under_horovodrun and _C.mpi_built())
    if wanted and not _C.mpi_built():
        raise ValueError("the MPI controller was requested (HOROVOD_CONTROLLER=mpi or "
                         "init(comm=...)), but this build of horovod_torch has no MPI; install "
                         "MPI (e.g. libopenmpi-dev) and rebuild, or use the TCP transport")
    return wanted


def _mpi_comm_arg(comm):
    """(ranks of MPI_COMM_WORLD, Fortran handle) for init(comm=...)."""
    if comm is None:
        return [], 0
    if hasattr(comm, "py2f"):  # an mpi4py communicator
        return [], int(comm.py2f())
    try:
        ranks = sorted(int(r) for r in comm)
    except TypeError:
        raise ValueError("init(comm=...) takes a list of MPI_COMM_WORLD ranks or an mpi4py "
                         f"communicator, got {type(comm).__name__}") from None
    if not ranks:
        raise ValueError("init(comm=[]): give at least one rank")
    return ranks, 0


def init(comm=None, process_sets=None) -> None:
    """Initialises horovod_torch: joins the job started by horovodrun.

    Without a launcher the process runs as a world of one. Calling init() again
    after shutdown() starts a fresh engine.
    """
    global _dynamic_process_sets
    env = launch_env.refresh()
    use_mpi = _use_mpi(env, comm)
    if process_sets == "dynamic":  # Horovod's spelling for HOROVOD_DYNAMIC_PROCESS_SETS=1
        _dynamic_process_sets = True  # for this process's later inits too (elastic resets)
        process_sets = None
    if process_sets is not None and not isinstance(process_sets, (list, tuple)):
        raise ValueError("process_sets must be a list of hvd.ProcessSet (or of rank lists), "
                         "or \"dynamic\"")
    with _lock:
        if _C.running():
            return  # a stopped engine (an error ended it) is replaced by a fresh one
        if _restart_barred is not None:
            raise HorovodInternalError(_restart_barred)
        from horovod_torch.elastic import worker as elastic_worker
        if use_mpi:
            ranks, handle = _mpi_comm_arg(comm)
            code, message = _C.init_mpi(ranks, handle)
        elif env.elastic:
            world, prefix = elastic_worker.next_assignment(env)
        else:
            world = _detect_world(env)
            base = env.rendezvous_prefix
            prefix = f"{base}/init{_init_counts.get(base, 0)}"
            _init_counts[base] = _init_counts.get(base, 0) + 1
        if not use_mpi:
            code, message = _start(world, prefix)
        _started(code)
    raise_for_status(code, message)
    if use_mpi and comm is None and env.mpirun_size is not None:
        expected, actual = env.mpirun_size, size()
        if actual != expected:
            shutdown()
            raise ValueError(f"MPI reports {actual} process(es) but OMPI_COMM_WORLD_SIZE="
                             f"{expected}: start the job with mpirun, or set "
                             "HOROVOD_CONTROLLER=gloo to use the TCP transport with these "
                             "variables (and MASTER_ADDR/MASTER_PORT)")
    if process_sets:
        from horovod_torch import process_sets as sets
        for ps in process_sets:  # every rank registers the same sets in the same order
            sets._register(ps, static=True)


def _start(world: dict, prefix: str) -> Tuple[int, str]:
    return _C.init(world["rank"], world["size"], world["local_rank"], world["local_size"],
                   world["cross_rank"], world["cross_size"], world["store_host"],
                   world["store_port"], world["secret"], prefix)


def _started(code: int) -> None:
    """What follows every _C.init (with _lock held)."""
    global _atexit_registered
    if not _atexit_registered:
        atexit.register(shutdown)
        _atexit_registered = True
    if code == _OK:
        # Unnamed ops are matched by submission order: every rank, including one
        # that joined an elastic job late, counts from zero after init().
        from horovod_torch import process_sets, submit
        submit.reset_auto_names()
        process_sets._reset_process_sets()


def init_world(world: dict, prefix: str) -> bool:
    """init() for a world that the caller found (the torch.distributed backend's
    bootstrap, horovod_torch/torch_distributed.py): the keys of
    launch_env.Placement.world() plus store_host, store_port and secret. False, doing
    nothing, when an engine is already running."""
    with _lock:
        if _C.running():
            return False
        code, message = _start(world, prefix)
        _started(code)
    raise_for_status(code, message)
    return True


def dynamic_process_sets() -> bool:
    """Whether hvd.add_process_set / remove_process_set may run after init():
    init(process_sets="dynamic") was called, or HOROVOD_DYNAMIC_PROCESS_SETS is set."""
    return _dynamic_process_sets or launch_env.dynamic_process_sets()


def shutdown() -> None:
    """Stops the engine; pending ops fail. Safe to call more than once."""
    global _restart_barred
    _restart_barred = None  # the caller's own shutdown: its next init() starts afresh
    _C.shutdown()


def _bar_restart(reason: Optional[str]) -> None:
    """For a host that runs calls on a long-lived engine (the Ray worker): while
    ``reason`` is set, init() on a stopped engine raises HorovodInternalError(reason)
    instead of starting a rendezvous that the job's other workers will not join.
    shutdown() lifts the bar; so does ``_bar_restart(None)``."""
    global _restart_barred
    _restart_barred = reason


def start_timeline(file_path: str, mark_cycles: bool = False) -> None:
    """Starts writing a Chrome-trace timeline to ``file_path`` (on the coordinator,
    rank 0; other ranks accept the call and write nothing). A running timeline is
    closed first. Open the file in chrome://tracing or https://ui.perfetto.dev, or
    render it with ``examples/plot_timeline.py``."""
    _world()
    raise_for_status(*_C.start_timeline(os.fspath(file_path), bool(mark_cycles)))


def stop_timeline() -> None:
    """Stops the timeline and closes its JSON array; the file is complete on return."""
    _world()
    raise_for_status(*_C.stop_timeline())


class RankLag(NamedTuple):
    """One rank's line of a :class:`StragglerReport`: how far behind the first rank its
    requests reached the coordinator, over the window's cycles."""
    rank: int
    host: str
    median_s: float  # median lateness over the report's samples, seconds
    p95_s: float  # 95th percentile
    last_share: float  # share of the samples in which this rank was the last


class StragglerReport(NamedTuple):
    """What :func:`straggler_report` returns (docs/observability.md)."""
    cycles: int  # negotiation cycles that completed ops, in the window (0: none yet)
    samples: int  # of them, those in which some rank was HOROVOD_STRAGGLER_MIN_LAG_MS behind
    step_s: float  # median interval between repeats of one op: the step time
    threshold_s: float  # median lateness from which a rank that is mostly last is named
    straggler: Optional[int]  # the rank named a straggler, or None
    wait_site: str  # where the other ranks wait for it (Python file:line), if known
    ranks: List[RankLag]

    def __str__(self) -> str:
        head = (f"straggler report: {self.samples} of the last {self.cycles} cycles with a "
                f"rank behind, step {self.step_s * 1e3:.1f} ms, "
                f"threshold {self.threshold_s * 1e3:.1f} ms, straggler: "
                f"{'none' if self.straggler is None else 'rank %d' % self.straggler}"
                + (f" (the others wait at {self.wait_site})" if self.wait_site else ""))
        rows = [f"  rank {r.rank:>4}  {r.host or '?':<20} median {r.median_s * 1e3:8.2f} ms  "
                f"p95 {r.p95_s * 1e3:8.2f} ms  last {r.last_share * 100:5.1f}%"
                for r in self.ranks]
        return "\n".join([head] + rows)


def straggler_report() -> StragglerReport:
    """Which rank holds the others up, and by how much: the coordinator measures, every
    negotiation cycle, how late each rank's requests arrive (HOROVOD_STRAGGLER_* knobs),
    and sends every rank its report about once a second; this returns the last one this
    rank received. Not a collective: any rank may call it at any time."""
    _world()
    r = _C.straggler_report()
    if r is None:
        raise ValueError("Horovod has not been initialized; use hvd.init().")
    cycles, samples, step_s, threshold_s, straggler, site, ranks = r
    return StragglerReport(cycles, samples, step_s, threshold_s,
                           None if straggler < 0 else straggler, site,
                           [RankLag(i, *row) for i, row in enumerate(ranks)])


def is_initialized() -> bool:
    return _C.world() is not None


def _world() -> Tuple[int, ...]:
    w = _C.world()
    if w is None:
        raise ValueError("Horovod has not been initialized; use hvd.init().")
    return w


def rank() -> int:
    """This process's rank in [0, size())."""
    return _world()[0]


def size() -> int:
    """Number of processes in the job."""
    return _world()[1]


def local_rank() -> int:
    """Rank among the processes on this host (use it to pick a GPU)."""
    return _world()[2]


def local_size() -> int:
    return _world()[3]


def cross_rank() -> int:
    """Index of this host among the hosts that have a process with our local_rank."""
    return _world()[4]


def cross_size() -> int:
    return _world()[5]


def is_homogeneous() -> bool:
    return size() % local_size() == 0


def nccl_built() -> int:
    """NCCL version code the core was built with, or 0."""
    return _C.nccl_built()


def cuda_built() -> bool:
    return _C.cuda_built()


def rocm_built() -> bool:
    return False


def mpi_built() -> bool:
    return _C.mpi_built()


def mpi_enabled() -> bool:
    """True when this job's engine runs over MPI (HOROVOD_CONTROLLER=mpi or mpirun)."""
    return _C.mpi_enabled()


def mpi_threads_supported() -> bool:
    """True when MPI runs with MPI_THREAD_MULTIPLE, so the script may use MPI (mpi4py)
    alongside horovod_torch. Raises ValueError, as Horovod does, when the engine does
    not run over MPI (or before init())."""
    _world()
    if not mpi_enabled():
        raise ValueError("Horovod MPI is not enabled; Please make sure it's installed and "
                         "enabled (start the job with horovodrun --mpi or mpirun, or set "
                         "HOROVOD_CONTROLLER=mpi).")
    return _C.mpi_threads_supported()


def gloo_built() -> bool:
    """Our TCP transport answers for Gloo: it is always built."""
    return True


def gloo_enabled() -> bool:
    return is_initialized() and not _C.mpi_enabled()


def ddl_built() -> bool:
    return False


def ccl_built() -> bool:
    return False
