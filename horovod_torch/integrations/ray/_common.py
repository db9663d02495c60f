"""What the static and the elastic Ray executors share: settings, the rendezvous
store in the driver process, the workers' environment, reading Ray's view of the
cluster, callbacks, and waiting for the workers' results."""
from __future__ import annotations

import math
import secrets
import sys
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import ray

from horovod_torch.runner import network
from horovod_torch.runner.hosts import SlotInfo


@dataclass
class Settings:
    """What ``RayExecutor.create_settings`` / ``ElasticRayExecutor.create_settings``
    return (Horovod's MiniSettings / ElasticSettings). Used: ``timeout_s`` (the
    workers' start and rendezvous timeout, HOROVOD_START_TIMEOUT),
    ``placement_group_timeout_s``, ``nics`` (the driver's interface for the store),
    ``verbose``, and for elastic jobs ``min_num_proc``, ``max_num_proc``,
    ``reset_limit``, ``elastic_timeout``, ``cooldown_range``. ``ssh_*`` and ``key`` are
    accepted for compatibility and unused: the workers are Ray actors (no ssh), and
    each job draws a fresh secret for its store."""
    timeout_s: int = 30
    placement_group_timeout_s: int = 100
    ssh_identity_file: Optional[str] = None
    ssh_port: Optional[int] = None
    nics: Any = None
    verbose: int = 1
    elastic: bool = False
    key: Any = None
    # elastic jobs
    min_num_proc: Optional[int] = None
    max_num_proc: Optional[int] = None
    num_proc: Optional[int] = None
    reset_limit: Optional[int] = None
    elastic_timeout: int = 600
    cooldown_range: Optional[Tuple[float, float]] = None
    discovery: Any = None
    extra: Dict[str, Any] = field(default_factory=dict)

    @property
    def start_timeout(self) -> float:
        return float(self.timeout_s)


def setting(settings: Any, name: str, default: Any) -> Any:
    """A value of our Settings or of any object a script passes (a Horovod Settings
    object: ``start_timeout`` is a Timeout there)."""
    value = getattr(settings, name, None)
    if value is None and name == "timeout_s":
        value = getattr(settings, "start_timeout", None)
        value = getattr(value, "_timeout", value)  # Horovod's Timeout object
    return default if value is None else value


def ensure_ray() -> None:
    """Connects to Ray as ``ray.remote`` would (``ray.init()`` when not yet), and
    refuses Ray Client: the store runs in this process, which must be a node of
    the cluster."""
    try:
        from ray.util.client import ray as client_ray  # pylint: disable=import-outside-toplevel
        if client_ray.is_connected():
            raise NotImplementedError(
                "horovod_torch.ray does not support Ray Client (ray://) drivers: the "
                "rendezvous store runs in the driver process, which the workers must reach; "
                "run the driver on a node of the cluster (ray.init(address='auto'))")
    except ImportError:
        pass
    if not ray.is_initialized():
        ray.init()


def alive_nodes() -> List[dict]:
    return [n for n in ray.nodes() if n.get("Alive", n.get("alive", False))]


def bundle_for(cpus: float, gpus: float) -> Dict[str, float]:
    bundle = {"CPU": float(cpus)}
    if gpus:
        bundle["GPU"] = float(gpus)
    return bundle


def fits(node_resources: Dict[str, float], bundle: Dict[str, float]) -> int:
    """How many ``bundle``s fit a node's total resources."""
    counts = [math.floor(node_resources.get(r, 0.0) / v + 1e-9)
              for r, v in bundle.items() if v > 0]
    return max(0, min(counts)) if counts else 1 << 30


def describe_nodes(nodes: Sequence[dict]) -> str:
    parts = []
    for n in nodes:
        res = n.get("Resources", {})
        desc = f"{res.get('CPU', 0):g} CPU"
        if res.get("GPU"):
            desc += f", {res['GPU']:g} GPU"
        parts.append(f"{n.get('NodeManagerAddress', '?')} ({n['NodeID'][:8]}): {desc}")
    return "; ".join(parts) or "no alive node"


def check_fits(what: str, bundle: Dict[str, float], count: int, strategy: str) -> None:
    """Raises ValueError at once when ``count`` bundles can never be placed with
    ``strategy`` on the cluster's alive nodes (their total resources), instead of
    letting the placement group wait for resources that do not exist."""
    nodes = alive_nodes()
    per_node = [fits(n.get("Resources", {}), bundle) for n in nodes]
    if strategy == "STRICT_PACK":
        ok, need = max(per_node, default=0) >= count, f"one node with room for all {count}"
    elif strategy == "STRICT_SPREAD":
        ok, need = sum(1 for c in per_node if c) >= count, f"{count} nodes with room for one"
    else:
        ok, need = sum(per_node) >= count, f"room for {count}"
    if ok:
        return
    wanted = ", ".join(f"{v:g} {r}" for r, v in bundle.items())
    total = {r: sum(n.get("Resources", {}).get(r, 0.0) for n in nodes) for r in bundle}
    have = ", ".join(f"{v:g} {r}" for r, v in total.items())
    raise ValueError(
        f"{what} needs {need} of {{{wanted}}} ({strategy} placement), but the Ray cluster "
        f"has {have} in total ({describe_nodes(nodes)}); use fewer workers or fewer "
        "resources per worker, or add nodes to the cluster")


