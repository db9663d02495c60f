"""TorchState's handlers: how each kind of object a TorchState holds is saved at
commit(), restored after a failure and synced from the sync root. ``StateHandler`` (the
interface), ``ModelStateHandler``, ``OptimizerStateHandler``,
``ShardedOptimizerStateHandler`` (a sharded optimizer's parts and their keepers'
copies), ``SchedulerStateHandler``, ``SamplerStateHandler``, and the registry that
picks one by type: ``get_handler_registry`` / ``set_handler_registry`` (Horovod's
names; ``horovod_torch.elastic.state`` re-exports them)."""
import copy
from typing import Any, Dict, List, Optional, Tuple, Type

import torch

from horovod_torch.engine import basics
from horovod_torch.common import elastic_worker as worker
from horovod_torch.training.elastic.sampler import ElasticSampler
from horovod_torch.common.exceptions import CommittedStateLostError
from horovod_torch.training.functions import (allgather_object, broadcast_object,
                                              broadcast_optimizer_state, broadcast_parameters)
from horovod_torch.collectives.ops import allgather
from horovod_torch.training import sharded_recovery
from horovod_torch.training.sharded import ShardedOptimizer

class StateHandler:
    """Saves, restores and syncs one kind of object held by a TorchState. Register a
    subclass for a type with set_handler_registry(). ``sync()`` broadcasts from
    ``self.root_rank`` (set by TorchState.sync() before it calls sync(): the rank
    holding the newest commit, usually 0)."""

    root_rank = 0

    def __init__(self, value: Any):
        self.value = value

    def prepare(self) -> None:
        """The collective part of the next save(), run by TorchState on every handler
        before any saves: it may fail, so it must leave the saved state as it is."""

    def save(self) -> None:
        raise NotImplementedError

    def restore(self) -> None:
        raise NotImplementedError

    def sync(self) -> None:
        raise NotImplementedError

    def reset(self) -> None:
        """After a reset of the job, before the sync (which a removed host skips)."""

    def set_value(self, value: Any) -> None:
        """``state.<name> = value``: track `value` from now on, saved as it is now."""
        self.value = value
        self.save()


class ModelStateHandler(StateHandler):
    """A module's state_dict, saved into copies allocated once (cheap every batch);
    restore is load_state_dict, sync is broadcast_parameters from rank 0."""

    def __init__(self, model: torch.nn.Module):
        super().__init__(model)
        self._saved_model_state: Dict[str, Any] = {}
        self.save()

    def save(self) -> None:
        saved = {}
        for k, v in self.value.state_dict().items():
            old = self._saved_model_state.get(k)
            if not isinstance(v, torch.Tensor):
                saved[k] = copy.deepcopy(v)
            elif (isinstance(old, torch.Tensor) and old.shape == v.shape
                  and old.dtype == v.dtype and old.device == v.device):
                old.copy_(v.detach())
                saved[k] = old
            else:
                saved[k] = v.detach().clone()
        self._saved_model_state = saved

    def restore(self) -> None:
        self.value.load_state_dict(self._saved_model_state)

    def sync(self) -> None:
        broadcast_parameters(self.value.state_dict(), root_rank=self.root_rank)
        self.save()


def _copy_into(dst: Any, src: Any) -> Any:
    """Copies nested optimizer state into the existing structure where shapes match."""
    if isinstance(src, torch.Tensor):
        if isinstance(dst, torch.Tensor) and dst.shape == src.shape and dst.dtype == src.dtype:
            dst.copy_(src)
            return dst
        return src.detach().clone()
    if isinstance(src, dict):
        base = dst if isinstance(dst, dict) else {}
        return {k: _copy_into(base.get(k), v) for k, v in src.items()}
    if isinstance(src, (list, tuple)):
        base = dst if isinstance(dst, (list, tuple)) and len(dst) == len(src) else [None] * len(src)
        return type(src)(_copy_into(d, s) for d, s in zip(base, src))
    return copy.deepcopy(src)


class OptimizerStateHandler(StateHandler):
    """An optimizer's state_dict; sync is broadcast_optimizer_state from rank 0."""

    def __init__(self, optimizer: torch.optim.Optimizer):
        super().__init__(optimizer)
        self._saved_optimizer_state = _copy_into(None, optimizer.state_dict())

    def save(self) -> None:
        self._saved_optimizer_state = _copy_into(self._saved_optimizer_state,
                                                 self.value.state_dict())

    def restore(self) -> None:
        # load_state_dict keeps the tensors it is given: hand it a copy, so later
        # steps do not update the commit in place.
        self.value.load_state_dict(copy.deepcopy(self._saved_optimizer_state))
        # A DistributedOptimizer may hold gradients in flight from the failed step.
        if hasattr(self.value, "_reset_pending"):
            self.value._reset_pending()

    def sync(self) -> None:
        broadcast_optimizer_state(self.value, root_rank=self.root_rank)
        self.save()


