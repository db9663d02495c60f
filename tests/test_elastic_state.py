"""hvd.elastic state: ObjectState / TorchState save, restore and sync, and the
ElasticSampler's sharding and re-sharding across resets.

World-of-one tests run in the pytest process; multi-rank ones use run_workers with the
functions in tests/elastic_state_workers.py."""
import copy
import json
import math
from collections import Counter

import pytest
import torch
import torch.nn as nn

import horovod_torch as hvd
from horovod_torch import basics
from horovod_torch.elastic import ElasticSampler, ObjectState, TorchState
from horovod_torch.exceptions import HorovodInternalError
from tests.harness import describe, run_workers

W = "tests.elastic_state_workers"
LAUNCHER_VARS = ("HOROVOD_RANK", "OMPI_COMM_WORLD_RANK", "RANK", "SLURM_PROCID",
                 "HOROVOD_ELASTIC")


@pytest.fixture
def world_of_one():
    """hvd.init() in this process with no launcher: a world of one."""
    with pytest.MonkeyPatch.context() as mp:
        for v in LAUNCHER_VARS:
            mp.delenv(v, raising=False)
        hvd.init()
        assert (hvd.rank(), hvd.size()) == (0, 1)
        try:
            yield
        finally:
            hvd.shutdown()


def _fake_world(monkeypatch, size: int, rank: int) -> None:
    """What ElasticSampler.reset() reads as the world, without starting one."""
    monkeypatch.setattr(basics, "is_initialized", lambda: True)
    monkeypatch.setattr(basics, "size", lambda: size)
    monkeypatch.setattr(basics, "rank", lambda: rank)


def _model_and_adam():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(5, 4), nn.BatchNorm1d(4), nn.Linear(4, 2))
    return model, torch.optim.Adam(model.parameters(), lr=0.01)


def _train_step(model, opt, seed):
    g = torch.Generator().manual_seed(seed)
    model.train()
    opt.zero_grad()
    model(torch.randn(8, 5, generator=g)).pow(2).mean().backward()
    opt.step()


def _assert_model_equal(model, expect: dict):
    got = model.state_dict()
    assert got.keys() == expect.keys()
    for k in got:
        assert torch.equal(got[k], expect[k]), f"model[{k}]: {got[k]} != {expect[k]}"


def _assert_opt_equal(opt, expect: dict):
    got = opt.state_dict()
    assert got["param_groups"] == expect["param_groups"]
    assert got["state"].keys() == expect["state"].keys()
    for pid, s in got["state"].items():
        for k, v in s.items():
            e = expect["state"][pid][k]
            assert torch.equal(v, e) if torch.is_tensor(v) else v == e, \
                f"optimizer state[{pid}][{k}]: {v} != {e}"


# ----------------------------------------------------------------- ObjectState, one rank

def test_object_state_commit_restore_and_assignment_syntax():
    state = ObjectState(epoch=0, batch=0, lr=0.1, history=[], cfg={"a": 1})
    state.epoch = 3
    state.history.append("x")
    state.cfg["a"] = 2
    for state.batch, _ in enumerate("abcdefg"):
        if state.batch == 4:
            state.commit()
    assert state.batch == 6
    state.epoch = 4
    state.lr = 0.5
    state.history.append("y")
    state.cfg["a"] = 9
    state.restore()
    assert (state.epoch, state.batch, state.lr, state.history, state.cfg) == \
        (3, 4, 0.1, ["x"], {"a": 2})
    for state.epoch in range(5, 7):
        pass
    state.commit()
    state.epoch = 0
    state.restore()
    assert state.epoch == 6


def test_object_state_restore_twice_gives_the_commit_both_times():
    """Two failures between commits: each restore() must bring back the committed
    value, even when a mutable value was changed in place after the first restore."""
    state = ObjectState(history=[], cfg={"a": 1})
    state.commit()
    state.history.append(1)
    state.cfg["a"] = 2
    state.restore()
    assert (state.history, state.cfg) == ([], {"a": 1})
    state.history.append(2)  # training after the first restore ...
    state.cfg["a"] = 3
    state.restore()          # ... then a second failure
    assert (state.history, state.cfg) == ([], {"a": 1}), \
        "restore() hands out the saved objects themselves, so in-place changes after a " \
        "restore corrupt the commit"


