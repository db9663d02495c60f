"""Horovod's elastic API as its users touch it: ElasticSampler's processed_num /
processed_indices / remaining_indices / get_indices and Horovod's state_dict keys;
TorchState's handler classes and registry; State's host-update bookkeeping
(on_hosts_updated, check_host_updates, _host_messages, _last_updated_timestamp);
run_fn and the notification manager. One process, no launcher."""
import pytest
import torch
import torch.nn as nn
from torch.utils.data import DataLoader

import horovod.torch as hvd
from horovod.common.elastic import (HostUpdateResult, ObjectState, State,
                                    notification_manager, run_fn)
from horovod.torch.elastic import ElasticSampler, TorchState
from horovod.torch.elastic.state import (ModelStateHandler, OptimizerStateHandler,
                                         SamplerStateHandler, StateHandler,
                                         get_handler_registry, set_handler_registry)
from horovod_torch import basics
from horovod_torch.elastic import worker
from horovod_torch.elastic.state import SchedulerStateHandler
from horovod_torch.exceptions import HostsUpdatedInterrupt

LAUNCHER_VARS = ("HOROVOD_RANK", "OMPI_COMM_WORLD_RANK", "RANK", "SLURM_PROCID",
                 "HOROVOD_ELASTIC")


@pytest.fixture
def no_launcher(monkeypatch):
    for v in LAUNCHER_VARS:
        monkeypatch.delenv(v, raising=False)


@pytest.fixture
def world_of_one(no_launcher):
    hvd.init()
    try:
        yield
    finally:
        hvd.shutdown()


def _loader(sampler, n, batch):
    return DataLoader(list(range(n)), batch_size=batch, sampler=sampler)


# ------------------------------------------------------------------------ ElasticSampler

def test_processed_num_counts_recorded_samples(world_of_one):
    n, batch = 12, 3
    sampler = ElasticSampler(list(range(n)), shuffle=True, seed=4)
    loader = _loader(sampler, n, batch)
    state = TorchState(sampler=sampler)
    state.sync()
    assert state.sampler.processed_num == 0 and state.sampler.epoch == 0
    for epoch in range(2):
        sampler.set_epoch(epoch)
        assert sampler.processed_num == 0
        for i, xb in enumerate(loader):
            assert xb.tolist() == sampler.get_indices(i, batch)
            sampler.record_batch(i, batch)
            assert sampler.processed_num == batch * (i + 1)
        assert sampler.processed_num == n and sampler.processed_indices == set(range(n))
    # Iterating again without set_epoch or a reset repeats the same samples.
    assert len(list(loader)) == n // batch and len(sampler) == n


def test_restore_in_the_middle_of_a_pass_keeps_its_batch_numbers(world_of_one):
    n, batch = 12, 3
    sampler = ElasticSampler(list(range(n)), shuffle=True, seed=1)
    state = TorchState(sampler=sampler)
    sampler.set_epoch(5)
    loader = _loader(sampler, n, batch)
    it = iter(loader)
    seen = [next(it).tolist() for _ in range(3)]
    sampler.record_batch(0, batch)
    sampler.record_batch(1, batch)
    state.commit()
    sampler.record_batch(2, batch)
    state.restore()  # back to 2 batches; the loop goes on with batch 2 of this pass
    assert sampler.processed_num == 2 * batch
    assert sampler.get_indices(2, batch) == seen[2]
    sampler.record_batch(2, batch)
    assert sampler.processed_indices == {i for b in seen for i in b}
    state.commit()
    state.sync()
    assert sampler.processed_num == 3 * batch and len(sampler) == n - 3 * batch
    rest = [xb.tolist() for xb in loader]  # a new pass: the one batch left
    assert len(rest) == 1 and not set(rest[0]) & sampler.processed_indices
    assert sorted(rest[0] + [i for b in seen for i in b]) == list(range(n))


