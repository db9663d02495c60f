"""Elastic state: what is saved at commit(), restored after a failure and
broadcast when the set of workers changes: from the lowest rank that holds the newest
commit (rank 0 unless it is a new worker that has not synced yet). A worker knows
whether it holds a commit (``_commit_id``: None until it commits or syncs); rank 0 of
an elastic job records each commit's number in the store, and ``sync()`` raises
``CommittedStateLostError`` when no worker of the new generation holds the newest
commit (every worker that held it is gone).

Horovod's classes and names: ``State`` (with its host-update bookkeeping:
``on_hosts_updated``, ``check_host_updates``, ``_host_messages``,
``_last_updated_timestamp``), ``ObjectState``, ``TorchState``. TorchState's handlers
(``StateHandler``, ``ModelStateHandler``, ``OptimizerStateHandler``,
``SamplerStateHandler``, ``SchedulerStateHandler`` for LR schedulers, and
``get_handler_registry`` / ``set_handler_registry``) are in handlers.py; this module
re-exports them, as Horovod's has them."""
import copy
import queue
import sys
from typing import Any, Callable, Dict, List, Optional, Tuple

import torch

from horovod_torch import _C
from horovod_torch.engine import basics
from horovod_torch.engine.basics import rank  # noqa: F401  (Horovod's module has it)
from horovod_torch.common import elastic_worker as worker
from horovod_torch.training.elastic.handlers import (ShardedOptimizerStateHandler, _get_handler,
                                                     _handler_class)
from horovod_torch.common.elastic_worker import HostUpdateResult
from horovod_torch.common.exceptions import (CommittedStateLostError, HorovodInternalError,
                                             HostsUpdatedInterrupt)
from horovod_torch.training.functions import broadcast_object
from horovod_torch.collectives.ops import allgather, broadcast_

# Horovod's module has these names (its tests and users import them from here).
from horovod_torch.training.elastic.handlers import (ModelStateHandler,  # noqa: F401
                                                     OptimizerStateHandler, SamplerStateHandler,
                                                     SchedulerStateHandler, StateHandler,
                                                     get_handler_registry, set_handler_registry)
from horovod_torch.training.elastic.sampler import ElasticSampler  # noqa: F401
from horovod_torch.training.functions import (allgather_object,  # noqa: F401
                                              broadcast_optimizer_state, broadcast_parameters)


def fence_gpu_collectives() -> None:
    """Waits until the GPUs this process ran collectives on are idle, then raises
    HorovodInternalError if the engine failed meanwhile.

    A GPU collective's handle completes once the collective is queued, and the work
    queued after it (the optimizer's step) runs when it ends. When a peer dies or
    stops during it, the engine fails and aborts the NCCL communicator: the kernel
    ends with an undefined result, and that work runs on it. The failure is recorded
    before the abort, so a caller that finds the GPU idle and no failure saves state
    computed from completed collectives only, and one that finds a failure must not
    save (commit() restores the last commit instead)."""
    devices = _C.gpu_devices() if basics.is_initialized() else []
    if not devices:
        return
    try:
        for device in devices:
            torch.cuda.synchronize(device)
    except RuntimeError as exc:  # a CUDA error once the communicator was aborted
        code, message = _C.failure()
        if code:
            raise HorovodInternalError(message) from exc
        raise
    basics.raise_for_status(*_C.failure())


class _HostMessages(queue.Queue):
    """Host updates as (timestamp, HostUpdateResult), Horovod's ``state._host_messages``.

    Horovod's driver pushes them into every worker. Here the driver only writes its
    store, so ``poll()`` asks it and queues what is new (the generation number is the
    timestamp); ``empty()`` and ``qsize()`` poll first, so a script that waits with
    ``while state._host_messages.empty(): time.sleep(0.1)`` sees the update."""

    def __init__(self):
        super().__init__()
        self._posted = -1

    def poll(self) -> None:
        update = worker.poll_host_update()
        if update is not None and update[0] > self._posted:
            self._posted = update[0]
            self.put(update)

    def empty(self) -> bool:
        self.poll()
        return super().empty()

    def qsize(self) -> int:
        self.poll()
        return super().qsize()


def _number(x: float):
    return int(x) if float(x).is_integer() else float(x)