class ShardedOptimizerStateHandler(StateHandler):
    """A sharded DistributedOptimizer (shard_optimizer_state): at each commit every
    rank saves its own part of the state in host memory and sends a copy to its
    keeper, a rank on another host when there is one (sharded_recovery.keepers; the next rank
    on a single host), which keeps it (horovod_torch/training/sharded.py: one flat buffer per
    dtype, sent from the device). The part and the copies of the commit before stay
    until every rank has saved the new one (commit_complete), so an interrupted
    commit leaves the last complete one restorable. Before a host change, the workers
    that leave hand their parts to one that stays (hand_over). sync() sends each
    parameter's state of the agreed commit from a survivor holding it (its owner,
    else a keeper) to its owner in the new world; new workers get their parts the
    same way. A part lost with its every copy (a rank and its keeper lost at once)
    makes sync() raise CommittedStateLostError naming it. A removed host takes its
    part away too, so sync() runs after every reset."""

    sync_after_every_reset = True

    def __init__(self, optimizer: torch.optim.Optimizer):
        super().__init__(optimizer)
        self._seq = 0  # commits since the job's state was last agreed (same on every rank)
        self._saved = optimizer._part(0)  # this rank's part of the last commit
        self._copies: List[Dict[str, Any]] = []  # others' parts of it this rank keeps
        self._older: List[Dict[str, Any]] = []  # the commit before's, until the last is complete
        self._pending: Optional[Tuple[Dict[str, Any], List[Dict[str, Any]]]] = None
        self._infos = None  # every rank's offers, from missing() until sync()

    def _device(self) -> torch.device:
        return self.value._all_params()[0].device

    def _process_set(self):
        return self.value._process_set

    def prepare(self) -> None:
        """This rank's part of the next commit and the copies it keeps of others'
        (collective), held aside: the last commit is not touched."""
        part = self.value._part(self._seq + 1)
        copies = sharded_recovery.send_parts(part, basics.cross_rank(), sharded_recovery.keepers,
                                    self._device(), self._process_set())
        self._pending = (part, copies)

    def save(self) -> None:
        if self._pending is None:
            self.prepare()
        (part, copies), self._pending = self._pending, None
        self._older = [self._saved, *self._copies]
        self._saved, self._copies, self._seq = part, copies, self._seq + 1

    def commit_complete(self) -> None:
        self._older = []

    def hand_over(self, stays: bool) -> None:
        """Collective, before the workers that do not stay leave: each of them sends
        its part of the last commit to the next rank that stays, which keeps it (the
        sync after the reset finds it there). One allgather of a flag, and the parts'
        exchange only when some leave."""
        if self.value._shard() is None or self.value._shard().size == 1:
            return
        flags = allgather(torch.tensor([int(stays)]), name="sharded.staying",
                          process_set=self._process_set())
        staying = [bool(v) for v in flags.tolist()]
        n = len(staying)
        if all(staying) or not any(staying):
            return

        def targets(_):
            return [None if staying[r] else
                    next((r + k) % n for k in range(1, n) if staying[(r + k) % n])
                    for r in range(n)]
        self._copies += sharded_recovery.send_parts(self._saved, None, targets, self._device(),
                                           self._process_set())

    def restore(self) -> None:
        self._pending = None
        self.value._load_part_state(sharded_recovery.unpack(self._saved, self._device()),
                                    self._saved["param_groups"])

    def _offers(self) -> List[Dict[str, Any]]:
        return [self._saved, *self._copies, *self._older]

    def missing(self, root: int) -> List[int]:
        """The indices of the parameters whose part of the commit ``root`` holds
        nobody offers (empty: restorable). Collective on its first call after a
        reset, where every rank offers what it holds."""
        if self._infos is None:
            self._pending = None
            self._infos = sharded_recovery.gather_offers(self._offers(), self._process_set())
        seq = self._infos[root][0]["seq"]
        return sharded_recovery.missing(self._infos, seq, len(self.value._all_params()))

    def sync(self) -> None:
        lost = self.missing(self.root_rank)
        if lost:
            message = (f"committed state lost: the optimizer state of {len(lost)} "
                       f"parameter(s) (indices {lost[:8]}{' ...' if len(lost) > 8 else ''}) "
                       "was held only by a worker that is gone and by the worker that kept "
                       "its copy, also gone (a rank and its keeper lost at once). Resuming "
                       "would silently reset that state, so the job stops; restart it from "
                       "a checkpoint")
            if worker.is_elastic():
                worker.report_fatal(message)
            raise CommittedStateLostError(message)
        infos, self._infos = self._infos, None
        seq = infos[self.root_rank][0]["seq"]
        state, groups = sharded_recovery.reshard(self._offers(), infos, seq, self.value._shard(),
                                        self._device(), self._process_set())
        # Before any commit a part that left is the initial state: those parameters
        # start with none, as they did.
        self.value._load_part_state(state, groups)
        self._seq = seq
        self.save()
        self._older = []