def test_load_state_dict_reads_horovods_processed_num(no_launcher):
    n = 10
    s = ElasticSampler(list(range(n)), shuffle=True, seed=7)
    s.set_epoch(2)
    order = list(s)
    t = ElasticSampler(list(range(n)), shuffle=True, seed=7)
    t.load_state_dict({"epoch": 2, "processed_num": 4})  # Horovod's keys
    assert t.epoch == 2 and t.processed_num == 4
    assert t.processed_indices == set(order[:4])
    assert t.remaining_indices == order[4:] and list(t) == order[4:] and len(t) == 6
    sd = t.state_dict()
    assert sd["epoch"] == 2 and sd["processed_num"] == 4
    assert sd["processed_indices"] == sorted(order[:4])
    # Assigning processed_num means Horovod's "the first k of the epoch's order".
    t.processed_num = 7
    t.reset()
    assert list(t) == order[7:] and (t.num_samples, t.total_size) == (3, 3)
    assert (t.num_replicas, t.rank) == (1, 0)


def test_record_indices_and_get_indices(no_launcher):
    s = ElasticSampler(list(range(8)), shuffle=False)
    assert list(s) == list(range(8))
    assert s.get_indices(1, 3) == [3, 4, 5] and s.get_indices(2, 3) == [6, 7]
    s.record_indices([6, 7])
    s.record_batch(0, 3)
    assert s.processed_indices == {0, 1, 2, 6, 7} and s.processed_num == 5
    s.reset()
    assert s.remaining_indices == [3, 4, 5] and len(s) == 3


def test_a_reset_into_another_world_starts_a_new_pass(monkeypatch, no_launcher):
    s = ElasticSampler(list(range(20)), shuffle=False)
    assert list(s)[:4] == [0, 1, 2, 3]
    s.record_batch(0, 2)
    s.record_batch(1, 2)
    monkeypatch.setattr(basics, "is_initialized", lambda: True)
    monkeypatch.setattr(basics, "size", lambda: 2)
    monkeypatch.setattr(basics, "rank", lambda: 1)
    s.reset()
    assert s.indices == [5, 7, 9, 11, 13, 15, 17, 19]
    assert s.get_indices(0, 2) == [5, 7]  # batch 0 of the new shard
    s.record_batch(0, 2)
    assert s.processed_indices == {0, 1, 2, 3, 5, 7}


# ------------------------------------------------------------------ TorchState handlers

class _Box:
    def __init__(self, v):
        self.v = v


class _BoxHandler(StateHandler):
    def __init__(self, value):
        super().__init__(value)
        self.saved = value.v

    def save(self):
        self.saved = self.value.v

    def restore(self):
        self.value.v = self.saved

    def sync(self):
        pass


def test_default_handlers_and_a_registered_one(no_launcher):
    model = nn.Linear(2, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1)
    sampler = ElasticSampler(list(range(4)))
    before = list(get_handler_registry())
    set_handler_registry(before + [(_Box, _BoxHandler)])
    try:
        box = _Box(1)
        state = TorchState(model, opt, sampler=sampler, sched=sched, box=box, epoch=0)
        kinds = {k: type(h) for k, h in state._handlers.items()}
        assert kinds == {"model": ModelStateHandler, "optimizer": OptimizerStateHandler,
                         "sampler": SamplerStateHandler, "sched": SchedulerStateHandler,
                         "box": _BoxHandler}
        box.v = 2
        state.commit()
        box.v = 3
        state.restore()
        assert box.v == 2
        # Reassigning a handled attribute: the handler tracks the new object, saved now.
        other = _Box(10)
        handler = state._handlers["box"]
        state.box = other
        assert state._handlers["box"] is handler and handler.value is other
        other.v = 11
        state.restore()
        assert other.v == 10 and state.box is other
        with pytest.raises(ValueError):
            state.model = "not a model"
    finally:
        set_handler_registry(before)
    assert get_handler_registry() == before
    plain = TorchState(sampler=sampler)
    assert plain.model is None and plain.optimizer is None  # readable, as in Horovod