def test_reset_callbacks_called_by_on_reset():
    calls = []

    class S(ObjectState):
        def reset(self):
            calls.append("reset")

    state = S(epoch=0)
    state.register_reset_callbacks([lambda: calls.append("a"), lambda: calls.append("b")])
    state.register_reset_callbacks([lambda: calls.append("c")])
    assert calls == []
    state.on_reset()
    assert calls == ["reset", "a", "b", "c"]
    state.on_reset()
    assert calls == ["reset", "a", "b", "c"] * 2


# ------------------------------------------------------------------ TorchState, one rank

def test_torch_state_restores_model_and_optimizer_exactly():
    model, opt = _model_and_adam()
    _train_step(model, opt, 1)
    state = TorchState(model, opt, epoch=0, batch=0)
    assert state.model is model and state.optimizer is opt
    _train_step(model, opt, 2)
    state.epoch, state.batch = 1, 7
    state.commit()
    saved_model = copy.deepcopy(model.state_dict())
    saved_opt = copy.deepcopy(opt.state_dict())
    params = list(model.parameters())

    for s in range(3, 6):
        _train_step(model, opt, s)
    opt.param_groups[0]["lr"] = 0.5
    state.epoch, state.batch = 2, 0
    state.restore()
    _assert_model_equal(model, saved_model)  # parameters and BatchNorm buffers
    _assert_opt_equal(opt, saved_opt)        # Adam moments, step and lr
    assert (state.epoch, state.batch) == (1, 7)
    assert list(model.parameters()) == params and all(
        a is b for a, b in zip(model.parameters(), params)), "parameters were replaced"
    assert all(a is b for a, b in zip(opt.param_groups[0]["params"], params))

    # Training on from the restored state is the same as training on from the commit.
    ref_model, ref_opt = _model_and_adam()
    ref_model.load_state_dict(saved_model)
    ref_opt.load_state_dict(copy.deepcopy(saved_opt))
    _train_step(model, opt, 9)
    _train_step(ref_model, ref_opt, 9)
    _assert_model_equal(model, ref_model.state_dict())


def test_torch_state_optimizer_restore_twice_gives_the_commit_both_times():
    """commit, step, restore, step, restore: the second restore must give the commit."""
    model, opt = _model_and_adam()
    _train_step(model, opt, 1)
    state = TorchState(model, opt)
    state.commit()
    saved_opt = copy.deepcopy(opt.state_dict())
    _train_step(model, opt, 2)
    state.restore()
    _assert_opt_equal(opt, saved_opt)
    _train_step(model, opt, 3)  # after the first restore, the optimizer's state tensors
    state.restore()             # are the saved ones: Adam updates them in place
    _assert_opt_equal(opt, saved_opt)


def test_torch_state_model_saved_at_construction():
    model, opt = _model_and_adam()
    state = TorchState(model=model, optimizer=opt)
    initial = copy.deepcopy(model.state_dict())
    _train_step(model, opt, 1)
    state.restore()
    _assert_model_equal(model, initial)
    assert opt.state_dict()["state"] == {}


def test_torch_state_plain_values_only(world_of_one):
    state = TorchState(epoch=0, batch=0, name="x")
    state.epoch = 2
    for state.batch, _ in enumerate(range(5)):
        pass
    state.commit()
    state.epoch, state.batch, state.name = 9, 9, "y"
    state.restore()
    assert (state.epoch, state.batch, state.name) == (2, 4, "x")
    state.sync()
    assert (state.epoch, state.batch, state.name) == (2, 4, "x")
    state.on_reset()
    empty = TorchState()  # nothing at all
    empty.commit()
    empty.restore()
    empty.sync()


def test_torch_state_sync_in_a_world_of_one(world_of_one):
    model, opt = _model_and_adam()
    _train_step(model, opt, 1)
    sampler = ElasticSampler(list(range(10)), shuffle=False)
    state = TorchState(model, opt, sampler=sampler, epoch=1)
    before_model = copy.deepcopy(model.state_dict())
    before_opt = copy.deepcopy(opt.state_dict())
    sampler.record_indices([0, 1, 2])
    state.sync()
    _assert_model_equal(model, before_model)
    _assert_opt_equal(opt, before_opt)
    assert state.epoch == 1
    assert list(sampler) == list(range(3, 10)) and len(sampler) == 7
    # sync() saved: restore() keeps the synced sampler progress
    sampler.record_indices([3, 4])
    state.restore()
    assert list(sampler) == list(range(3, 10))