class SchedulerStateHandler(StateHandler):
    """An LR scheduler: its state_dict is saved, restored and synced; the scheduler
    object itself (attached to the real optimizer) is kept."""

    def __init__(self, scheduler):
        super().__init__(scheduler)
        self._saved_scheduler_state = copy.deepcopy(scheduler.state_dict())

    def save(self) -> None:
        self._saved_scheduler_state = copy.deepcopy(self.value.state_dict())

    def restore(self) -> None:
        self.value.load_state_dict(copy.deepcopy(self._saved_scheduler_state))

    def sync(self) -> None:
        self._saved_scheduler_state = broadcast_object(self._saved_scheduler_state,
                                                       self.root_rank,
                                                       name="elastic.scheduler_state")
        self.restore()


class SamplerStateHandler(StateHandler):
    """ElasticSampler: every commit of an elastic job shares the indices each rank
    recorded since the last one (one allgather of the new ones), so every rank commits
    the progress of all, and a rank that leaves without a sync (a removed host, an
    evicted straggler) takes none of the epoch with it: the survivors re-shard exactly
    what nobody trained on. sync merges every rank's processed indices too (the union,
    over the ranks in the sync root's epoch), for indices recorded after the last
    commit. (Horovod shares them at sync only, which a host removal skips: the
    survivors then train again on what the removed rank and each other had trained on
    since the last sync.)"""

    def __init__(self, sampler: ElasticSampler):
        super().__init__(sampler)
        self._saved_sampler_state = copy.deepcopy(sampler.state_dict())
        self._shared = False

    def prepare(self) -> None:
        self._share_progress()
        self._shared = True

    def save(self) -> None:
        if not self._shared:
            self._share_progress()
        self._shared = False
        self._saved_sampler_state = copy.deepcopy(self.value.state_dict())

    def _share_progress(self) -> None:
        new = self.value.take_unshared()
        # Only an elastic job's commits are collective (elsewhere they are local).
        if not (worker.is_elastic() and basics.is_initialized() and basics.size() > 1):
            return
        rows = torch.tensor([[self.value.epoch, i] for i in new], dtype=torch.int64)
        every = allgather(rows.reshape(-1, 2), name="elastic.sampler_progress")
        others = every[every[:, 0] == self.value.epoch][:, 1].tolist()
        self.value.processed_indices.update(int(i) for i in others)

    def restore(self) -> None:
        self._shared = False
        self.value.load_state_dict(copy.deepcopy(self._saved_sampler_state))

    def reset(self) -> None:
        # Re-shard over the new world even when the sync is skipped (hosts removed).
        self.value.reset()

    def sync(self) -> None:
        states = allgather_object(self.value.state_dict(), name="elastic.sampler_state")
        merged = dict(states[self.root_rank])
        done = sorted({int(i) for s in states if s["epoch"] == merged["epoch"]
                       for i in s.get("processed_indices") or ()})
        merged.update(processed_indices=done, processed_num=len(done))
        self.value.load_state_dict(merged)
        self.save()


_handler_registry: List[Tuple[Type, Type[StateHandler]]] = [
    (torch.nn.Module, ModelStateHandler),
    (ShardedOptimizer, ShardedOptimizerStateHandler),
    (torch.optim.Optimizer, OptimizerStateHandler),
    (torch.optim.lr_scheduler.LRScheduler, SchedulerStateHandler),
    (ElasticSampler, SamplerStateHandler),
]


def get_handler_registry() -> List[Tuple[Type, Type[StateHandler]]]:
    """The (type, handler class) pairs TorchState consults, first match wins."""
    return _handler_registry


def set_handler_registry(registry: List[Tuple[Type, Type[StateHandler]]]) -> None:
    global _handler_registry
    _handler_registry = registry


def _handler_class(value: Any) -> Optional[Type[StateHandler]]:
    for handled_type, handler_cls in _handler_registry:
        if isinstance(value, handled_type):
            return handler_cls
    return None


def _get_handler(value: Any) -> Optional[StateHandler]:
    cls = _handler_class(value)
    return cls(value) if cls is not None else None
