"""``ElasticRayExecutor``: an elastic horovod_torch job whose workers are Ray actors.

This is horovodrun's elastic driver (horovod_torch/runner/elastic_driver.py), not a
second one: the same generations and store keys, the same blacklisting (with
``cooldown_range``), reset limit and min/max workers. Only two things differ:

* host discovery is Ray's view of the cluster: every alive node is a host with
  ``CPU // cpus_per_worker`` slots (also bounded by ``GPU // gpus_per_worker`` with
  ``use_gpu``), checked once a second like a discovery script. Hosts are Ray node
  ids, so fake nodes of one machine (ray.cluster_utils.Cluster) are distinct hosts;
* a worker is an actor pinned to its node (NodeAffinitySchedulingStrategy) running
  the function once, instead of a process; the driver sees it through
  :class:`_ActorProcess` (poll/wait/signal like a Popen).

When an actor or its node dies, the survivors' ``hvd.elastic.run`` catches the
failure in their own processes, restores the last commit and re-forms the job with
the generation the driver publishes; nothing is restarted but the lost workers
(Ray Train restarts every worker instead). New nodes get new workers, which join
at the survivors' next commit and receive the state from rank 0.
"""
from __future__ import annotations

import itertools
import math
import os
import secrets
import sys
import threading
import time
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import ray
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from horovod_torch.integrations.ray import _common
from horovod_torch.integrations.ray._common import Settings, setting
from horovod_torch.integrations.ray.worker import REMOVED, BaseHorovodWorker
from horovod_torch.runner.elastic_driver import UNBOUNDED, ElasticDriver, ElasticOptions
from horovod_torch.runner.hosts import SlotInfo
from horovod_torch.runner.output import OutputForwarder, TextSink


class RayHostDiscovery:
    """Ray's alive nodes as hosts: ``{node_id: slots}`` (Horovod's RayHostDiscovery,
    keyed by node id rather than address). Slots come from each node's total
    resources: the executor assumes the cluster is there for it."""

    def __init__(self, use_gpu: bool = False, cpus_per_slot: float = 1,
                 gpus_per_slot: float = 1, cpus_per_worker: Optional[float] = None,
                 gpus_per_worker: Optional[float] = None) -> None:
        self.use_gpu = use_gpu
        self.cpus_per_slot = cpus_per_worker if cpus_per_worker is not None else cpus_per_slot
        self.gpus_per_slot = gpus_per_worker if gpus_per_worker is not None else gpus_per_slot

    def find_available_hosts_and_slots(self) -> Dict[str, int]:
        bundle = _common.bundle_for(self.cpus_per_slot,
                                    (self.gpus_per_slot or 1) if self.use_gpu else 0)
        found = {}
        for node in _common.alive_nodes():
            slots = _common.fits(node.get("Resources", {}), bundle)
            if slots:
                found[node["NodeID"]] = min(slots, UNBOUNDED)
        return found

    __call__ = find_available_hosts_and_slots


class _Started:
    """``is_set()``: the actor runs (its first call returned, or failed)."""

    def __init__(self, ref: "ray.ObjectRef") -> None:
        self._ref = ref
        self._set = False

    def is_set(self) -> bool:
        if not self._set:
            ready, _ = ray.wait([self._ref], timeout=0)
            self._set = bool(ready)
        return self._set