def test_commit_numbers_are_published_and_a_lost_commit_fails_sync(world_of_one, monkeypatch):
    """Elastic bookkeeping in a world of one, the driver's store faked: rank 0 records
    each commit's number (after the commit's collective); a sync in which no worker
    holds the job's newest commit raises CommittedStateLostError naming it, reports it
    to the driver, and is not retried by hvd.elastic.run."""
    from horovod_torch.elastic import worker
    from horovod_torch.exceptions import CommittedStateLostError
    store = {}
    monkeypatch.setattr(worker, "is_elastic", lambda: True)
    monkeypatch.setattr(worker, "publish_commit",
                        lambda n, counters: store.update(commit=(n, counters)))
    monkeypatch.setattr(worker, "last_commit", lambda: store.get("commit", (0, {})))
    monkeypatch.setattr(worker, "report_fatal", lambda msg: store.update(fatal=msg))
    state = TorchState(nn.Linear(2, 1), epoch=0, batch=0, name="x")
    assert state._commit_id is None
    state.sync()  # nothing committed yet: a new worker may start from its own state
    assert state._commit_id == 0 and "commit" not in store
    for state.batch in range(1, 4):
        state.commit()
    assert state._commit_id == 3 and store["commit"] == (3, {"epoch": 0, "batch": 3})
    state.sync()  # holds the newest commit: fine
    assert state._commit_id == 3 and "fatal" not in store

    fresh = TorchState(nn.Linear(2, 1), epoch=0, batch=0)  # a replacement worker
    with pytest.raises(CommittedStateLostError) as e:
        fresh.sync()
    msg = str(e.value)
    assert msg.startswith("committed state lost: the last commit (commit 3) was held "
                          "only by workers that are gone"), msg
    assert "epoch=0, batch=3" in msg and store["fatal"] == msg
    assert (e.value.commit, e.value.counters) == (3, {"epoch": 0, "batch": 3})
    assert not isinstance(e.value, HorovodInternalError)
    assert hvd.elastic.CommittedStateLostError is CommittedStateLostError

    calls = []

    @hvd.elastic.run
    def train(state):
        calls.append(1)

    with pytest.raises(CommittedStateLostError):
        train(TorchState(nn.Linear(2, 1), epoch=0))
    assert calls == [], "training ran from a fresh state after the commit was lost"


def test_torch_state_reassigned_handled_attributes_are_tracked():
    """Horovod's TorchState follows `state.model = other` / `state.optimizer = other`
    (the handler takes the new object); restore() must act on the new model."""
    model, opt = _model_and_adam()
    state = TorchState(model, opt)
    torch.manual_seed(5)
    new_model = nn.Sequential(nn.Linear(5, 4), nn.BatchNorm1d(4), nn.Linear(4, 2))
    state.model = new_model
    state.commit()
    committed = copy.deepcopy(new_model.state_dict())
    with torch.no_grad():
        for p in new_model.parameters():
            p.add_(1.0)
    state.restore()
    assert state.model is new_model
    _assert_model_equal(new_model, committed)


def test_torch_state_keeps_lr_scheduler_attached_to_the_optimizer():
    """Horovod's TorchState has a handler for LR schedulers (state_dict save/restore).
    Here a scheduler is a plain value: restore() replaces it by a deep copy whose
    optimizer is a detached copy, so later scheduler.step() no longer changes the lr."""
    model = nn.Linear(3, 2)
    opt = torch.optim.SGD(model.parameters(), lr=1.0)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    state = TorchState(model, opt, scheduler=sched)
    state.commit()
    opt.step()
    sched.step()
    assert opt.param_groups[0]["lr"] == 0.5
    state.restore()
    assert opt.param_groups[0]["lr"] == 1.0
    assert state.scheduler.optimizer is opt, \
        "after restore(), state.scheduler drives a copy of the optimizer, not the real one"
    opt.step()
    state.scheduler.step()
    assert opt.param_groups[0]["lr"] == 0.5


def test_elastic_run_restores_commit_and_calls_reset_callbacks(world_of_one):
    model, opt = _model_and_adam()
    state = TorchState(model, opt, epoch=0)
    calls = []
    state.register_reset_callbacks([lambda: calls.append(hvd.size())])
    attempts = []
    committed = {}

    @hvd.elastic.run
    def train(state):
        attempts.append(state.epoch)
        if len(attempts) == 1:
            state.epoch = 1
            _train_step(state.model, state.optimizer, 1)
            state.commit()
            committed["model"] = copy.deepcopy(model.state_dict())
            state.epoch = 2
            _train_step(state.model, state.optimizer, 2)
            raise HorovodInternalError("simulated lost peer")
        return state.epoch

    assert train(state) == 1
    assert attempts == [0, 1] and calls == [1]
    _assert_model_equal(model, committed["model"])
    assert hvd.is_initialized()


