"""The executor side of ``horovod_torch.spark.run``: the body of each barrier task.

A task works out its rank from the barrier stage's task list (tasks grouped by
executor host, hosts in the order of their first partition, so ranks are contiguous
per host as with ``horovodrun -H``), starts ``python -m horovod_torch.spark.exec_fn``
with the ``HOROVOD_*`` variables ``hvd.init()`` reads, forwards that process's output
to the driver through the job store, and waits for it. It stops the process (its
whole process group) when the driver asks (``spark/abort``, set when another rank
failed or the job was cancelled), when the driver's store goes away, or when the
task itself ends early; the process also stops by itself if this Python worker dies
(it watches a pipe from us, see :mod:`horovod_torch.spark.exec_fn`).

Only the standard library, horovod_torch's runner helpers and the C++ store client
are used here; pyspark only for ``BarrierTaskContext``.
"""
from __future__ import annotations

import os
import queue
import signal
import subprocess
import sys
import threading
import time
from typing import Dict, Iterator, List, Optional, Sequence, Tuple

from horovod_torch.runner.hosts import HostInfo, SlotInfo, assign_ranks

KEY_STARTED = "spark/started"
KEY_ABORT = "spark/abort"
KEY_OUT = "spark/out/{rank}/{seq}"
KEY_EXIT = "spark/exit/{rank}"
STREAM_IDS = {"stdout": b"o", "stderr": b"e"}

ABORT_POLL_S = 0.2
TERM_GRACE_S = 5.0
OUT_CHUNK_BYTES = 1 << 20


def slots_for_tasks(addresses: Sequence[str]) -> List[SlotInfo]:
    """The slot of each partition (index = partition id), given the executor address
    (``host:port``) each barrier task runs on."""
    hosts: Dict[str, List[int]] = {}
    for pid, address in enumerate(addresses):
        host = address.rsplit(":", 1)[0] if ":" in address else address
        hosts.setdefault(host, []).append(pid)
    placed = assign_ranks([HostInfo(h, len(p)) for h, p in hosts.items()], len(addresses))
    by_partition: List[Optional[SlotInfo]] = [None] * len(addresses)
    it = iter(placed)
    for partitions in hosts.values():  # assign_ranks fills the hosts in this order
        for pid in partitions:
            by_partition[pid] = next(it)
    return by_partition  # type: ignore[return-value]


class _Sender:
    """Collects output lines of the rank's process and puts them into the driver's
    store in order (``spark/out/<rank>/<seq>``: a stream id byte, then the lines),
    batching what arrived meanwhile into one key."""

    def __init__(self, client, lock: threading.Lock, rank: int) -> None:
        self._client, self._lock, self._rank = client, lock, rank
        self._queue: "queue.Queue[Optional[Tuple[bytes, bytes]]]" = queue.Queue()
        self._seq = 0
        self._failed = False
        self._thread = threading.Thread(target=self._run, name="hvd-spark-out", daemon=True)
        self._thread.start()

    def put(self, stream: bytes, data: bytes) -> None:
        self._queue.put((stream, data))

    def close(self, timeout: float = 10.0) -> None:
        self._queue.put(None)
        self._thread.join(timeout)

    def _send(self, stream: bytes, data: bytes) -> None:
        if self._failed or not data:
            return
        try:
            with self._lock:
                self._client.set(KEY_OUT.format(rank=self._rank, seq=self._seq), stream + data)
            self._seq += 1
        except Exception:  # pylint: disable=broad-except  (the driver is gone)
            self._failed = True

    def _run(self) -> None:
        done = False
        while not done:
            item = self._queue.get()
            if item is None:
                break
            stream, data = item
            # Whatever else is waiting joins this batch (same stream, bounded size).
            while len(data) < OUT_CHUNK_BYTES:
                try:
                    nxt = self._queue.get_nowait()
                except queue.Empty:
                    break
                if nxt is None:
                    done = True
                    break
                if nxt[0] != stream:
                    self._send(stream, data)
                    stream, data = nxt
                    continue
                data += nxt[1]
            self._send(stream, data)


def _pump(pipe, stream: bytes, sender: _Sender, echo) -> None:
    with pipe:
        for line in iter(pipe.readline, b""):
            sender.put(stream, line)
            if echo is not None:  # also into the executor's log
                try:
                    echo.write(line)
                    echo.flush()
                except (OSError, ValueError):
                    echo = None


def _stop(proc: "subprocess.Popen[bytes]") -> None:
    """SIGTERM to the process group, SIGKILL after TERM_GRACE_S."""
    if proc.poll() is not None:
        return
    try:
        os.killpg(proc.pid, signal.SIGTERM)
    except OSError:
        return
    deadline = time.monotonic() + TERM_GRACE_S
    while proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.05)
    if proc.poll() is None:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except OSError:
            pass
        proc.wait()


