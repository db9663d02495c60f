"""The Ray actor that hosts one horovod_torch worker (Horovod's ``BaseHorovodWorker``).

The executors (runner.py, elastic.py) create one actor per worker and, before any
user function runs in it, set in its environment exactly what ``horovodrun`` gives
a worker process: ``HOROVOD_RANK``/``SIZE``/``LOCAL_*``/``CROSS_*``/``HOSTNAME``, the
rendezvous store's ``HOROVOD_STORE_ADDR``/``PORT`` and the job's ``HOROVOD_SECRET``
(plus ``HOROVOD_ELASTIC*`` for elastic jobs). ``hvd.init()`` in the actor then joins
the job through the store, as under horovodrun.

This module imports nothing heavy of its own; importing the package loads torch.
"""
import os
import socket
import sys
import traceback
from typing import Any, Callable, Dict, List, Optional

import ray

from horovod_torch.common import elastic_keys, launch_env

REMOVED = "__horovod_torch_ray_removed__"  # run_elastic's value for a worker left out


def _shutdown_horovod_quietly() -> None:
    """Stops this process's horovod engine if it runs, so that peers blocked in a
    collective with us fail at once (HorovodInternalError) instead of waiting for
    the stall timeout: what a worker process's exit does under horovodrun."""
    basics = sys.modules.get("horovod_torch.engine.basics")
    if basics is None:
        return
    try:
        if basics.is_initialized():
            basics.shutdown()
    except Exception:  # pylint: disable=broad-except
        pass


class BaseHorovodWorker:
    """One worker of a horovod_torch job on Ray: a plain class that the executors
    wrap with ``ray.remote``. ``executable`` is the object ``start(executable_cls=...)``
    made in this actor; ``execute(fn)`` calls ``fn(executable)``."""

    executable = None

    def __init__(self, world_rank: int = 0, world_size: int = 1):
        os.environ["HOROVOD_HOSTNAME"] = self.node_id()
        os.environ["HOROVOD_RANK"] = str(world_rank)
        os.environ["HOROVOD_SIZE"] = str(world_size)

    # -- where this actor runs ---------------------------------------------------

    def node_id(self) -> str:
        return ray.get_runtime_context().get_node_id()

    def hostname(self) -> str:
        return socket.gethostname()

    def node_ip(self) -> str:
        return ray.util.get_node_ip_address()

    def get_gpu_ids(self) -> List[int]:
        """The CUDA device ids Ray gave this actor."""
        return [int(i) if str(i).isdigit() else i for i in ray.get_gpu_ids()]

    def placement(self) -> Dict[str, Any]:
        """(node id, node IP, hostname, pid, GPU ids) in one round trip."""
        return dict(node_id=self.node_id(), node_ip=self.node_ip(), hostname=self.hostname(),
                    pid=os.getpid(), gpu_ids=self.get_gpu_ids())

    # -- environment and state -----------------------------------------------------

    def update_env_vars(self, env_vars: Dict[str, Any]) -> None:
        """Sets environment variables in this actor's process."""
        os.environ.update({str(k): str(v) for k, v in env_vars.items()})

    def env_vars(self) -> Dict[str, str]:
        return dict(os.environ)

    def start_executable(self, executable_cls: Optional[type] = None,
                         executable_args: Optional[list] = None,
                         executable_kwargs: Optional[dict] = None) -> None:
        """Makes ``executable_cls(*args, **kwargs)`` this worker's executable (state)."""
        if executable_cls is not None:
            try:
                self.executable = self._call(executable_cls, *(executable_args or []),
                                             **(executable_kwargs or {}))
            except BaseException as exc:
                self._start_error = exc  # run_elastic, queued behind this call, raises it
                raise

    def set_queue(self, queue) -> None:
        """Where ``horovod_torch.ray.ray_logger.log`` sends values (callbacks)."""
        # pylint: disable-next=import-outside-toplevel
        from horovod_torch.integrations.ray import ray_logger
        ray_logger.configure(queue=queue)

    def stop_horovod(self) -> None:
        """Shuts this actor's horovod engine down if it runs (before the actor is killed)."""
        _shutdown_horovod_quietly()

    # -- running functions -----------------------------------------------------------

    @staticmethod
    def _call(fn: Callable, *args, **kwargs):
        try:
            return fn(*args, **kwargs)
        except BaseException:
            _shutdown_horovod_quietly()
            raise

    def execute(self, func: Callable[[Any], Any], call_id: Optional[int] = None) -> Any:
        """``func(executable)`` in this actor. If it raises, the horovod engine of
        this actor is shut down (peers in a collective with it fail instead of
        hanging) and the exception goes to the caller.

        ``call_id`` (the executor's count of calls) names the store namespace of an
        engine started during the call, so that workers which disagreed in one call
        cannot disagree in the next. An engine that runs when the call starts and is
        stopped by a peer during it is not restarted by ``hvd.init()`` in that call:
        init() raises instead of waiting for workers that will not come."""
        if call_id is not None:
            os.environ["HOROVOD_RENDEZVOUS_PREFIX"] = f"ray/call{int(call_id)}"
        basics = sys.modules.get("horovod_torch.engine.basics")
        held = basics is not None and basics.is_initialized()
        if held:
            basics._bar_restart(  # pylint: disable=protected-access
                "this worker's horovod engine was stopped during the call (a peer failed "
                "or shut down); hvd.init() does not start a new job within the same call, "
                "because the other workers would not join it. The next call starts one.")
        try:
            return self._call(func, self.executable)
        finally:
            if held:
                basics._bar_restart(None)  # pylint: disable=protected-access

    def run_elastic(self, func: Callable[[Any], Any]) -> Any:
        """For ElasticRayExecutor: ``func(executable)``; returns ``(rank, value)`` with
        the rank this worker had when ``func`` returned, or REMOVED when the driver
        left this worker out of a new generation (a process would exit 0)."""
        start_error = getattr(self, "_start_error", None)
        if start_error is not None:
            raise RuntimeError("executable_cls(...) raised in this worker") from start_error
        try:
            value = self._call(func, self.executable)
        except SystemExit as exc:
            if exc.code in (0, None):
                return REMOVED
            raise RuntimeError(f"the function called sys.exit({exc.code!r})") from None
        placement = launch_env.read().placement
        rank = placement.rank if placement is not None else 0
        basics = sys.modules.get("horovod_torch.engine.basics")
        if basics is not None:
            try:
                rank = basics.rank()
            except ValueError:  # left uninitialised
                from horovod_torch.common import elastic_worker  # noqa
                rank = _last_rank(elastic_worker, rank)
        return rank, value


def _last_rank(elastic_worker, default: int) -> int:
    """The rank this elastic worker had in the last generation it joined."""
    try:
        gen = elastic_worker.current_generation_of_this_worker()
        if gen < 0:
            return default
        raw = elastic_worker._store().get(  # pylint: disable=protected-access
            elastic_keys.assign_key(gen, launch_env.current().elastic_worker_id), 0.0)
        return int(raw.decode().split(",")[0]) if raw is not None else default
    except Exception:  # pylint: disable=broad-except
        traceback.print_exc()
        return default