class State:
    """Base class: commit() = save() + check_host_updates().

    Commits are numbered from the job's start (1 = the first commit; 0 = the initial
    state agreed at the first sync). ``_commit_id`` is the number of the commit this
    worker holds as its saved state: set by commit() and by sync() (what the sync
    root held), None in a new worker until its first sync completes. A subclass that
    overrides sync() should call ``_agree_on_commit()`` first and broadcast from the
    root it returns (ObjectState and TorchState do).

    Args:
        bcast_object: broadcasts an object from rank 0 (default: hvd.broadcast_object).
        get_rank: returns this worker's rank (default: hvd.rank).
    """

    def __init__(self, bcast_object: Optional[Callable] = None,
                 get_rank: Optional[Callable[[], int]] = None):
        self._bcast_object = bcast_object or broadcast_object
        self._rank = get_rank or basics.rank
        self._host_messages = _HostMessages()
        self._last_updated_timestamp = 0
        self._reset_callbacks: List[Callable[[], None]] = []
        self._commit_id: Optional[int] = None
        self._published_commit: Optional[int] = None

    def register_reset_callbacks(self, callbacks: List[Callable[[], None]]) -> None:
        """Callbacks run after every reset (e.g. to rescale the learning rate)."""
        self._reset_callbacks.extend(callbacks)

    def on_reset(self) -> None:
        self._host_messages = _HostMessages()
        self.reset()
        for cb in self._reset_callbacks:
            cb()

    def on_hosts_updated(self, timestamp, update_res) -> None:
        """Queues a host update (what Horovod's driver notification calls); the next
        check_host_updates() acts on it if `timestamp` is newer than the last one."""
        self._host_messages.put((timestamp, update_res))

    def commit(self) -> None:
        """Saves the state and raises HostsUpdatedInterrupt if hosts changed. In an
        elastic job rank 0 then records the commit's number in the driver's store
        (one store write, after the collective of check_host_updates(), so once it is
        written every worker of the job has saved this commit). Raises
        HorovodInternalError, saving nothing, when a GPU collective the state may
        depend on was cut off by a failure (see fence_gpu_collectives).

        A commit is all or nothing on each worker: save() runs its collectives
        first and replaces the saved state only once they all succeeded (TorchState);
        what only some workers saved is settled by the next sync()."""
        fence_gpu_collectives()
        self.save()
        self._commit_id = (self._commit_id or 0) + 1
        self.check_host_updates()

    def _commit_counters(self) -> Dict[str, int]:
        """Integer attributes saved in the commit (e.g. epoch, batch), for messages."""
        return {}

    def describe_commit(self) -> str:
        """What restore() brings back, for messages: "commit 23 (epoch=1, batch=22)"."""
        if self._commit_id is None:
            return "the state it started with (no commit yet)"
        return f"commit {self._commit_id}{_counters_text(self._commit_counters())}"

    def _publish_commit(self) -> None:
        if self._commit_id is not None and self._commit_id != self._published_commit:
            worker.publish_commit(self._commit_id, self._commit_counters())
            self._published_commit = self._commit_id

    def _agree_on_commit(self) -> Tuple[int, int]:
        """The start of sync(), on every rank: returns (root, commit): the lowest rank
        holding the newest commit any rank holds (rank 0 when none holds one), and
        that commit's number (see _commits_held and sync_root)."""
        helds, job = self._commits_held()
        return sync_root(helds, job, self._commit_lost)

    def _commit_lost(self, root: int) -> bool:
        """Collective: whether part of the commit `root` holds is gone with workers
        that left (a sharded state's part and its every copy)."""
        return False

    def _commits_held(self) -> Tuple[List[int], int]:
        """(the commit each rank holds, -1 for none; the job's newest commit). One
        allgather of two numbers per rank (none in a world of one); in an elastic job
        each rank also reads the job's newest commit from the store. Raises
        CommittedStateLostError, on every rank, when the job has committed but no
        rank holds its newest commit."""
        held = -1 if self._commit_id is None else self._commit_id
        elastic = worker.is_elastic() and basics.is_initialized()
        job, counters = worker.last_commit() if elastic else (0, {})
        if basics.is_initialized() and basics.size() > 1:
            rows = allgather(torch.tensor([[held, job]], dtype=torch.int64),
                             name="elastic.sync_commits")
            helds = [int(v) for v in rows[:, 0].tolist()]
            newest_job = int(rows[:, 1].max().item())
            if newest_job != job:
                counters = {}
            job = newest_job
        else:
            helds = [held]
        best = max(helds)
        if job > 0 and best < job:
            message = _lost_message(job, counters, best, len(helds))
            if elastic:
                worker.report_fatal(message)
            raise CommittedStateLostError(message, commit=job, counters=counters)
        return helds, job

    def check_host_updates(self) -> None:
        """Raises HostsUpdatedInterrupt if a host update newer than the last one acted
        on was queued. In an elastic job rank 0 asks the driver and broadcasts its
        verdict, so every rank raises at the same point, or none does: a collective
        call. Outside an elastic job only updates queued by on_hosts_updated() count,
        and no collective is run."""
        elastic = worker.is_elastic() and basics.is_initialized()
        if elastic and basics.rank() == 0 and hasattr(self._host_messages, "poll"):
            try:
                worker.watch_straggler(basics.straggler_report())
            except Exception as exc:  # pylint: disable=broad-except
                # Never before the verdict's broadcast, which the others wait in.
                print(f"horovod_torch: straggler eviction check failed: {exc!r}",
                      file=sys.stderr, flush=True)
            self._host_messages.poll()
        prev = last = self._last_updated_timestamp
        update = HostUpdateResult.no_update
        while True:
            try:
                timestamp, res = self._host_messages.get_nowait()
            except queue.Empty:
                break
            if timestamp > last:
                last = timestamp
                update |= res
        if elastic:
            verdict = torch.tensor([prev, last, int(update)], dtype=torch.float64)
            broadcast_(verdict, 0, name="elastic.check_host_updates")
            prev, last = _number(verdict[0].item()), _number(verdict[1].item())
            update = HostUpdateResult(int(verdict[2].item()))
            if basics.rank() == 0:
                # Every rank has submitted this broadcast (the coordinator waits for
                # all of them), so every rank has saved the commit before it.
                self._publish_commit()
        self._commit_complete()
        self._last_updated_timestamp = last
        if last > prev:
            if elastic:
                self._before_leaving(int(last))
            raise HostsUpdatedInterrupt(skip_sync=(update == HostUpdateResult.removed))

    def _commit_complete(self) -> None:
        """Every worker has saved the last commit (check_host_updates' collective)."""

    def _before_leaving(self, generation: int) -> None:
        """Collective, when the hosts changed, before any worker leaves the job: the
        workers not in `generation` can still hand their state over."""

    def must_sync_after_reset(self) -> bool:
        """Whether sync() must run after every reset, also when hosts were only
        removed (where the survivors' states already agree and it is skipped)."""
        return False

    def save(self) -> None:
        """Saves the state in host memory."""
        raise NotImplementedError

    def restore(self) -> None:
        """Brings back the last saved state."""
        raise NotImplementedError

    def sync(self) -> None:
        """Makes every rank's state the one of the rank holding the newest commit."""
        raise NotImplementedError

    def reset(self) -> None:
        """Runs after a reset of the job, before the sync."""


