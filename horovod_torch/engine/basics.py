"""init / shutdown / topology queries, and the bridge to the C++ core's status codes."""
import atexit
import os
import threading
from typing import List, NamedTuple, Optional, Tuple

from horovod_torch import _C
from horovod_torch.common import elastic_worker, launch_env
from horovod_torch.engine import rendezvous
from horovod_torch.common.exceptions import HorovodInternalError

# Reduction ops (Horovod's numbering), from the C++ core's table (csrc/common/types.h).
Average = _C.REDUCE_OPS["Average"]
Sum = _C.REDUCE_OPS["Sum"]
Adasum = _C.REDUCE_OPS["Adasum"]
Min = _C.REDUCE_OPS["Min"]
Max = _C.REDUCE_OPS["Max"]
Product = _C.REDUCE_OPS["Product"]

_OK, _INVALID, _MISMATCH, _ABORTED = (_C.STATUS_OK, _C.STATUS_INVALID_ARGUMENT,
                                      _C.STATUS_MISMATCH, _C.STATUS_ABORTED)

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
        if use_mpi:
            ranks, handle = _mpi_comm_arg(comm)
            code, message = _C.init_mpi(ranks, handle)
        elif env.elastic:
            world, prefix = elastic_worker.next_assignment(env)
        else:
            world = rendezvous.detect_world(env)
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
        from horovod_torch.collectives import process_sets as sets
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
        from horovod_torch.collectives import process_sets, submit
        submit.reset_auto_names()
        process_sets._reset_process_sets()


def init_world(world: dict, prefix: str) -> bool:
    """init() for a world that the caller found (the torch.distributed backend's
    bootstrap, horovod_torch/integrations/torch_distributed.py): the keys of
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
