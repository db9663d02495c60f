"""``horovod_torch.spark.run``: the driver side.

The driver starts two stores on the address the executors reach it at: the
rendezvous store ``hvd.init()`` joins (as ``horovodrun`` runs it, with a fresh random
secret) and a job store with its own secret that carries the pickled
``(fn, args, kwargs)``, the ranks' output, their return values or errors. It then
runs one barrier stage of ``num_proc`` tasks (:mod:`horovod_torch.spark.task`) in a
background thread, and meanwhile prints the ranks' output, watches for the first
error, and enforces ``start_timeout``. The store addresses and secrets reach the tasks
inside the pickled task closure (as Horovod's key does): enable Spark's RPC encryption
(``spark.network.crypto.enabled``) where the network between driver and executors is
not trusted.
"""
from __future__ import annotations

import ipaddress
import logging
import os
import pickle
import secrets
import sys
import threading
import time
from typing import Any, Callable, Dict, List, Optional, Sequence, TextIO

from horovod_torch.common import config, extras
from horovod_torch.runner import func as run_func
from horovod_torch.runner import network
from horovod_torch.integrations.spark import task as spark_task

POLL_S = 0.05
CANCEL_JOIN_S = 60.0
_job_counter = 0
_job_lock = threading.Lock()

logger = logging.getLogger("horovod_torch.spark")


def _next_job_id() -> int:
    global _job_counter
    with _job_lock:
        _job_counter += 1
        return _job_counter


def _spark_context():
    pyspark = extras.require("pyspark", "horovod_torch.spark")
    sc = pyspark.SparkContext._active_spark_context  # pylint: disable=protected-access
    if sc is None:
        raise RuntimeError("Could not find an active SparkContext, are you running in a "
                           "PySpark session? (create one first, e.g. "
                           "SparkSession.builder.master('local[2]').getOrCreate())")
    return sc


def _store_address(sc, nics: Optional[Sequence[str]]) -> str:
    """The address (IPv4, else IPv6) of this machine the executors reach the driver at."""
    if nics:
        names = network.parse_nics(",".join(nics))
        for name in names:
            addr = network.interface_address(name)
            if addr:
                return addr
        raise ValueError(f"none of the network interfaces {', '.join(names)} has an IPv4 "
                         "or global IPv6 address")
    master = sc.master or ""
    if master.startswith("local"):
        return network.LOOPBACK
    host = sc.getConf().get("spark.driver.host")
    if not host:
        raise ValueError("spark.driver.host is not set; pass nics=[...] to choose the "
                         "driver's network interface")
    addr = network.resolve(host)
    if ipaddress.ip_address(addr.split("%")[0]).is_loopback:
        raise ValueError(f"spark.driver.host={host!r} resolves to {addr}, a loopback address "
                         f"the executors of master {master!r} cannot reach; set "
                         "spark.driver.host to this machine's address, or pass nics=[...]")
    return addr


def _dumps_fn(payload: Any) -> bytes:
    """pyspark's cloudpickle (always there where pyspark is): functions of __main__,
    lambdas and closures travel by value."""
    try:
        from pyspark import cloudpickle  # pylint: disable=import-outside-toplevel
        return cloudpickle.dumps(payload)
    except ImportError:  # pragma: no cover - pyspark without its cloudpickle
        return run_func.dumps(payload)


class _Output:
    """Writes the ranks' output lines, prefixed ``[rank]<stdout>:`` like horovodrun,
    to the driver's streams; reads them from the job store in order."""

    def __init__(self, server, num_proc: int, stdout: Optional[TextIO],
                 stderr: Optional[TextIO], timestamp: bool) -> None:
        self._server = server
        self._next = [0] * num_proc
        self._streams = {spark_task.STREAM_IDS["stdout"]: (stdout, "stdout"),
                         spark_task.STREAM_IDS["stderr"]: (stderr, "stderr")}
        self._timestamp = timestamp

    def pump(self) -> None:
        for rank, seq in enumerate(self._next):
            while True:
                key = spark_task.KEY_OUT.format(rank=rank, seq=seq)
                raw = self._server.get(key)
                if not raw:
                    break
                self._server.set(key, b"")  # frees the value; the key stays (small)
                self._write(rank, raw[:1], raw[1:])
                seq += 1
            self._next[rank] = seq

    def _write(self, rank: int, stream_id: bytes, data: bytes) -> None:
        stream, kind = self._streams.get(stream_id, (None, "stdout"))
        if stream is None:
            stream = sys.stdout if kind == "stdout" else sys.stderr
        text = data.decode("utf-8", errors="replace")
        lines = text.splitlines(keepends=False)
        prefix = f"[{rank}]<{kind}>:"
        out = []
        for line in lines:
            stamp = time.asctime() + " " if self._timestamp else ""
            out.append(f"{stamp}{prefix}{line}\n")
        try:
            stream.write("".join(out))
            stream.flush()
        except (OSError, ValueError):
            pass