class ObjectState(State):
    """Plain attributes (``state.epoch``), saved by value and synced from rank 0."""

    def __init__(self, bcast_object: Optional[Callable] = None,
                 get_rank: Optional[Callable[[], int]] = None, **kwargs: Any):
        self._saved_state: Dict[str, Any] = copy.deepcopy(kwargs)
        for k, v in kwargs.items():
            setattr(self, k, v)
        super().__init__(bcast_object=bcast_object, get_rank=get_rank)

    def _set_attrs(self) -> None:
        # Copies: changing a restored list in place must not change the commit.
        for k, v in self._saved_state.items():
            setattr(self, k, copy.deepcopy(v))

    def save(self) -> None:
        self._saved_state = {k: copy.deepcopy(getattr(self, k)) for k in self._saved_state}

    def restore(self) -> None:
        self._set_attrs()

    def _commit_counters(self) -> Dict[str, int]:
        return {k: v for k, v in self._saved_state.items() if type(v) is int}

    def sync(self) -> None:
        """Makes every rank's state that of the rank holding the newest commit (see
        _agree_on_commit); afterwards this worker holds that commit."""
        root, commit = self._agree_on_commit()
        self._sync_from(root)
        self._commit_id = commit

    def _sync_from(self, root: int) -> None:
        if self._saved_state:
            if self._bcast_object is broadcast_object or root != 0:
                self._saved_state = broadcast_object(self._saved_state, root,
                                                     name="elastic.object_state")
            else:  # Horovod's convention for a user's function: bcast_object(obj)
                self._saved_state = self._bcast_object(self._saved_state)
            self._set_attrs()


