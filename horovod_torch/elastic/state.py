"""Elastic state: what is saved at commit(), restored after a failure and
broadcast from rank 0 when the set of workers changes."""
import copy
from typing import Any, Callable, Dict, List

import torch

from horovod_torch import basics
from horovod_torch.elastic import worker
from horovod_torch.exceptions import HostsUpdatedInterrupt
from horovod_torch.functions import (allgather_object, broadcast_object,
                                     broadcast_optimizer_state, broadcast_parameters)
from horovod_torch.ops import broadcast_


class State:
    """Base class: commit() = save() + check_host_updates()."""

    def __init__(self):
        self._reset_callbacks: List[Callable[[], None]] = []

    def register_reset_callbacks(self, callbacks: List[Callable[[], None]]) -> None:
        """Callbacks run after every reset (e.g. to rescale the learning rate)."""
        self._reset_callbacks.extend(callbacks)

    def on_reset(self) -> None:
        self.reset()
        for cb in self._reset_callbacks:
            cb()

    def commit(self) -> None:
        """Saves the state and raises HostsUpdatedInterrupt if hosts changed."""
        self.save()
        self.check_host_updates()

    def check_host_updates(self) -> None:
        """Rank 0 asks the driver whether hosts changed and tells every rank, so all
        ranks raise HostsUpdatedInterrupt at the same point, or none does."""
        if not worker.is_elastic():
            return
        flag = torch.zeros(2, dtype=torch.int32)
        if basics.rank() == 0:
            removed_only = worker.host_update_since_init()
            if removed_only is not None:
                flag[0], flag[1] = 1, int(removed_only)
        broadcast_(flag, 0, name="elastic.check_host_updates")
        if flag[0]:
            raise HostsUpdatedInterrupt(skip_sync=bool(flag[1]))

    def save(self) -> None:
        raise NotImplementedError

    def restore(self) -> None:
        raise NotImplementedError

    def sync(self) -> None:
        raise NotImplementedError

    def reset(self) -> None:
        pass


class ObjectState(State):
    """Plain attributes (``state.epoch``), saved by value and synced from rank 0."""

    def __init__(self, bcast_object=broadcast_object, get_rank=None, **kwargs: Any):
        self._bcast_object = bcast_object
        self._saved_state: Dict[str, Any] = copy.deepcopy(kwargs)
        for k, v in kwargs.items():
            setattr(self, k, v)
        super().__init__()

    def _set_attrs(self) -> None:
        # Copies: changing a restored list in place must not change the commit.
        for k, v in self._saved_state.items():
            setattr(self, k, copy.deepcopy(v))

    def save(self) -> None:
        self._saved_state = {k: copy.deepcopy(getattr(self, k)) for k in self._saved_state}

    def restore(self) -> None:
        self._set_attrs()

    def sync(self) -> None:
        if self._saved_state:
            self._saved_state = self._bcast_object(self._saved_state, 0,
                                                   name="elastic.object_state")
            self._set_attrs()


class _ModelHandler:
    """Saves a module's state_dict into preallocated copies (cheap every batch)."""

    def __init__(self, model: torch.nn.Module):
        self.value = model
        self._saved = {k: v.detach().clone() for k, v in model.state_dict().items()}

    def save(self) -> None:
        for k, v in self.value.state_dict().items():
            saved = self._saved.get(k)
            if saved is None or saved.shape != v.shape or saved.dtype != v.dtype:
                self._saved[k] = v.detach().clone()
            else:
                saved.copy_(v.detach())

    def restore(self) -> None:
        self.value.load_state_dict(self._saved)

    def sync(self) -> None:
        broadcast_parameters(self.value.state_dict(), root_rank=0)
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