def _spark_thread(sc, group: str, num_proc: int, job: dict, outcome: dict):
    try:
        from pyspark import InheritableThread as Thread  # pylint: disable=import-outside-toplevel
    except ImportError:  # pragma: no cover - old pyspark
        Thread = threading.Thread  # pylint: disable=invalid-name

    def run_stage() -> None:
        try:
            sc.setJobGroup(group, "horovod_torch.spark.run", interruptOnCancel=True)
            rdd = sc.parallelize(range(num_proc), num_proc)
            outcome["tasks"] = rdd.barrier().mapPartitions(
                spark_task.make_mapper(job)).collect()
        except BaseException as exc:  # pylint: disable=broad-except
            outcome["error"] = exc

    thread = Thread(target=run_stage, name="hvd-spark-job")
    thread.daemon = True
    return thread


ERROR_GRACE_S = 1.0
"""After the first rank's error, how long the driver waits for others before it
picks the one to raise (see horovod_torch.runner.func.pick_error)."""
INTERNAL_GRACE_S = 5.0
"""How much longer it waits while every error is a lost connection."""


def _raise_first_failure(server, thread, output: "_Output", outcome: Dict[str, Any]) -> None:
    """A rank reported an error: wait briefly for the root cause (another rank's own
    error, or the Spark job's failure when a task died), then raise it."""
    deadline = time.monotonic() + ERROR_GRACE_S
    while time.monotonic() < deadline and thread.is_alive():
        output.pump()
        thread.join(POLL_S)
    # Only lost connections so far: the rank that broke them may still be reporting,
    # or its Spark task died (then the Spark job fails).
    deadline = time.monotonic() + INTERNAL_GRACE_S
    while (thread.is_alive() and time.monotonic() < deadline
           and all(run_func.is_internal(e) for e in run_func.errors(server))):
        output.pump()
        thread.join(POLL_S)
    output.pump()
    errors = run_func.errors(server)
    chosen = run_func.pick_error(errors)
    if run_func.is_internal(chosen) and "error" in outcome:
        _raise_spark_failure(outcome["error"])
    _raise_rank_error(chosen)


def _raise_spark_failure(exc: BaseException) -> None:
    lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
    useful = [line for line in lines if "Job aborted" in line or "Exception:" in line]
    first = (useful or lines or [type(exc).__name__])[0][:500]
    raise RuntimeError("the Spark job of horovod_torch.spark.run failed (did a task or "
                       f"its executor die?): {first}") from exc


def _raise_rank_error(error: dict) -> None:
    """Raises the rank's exception (its cause: the rank's traceback), or a
    RuntimeError for a rank that crashed."""
    rank = error["rank"]
    if not error.get("traceback"):
        raise RuntimeError(f"horovod_torch.spark.run: rank {rank} {error['summary']} "
                           "(its output above says more)")
    run_func._raise_worker_error(error, "horovod_torch.spark.run")  # pylint: disable=protected-access


