"""``horovod.runner.run`` / ``horovod.run``: run a Python function on every worker of a
job that ``horovodrun`` starts, and get back what each rank returned.

The caller starts a store of its own (the same C++ key/value server as the
rendezvous store) on the address the workers reach this machine at, and puts the
pickled ``(func, args, kwargs)`` there. The launcher, run in this process, starts
``python -m horovod_torch.runner.run_task`` on every slot; each worker reads the
function, calls it and stores its return value under its rank, or its exception and
traceback (and exits 1, which stops the job). ``run`` then returns the values in
rank order, or raises the first worker error with the worker's traceback.

Functions are pickled with cloudpickle when it is installed (closures, lambdas and
functions of ``__main__`` travel by value), else with pickle (by reference: the
function's module must be importable by the workers). Nothing here loads torch until
``run`` starts the store.
"""
from __future__ import annotations

import itertools
import os
import pickle
import secrets
import sys
import warnings
from typing import Any, Callable, List, Optional, Sequence

from horovod_torch.common import config
from horovod_torch.runner import launch

KEY_FUNC = "run_func/func"
KEY_RESULT = "run_func/result/{rank}"
KEY_ERROR = "run_func/error/{seq}"
KEY_ERRORS = "run_func/errors"
ENV_ADDR = "HOROVOD_RUN_FUNC_ADDR"
ENV_PORT = "HOROVOD_RUN_FUNC_PORT"
ENV_SECRET = "HOROVOD_RUN_FUNC_SECRET"


def dumps(obj: Any) -> bytes:
    """cloudpickle if available (by value where needed), else pickle."""
    try:
        import cloudpickle  # pylint: disable=import-outside-toplevel
    except ImportError:
        return pickle.dumps(obj)
    return cloudpickle.dumps(obj)


class RemoteTraceback(Exception):
    """The traceback of an exception raised in a worker (the cause of the error that
    run() raises)."""

    def __init__(self, rank: int, text: str) -> None:
        super().__init__(rank, text)
        self.rank = rank
        self.text = text

    def __str__(self) -> str:
        return f"the function raised in rank {self.rank}:\n\n{self.text.rstrip()}"


def run(func: Callable[..., Any],
        args: Sequence[Any] = (),
        kwargs: Optional[dict] = None,
        num_proc: Optional[int] = 1,
        min_num_proc: Optional[int] = None,
        max_num_proc: Optional[int] = None,
        slots: Optional[int] = None,
        reset_limit: Optional[int] = None,
        cooldown_range: Optional[Sequence[float]] = None,
        hosts: Optional[str] = None,
        hostfile: Optional[str] = None,
        host_discovery_script: Optional[str] = None,
        start_timeout: Optional[int] = None,
        ssh_port: Optional[int] = None,
        ssh_identity_file: Optional[str] = None,
        disable_cache: Optional[bool] = None,
        output_filename: Optional[str] = None,
        verbose: Optional[bool] = None,
        use_gloo: Optional[bool] = None,
        use_mpi: Optional[bool] = None,
        mpi_args: Optional[str] = None,
        network_interface: Optional[str] = None,
        network_interfaces: Optional[Sequence[str]] = None,
        executable: Optional[str] = None,
        np: Optional[int] = None,  # pylint: disable=invalid-name
        min_np: Optional[int] = None,
        max_np: Optional[int] = None) -> List[Any]:
    """Run ``func(*args, **kwargs)`` on every worker of a horovod_torch job and return
    the list of the values it returned, indexed by rank (Horovod's ``horovod.run``).

    The job is what ``horovodrun`` would start with the corresponding options:
    ``num_proc`` workers on ``hosts`` (``"host1:2,host2:2"``) or ``hostfile``, else
    on this machine; elastic with ``min_num_proc``/``max_num_proc`` or
    ``host_discovery_script`` (then the values of the ranks 0.. that returned);
    over MPI with ``use_mpi``. ``np``, ``min_np``, ``max_np`` and
    ``network_interface`` are Horovod's older names. ``executable`` is the Python
    the workers run (default: this one).

    A worker's rank is ``hvd.rank()`` when the function leaves horovod initialised,
    else the rank the worker was started as. If the function raises in a worker, the
    job is stopped and ``run`` raises that exception (the worker's traceback is its
    cause); if a worker fails otherwise, ``RuntimeError``. Invalid options raise
    ``ValueError``.
    """
    if network_interface:
        warnings.warn("network_interface is deprecated, use network_interfaces instead",
                      DeprecationWarning, stacklevel=2)
        network_interfaces = network_interface.split(",")
    if np is not None:
        warnings.warn("np is deprecated, use num_proc instead", DeprecationWarning,
                      stacklevel=2)
        num_proc = np
    if min_np is not None:
        warnings.warn("min_np is deprecated, use min_num_proc instead", DeprecationWarning,
                      stacklevel=2)
        min_num_proc = min_np
    if max_np is not None:
        warnings.warn("max_np is deprecated, use max_num_proc instead", DeprecationWarning,
                      stacklevel=2)
        max_num_proc = max_np
    if hosts is not None and hostfile is not None:
        raise ValueError("Argument hosts and hostfile only allow one provided.")
    if use_gloo and use_mpi:
        raise ValueError("Argument use_gloo and use_mpi only allow one set True.")

    argv: List[str] = []
    if num_proc is not None:
        argv += ["-np", str(num_proc)]
    for option, value in (("--min-np", min_num_proc), ("--max-np", max_num_proc),
                          ("--slots-per-host", slots), ("--reset-limit", reset_limit),
                          ("-H", hosts), ("--hostfile", hostfile),
                          ("--host-discovery-script", host_discovery_script),
                          ("--start-timeout", start_timeout), ("--ssh-port", ssh_port),
                          ("--ssh-identity-file", ssh_identity_file),
                          ("--output-filename", output_filename), ("--mpi-args", mpi_args)):
        if value is not None:
            argv.append(f"{option}={value}")
    if cooldown_range is not None:
        lo, hi = cooldown_range
        argv += ["--blacklist-cooldown-range", str(lo), str(hi)]
    if network_interfaces:
        argv.append("--network-interfaces=" + ",".join(network_interfaces))
    for option, flag in (("--disable-cache", disable_cache), ("--verbose", verbose),
                         ("--gloo", use_gloo), ("--mpi", use_mpi)):
        if flag:
            argv.append(option)
    argv += ["--", executable or sys.executable, "-m", "horovod_torch.runner.run_task"]
    job = launch.parse_args(argv, raise_errors=True)

    addr = launch.store_address(job) if launch.is_elastic(job) else job.store_addr
    if addr is None:
        raise RuntimeError("horovod.runner.run: cannot tell which address the workers "
                           "reach this machine at (see the message above)")
    payload = dumps((func, tuple(args), dict(kwargs or {})))
    from horovod_torch import _C  # pylint: disable=import-outside-toplevel
    secret = secrets.token_hex(16)
    server = _C.StoreServer(addr, 0, secret, max_frame=1 << 32)  # the values: up to 4 GiB
    try:
        server.set(KEY_FUNC, payload)
        job.extra_env = {ENV_ADDR: addr, ENV_PORT: str(server.port()), ENV_SECRET: secret}
        code = launch.run(job)
        return _results(server, job, code)
    finally:
        server.stop()