def test_reassigned_model_restores_its_own_state(no_launcher):
    state = TorchState(nn.Linear(3, 2))
    new = nn.Sequential(nn.Linear(3, 4), nn.Linear(4, 1))
    state.model = new
    committed = {k: v.clone() for k, v in new.state_dict().items()}
    with torch.no_grad():
        for p in new.parameters():
            p.add_(1.0)
    state.restore()  # the old model's keys are gone from the saved state
    assert all(torch.equal(new.state_dict()[k], v) for k, v in committed.items())


# ---------------------------------------------------------------- host-update bookkeeping

def test_host_updates_queued_by_hand(no_launcher):
    state = TorchState(epoch=0)
    assert state._last_updated_timestamp == 0 and state._host_messages.empty()
    state.commit()  # nothing queued
    state.on_hosts_updated(5, HostUpdateResult.added)
    with pytest.raises(HostsUpdatedInterrupt) as e:
        state.commit()
    assert e.value.skip_sync is False and state._last_updated_timestamp == 5
    state.commit()  # acted on once
    state.on_hosts_updated(4, HostUpdateResult.added)  # older than the last one
    state.check_host_updates()
    state.on_hosts_updated(7, HostUpdateResult.removed)
    with pytest.raises(HostsUpdatedInterrupt) as e:
        state.check_host_updates()
    assert e.value.skip_sync is True
    state.on_hosts_updated(8, HostUpdateResult.removed)
    state.on_hosts_updated(9, HostUpdateResult.added)
    with pytest.raises(HostsUpdatedInterrupt) as e:
        state.check_host_updates()
    assert e.value.skip_sync is False and state._last_updated_timestamp == 9
    state.on_hosts_updated(20, HostUpdateResult.added)
    state.on_reset()  # a reset drops what was queued before it
    state.commit()


def test_host_updates_from_the_elastic_driver(world_of_one, monkeypatch):
    """In an elastic job rank 0 asks the driver's store; a script waiting with
    `while state._host_messages.empty(): sleep()` sees the update too."""
    news = []
    monkeypatch.setattr(worker, "is_elastic", lambda: True)
    monkeypatch.setattr(worker, "poll_host_update", lambda: news[-1] if news else None)
    state = TorchState(nn.Linear(2, 1), batch=0)
    state.commit()
    assert state._host_messages.empty()
    news.append((3, HostUpdateResult.removed))
    assert not state._host_messages.empty() and state._host_messages.qsize() == 1
    with pytest.raises(HostsUpdatedInterrupt) as e:
        state.commit()
    assert e.value.skip_sync is True and state._last_updated_timestamp == 3
    state.commit()  # the same generation is not reported twice
    news.append((4, HostUpdateResult.added))
    with pytest.raises(HostsUpdatedInterrupt) as e:
        state.commit()
    assert e.value.skip_sync is False and state._last_updated_timestamp == 4


# ----------------------------------------------------------------------- run_fn, State

def test_run_fn_with_a_custom_reset_and_one_argument_bcast(no_launcher):
    events = []

    def bcast(obj):  # Horovod's convention for ObjectState's bcast_object
        events.append("bcast")
        return obj

    state = ObjectState(bcast, lambda: 0, step=0)
    assert isinstance(state, State)
    state.register_reset_callbacks([lambda: events.append("callback")])

    def reset():
        events.append("reset")

    def train(state, limit):
        events.append(("train", state.step))
        assert state in notification_manager._listeners
        if len(events) < 4:
            state.step += 1
            state.commit()
            notification_manager.handle_hosts_updated(1, HostUpdateResult.removed)
            state.check_host_updates()
        return state.step * limit

    assert run_fn(train, reset)(state, 10) == 10
    assert events == ["bcast", ("train", 0), "reset", "callback", ("train", 1)]
    assert state not in notification_manager._listeners