# --------------------------------------------------------- ElasticSampler, no world needed

def test_sampler_set_epoch_order_and_determinism():
    data = list(range(50))
    a = ElasticSampler(data, shuffle=True, seed=3)
    b = ElasticSampler(data, shuffle=True, seed=3)
    assert list(a) == list(b) and sorted(a) == data and list(a) != data
    e0 = list(a)
    a.set_epoch(1)
    assert list(a) != e0 and sorted(a) == data
    b.set_epoch(1)
    assert list(a) == list(b)
    a.set_epoch(0)
    assert list(a) == e0
    c = ElasticSampler(data, shuffle=True, seed=4)
    assert list(c) != e0
    d = ElasticSampler(data, shuffle=False, seed=3)
    d.set_epoch(5)
    assert list(d) == data
    # set_epoch starts the epoch afresh
    a.record_batch(0, 10)
    assert len(a) == 50  # recording does not reshard; reset() does
    a.reset()
    assert len(a) == 40 and not set(a) & a.processed_indices
    a.set_epoch(2)
    assert len(a) == 50 and a.processed_indices == set()


def test_sampler_record_batch_and_state_dict_round_trip():
    s = ElasticSampler(list(range(30)), shuffle=True, seed=1)
    s.set_epoch(4)
    order = list(s)
    s.record_batch(0, 4)
    s.record_batch(2, 4)
    assert s.processed_indices == set(order[0:4] + order[8:12])
    sd = s.state_dict()
    assert sd == {"epoch": 4, "processed_num": 8,  # processed_num: Horovod's key
                  "processed_indices": sorted(order[0:4] + order[8:12])}
    assert json.loads(json.dumps(sd)) == sd  # plain data
    s.reset()
    remaining = [i for i in order if i not in sd["processed_indices"]]
    assert list(s) == remaining and len(s) == 22

    t = ElasticSampler(list(range(30)), shuffle=True, seed=1)
    t.load_state_dict(copy.deepcopy(sd))
    assert t.epoch == 4 and list(t) == list(s) and len(t) == len(s)
    assert t.state_dict() == s.state_dict()
    # the last batch may be short
    t.record_batch(5, 4)
    assert len(t.processed_indices) == 8 + 2


def _shards(monkeypatch, n_items, size, processed, shuffle=True, seed=0, epoch=0):
    out = []
    for r in range(size):
        _fake_world(monkeypatch, size, r)
        s = ElasticSampler(list(range(n_items)), shuffle=shuffle, seed=seed)
        s.set_epoch(epoch)
        s.load_state_dict({"epoch": epoch, "processed_indices": sorted(processed)})
        out.append(s)
    return out