class _ActorProcess:
    """A worker actor as the elastic driver sees a worker process: ``poll()`` is
    None while its function runs, 0 once it returned, 1 if it raised, -9 (shown
    as 137) if the actor died; ``signal_worker`` kills the actor."""

    stdout = None  # Ray forwards actors' output to the driver itself
    stderr = None
    start_failure = "Ray could not place or start the actor"

    def __init__(self, actor, ready: "ray.ObjectRef", result: "ray.ObjectRef",
                 host: str, worker_id: str) -> None:
        self.actor = actor
        self.host = host
        self.worker_id = worker_id
        self.started = _Started(ready)
        self._result_ref = result
        self.returncode: Optional[int] = None
        self.pid = 0
        self.result: Optional[Tuple[int, Any]] = None  # (rank, value) if it returned one
        self.removed = False
        self.error: Optional[BaseException] = None
        self.ended_at: Optional[float] = None

    def poll(self) -> Optional[int]:
        if self.returncode is not None:
            return self.returncode
        ready, _ = ray.wait([self._result_ref], timeout=0)
        if not ready:
            return None
        try:
            value = ray.get(self._result_ref)
        except ray.exceptions.RayTaskError as exc:
            self.error, self.returncode = exc, 1
        except Exception as exc:  # pylint: disable=broad-except  (the actor died)
            self.error, self.returncode = exc, -9
        else:
            if isinstance(value, str) and value == REMOVED:
                self.removed = True
            else:
                self.result = value
            self.returncode = 0
        self.ended_at = time.monotonic()
        return self.returncode

    def wait(self, timeout: Optional[float] = None) -> int:
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.poll() is None:
            if deadline is not None and time.monotonic() > deadline:
                raise TimeoutError(f"actor {self.worker_id} still runs")
            time.sleep(0.02)
        return self.returncode  # type: ignore[return-value]

    def signal_worker(self, signum: int) -> None:
        """Any signal ends the actor (Ray has no gentler stop for a running call)."""
        del signum
        try:
            ray.kill(self.actor, no_restart=True)
        except Exception:  # pylint: disable=broad-except
            pass


class _RaySpawner:
    """The elastic driver's spawner: one actor per worker, on the slot's node."""

    remote = "ray"  # the driver keeps hosts that are not this machine (Ray reaches them)

    def __init__(self, executor: "ElasticRayExecutor", fn: Callable[[Any], Any],
                 queue=None) -> None:
        self._x = executor
        self._fn = fn
        self._queue = queue
        self._cls = ray.remote(BaseHorovodWorker)
        self._job = secrets.token_hex(4)
        self._seq = itertools.count()
        self.procs: List[_ActorProcess] = []

    def spawn(self, slot: SlotInfo, command: Sequence[str],
              env: Dict[str, str]) -> _ActorProcess:
        del command
        x = self._x
        actor = self._cls.options(
            name=f"horovod_torch-{self._job}-{next(self._seq)}",
            num_cpus=x.cpus_per_slot, num_gpus=x.gpus_per_slot if x.use_gpu else 0,
            scheduling_strategy=NodeAffinitySchedulingStrategy(slot.hostname, soft=False),
        ).remote(world_rank=slot.rank, world_size=slot.size)
        ready = actor.update_env_vars.remote(env)
        if x.use_gpu:
            actor.execute.remote(_gpu_pinner(slot.local_rank))
        if self._queue is not None:
            actor.set_queue.remote(self._queue)
        actor.start_executable.remote(x.executable_cls, x.executable_args, x.executable_kwargs)
        result = actor.run_elastic.remote(self._fn)
        proc = _ActorProcess(actor, ready, result, slot.hostname,
                             env.get("HOROVOD_ELASTIC_WORKER_ID", ""))
        self.procs.append(proc)
        return proc

    def close(self) -> None:
        """Stops the actors: the engines of those that finished first (so that no
        worker sees its peers vanish mid-collective and says so), then kills all."""
        done = [p for p in self.procs if p.returncode == 0 and not p.removed]
        if done:
            refs = [p.actor.stop_horovod.remote() for p in done]
            try:
                ray.wait(refs, num_returns=len(refs), timeout=5.0)
            except Exception:  # pylint: disable=broad-except
                pass
        for p in self.procs:
            p.signal_worker(9)


def _gpu_pinner(local_rank: int) -> Callable[[Any], None]:
    """Makes the actor's own GPU device ``local_rank`` of CUDA_VISIBLE_DEVICES (the
    node's GPUs), so torch.cuda.set_device(hvd.local_rank()) picks it in the
    generation the worker is started for."""
    def pin(_executable):
        own = [str(g) for g in ray.get_gpu_ids()]
        node = ray.get_runtime_context().get_node_id()
        total = 0
        for n in ray.nodes():
            if n.get("NodeID") == node:
                total = int(n.get("Resources", {}).get("GPU", 0))
        others = [str(i) for i in range(total) if str(i) not in own]
        visible = others[:local_rank] + own + others[local_rank:]
        os.environ["CUDA_VISIBLE_DEVICES"] = ",".join(visible)
    return pin