def run(fn: Callable[..., Any], args: Sequence[Any] = (), kwargs: Optional[dict] = None,
        num_proc: Optional[int] = None, start_timeout: Optional[float] = None,
        use_mpi: Optional[bool] = None, use_gloo: Optional[bool] = None,
        extra_mpi_args: Optional[str] = None, env: Optional[Dict[str, str]] = None,
        stdout: Optional[TextIO] = None, stderr: Optional[TextIO] = None,
        verbose: int = 1, nics: Optional[Sequence[str]] = None,
        prefix_output_with_timestamp: bool = False,
        executable: Optional[str] = None) -> List[Any]:
    """Runs ``fn(*args, **kwargs)`` as a horovod_torch job of ``num_proc`` ranks on
    Spark executors (one barrier-stage task each) and returns the values it returned,
    in rank order (Horovod's ``horovod.spark.run``).

    Args:
        fn: the function; it calls ``hvd.init()`` as in any horovod_torch script.
            Pickled with pyspark's cloudpickle (lambdas, closures, functions of
            ``__main__`` work); it runs in a fresh Python process per rank, started by
            the rank's task.
        num_proc: number of ranks (Spark tasks). Default: ``spark.default.parallelism``.
            Barrier mode needs that many task slots free at once.
        start_timeout: seconds for all tasks to start (and for ``hvd.init()``'s
            rendezvous); default ``HOROVOD_SPARK_START_TIMEOUT``, else 600.
        env: variables added to each rank's environment (on top of the executor's).
        stdout, stderr: text streams the ranks' output lines are written to on the
            driver, prefixed ``[rank]<stdout>:``; default ``sys.stdout``/``sys.stderr``.
        verbose: 0 quiet, 1 (default) logs the number of processes, 2 also when
            all tasks have started (``logging``, logger ``horovod_torch.spark``).
        nics: network interfaces of the driver; the stores listen on the first one
            with an IPv4 address (default: ``127.0.0.1`` with a ``local`` master, else
            the address of ``spark.driver.host``).
        prefix_output_with_timestamp: start each forwarded line with the local time.
        executable: the Python that runs each rank (default: the executor's Python).
        use_mpi, use_gloo, extra_mpi_args: Horovod's controller choice; only the TCP
            transport (Horovod's Gloo) runs on Spark: ``use_mpi=True`` raises
            ``ValueError``, ``extra_mpi_args`` is ignored.

    Raises:
        the exception ``fn`` raised in the rank that failed first (its ``__cause__``
        is a ``RemoteTraceback`` naming the rank, with that rank's traceback; the
        HorovodInternalError of peers that lost their connection to it is passed
        over);
        ``RuntimeError`` when a rank or the Spark job failed otherwise;
        ``TimeoutError`` when the tasks did not all start within ``start_timeout``.
        The other ranks are stopped and the Spark job cancelled first.
    """
    if use_mpi:
        raise ValueError("horovod_torch.spark.run runs on the TCP transport (Horovod's "
                         "Gloo controller); use_mpi=True is not supported")
    if start_timeout is None:
        start_timeout = config.spark_start_timeout_s()
    if isinstance(nics, str):
        nics = [nics]
    sc = _spark_context()
    if num_proc is None:
        num_proc = sc.defaultParallelism
        if verbose >= 1:
            logger.info("Running %d processes (inferred from spark.default.parallelism)...",
                        num_proc)
    elif verbose >= 1:
        logger.info("Running %d processes...", num_proc)
    if num_proc < 1:
        raise ValueError(f"num_proc must be >= 1, got {num_proc}")

    addr = _store_address(sc, nics)
    from horovod_torch import _C  # pylint: disable=import-outside-toplevel
    rdzv_secret, job_secret = secrets.token_hex(16), secrets.token_hex(16)
    rdzv = _C.StoreServer(addr, 0, rdzv_secret)
    try:
        server = _C.StoreServer(addr, 0, job_secret, max_frame=1 << 32)
    except BaseException:
        rdzv.stop()
        raise
    try:
        server.set(run_func.KEY_FUNC, _dumps_fn((fn, tuple(args), dict(kwargs or {}))))
        job = dict(addr=addr, port=server.port(), secret=job_secret, rdzv_port=rdzv.port(),
                   rdzv_secret=rdzv_secret, start_timeout=float(start_timeout),
                   env={str(k): str(v) for k, v in (env or {}).items()},
                   executable=executable, num_proc=num_proc)
        group = f"horovod_torch.spark.run.{os.getpid()}.{_next_job_id()}"
        outcome: Dict[str, Any] = {}
        thread = _spark_thread(sc, group, num_proc, job, outcome)
        output = _Output(server, num_proc, stdout, stderr, prefix_output_with_timestamp)
        thread.start()
        try:
            _supervise(sc, server, thread, output, num_proc, float(start_timeout), verbose,
                       outcome)
        except BaseException:
            _abort(sc, server, group, thread, output, num_proc)
            raise
        output.pump()
        return _results(server, outcome, num_proc)
    finally:
        server.stop()
        rdzv.stop()