def _contract_cases():
    cases = []
    for n_items in (1, 2, 5, 10, 31, 103):
        for size in (1, 2, 3, 4, 5):
            for n_done in sorted({0, 1, n_items // 3, n_items - 2, n_items - 1}):
                if 0 <= n_done < n_items:
                    rem = n_items - n_done
                    if size * math.ceil(rem / size) - rem <= rem:  # see the padding test
                        cases.append((n_items, size, n_done))
    return cases


@pytest.mark.parametrize("shuffle", [False, True])
def test_sampler_sharding_contract(monkeypatch, shuffle):
    """Like DistributedSampler: len == ceil(remaining / size) on every rank, each rank
    yields len items, shards cover the remaining indices and overlap only in the
    padding. With nothing processed, exactly DistributedSampler's shards."""
    for n_items, size, n_done in _contract_cases():
        g = torch.Generator().manual_seed(n_items * 7 + n_done)
        processed = set(torch.randperm(n_items, generator=g)[:n_done].tolist())
        remaining = set(range(n_items)) - processed
        per = math.ceil(len(remaining) / size)
        shards = _shards(monkeypatch, n_items, size, processed, shuffle, seed=2, epoch=3)
        what = f"items={n_items} size={size} done={n_done}"
        for r, s in enumerate(shards):
            assert len(s) == per, f"{what} rank {r}: len {len(s)} != {per}"
            assert len(list(s)) == per, f"{what} rank {r}: yields {len(list(s))} != {per}"
            assert not set(s) & processed, f"{what} rank {r}: yields processed indices"
        flat = [i for s in shards for i in s]
        assert set(flat) == remaining, what
        counts = Counter(flat)
        assert sum(c - 1 for c in counts.values()) == size * per - len(remaining), what
        assert max(counts.values()) <= 2, what
        if n_done == 0:
            for r, s in enumerate(shards):
                ds = torch.utils.data.DistributedSampler(
                    list(range(n_items)), num_replicas=size, rank=r, shuffle=shuffle, seed=2)
                ds.set_epoch(3)
                assert list(s) == list(ds), f"{what} rank {r}: differs from DistributedSampler"


def test_sampler_padding_when_fewer_remaining_than_padding(monkeypatch):
    """At the end of an epoch after a reshard few indices remain. Every rank must still
    yield len(sampler) = ceil(remaining / size) items (DistributedSampler repeats the
    indices as often as needed), or the ranks run different numbers of batches."""
    n_items = 103
    order = list(_shards(monkeypatch, n_items, 1, set())[0])
    bad = []
    for remaining, size in [(1, 3), (1, 4), (2, 5), (3, 7)]:
        shards = _shards(monkeypatch, n_items, size, set(order[:n_items - remaining]))
        lens = [len(s) for s in shards]
        yielded = [len(list(s)) for s in shards]
        assert lens == [1] * size
        if yielded != lens:
            bad.append(f"remaining={remaining} size={size}: len(sampler) per rank {lens}, "
                       f"items yielded per rank {yielded}")
    assert not bad, "\n".join(bad)


# ------------------------------------------------------------------- several ranks

def test_state_sync_across_three_ranks():
    run_workers(f"{W}:state_sync", 3, timeout=60)


def test_sync_broadcasts_from_the_rank_holding_the_newest_commit():
    """Rank 0 is a new worker holding no commit (as a replacement that is rank 0 of
    its generation would be): the sync must not hand its initial state to the others."""
    res = run_workers(f"{W}:sync_from_newest_commit", 3, timeout=60)
    assert all("sync from the newest commit ok" in r.output for r in res), describe(res)


def test_sampler_reshard_on_sync_two_ranks():
    res = run_workers(f"{W}:sampler_reshard", 2, timeout=60)
    assert all("sampler reshard ok" in r.output for r in res), describe(res)


def _results(res):
    out = {}
    for r in res:
        for line in r.output.splitlines():
            if line.startswith("RESULT "):
                d = json.loads(line[len("RESULT "):])
                out[d["rank"]] = d
    assert sorted(out) == [0, 1, 2], "missing RESULT lines:\n" + describe(res)
    return out


def _effective(out):
    """Indices whose gradient went into the final model: each rank's committed work
    before the change plus everything after it."""
    return [i for d in out.values() for i in d["committed"] + d["after"]]


def test_sampler_reshard_when_a_worker_joins():
    out = _results(run_workers(f"{W}:sampler_world_grows", 3, timeout=60))
    flat = _effective(out)
    assert set(flat) == set(range(103)), f"never processed: {sorted(set(range(103)) - set(flat))}"
    assert len(flat) - 103 <= 2, f"{len(flat) - 103} repeats; padding allows 2"


@pytest.mark.xfail(strict=True, reason=(
    "known limitation (as in Horovod): processed indices are merged across ranks at "
    "sync(), not at every commit(), so a dead rank's committed samples are processed "
    "again after the reset; merging at commit would add a collective to every commit"))
def test_sampler_after_a_rank_is_lost_repeats_no_committed_sample():
    """The failed rank's committed progress is part of the restored model, so its
    committed samples must not be trained on again after the survivors re-form."""
    res = run_workers(f"{W}:sampler_rank_lost", 3, timeout=60)
    out = _results(res)
    flat = _effective(out)
    assert set(flat) == set(range(103)), f"never processed: {sorted(set(range(103)) - set(flat))}"
    repeated = sorted(i for i, c in Counter(flat).items() if c > 1)
    lost = set(out[2]["committed"])
    assert len(flat) - 103 <= 1, (
        f"{len(flat) - 103} repeats (padding allows 1); {len(lost & set(repeated))} of them "
        f"are the {len(lost)} samples the lost rank 2 had committed: {repeated}")


def test_sampler_after_hosts_removed_without_sync_skips_no_sample():
    """Hosts only removed: hvd.elastic.run resets and skips sync(). The survivors'
    samplers must still cover what the removed rank had not processed."""
    res = run_workers(f"{W}:sampler_hosts_removed", 3, timeout=60)
    out = _results(res)
    flat = _effective(out)
    missing = sorted(set(range(103)) - set(flat))
    assert not missing, (
        f"{len(missing)} samples never processed this epoch; after the reset to "
        f"size {out[0]['size']} the samplers still shard for num_replicas="
        f"{out[0]['num_replicas']}: {missing}")
    assert len(flat) - 103 <= 1
