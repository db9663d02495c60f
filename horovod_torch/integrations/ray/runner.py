"""``RayExecutor``: a horovod_torch job whose workers are Ray actors (Horovod's
``horovod.ray.RayExecutor``).

``start()`` places ``num_workers`` actors with a placement group (PACK by default;
SPREAD, STRICT_PACK or STRICT_SPREAD with ``placement_strategy``; one bundle per host,
STRICT_SPREAD, with ``num_hosts``/``num_workers_per_host``), starts the rendezvous store
in this (the driver's) process with a fresh job secret, and sets in each actor the
variables horovodrun gives a worker (ranks grouped by node, so local ranks are
contiguous). ``hvd.init()`` in a function run there joins the job through the store.

With ``min_workers`` the executor is elastic (Horovod's elastic_v2 API): it delegates
to :class:`horovod_torch.ray.elastic.ElasticRayExecutor`.
"""
from __future__ import annotations

import logging
import time
from typing import Any, Callable, Dict, List, Optional, Sequence

import ray
from ray.util.placement_group import (get_current_placement_group, placement_group,
                                      placement_group_table, remove_placement_group)
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from horovod_torch.integrations.ray import _common
from horovod_torch.integrations.ray._common import Settings, setting
from horovod_torch.integrations.ray.elastic import ElasticRayExecutor
from horovod_torch.integrations.ray.worker import BaseHorovodWorker
from horovod_torch.runner.hosts import assign

logger = logging.getLogger(__name__)

STRATEGIES = ("PACK", "SPREAD", "STRICT_PACK", "STRICT_SPREAD")


