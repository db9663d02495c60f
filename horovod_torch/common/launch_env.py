"""What the launcher told this process, read from the environment in one place.

The launchers (horovodrun, static or elastic; OpenMPI's mpirun; torchrun; SLURM's
srun; a Ray or Spark worker, which sets horovodrun's variables) speak to a worker
through environment variables. :func:`read` turns them into one :class:`LaunchEnv`;
``hvd.init()`` reads it once per init (:func:`refresh`) and what runs after it asks
:func:`current`, so no other module reads these variables or writes them to talk to
another. Engine knobs (``HOROVOD_FUSION_THRESHOLD``, ...) are not here: the C++ core
reads those (csrc/common/config.h), and ``horovod_torch.config`` names them for Python.

Torch-free and ``_C``-free: the elastic worker and the runner may import it.
"""
import os
from dataclasses import dataclass
from typing import Mapping, Optional, Tuple

# Variables that tell one job's ranks from another's on a host (the job-secret file).
JOB_ID_VARS = ("SLURM_JOB_ID", "SLURM_STEP_ID", "OMPI_MCA_orte_ess_jobid",
               "OMPI_MCA_ess_base_jobid", "PMIX_NAMESPACE")


@dataclass(frozen=True)
class Placement:
    """This rank's place in the world, as the launcher gave it."""
    launcher: str  # "horovodrun", "mpirun", "torchrun" or "srun"
    rank: int
    size: int
    local_rank: int
    local_size: int
    cross_rank: int
    cross_size: int

    def world(self) -> dict:
        return dict(rank=self.rank, size=self.size, local_rank=self.local_rank,
                    local_size=self.local_size, cross_rank=self.cross_rank,
                    cross_size=self.cross_size)


@dataclass(frozen=True)
class LaunchEnv:
    placement: Optional[Placement]  # None: no launcher (a world of one)
    store_host: str  # HOROVOD_STORE_ADDR ("" unset)
    store_port: int  # HOROVOD_STORE_PORT (0 unset)
    secret: str  # HOROVOD_SECRET
    hostname: str  # HOROVOD_HOSTNAME: the launcher's name for this host ("" unset)
    master_addr: str  # MASTER_ADDR (torchrun and friends; "" unset)
    master_port: Optional[int]  # MASTER_PORT
    controller: str  # HOROVOD_CONTROLLER, lower-cased ("" unset)
    mpirun_size: Optional[int]  # OMPI_COMM_WORLD_SIZE: mpirun started this process
    under_horovodrun: bool  # HOROVOD_RANK is set
    elastic: bool  # HOROVOD_ELASTIC=1: the elastic driver started this worker
    elastic_worker_id: str  # HOROVOD_ELASTIC_WORKER_ID
    elastic_timeout_s: float  # HOROVOD_ELASTIC_TIMEOUT (600)
    # HOROVOD_STRAGGLER_EVICT_AFTER: under --straggler-policy evict, seconds a rank must be
    # named a straggler before rank 0 asks the driver to evict its host (None: never).
    straggler_evict_after_s: Optional[float]
    rendezvous_prefix: str  # HOROVOD_RENDEZVOUS_PREFIX ("job")
    torchrun_agent_store: bool  # TORCHELASTIC_USE_AGENT_STORE=True
    torchrun_restart_count: str  # TORCHELASTIC_RESTART_COUNT ("0")
    job_ids: Tuple[str, ...]  # JOB_ID_VARS' values

    @property
    def has_store(self) -> bool:
        return bool(self.store_host) and self.store_port > 0


def _int(env: Mapping[str, str], *names: str, default: Optional[int] = None) -> Optional[int]:
    for n in names:
        v = env.get(n)
        if v not in (None, ""):
            try:
                return int(v)
            except ValueError:
                raise ValueError(f"environment variable {n}={v!r} is not an integer") from None
    return default


def _set(env: Mapping[str, str], name: str) -> bool:
    return env.get(name) not in (None, "")