class _OptimizerHandler:
    def __init__(self, optimizer: torch.optim.Optimizer):
        self.value = optimizer
        self._saved = _copy_into(None, optimizer.state_dict())

    def save(self) -> None:
        self._saved = _copy_into(self._saved, self.value.state_dict())

    def restore(self) -> None:
        # load_state_dict keeps the tensors it is given: hand it a copy, so later
        # steps do not update the commit in place.
        self.value.load_state_dict(copy.deepcopy(self._saved))
        # A DistributedOptimizer may hold gradients in flight from the failed step.
        if hasattr(self.value, "_reset_pending"):
            self.value._reset_pending()

    def sync(self) -> None:
        broadcast_optimizer_state(self.value, root_rank=0)
        self.save()


class _SchedulerHandler:
    """An LR scheduler: its state_dict is saved, restored and synced; the scheduler
    object itself (attached to the real optimizer) is kept."""

    def __init__(self, scheduler):
        self.value = scheduler
        self._saved = copy.deepcopy(scheduler.state_dict())

    def save(self) -> None:
        self._saved = copy.deepcopy(self.value.state_dict())

    def restore(self) -> None:
        self.value.load_state_dict(copy.deepcopy(self._saved))

    def sync(self) -> None:
        self._saved = broadcast_object(self._saved, 0, name="elastic.scheduler_state")
        self.restore()

    def reset(self) -> None:
        pass


class _SamplerHandler:
    """ElasticSampler: the union of every rank's processed indices survives a reset."""

    def __init__(self, sampler):
        self.value = sampler
        self._saved = copy.deepcopy(sampler.state_dict())

    def save(self) -> None:
        self._saved = copy.deepcopy(self.value.state_dict())

    def restore(self) -> None:
        self.value.load_state_dict(self._saved)

    def reset(self) -> None:
        # Re-shard over the new world even when the sync is skipped (hosts removed).
        self.value.reset()

    def sync(self) -> None:
        states = allgather_object(self.value.state_dict(), name="elastic.sampler_state")
        merged = dict(states[0])
        merged["processed_indices"] = sorted({i for s in states for i in s["processed_indices"]})
        self.value.load_state_dict(merged)
        self.save()


def _handler_for(value: Any):
    from horovod_torch.elastic.sampler import ElasticSampler
    if isinstance(value, torch.nn.Module):
        return _ModelHandler(value)
    if isinstance(value, torch.optim.Optimizer):
        return _OptimizerHandler(value)
    if isinstance(value, torch.optim.lr_scheduler.LRScheduler):
        return _SchedulerHandler(value)
    if isinstance(value, ElasticSampler):
        return _SamplerHandler(value)
    return None


class TorchState(ObjectState):
    """State of a PyTorch training loop: a model, an optimizer, ElasticSamplers and
    any plain values (``TorchState(model, optimizer, epoch=1, batch=0)``)."""

    def __init__(self, model=None, optimizer=None, **kwargs: Any):
        kwargs.update(model=model, optimizer=optimizer)
        handlers = {}
        plain = {}
        for k, v in kwargs.items():
            h = _handler_for(v)
            if h is not None:
                handlers[k] = h
            elif v is not None or k not in ("model", "optimizer"):
                plain[k] = v
        object.__setattr__(self, "_handlers", handlers)
        for k, h in handlers.items():
            object.__setattr__(self, k, h.value)
        super().__init__(**plain)

    def __setattr__(self, name: str, value: Any) -> None:
        # `state.model = new_model` re-targets the handler to the new object.
        handlers = self.__dict__.get("_handlers")
        if handlers is not None and name in handlers and value is not handlers[name].value:
            h = _handler_for(value)
            if h is None:
                raise ValueError(f"state.{name} was a {type(handlers[name].value).__name__}; "
                                 f"cannot replace it with a {type(value).__name__}")
            handlers[name] = h
        object.__setattr__(self, name, value)

    def reset(self) -> None:
        for h in self._handlers.values():
            if hasattr(h, "reset"):
                h.reset()
        super().reset()

    def save(self) -> None:
        for h in self._handlers.values():
            h.save()
        super().save()

    def restore(self) -> None:
        for h in self._handlers.values():
            h.restore()
        super().restore()

    def sync(self) -> None:
        for h in self._handlers.values():
            h.sync()
        super().sync()