def sync_root(helds: List[int], job: int, lost: Callable[[int], bool]) -> Tuple[int, int]:
    """(root, commit) for a sync, given the commit each rank holds (-1: none) and the
    job's newest (0: none): the lowest rank holding the newest commit, or, when
    `lost(root)` says that part of what that commit needs is gone, the commit before
    if a rank still holds it and the job never recorded the newer one (a commit
    interrupted after some workers saved it). Else the newest, whose sync then
    raises CommittedStateLostError."""
    best = max(helds)
    for c in (best, best - 1):
        if c >= max(job, 0) and c in helds and not lost(helds.index(c)):
            return helds.index(c), c
    return helds.index(best), max(best, 0)


def _counters_text(counters: Dict[str, int]) -> str:
    """ " (epoch=1, batch=22)" for a commit's integer attributes; "" when none."""
    text = ", ".join(f"{k}={v}" for k, v in list(counters.items())[:8])
    return f" ({text})" if text else ""


def _lost_message(job: int, counters: Dict[str, int], best: int, size: int) -> str:
    saved = _counters_text(counters).replace(" (", " (saved with ", 1)
    held = ("none holds a committed state (they joined after it and had not synced "
            "yet)" if best < 0 else
            "none holds a commit of this job" if best == 0 else
            f"the newest commit they hold is commit {best}")
    return (f"committed state lost: the last commit (commit {job}) was held only by "
            f"workers that are gone{saved}; of the {size} worker(s) of generation "
            f"{worker.current_generation_of_this_worker()}, {held}. Resuming would "
            "silently restart training from an older state, so the job stops; restart "
            "it from a checkpoint")


class TorchState(ObjectState):
    """State of a PyTorch training loop: a model, an optimizer, ElasticSamplers, LR
    schedulers and any plain values (``TorchState(model, optimizer, epoch=1, batch=0)``).
    Objects of a type in the handler registry get that handler; others are plain
    values (deep-copied, synced with broadcast_object)."""

    def __init__(self, model=None, optimizer=None, **kwargs: Any):
        kwargs.update(model=model, optimizer=optimizer)
        handlers = {}
        plain = {}
        for k, v in kwargs.items():
            h = _get_handler(v)
            if h is not None:
                handlers[k] = h
            elif v is not None or k not in ("model", "optimizer"):
                plain[k] = v
        object.__setattr__(self, "_handlers", handlers)
        for k, h in handlers.items():
            object.__setattr__(self, k, h.value)
        for k in ("model", "optimizer"):  # readable when not given, but not tracked
            if k not in handlers and k not in plain:
                object.__setattr__(self, k, None)
        super().__init__(bcast_object=broadcast_object, get_rank=basics.rank, **plain)

    def __setattr__(self, name: str, value: Any) -> None:
        # `state.model = new_model` makes the handler track the new object.
        handlers = self.__dict__.get("_handlers")
        if handlers is not None and name in handlers and value is not handlers[name].value:
            cls = _handler_class(value)
            if cls is None:
                raise ValueError(f"state.{name} was a {type(handlers[name].value).__name__}; "
                                 f"cannot replace it with a {type(value).__name__}")
            if isinstance(handlers[name], cls):
                handlers[name].set_value(value)
            else:
                handlers[name] = cls(value)
        object.__setattr__(self, name, value)

    def reset(self) -> None:
        for h in self._handlers.values():
            if hasattr(h, "reset"):
                h.reset()
        super().reset()

    def must_sync_after_reset(self) -> bool:
        return any(getattr(h, "sync_after_every_reset", False) for h in self._handlers.values())

    def save(self) -> None:
        # First every collective (which a peer's failure can interrupt), then the
        # local copies: a failure leaves this worker's last commit whole.
        for h in self._handlers.values():
            h.prepare()
        for h in self._handlers.values():
            h.save()
        super().save()

    def _sharded(self) -> List["ShardedOptimizerStateHandler"]:
        return [h for h in self._handlers.values()
                if isinstance(h, ShardedOptimizerStateHandler)]

    def _commit_complete(self) -> None:
        for h in self._sharded():
            h.commit_complete()

    def _before_leaving(self, generation: int) -> None:
        sharded_handlers = self._sharded()
        if sharded_handlers:
            stays = worker.assigned_in(generation)
            for h in sharded_handlers:
                h.hand_over(stays)

    def _commit_lost(self, root: int) -> bool:
        # Sharded parts are per worker: a commit interrupted after some workers saved
        # it may lack the copy of a dead worker's part; the commit before is complete.
        return any(h.missing(root) for h in self._sharded())

    def restore(self) -> None:
        for h in self._handlers.values():
            h.restore()
        super().restore()

    def _sync_from(self, root: int) -> None:
        for h in self._handlers.values():
            h.root_rank = root
            h.sync()
        super()._sync_from(root)