def _placement(env: Mapping[str, str]) -> Optional[Placement]:
    """Rank and size from whichever launcher started us, in this order of precedence:
    horovodrun (HOROVOD_RANK), OpenMPI's mpirun (OMPI_COMM_WORLD_RANK), torchrun
    (RANK + WORLD_SIZE), SLURM's srun (SLURM_PROCID). None: no launcher."""
    if _set(env, "HOROVOD_RANK"):
        rank, size = _int(env, "HOROVOD_RANK"), _int(env, "HOROVOD_SIZE")
        if size is None:
            raise ValueError("HOROVOD_RANK is set but HOROVOD_SIZE is not")
        return Placement("horovodrun", rank, size,
                         _int(env, "HOROVOD_LOCAL_RANK", default=rank),
                         _int(env, "HOROVOD_LOCAL_SIZE", default=size),
                         _int(env, "HOROVOD_CROSS_RANK", default=0),
                         _int(env, "HOROVOD_CROSS_SIZE", default=1))
    if _set(env, "OMPI_COMM_WORLD_RANK"):
        rank, size = _int(env, "OMPI_COMM_WORLD_RANK"), _int(env, "OMPI_COMM_WORLD_SIZE")
        lsize = _int(env, "OMPI_COMM_WORLD_LOCAL_SIZE", default=size)
        return Placement("mpirun", rank, size,
                         _int(env, "OMPI_COMM_WORLD_LOCAL_RANK", default=rank), lsize,
                         rank // max(1, lsize), max(1, size // max(1, lsize)))
    if _set(env, "RANK") and env.get("WORLD_SIZE"):
        rank, size = _int(env, "RANK"), _int(env, "WORLD_SIZE")
        lsize = _int(env, "LOCAL_WORLD_SIZE", default=size)
        return Placement("torchrun", rank, size, _int(env, "LOCAL_RANK", default=rank), lsize,
                         _int(env, "GROUP_RANK", default=rank // max(1, lsize)),
                         max(1, size // max(1, lsize)))
    if _set(env, "SLURM_PROCID"):
        rank, size = _int(env, "SLURM_PROCID"), _int(env, "SLURM_NTASKS", default=1)
        nodes = _int(env, "SLURM_NNODES", "SLURM_JOB_NUM_NODES", default=1)
        lsize = max(1, size // max(1, nodes))
        return Placement("srun", rank, size, _int(env, "SLURM_LOCALID", default=rank % lsize),
                         lsize, _int(env, "SLURM_NODEID", default=rank // lsize), nodes)
    return None


def _float(env: Mapping[str, str], name: str) -> Optional[float]:
    value = env.get(name)
    if not value:
        return None
    try:
        return float(value)
    except ValueError:
        raise ValueError(f"environment variable {name}={value!r} is not a number") from None


def read(environ: Optional[Mapping[str, str]] = None) -> LaunchEnv:
    """The launch environment of `environ` (default: this process's). A malformed
    number raises ValueError naming the variable."""
    env = os.environ if environ is None else environ
    try:
        elastic_timeout = float(env.get("HOROVOD_ELASTIC_TIMEOUT") or 600)
    except ValueError:
        raise ValueError("environment variable HOROVOD_ELASTIC_TIMEOUT="
                         f"{env.get('HOROVOD_ELASTIC_TIMEOUT')!r} is not a number") from None
    return LaunchEnv(
        placement=_placement(env),
        store_host=env.get("HOROVOD_STORE_ADDR", ""),
        store_port=_int(env, "HOROVOD_STORE_PORT", default=0),
        secret=env.get("HOROVOD_SECRET", ""),
        hostname=env.get("HOROVOD_HOSTNAME", ""),
        master_addr=env.get("MASTER_ADDR", ""),
        master_port=_int(env, "MASTER_PORT"),
        controller=env.get("HOROVOD_CONTROLLER", "").lower(),
        mpirun_size=_int(env, "OMPI_COMM_WORLD_SIZE") if "OMPI_COMM_WORLD_SIZE" in env else None,
        under_horovodrun="HOROVOD_RANK" in env,
        elastic=env.get("HOROVOD_ELASTIC") == "1",
        elastic_worker_id=env.get("HOROVOD_ELASTIC_WORKER_ID", ""),
        elastic_timeout_s=elastic_timeout,
        straggler_evict_after_s=_float(env, "HOROVOD_STRAGGLER_EVICT_AFTER"),
        rendezvous_prefix=env.get("HOROVOD_RENDEZVOUS_PREFIX", "job"),
        torchrun_agent_store=env.get("TORCHELASTIC_USE_AGENT_STORE") == "True",
        torchrun_restart_count=env.get("TORCHELASTIC_RESTART_COUNT", "0"),
        job_ids=tuple(env.get(k, "") for k in JOB_ID_VARS),
    )


def dynamic_process_sets(environ: Optional[Mapping[str, str]] = None) -> bool:
    """HOROVOD_DYNAMIC_PROCESS_SETS. Read when a process set is added or removed, not
    at init: a script may set it after hvd.init() (tests/compat check this)."""
    env = os.environ if environ is None else environ
    return env.get("HOROVOD_DYNAMIC_PROCESS_SETS", "0") not in ("", "0", "false", "False")


_current: Optional[LaunchEnv] = None


def refresh() -> LaunchEnv:
    """Reads the environment again (hvd.init() does, once per init: a Ray or Spark
    worker sets the variables of each job before its init) and returns it."""
    global _current
    _current = read()
    return _current


def current() -> LaunchEnv:
    """The launch environment of the last init (read now if there was none yet)."""
    return _current if _current is not None else refresh()