def _supervise(sc, server, thread, output: _Output, num_proc: int, start_timeout: float,
               verbose: int, outcome: Dict[str, Any]) -> None:
    """Until the Spark job ends: forward output, raise the first rank's error, and
    raise TimeoutError if the tasks do not all start in time."""
    started_at = time.monotonic()
    all_started = False
    while thread.is_alive():
        output.pump()
        if server.get(run_func.KEY_ERRORS) is not None:
            _raise_first_failure(server, thread, output, outcome)
        if not all_started:
            raw = server.get(spark_task.KEY_STARTED)
            count = int(raw.decode()) if raw else 0
            all_started = count >= num_proc
            if all_started and verbose >= 2:
                logger.info("All %d Spark tasks started", num_proc)
            if not all_started and time.monotonic() - started_at > start_timeout:
                raise TimeoutError(
                    f"Timed out waiting for Spark tasks to start: {count} of {num_proc} "
                    f"started within {start_timeout:g} s. Please check that you have enough "
                    "resources to run all Horovod processes: each one runs in a Spark task "
                    "of one barrier stage, so num_proc task slots must be free at once "
                    f"(this SparkContext's default parallelism is {sc.defaultParallelism}). "
                    "You may need to increase the start_timeout parameter if your Spark "
                    "resources are allocated on demand.")
        thread.join(POLL_S)


def _abort(sc, server, group: str, thread, output: _Output, num_proc: int) -> None:
    """Stops every rank (the tasks poll spark/abort) and cancels the Spark job."""
    try:
        server.set(spark_task.KEY_ABORT, b"1")
    except Exception:  # pylint: disable=broad-except
        pass
    # The started tasks stop their ranks (SIGTERM, SIGKILL after TERM_GRACE_S) and
    # report; then the stage is cancelled (tasks still waiting for slots included).
    deadline = time.monotonic() + spark_task.TERM_GRACE_S + 5.0
    while thread.is_alive() and time.monotonic() < deadline:
        output.pump()
        raw = server.get(spark_task.KEY_STARTED)
        started = int(raw.decode()) if raw else 0
        ended = sum(server.get(spark_task.KEY_EXIT.format(rank=r)) is not None
                    for r in range(num_proc))
        if ended >= started:
            break
        thread.join(POLL_S)
    try:
        sc.cancelJobGroup(group)
    except Exception:  # pylint: disable=broad-except
        pass
    thread.join(CANCEL_JOIN_S)
    output.pump()


def _results(server, outcome: Dict[str, Any], num_proc: int) -> List[Any]:
    errors = run_func.errors(server)
    if errors:
        chosen = run_func.pick_error(errors)
        if run_func.is_internal(chosen) and "error" in outcome:
            _raise_spark_failure(outcome["error"])
        _raise_rank_error(chosen)
    if "error" in outcome:
        _raise_spark_failure(outcome["error"])
    codes = dict(outcome.get("tasks") or [])
    failed = [(rank, code) for rank, code in sorted(codes.items()) if code != 0]
    if failed:
        raise RuntimeError("horovod_torch.spark.run: " + "; ".join(
            f"rank {rank} exited with {spark_task.describe_exit(code)}" for rank, code in failed)
            + " (its output above says more)")
    results = []
    for rank in range(num_proc):
        raw = server.get(run_func.KEY_RESULT.format(rank=rank))
        if raw is None:
            raise RuntimeError(f"horovod_torch.spark.run: rank {rank} ended without "
                               "returning a value (did the function exit the process?)")
        results.append(pickle.loads(raw))
    return results


def run_elastic(*args: Any, **kwargs: Any) -> List[Any]:
    """Horovod's elastic Spark runner is not provided: Spark's barrier mode restarts a
    whole stage, not single tasks. Use ``horovodrun`` with ``--min-np``/``--max-np`` or a
    host discovery script, or ``horovod.ray.ElasticRayExecutor``, for elastic jobs."""
    raise NotImplementedError(
        "horovod_torch.spark.run_elastic is not supported: run elastic jobs with "
        "horovodrun (--min-np/--max-np, --host-discovery-script) or "
        "horovod.ray.ElasticRayExecutor (docs/integrations.md)")