class RayExecutor:
    """A group of Ray actors forming one horovod_torch job.

    Args:
        settings: from :meth:`create_settings` (or any object with ``timeout_s``,
            ``placement_group_timeout_s``, ``nics``).
        num_workers: number of workers.
        num_hosts, num_workers_per_host: instead of ``num_workers``: that many
            workers on each of that many distinct nodes.
        cpus_per_worker, use_gpu, gpus_per_worker: Ray resources of each worker.
        use_current_placement_group: inside a placement group (e.g. a Ray Tune
            trial), place the workers in it instead of creating one.
        placement_strategy: the placement group's strategy, "PACK" (default:
            as few nodes as possible), "SPREAD", "STRICT_PACK" or "STRICT_SPREAD".
        min_workers, max_workers, reset_limit, cooldown_range, elastic_timeout,
        override_discovery: an elastic job (see ElasticRayExecutor).
    """

    @classmethod
    def create_settings(cls, timeout_s: int = 30, ssh_identity_file: Optional[str] = None,
                        ssh_str: Optional[str] = None, placement_group_timeout_s: int = 100,
                        nics: Any = None, verbose: int = 1, **kwargs) -> Settings:
        """Settings for the executor (Horovod's signature). ``timeout_s``: how long a
        worker waits for the others at ``hvd.init()``; ``placement_group_timeout_s``:
        how long ``start()`` waits for the placement group. ``ssh_identity_file`` and
        ``ssh_str`` are accepted and unused: nothing here uses ssh (and no key file
        is written)."""
        del ssh_str  # Horovod wrote it to ssh_identity_file; nothing here uses ssh
        return Settings(timeout_s=timeout_s, ssh_identity_file=ssh_identity_file,
                        placement_group_timeout_s=placement_group_timeout_s, nics=nics,
                        verbose=verbose, extra=dict(kwargs))

    def __init__(self, settings: Any, num_workers: Optional[int] = None,
                 num_hosts: Optional[int] = None, num_workers_per_host: int = 1,
                 cpus_per_worker: float = 1, use_gpu: bool = False,
                 gpus_per_worker: Optional[float] = None,
                 use_current_placement_group: bool = True,
                 min_workers: Optional[int] = None, max_workers: Optional[int] = None,
                 reset_limit: Optional[int] = None, cooldown_range: Optional[Sequence] = None,
                 elastic_timeout: int = 600, override_discovery: bool = True,
                 placement_strategy: str = "PACK") -> None:
        if max_workers and (not min_workers or min_workers <= 0):
            raise ValueError("`max_workers` provided without any positive `min_workers`: "
                             "elastic workloads require a positive `min_workers`")
        if min_workers and num_workers:
            raise ValueError("both `min_workers` and `num_workers` were given: a job is "
                             "either elastic (min_workers/max_workers) or not (num_workers)")
        if gpus_per_worker and not use_gpu:
            raise ValueError("gpus_per_worker is set, but use_gpu is False. "
                             "use_gpu must be True if gpus_per_worker is set.")
        if use_gpu and gpus_per_worker is not None and gpus_per_worker <= 0:
            raise ValueError(f"gpus_per_worker must be > 0: got {gpus_per_worker}")
        if cpus_per_worker is None or cpus_per_worker < 0:
            raise ValueError(f"cpus_per_worker must be >= 0: got {cpus_per_worker}")
        self.settings = settings
        self._elastic = None
        if min_workers is not None:
            self._elastic = ElasticRayExecutor(
                settings, use_gpu=use_gpu, cpus_per_slot=cpus_per_worker,
                gpus_per_slot=gpus_per_worker, override_discovery=override_discovery,
                min_workers=min_workers, max_workers=max_workers, reset_limit=reset_limit,
                cooldown_range=cooldown_range, elastic_timeout=elastic_timeout)
            _set_elastic(settings, True)
            return
        _set_elastic(settings, False)
        if num_workers is None and num_hosts is None:
            raise ValueError("give num_workers (or num_hosts and num_workers_per_host)")
        if num_workers is not None and num_hosts is not None:
            raise ValueError("give either num_workers or num_hosts, not both")
        if num_workers is not None and num_workers < 1:
            raise ValueError(f"num_workers must be >= 1: got {num_workers}")
        if num_hosts is not None and (num_hosts < 1 or num_workers_per_host < 1):
            raise ValueError("num_hosts and num_workers_per_host must be >= 1: got "
                             f"{num_hosts} and {num_workers_per_host}")
        strategy = str(placement_strategy).upper()
        if strategy not in STRATEGIES:
            raise ValueError(f"placement_strategy must be one of {', '.join(STRATEGIES)}: "
                             f"got {placement_strategy!r}")
        self.num_workers = (num_workers if num_workers is not None
                            else num_hosts * num_workers_per_host)
        self.num_hosts = num_hosts
        self.num_workers_per_host = num_workers_per_host
        self.cpus_per_worker = cpus_per_worker
        self.use_gpu = use_gpu
        self.gpus_per_worker = (gpus_per_worker or 1) if use_gpu else 0
        self.use_current_placement_group = use_current_placement_group
        self.placement_strategy = strategy
        self.workers: List[Any] = []  # actor handles, in rank order
        self.placements: List[Dict[str, Any]] = []  # node, pid, GPUs of each rank
        self._pg = None
        self._own_pg = False
        self._store: Optional[_common.Store] = None
        self._calls = 0  # calls made on every worker: each one's store namespace

    # -- starting ----------------------------------------------------------------------

    def start(self, executable_cls: Optional[type] = None,
              executable_args: Optional[List] = None,
              executable_kwargs: Optional[Dict] = None,
              extra_env_vars: Optional[Dict] = None) -> None:
        """Starts the workers: places the actors, starts the store and sets each
        actor's environment, then makes ``executable_cls(*args, **kwargs)`` in each
        (the object ``execute`` passes to its function). Raises ValueError at once
        when the cluster cannot hold the workers, TimeoutError when the placement
        group is not ready within ``placement_group_timeout_s``."""
        if self._elastic is not None:
            return self._elastic.start(executable_cls, executable_args, executable_kwargs,
                                       extra_env_vars)
        if self.workers:
            raise RuntimeError("the executor is already started; call shutdown() first")
        _common.ensure_ray()
        try:
            self._place_workers()
            self._store = _common.Store(self.settings)
            self._set_environment(extra_env_vars or {})
            timeout = float(setting(self.settings, "placement_group_timeout_s", 100))
            ray.get([w.start_executable.remote(executable_cls, executable_args,
                                               executable_kwargs) for w in self.workers],
                    timeout=max(timeout, float(setting(self.settings, "timeout_s", 30))))
        except BaseException:
            self._teardown()
            raise
        return None

    def _place_workers(self) -> None:
        n = self.num_workers
        bundle = _common.bundle_for(self.cpus_per_worker, self.gpus_per_worker)
        current = get_current_placement_group() if self.use_current_placement_group else None
        if current is not None:
            logger.info("placing the workers in the current placement group "
                        "(use_current_placement_group=False to create one)")
            self._pg, self._own_pg = current, False
            index_of = [-1] * n
        else:
            if self.num_hosts is not None:
                per_host = self.num_workers_per_host
                host_bundle = {r: v * per_host for r, v in bundle.items()}
                _common.check_fits(f"RayExecutor(num_hosts={self.num_hosts}, "
                                   f"num_workers_per_host={per_host})",
                                   host_bundle, self.num_hosts, "STRICT_SPREAD")
                bundles, strategy = [host_bundle] * self.num_hosts, "STRICT_SPREAD"
                index_of = [i // per_host for i in range(n)]
            else:
                _common.check_fits(f"RayExecutor(num_workers={n})", bundle, n,
                                   self.placement_strategy)
                bundles, strategy = [bundle] * n, self.placement_strategy
                index_of = list(range(n))
            self._pg = placement_group([dict(b) for b in bundles], strategy=strategy)
            self._own_pg = True
            timeout = float(setting(self.settings, "placement_group_timeout_s", 100))
            ready, _ = ray.wait([self._pg.ready()], timeout=timeout)
            if not ready:
                raise TimeoutError(
                    f"the placement group for {n} workers ({strategy}, "
                    f"{bundles[0]} per bundle) was not ready within {timeout:g} s "
                    "(placement_group_timeout_s): other tasks or actors hold the resources. "
                    f"Available now: {ray.available_resources()}")
        cls = ray.remote(BaseHorovodWorker)
        actors = []
        for i in range(n):
            actors.append(cls.options(
                num_cpus=self.cpus_per_worker, num_gpus=self.gpus_per_worker,
                scheduling_strategy=PlacementGroupSchedulingStrategy(
                    self._pg, placement_group_bundle_index=index_of[i],
                    placement_group_capture_child_tasks=False),
            ).remote(world_rank=i, world_size=n))
        self.workers = actors  # so that a failure below still kills them
        timeout = float(setting(self.settings, "placement_group_timeout_s", 100))
        placements = ray.get([a.placement.remote() for a in actors], timeout=timeout)
        # Ranks grouped by node (in order of each node's first worker): local ranks
        # are contiguous, as horovodrun assigns them.
        first: Dict[str, int] = {}
        for i, p in enumerate(placements):
            first.setdefault(p["node_id"], i)
        order = sorted(range(n), key=lambda i: (first[placements[i]["node_id"]], i))
        self.workers = [actors[i] for i in order]
        self.placements = [placements[i] for i in order]

    def _set_environment(self, extra_env_vars: Dict) -> None:
        assert self._store is not None
        slots = assign([p["node_id"] for p in self.placements])
        timeout = float(setting(self.settings, "timeout_s", 30))
        envs = []
        for slot, p in zip(slots, self.placements):
            env = self._store.env(slot, timeout)
            env.update({str(k): str(v) for k, v in extra_env_vars.items()})
            envs.append(env)
        if self.use_gpu:
            # Every worker of a node sees the node's workers' GPUs, ordered by local
            # rank: torch.cuda.set_device(hvd.local_rank()) picks the actor's own GPU
            # and CUDA can use peer access between them.
            per_node: Dict[str, List[str]] = {}
            for slot, p in zip(slots, self.placements):
                per_node.setdefault(p["node_id"], []).extend(str(g) for g in p["gpu_ids"])
            for env, p in zip(envs, self.placements):
                env["CUDA_VISIBLE_DEVICES"] = ",".join(per_node[p["node_id"]])
        ray.get([w.update_env_vars.remote(env) for w, env in zip(self.workers, envs)])

    # -- running -----------------------------------------------------------------------

    def _check_started(self) -> None:
        if not self.workers:
            raise RuntimeError("the executor is not started: call start() first")

    def _grace_s(self) -> float:
        return float(setting(self.settings, "timeout_s", 30))

    def run(self, fn: Callable[..., Any], args: Optional[List] = None,
            kwargs: Optional[Dict] = None,
            callbacks: Optional[List[Callable]] = None) -> List[Any]:
        """``fn(*args, **kwargs)`` on every worker; the values in rank order. If it
        raises on a worker, that exception is raised here (after the other workers
        ended, or ``timeout_s`` later)."""
        if self._elastic is not None:
            return self._elastic.run(fn, args=args, kwargs=kwargs, callbacks=callbacks)
        args, kwargs = list(args or []), dict(kwargs or {})
        return self.execute(lambda _: fn(*args, **kwargs), callbacks=callbacks)

    def run_remote(self, fn: Callable[..., Any], args: Optional[List] = None,
                   kwargs: Optional[Dict] = None) -> List["ray.ObjectRef"]:
        """Like run(), without waiting: the ObjectRefs of the values, in rank order."""
        if self._elastic is not None:
            raise NotImplementedError("ObjectRefs cannot be returned from elastic runs: "
                                      "the workers come and go")
        self._check_started()
        args, kwargs = list(args or []), dict(kwargs or {})
        call_id = self._next_call_id()
        return [w.execute.remote(lambda _: fn(*args, **kwargs), call_id) for w in self.workers]

    def execute(self, fn: Callable[[Any], Any],
                callbacks: Optional[List[Callable]] = None) -> List[Any]:
        """``fn(executable)`` on every worker (the object made by
        ``start(executable_cls=...)``, else None); the values in rank order."""
        if self._elastic is not None:
            return self._elastic.execute(fn, callbacks=callbacks)
        self._check_started()
        with _common.Callbacks(callbacks) as cbs:
            if cbs.queue is not None:
                ray.get([w.set_queue.remote(cbs.queue) for w in self.workers])
            call_id = self._next_call_id()
            return _common.gather([w.execute.remote(fn, call_id) for w in self.workers],
                                  self._grace_s())

    def _next_call_id(self) -> int:
        self._calls += 1
        return self._calls

    def execute_single(self, fn: Callable[[Any], Any]) -> Any:
        """``fn(executable)`` on the rank 0 worker only; its value."""
        if self._elastic is not None:
            raise NotImplementedError("elastic jobs do not support execute_single: "
                                      "use execute or run")
        self._check_started()
        return ray.get(self.workers[0].execute.remote(fn))

    # -- stopping ----------------------------------------------------------------------

    def shutdown(self) -> None:
        """Kills the workers, removes the placement group it made and stops the store."""
        if self._elastic is not None:
            return self._elastic.shutdown()
        self._teardown()
        return None

    def _teardown(self) -> None:
        if self.workers:
            # Engines stopped in every worker first, so that none sees its peers
            # vanish mid-collective (and says so); a worker still busy is killed.
            refs = [w.stop_horovod.remote() for w in self.workers]
            try:
                ray.wait(refs, num_returns=len(refs), timeout=5.0)
            except Exception:  # pylint: disable=broad-except
                pass
        for w in self.workers:
            try:
                ray.kill(w, no_restart=True)
            except Exception:  # pylint: disable=broad-except
                pass
        self.workers, self.placements = [], []
        if self._pg is not None and self._own_pg:
            try:
                remove_placement_group(self._pg)
                # Removal is asynchronous: wait (briefly) until the resources are free
                # again, so that a job started next finds them.
                deadline = time.monotonic() + 5.0
                while (time.monotonic() < deadline and
                       placement_group_table(self._pg).get("state") != "REMOVED"):
                    time.sleep(0.05)
            except Exception:  # pylint: disable=broad-except
                pass
        self._pg = None
        if self._store is not None:
            self._store.stop()
            self._store = None


def _set_elastic(settings: Any, value: bool) -> None:
    try:
        settings.elastic = value
    except AttributeError:
        pass