def store_address(settings: Any) -> str:
    """The driver's address the workers reach the store at: the first of the
    ``nics`` that has an IPv4 or global IPv6 address, else the address Ray uses for
    this node (which every node of the cluster reaches)."""
    nics = setting(settings, "nics", None)
    if nics:
        names = nics.split(",") if isinstance(nics, str) else list(nics)
        return network.store_address(names, [])
    return ray.util.get_node_ip_address()


class Store:
    """The job's rendezvous store, in the driver process, with a fresh secret:
    no connection without the secret is served."""

    def __init__(self, settings: Any) -> None:
        from horovod_torch import _C  # pylint: disable=import-outside-toplevel
        self.addr = store_address(settings)
        self.secret = secrets.token_hex(16)
        self.server = _C.StoreServer(self.addr, 0, self.secret)
        self.port = int(self.server.port())

    def env(self, slot: SlotInfo, start_timeout: float) -> Dict[str, str]:
        """What horovodrun sets for a worker placed at ``slot``."""
        env = slot.to_env()
        env.update({
            "HOROVOD_STORE_ADDR": self.addr,
            "HOROVOD_STORE_PORT": str(self.port),
            "HOROVOD_SECRET": self.secret,
            "HOROVOD_CONTROLLER": "tcp",
            "HOROVOD_START_TIMEOUT": str(start_timeout),
            "PYTHONUNBUFFERED": "1",
        })
        return env

    def stop(self) -> None:
        if self.server is not None:
            self.server.stop()
            self.server = None


class Callbacks:
    """Drains values sent with ``ray_logger.log`` to ``callbacks`` on the driver
    (a Ray queue actor, made only when there are callbacks)."""

    def __init__(self, callbacks: Optional[Sequence[Callable]]) -> None:
        self.callbacks = list(callbacks or [])
        self.queue = None
        if self.callbacks:
            from ray.util.queue import Queue  # pylint: disable=import-outside-toplevel
            self.queue = Queue(actor_options={"num_cpus": 0})
        self._stop = threading.Event()
        self._thread: Optional[threading.Thread] = None

    def __enter__(self) -> "Callbacks":
        if self.queue is not None:
            self._thread = threading.Thread(target=self._drain_loop, daemon=True,
                                            name="horovod_torch-ray-callbacks")
            self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        if self.queue is None:
            return
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=30)
        try:
            self.queue.shutdown()
        except Exception:  # pylint: disable=broad-except
            pass

    def _drain(self) -> None:
        while True:
            try:
                items = self.queue.get_nowait_batch(self.queue.qsize())
            except Exception:  # pylint: disable=broad-except
                return
            if not items:
                return
            for item in items:
                for cb in self.callbacks:
                    cb(item)

    def _drain_loop(self) -> None:
        while not self._stop.is_set():
            self._drain()
            self._stop.wait(0.1)
        self._drain()


def is_consequence(exc: BaseException) -> bool:
    """A worker's HorovodInternalError: a peer failed first (that peer's error is
    the one to report)."""
    cause = getattr(exc, "cause", None)
    return type(cause).__name__ == "HorovodInternalError"


def gather(refs: Sequence["ray.ObjectRef"], grace_s: float) -> List[Any]:
    """The values of ``refs`` in order. When one fails, the others get ``grace_s``
    seconds to end (a worker whose function raised shut its engine down, so peers
    blocked in a collective fail too); then the first failure that is not merely
    a peer's HorovodInternalError is raised (else the first failure)."""
    pending = list(refs)
    errors: List[BaseException] = []
    deadline = math.inf
    while pending:
        timeout = None if not errors else max(0.0, deadline - time.monotonic())
        done, pending = ray.wait(pending, num_returns=1, timeout=timeout)
        if not done:
            break  # the grace period is over
        try:
            ray.get(done[0])
        except Exception as exc:  # pylint: disable=broad-except
            if not errors:
                deadline = time.monotonic() + grace_s
            errors.append(exc)
    if errors:
        raise next((e for e in errors if not is_consequence(e)), errors[0])
    return ray.get(list(refs))


def log(message: str) -> None:
    sys.stdout.flush()
    sys.stderr.write(f"horovod_torch.ray: {message}\n")
    sys.stderr.flush()