class ElasticRayExecutor:
    """Elastic horovod_torch on Ray (Horovod's ``horovod.ray.ElasticRayExecutor``).

    Args:
        settings: from :meth:`create_settings` (min/max workers, reset limit,
            timeouts), or None for the defaults.
        use_gpu, cpus_per_slot, gpus_per_slot: each worker's Ray resources
            (``cpus_per_worker``/``gpus_per_worker`` are the same, newer names).
        env_vars: set in every worker before the function runs.
        override_discovery: use Ray's nodes as the hosts (default); False keeps
            ``settings.discovery`` (an object with ``find_available_hosts_and_slots()``
            returning ``{node_id: slots}``).
        min_workers, max_workers, reset_limit, cooldown_range, elastic_timeout:
            override the settings' values (the names RayExecutor takes).
        straggler_policy: "report" (default): a persistent straggler is named in the
            log and ``hvd.straggler_report()``; "evict": its Ray node is also removed
            from the job as a failed node is (back after the cool-down), never below
            ``min_workers`` (horovodrun's ``--straggler-policy``).
        straggler_evict_after: with "evict", seconds the same rank must stay named a
            straggler before its node is evicted (default 30).
    """

    @staticmethod
    def create_settings(min_num_proc: int = 1, max_num_proc: Optional[int] = None,
                        reset_limit: Optional[int] = None, elastic_timeout: int = 600,
                        timeout_s: int = 30, ssh_identity_file: Optional[str] = None,
                        nics: Any = None, min_np: Optional[int] = None,
                        max_np: Optional[int] = None, verbose: int = 1,
                        cooldown_range: Optional[Sequence[float]] = None,
                        **kwargs) -> Settings:
        """Horovod's signature; ``min_np``/``max_np`` are the older names."""
        if min_np is not None:
            min_num_proc = min_np
        if max_np is not None:
            max_num_proc = max_np
        return Settings(timeout_s=timeout_s, ssh_identity_file=ssh_identity_file, nics=nics,
                        verbose=verbose, elastic=True, min_num_proc=min_num_proc,
                        max_num_proc=max_num_proc, num_proc=min_num_proc,
                        reset_limit=reset_limit, elastic_timeout=elastic_timeout,
                        cooldown_range=tuple(cooldown_range) if cooldown_range else None,
                        extra=dict(kwargs))

    def __init__(self, settings: Any = None, use_gpu: bool = False, cpus_per_slot: float = 1,
                 gpus_per_slot: Optional[float] = None, env_vars: Optional[Dict] = None,
                 override_discovery: bool = True, *, min_workers: Optional[int] = None,
                 max_workers: Optional[int] = None, reset_limit: Optional[int] = None,
                 cooldown_range: Optional[Sequence[float]] = None,
                 elastic_timeout: Optional[float] = None,
                 cpus_per_worker: Optional[float] = None,
                 gpus_per_worker: Optional[float] = None,
                 straggler_policy: str = "report",
                 straggler_evict_after: float = 30.0) -> None:
        settings = settings if settings is not None else ElasticRayExecutor.create_settings()
        if cpus_per_worker is not None:
            cpus_per_slot = cpus_per_worker
        if gpus_per_worker is not None:
            gpus_per_slot = gpus_per_worker
        if gpus_per_slot and not use_gpu:
            raise ValueError("gpus_per_slot is set, but use_gpu is False. "
                             "use_gpu must be True if gpus_per_slot is set.")
        gpus_per_slot = gpus_per_slot or (1 if use_gpu else 0)
        if use_gpu and gpus_per_slot <= 0:
            raise ValueError(f"gpus_per_slot must be > 0: got {gpus_per_slot}")
        if cpus_per_slot is None or cpus_per_slot < 0 or (cpus_per_slot == 0 and not use_gpu):
            raise ValueError(f"cpus_per_slot must be > 0: got {cpus_per_slot}")
        self.settings = settings
        self.use_gpu = use_gpu
        self.cpus_per_slot = cpus_per_slot
        self.gpus_per_slot = gpus_per_slot
        self.env_vars = dict(env_vars or {})
        self.min_workers = int(min_workers if min_workers is not None
                               else setting(settings, "min_num_proc", 1))
        max_w = max_workers if max_workers is not None else setting(settings, "max_num_proc",
                                                                    None)
        self.max_workers = int(max_w) if max_w is not None else None
        self.reset_limit = (reset_limit if reset_limit is not None
                            else setting(settings, "reset_limit", None))
        cooldown = (cooldown_range if cooldown_range is not None
                    else setting(settings, "cooldown_range", None))
        self.cooldown_range = tuple(float(v) for v in cooldown) if cooldown else None
        self.elastic_timeout = float(elastic_timeout if elastic_timeout is not None
                                     else setting(settings, "elastic_timeout", 600))
        if self.min_workers < 1:
            raise ValueError(f"min_workers must be >= 1: got {self.min_workers}")
        if self.max_workers is not None and self.max_workers < self.min_workers:
            raise ValueError(f"max_workers ({self.max_workers}) must be >= min_workers "
                             f"({self.min_workers})")
        if self.reset_limit is not None and int(self.reset_limit) < 0:
            raise ValueError(f"reset_limit must be >= 0 (or None: no limit): got "
                             f"{self.reset_limit}")
        if self.cooldown_range and not 0 <= self.cooldown_range[0] <= self.cooldown_range[1]:
            raise ValueError(f"cooldown_range needs 0 <= lo <= hi: got {self.cooldown_range}")
        if straggler_policy not in ("report", "evict"):
            raise ValueError(f"straggler_policy must be \"report\" or \"evict\": got "
                             f"{straggler_policy!r}")
        if not straggler_evict_after > 0:
            raise ValueError(f"straggler_evict_after must be > 0 seconds: got "
                             f"{straggler_evict_after}")
        self.straggler_policy = straggler_policy
        self.straggler_evict_after = float(straggler_evict_after)
        discovery = getattr(settings, "discovery", None)
        if override_discovery or discovery is None:
            discovery = RayHostDiscovery(use_gpu=use_gpu, cpus_per_slot=cpus_per_slot,
                                         gpus_per_slot=gpus_per_slot)
            try:
                settings.discovery = discovery
            except AttributeError:
                pass
        self.discovery = discovery
        self.executable_cls: Optional[type] = None
        self.executable_args: Optional[list] = None
        self.executable_kwargs: Optional[dict] = None
        self._started = False
        self._running = threading.Lock()

    # -- lifecycle ---------------------------------------------------------------------

    def start(self, executable_cls: Optional[type] = None,
              executable_args: Optional[List] = None,
              executable_kwargs: Optional[Dict] = None,
              extra_env_vars: Optional[Dict] = None) -> None:
        """Connects to Ray and waits until the cluster offers ``min_workers`` slots
        (at most ``elastic_timeout`` s; says so at once if it does not yet).
        ``executable_cls`` is made in every worker before the function runs (the
        object ``execute`` passes it)."""
        _common.ensure_ray()
        # Loads torch now rather than in run() (its store needs the extension).
        from horovod_torch import _C  # noqa: F401  pylint: disable=W0611,C0415
        self.executable_cls = executable_cls
        self.executable_args = list(executable_args or [])
        self.executable_kwargs = dict(executable_kwargs or {})
        self.env_vars.update(extra_env_vars or {})
        deadline = time.monotonic() + self.elastic_timeout
        said = False
        while True:
            slots = sum(self._discover().values())
            if slots >= self.min_workers:
                break
            if not said:
                _common.log(f"waiting for the Ray cluster to offer {self.min_workers} "
                            f"worker slots (it offers {slots}: "
                            f"{_common.describe_nodes(_common.alive_nodes())}) for up to "
                            f"{self.elastic_timeout:g} s (elastic_timeout)")
                said = True
            if time.monotonic() > deadline:
                raise TimeoutError(
                    f"the Ray cluster offered {slots} worker slots (CPU // "
                    f"{self.cpus_per_slot:g}" + (f", GPU // {self.gpus_per_slot:g}"
                                                 if self.use_gpu else "") +
                    f" per node), fewer than min_workers={self.min_workers}, for "
                    f"{self.elastic_timeout:g} s (elastic_timeout)")
            time.sleep(0.5)
        self._started = True

    def _discover(self) -> Dict[str, int]:
        return dict(self.discovery.find_available_hosts_and_slots())

    def run(self, worker_fn: Callable[..., Any], callbacks: Optional[List[Callable]] = None,
            args: Optional[List] = None, kwargs: Optional[Dict] = None) -> List[Any]:
        """Runs ``worker_fn(*args, **kwargs)`` elastically (it calls ``hvd.init()`` and
        ``hvd.elastic.run``); returns the values of the workers that completed it, in
        the order of their final ranks. Raises the workers' first exception (or
        RuntimeError) if the job failed."""
        args, kwargs = list(args or []), dict(kwargs or {})
        return self._run(lambda _executable: worker_fn(*args, **kwargs), callbacks)

    def execute(self, fn: Callable[[Any], Any],
                callbacks: Optional[List[Callable]] = None) -> List[Any]:
        """Like run(), with ``fn(executable)``."""
        return self._run(fn, callbacks)

    def execute_single(self, fn: Callable[[Any], Any]) -> Any:
        raise NotImplementedError("elastic jobs do not support execute_single: use run")

    def run_remote(self, *args, **kwargs):
        raise NotImplementedError("ObjectRefs cannot be returned from elastic runs: "
                                  "the workers come and go")

    def shutdown(self) -> None:
        """Nothing is left running between runs; kept for the API."""
        self._started = False

    # -- one elastic job -----------------------------------------------------------------

    def _options(self) -> ElasticOptions:
        max_np = self.max_workers if self.max_workers is not None else UNBOUNDED
        return ElasticOptions(
            num_proc=max_np, min_np=self.min_workers, max_np=max_np, discovery_script=None,
            discover=self._discover,
            reset_limit=int(self.reset_limit) if self.reset_limit is not None else None,
            cooldown=self.cooldown_range, elastic_timeout=self.elastic_timeout,
            evict_stragglers=self.straggler_policy == "evict",
            verbose=int(setting(self.settings, "verbose", 1) or 0) >= 2,
            start_timeout=float(setting(self.settings, "timeout_s", 30)))

    def _run(self, fn: Callable[[Any], Any],
             callbacks: Optional[List[Callable]]) -> List[Any]:
        if not self._started:
            self.start()
        if not self._running.acquire(blocking=False):
            raise RuntimeError("this executor is already running a job")
        store = None
        spawner = None
        try:
            store = _common.Store(self.settings)
            start_timeout = float(setting(self.settings, "timeout_s", 30))

            def env_for(worker_id: str, slot: SlotInfo) -> Dict[str, str]:
                # As horovodrun's: a joining worker waits at rendezvous until the
                # survivors reach their next commit (the elastic timeout).
                env = store.env(slot, max(start_timeout, self.elastic_timeout))
                env.update({"HOROVOD_ELASTIC": "1", "HOROVOD_ELASTIC_WORKER_ID": worker_id,
                            "HOROVOD_ELASTIC_TIMEOUT": str(self.elastic_timeout)})
                if self.straggler_policy == "evict":
                    env["HOROVOD_STRAGGLER_EVICT_AFTER"] = str(self.straggler_evict_after)
                env.update({str(k): str(v) for k, v in self.env_vars.items()})
                return env

            forwarder = OutputForwarder(TextSink(sys.stdout), prefix=False,
                                        err_stream=TextSink(sys.stderr))
            with _common.Callbacks(callbacks) as cbs:
                spawner = _RaySpawner(self, fn, cbs.queue)
                code = ElasticDriver(self._options(), store.server, ["<ray actor>"], env_for,
                                     forwarder, spawner=spawner).run()
                for p in spawner.procs:
                    p.poll()
            return _results(code, spawner.procs)
        finally:
            if spawner is not None:
                spawner.close()
            if store is not None:
                store.stop()
            self._running.release()


def _results(code: int, procs: Sequence[_ActorProcess]) -> List[Any]:
    """The values of the workers that returned one, by final rank; or the job's
    failure: the first worker exception (by time), else RuntimeError."""
    if code != 0:
        failed = sorted((p for p in procs if p.error is not None),
                        key=lambda p: p.ended_at if p.ended_at is not None else math.inf)
        raised = [p.error for p in failed if isinstance(p.error, ray.exceptions.RayTaskError)]
        if raised:  # a peer's HorovodInternalError is a consequence, not the cause
            raise next((e for e in raised if not _common.is_consequence(e)), raised[0])
        detail = (f"; the first worker to fail was {failed[0].worker_id}: {failed[0].error}"
                  if failed else "")
        raise RuntimeError(
            "Horovod detected that one or more processes exited with non-zero status, thus "
            f"causing the job to be terminated (elastic driver exit code {code}; its "
            f"messages above say why){detail}")
    done = sorted((p.result for p in procs if p.result is not None), key=lambda r: r[0])
    return [value for _, value in done]