def run_rank(partition: int, addresses: Sequence[str], job: dict) -> Tuple[int, int]:
    """Runs this partition's rank to the end; returns (rank, exit code)."""
    from horovod_torch import _C  # pylint: disable=import-outside-toplevel
    from horovod_torch.runner import func as run_func  # pylint: disable=import-outside-toplevel

    slot = slots_for_tasks(addresses)[partition]
    client = _C.StoreClient(job["addr"], job["port"], job["secret"], job["start_timeout"])
    lock = threading.Lock()
    env = dict(os.environ)
    env.update(job.get("env") or {})
    env.update(slot.to_env())
    env.update({
        "HOROVOD_STORE_ADDR": job["addr"], "HOROVOD_STORE_PORT": str(job["rdzv_port"]),
        "HOROVOD_SECRET": job["rdzv_secret"],
        run_func.ENV_ADDR: job["addr"], run_func.ENV_PORT: str(job["port"]),
        run_func.ENV_SECRET: job["secret"],
    })
    env.setdefault("HOROVOD_START_TIMEOUT", str(int(job["start_timeout"])))
    env.setdefault("PYTHONUNBUFFERED", "1")  # lines reach the driver as they are printed
    executable = job.get("executable") or sys.executable
    with lock:
        started = client.add(KEY_STARTED, 1)
        if started > job["num_proc"]:  # a retried stage (barrier stages never speculate)
            _refuse_retry(client, slot.rank)
            return slot.rank, 1
    proc = subprocess.Popen(  # pylint: disable=consider-using-with
        [executable, "-m", "horovod_torch.integrations.spark.exec_fn"], env=env,
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
        start_new_session=True)
    sender = _Sender(client, lock, slot.rank)
    echo = job.get("echo", False)
    readers = [threading.Thread(target=_pump, daemon=True, args=(
        proc.stdout, STREAM_IDS["stdout"], sender, sys.stdout.buffer if echo else None)),
        threading.Thread(target=_pump, daemon=True, args=(
            proc.stderr, STREAM_IDS["stderr"], sender, sys.stderr.buffer if echo else None))]
    for r in readers:
        r.start()
    code: Optional[int] = None
    aborted = False
    try:
        while True:
            try:
                code = proc.wait(ABORT_POLL_S)
                break
            except subprocess.TimeoutExpired:
                pass
            try:
                with lock:
                    aborted = client.get(KEY_ABORT) is not None
            except Exception:  # pylint: disable=broad-except  (the driver's store is gone)
                aborted = True
            if aborted:
                _stop(proc)
                code = proc.wait()
                break
    finally:
        if code is None:  # interrupted (the Spark task was killed or failed here)
            _stop(proc)
        for r in readers:
            r.join(10.0)
        sender.close()
        if proc.stdin is not None:
            try:
                proc.stdin.close()
            except OSError:
                pass
    code = proc.returncode if code is None else code
    try:
        with lock:
            client.set(KEY_EXIT.format(rank=slot.rank), str(code).encode())
            if code != 0 and not aborted:
                _report_crash(client, slot.rank, code)
    except Exception:  # pylint: disable=broad-except
        pass
    return slot.rank, int(code)


def _refuse_retry(client, rank: int) -> None:
    """Spark re-runs a whole barrier stage after one of its tasks failed (with
    spark.task.maxFailures > 1); the ranks of the first attempt are gone, so the job
    cannot go on: report it (the driver then stops the job)."""
    import pickle  # pylint: disable=import-outside-toplevel
    from horovod_torch.runner import func as run_func  # pylint: disable=import-outside-toplevel
    seq = client.add(run_func.KEY_ERRORS, 1)
    client.set(run_func.KEY_ERROR.format(seq=seq), pickle.dumps({
        "rank": rank, "traceback": "", "exception": None,
        "summary": "was started again by Spark after a task of the job failed; "
                   "horovod_torch.spark.run does not restart ranks (the executors' logs "
                   "say why the first attempt failed)"}))


def _report_crash(client, rank: int, code: int) -> None:
    """A rank that ended with a non-zero code without storing an error of its own
    (killed, os._exit, a crash in C++) goes into the job's error list too, so the
    driver can tell a crash from the failures it caused in the other ranks."""
    import pickle  # pylint: disable=import-outside-toplevel
    from horovod_torch.runner import func as run_func  # pylint: disable=import-outside-toplevel
    if any(error.get("rank") == rank for error in run_func.errors(client)):
        return
    seq = client.add(run_func.KEY_ERRORS, 1)
    client.set(run_func.KEY_ERROR.format(seq=seq), pickle.dumps({
        "rank": rank, "traceback": "", "exception": None,
        "summary": f"exited with {describe_exit(code)} without returning a value"}))


def describe_exit(code: int) -> str:
    """``code 3``, or ``code -9 (signal SIGKILL)`` for a process a signal ended."""
    if code < 0 or code > 128:
        num = -code if code < 0 else code - 128
        try:
            return f"code {code} (signal {signal.Signals(num).name})"
        except ValueError:
            pass
    return f"code {code}"


def make_mapper(job: dict):
    """The function each barrier task runs (``rdd.barrier().mapPartitions``); it is
    pickled into the Spark tasks, with the job's store address and secrets."""

    def _mapper(_: Iterator) -> Iterator[Tuple[int, int]]:
        from pyspark import BarrierTaskContext  # pylint: disable=import-outside-toplevel
        ctx = BarrierTaskContext.get()
        addresses = [info.address for info in ctx.getTaskInfos()]
        yield run_rank(ctx.partitionId(), addresses, job)

    return _mapper