def _results(server: Any, job: Any, code: int) -> List[Any]:
    """The workers' values in rank order, or the first worker error raised here. An
    elastic job that finished despite a failed worker (it went on without it)
    returns its values, like Horovod's."""
    reported = errors(server)
    first_error = pick_error(reported) if reported else None
    elastic = launch.is_elastic(job)
    if first_error is not None and (code != 0 or not elastic):
        _raise_worker_error(first_error)
    if code != 0:
        raise RuntimeError(
            "Horovod detected that one or more processes exited with non-zero status, "
            f"thus causing the job to be terminated (horovodrun exit code {code}; the "
            "workers' output above says more).")
    results = []
    if not elastic:
        ranks = range(job.num_proc)
    else:  # without --max-np the job may have grown to any size
        ranks = range(job.max_np) if job.max_np else itertools.count()
    for rank in ranks:
        raw = server.get(KEY_RESULT.format(rank=rank))
        if raw is None:
            if elastic and rank >= job.min_np:
                break
            if first_error is not None:
                _raise_worker_error(first_error)
            raise RuntimeError(f"horovod.runner.run: rank {rank} ended without returning "
                               "a value (did the function exit the process?)")
        results.append(pickle.loads(raw))
    return results


def errors(server: Any) -> List[dict]:
    """The ranks' errors (the function raised, or the process crashed), in the order
    they were reported. A rank takes its number before it writes its error, so the
    first number may still be empty when a later one is written and the job stopped."""
    raw = server.get(KEY_ERRORS)
    found = []
    for seq in range(1, int(raw.decode()) + 1 if raw else 1):
        entry = server.get(KEY_ERROR.format(seq=seq))
        if entry:
            found.append(pickle.loads(entry))
    return found


def is_internal(error: dict) -> bool:
    """The error is a lost connection (a peer's failure), not the rank's own."""
    return error.get("summary", "").startswith("HorovodInternalError")


def pick_error(reported: List[dict]) -> dict:
    """The root cause: when one rank fails, its peers fail soon after with
    HorovodInternalError (a lost connection), sometimes before the failed rank's
    own report arrives. The first error of another kind wins; else the first."""
    for error in reported:
        if not is_internal(error):
            return error
    return reported[0]


def _raise_worker_error(error: dict, api: str = "horovod.runner.run") -> None:
    """Raises a rank's exception, with the rank's traceback as its cause (also used
    by horovod_torch.spark.run, `api` naming the caller in the note)."""
    cause = RemoteTraceback(error["rank"], error["traceback"])
    exc: Optional[BaseException] = None
    if error.get("exception") is not None:
        try:
            exc = pickle.loads(error["exception"])
        except Exception:  # pylint: disable=broad-except
            exc = None
    if not isinstance(exc, BaseException):
        exc = RuntimeError(f"rank {error['rank']}: {error['summary']}")
    if hasattr(exc, "add_note"):
        exc.add_note(f"(raised in rank {error['rank']} of {api}; the "
                     "worker's traceback is above)")
    raise exc from cause


def _worker_store() -> Any:
    from horovod_torch import _C  # pylint: disable=import-outside-toplevel
    return _C.StoreClient(os.environ[ENV_ADDR], int(os.environ[ENV_PORT]),
                          os.environ.get(ENV_SECRET, ""), config.start_timeout_s())
