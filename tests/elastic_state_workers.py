"""Worker functions for test_elastic_state.py (run on every rank by tests/harness.py).

Each calls hvd.init() and raises on a failed check. Workers that change the world
(a host added, a rank lost, a host removed) re-init with a new HOROVOD_SIZE in place
of a real elastic driver and print their processed sample indices as
``RESULT {json}`` lines; the test checks those in the pytest process, since a rank
that left the job can no longer take part in a collective.
"""
import json
import os

import torch
import torch.nn as nn

import horovod_torch as hvd
from horovod_torch.elastic import ElasticSampler, TorchState
from horovod_torch.functions import allgather_object

N_ITEMS = 103
BATCH = 4


# --------------------------------------------------------------------------- helpers

def build(seed_rank: int, step: bool):
    """A model with buffers (BatchNorm) and an Adam optimizer whose values depend on
    `seed_rank`; one Adam step when `step`. Deterministic: build(0, True) on any rank
    gives rank 0's model and optimizer."""
    torch.manual_seed(1000 + seed_rank)
    model = nn.Sequential(nn.Linear(5, 4), nn.BatchNorm1d(4), nn.Linear(4, 2))
    model.train()
    model(torch.randn(8, 5))  # rank-dependent BatchNorm running stats
    opt = torch.optim.Adam(model.parameters(), lr=0.01 * (seed_rank + 1),
                           betas=(0.9, 0.999 - 0.001 * seed_rank))
    if step:
        opt.zero_grad()
        model(torch.randn(8, 5)).pow(2).mean().backward()
        opt.step()
    return model, opt


def assert_tensors_equal(a: dict, b: dict, what: str) -> None:
    assert a.keys() == b.keys(), f"{what}: keys {sorted(a)} != {sorted(b)}"
    for k in a:
        assert torch.equal(a[k], b[k]), f"{what}[{k}]: {a[k]} != {b[k]}"


def assert_opt_state_equal(a: dict, b: dict, what: str) -> None:
    """Optimizer state_dicts equal: hyper-parameters and per-parameter tensors."""
    assert a["param_groups"] == b["param_groups"], \
        f"{what}: param_groups {a['param_groups']} != {b['param_groups']}"
    assert a["state"].keys() == b["state"].keys(), \
        f"{what}: state keys {sorted(a['state'])} != {sorted(b['state'])}"
    for pid in a["state"]:
        sa, sb = a["state"][pid], b["state"][pid]
        assert sa.keys() == sb.keys(), f"{what}: state[{pid}] keys differ"
        for k in sa:
            va, vb = sa[k], sb[k]
            if isinstance(va, torch.Tensor):
                assert torch.equal(va, vb), f"{what}: state[{pid}][{k}] {va} != {vb}"
            else:
                assert va == vb, f"{what}: state[{pid}][{k}] {va} != {vb}"


def flat_params(model) -> torch.Tensor:
    return torch.cat([v.detach().double().flatten() for v in model.state_dict().values()])


def emit(**result) -> None:
    print("RESULT " + json.dumps(result), flush=True)


def set_world(size: int, prefix: str) -> None:
    """The world the next hvd.init() joins (this process keeps its HOROVOD_RANK)."""
    os.environ.update(HOROVOD_SIZE=str(size), HOROVOD_LOCAL_SIZE=str(size),
                      HOROVOD_RENDEZVOUS_PREFIX=prefix)


def run_batches(state, sampler, limit=None, start=0):
    """The training loop: `for state.batch, x in enumerate(loader)` over a DataLoader
    on the sampler, recording each batch; stops after `limit` batches. `start` skips
    that many batches (resuming at state.batch). Returns the indices processed."""
    loader = torch.utils.data.DataLoader(list(range(N_ITEMS)), batch_size=BATCH,
                                         sampler=sampler)
    done = []
    for state.batch, xb in enumerate(loader):
        if state.batch < start:
            continue
        if limit is not None and state.batch >= start + limit:
            break
        xb = xb.tolist()
        expect = sampler.indices[state.batch * BATCH:(state.batch + 1) * BATCH]
        assert xb == expect, f"batch {state.batch}: loader gave {xb}, sampler.indices {expect}"
        done.extend(xb)
        sampler.record_batch(state.batch, BATCH)
    return done


def check_shards(sampler, what: str) -> None:
    """Every rank has as many samples; shards are the remaining indices, disjoint apart
    from the padding (at most size-1 repeats)."""
    n = hvd.size()
    got = allgather_object((len(sampler), list(sampler), sorted(sampler.processed_indices)),
                           name=f"check_shards.{what}")
    lens = [g[0] for g in got]
    assert len(set(lens)) == 1, f"{what}: len(sampler) differs across ranks: {lens}"
    assert all(len(g[1]) == g[0] for g in got), \
        f"{what}: len(sampler) != items yielded: {[(g[0], len(g[1])) for g in got]}"
    processed = set(got[0][2])
    assert all(set(g[2]) == processed for g in got), f"{what}: processed_indices differ"
    remaining = set(range(N_ITEMS)) - processed
    flat = [i for g in got for i in g[1]]
    assert set(flat) == remaining, \
        f"{what}: shards cover {sorted(set(flat) ^ remaining)} wrongly"
    assert len(flat) - len(remaining) <= n - 1, \
        f"{what}: {len(flat) - len(remaining)} repeats in the shards (padding is <= {n - 1})"


# ------------------------------------------------------------------ state sync (2-3 ranks)

def state_sync() -> None:
    """Rank-dependent model, optimizer (Adam stepped on rank 0 only) and plain values
    become rank 0's on every rank after state.sync(); restore() then gives rank 0's."""
    hvd.init()
    r, n = hvd.rank(), hvd.size()
    model, opt = build(r, step=(r == 0))
    state = TorchState(model, opt, epoch=r, batch=10 * r, name=f"rank{r}",
                       history=list(range(r)), cfg={"lr": 0.1 * (r + 1)})
    state.sync()

    ref_model, ref_opt = build(0, step=True)
    assert_tensors_equal(model.state_dict(), ref_model.state_dict(), f"rank {r} model")
    assert_opt_state_equal(opt.state_dict(), ref_opt.state_dict(), f"rank {r} optimizer")
    assert (state.epoch, state.batch, state.name, state.history, state.cfg) == \
        (0, 0, "rank0", [], {"lr": 0.1}), f"rank {r} plain values {vars(state)}"
    assert state.model is model and state.optimizer is opt
    rows = hvd.allgather(flat_params(model).unsqueeze(0), name="sync.params")
    assert all(torch.equal(rows[0], rows[q]) for q in range(n)), "params differ across ranks"

    # sync() also saved: what restore() brings back is rank 0's state.
    with torch.no_grad():
        for p in model.parameters():
            p.add_(1.0)
    opt.param_groups[0]["lr"] = 123.0
    state.epoch, state.name = 99, "changed"
    state.restore()
    assert_tensors_equal(model.state_dict(), ref_model.state_dict(), f"rank {r} restored model")
    assert_opt_state_equal(opt.state_dict(), ref_opt.state_dict(), f"rank {r} restored opt")
    assert (state.epoch, state.name) == (0, "rank0")

    # The optimizer state really is the same: one more identical step keeps every rank equal.
    torch.manual_seed(7)
    x = torch.randn(8, 5)
    opt.zero_grad()
    model(x).pow(2).mean().backward()
    opt.step()
    rows = hvd.allgather(flat_params(model).unsqueeze(0), name="sync.params_after_step")
    assert all(torch.equal(rows[0], rows[q]) for q in range(n)), \
        "params differ across ranks after one step from the synced state"

    # Reverse: only the last rank has Adam state; rank 0 has none -> all empty after sync.
    model2, opt2 = build(r, step=(r == n - 1))
    state2 = TorchState(model2, opt2)
    state2.sync()
    sd = opt2.state_dict()
    assert sd["state"] == {}, f"rank {r}: optimizer state {list(sd['state'])} survived sync"
    assert sd["param_groups"][0]["lr"] == 0.01, sd["param_groups"]
    assert_tensors_equal(model2.state_dict(), build(0, False)[0].state_dict(),
                         f"rank {r} model2")
    hvd.shutdown()
    print(f"rank {r}: state sync ok", flush=True)


# ------------------------------------------------ sampler: reshard at the same world size

def sampler_reshard() -> None:
    """2+ ranks; each processes some batches, state.sync() (the real sampler handler)
    merges and reshards, twice, then the epoch is finished. Every index is processed,
    only the last sharding's padding twice."""
    hvd.init()
    r, n = hvd.rank(), hvd.size()
    sampler = ElasticSampler(list(range(N_ITEMS)), shuffle=True, seed=11)
    sampler.set_epoch(2)
    state = TorchState(sampler=sampler, epoch=2, batch=0)
    assert state.sampler is sampler
    check_shards(sampler, "initial")
    processed = []
    for phase, limit in enumerate([3 + 2 * r, 4]):  # rank-dependent progress first
        processed += run_batches(state, sampler, limit=limit)
        state.commit()
        state.sync()
        assert sampler.epoch == 2
        union = set(i for p in allgather_object(processed, name=f"reshard.p{phase}") for i in p)
        assert sampler.processed_indices == union, \
            f"phase {phase}: processed_indices after sync != union of every rank's"
        assert not union & set(sampler.indices), f"phase {phase}: processed index resharded"
        check_shards(sampler, f"after sync {phase}")
    processed += run_batches(state, sampler)  # to the end of the epoch

    every = allgather_object(processed, name="reshard.all")
    flat = [i for p in every for i in p]
    missing = set(range(N_ITEMS)) - set(flat)
    assert not missing, f"indices never processed: {sorted(missing)}"
    repeats = len(flat) - N_ITEMS
    assert repeats <= n - 1, f"{repeats} indices processed twice (padding allows {n - 1})"
    state.sync()
    assert sampler.processed_indices == set(range(N_ITEMS)) and len(sampler) == 0
    sampler.set_epoch(3)
    check_shards(sampler, "next epoch")
    hvd.shutdown()
    print(f"rank {r}: sampler reshard ok ({repeats} padding repeats)", flush=True)


# ------------------------------------- sampler: the world changes (needs 3 processes)

def sampler_world_grows() -> None:
    """Ranks 0 and 1 train as a world of 2; then a third worker joins (as after a
    HostsUpdatedInterrupt for an added host): reset, on_reset(), sync(), finish."""
    r = int(os.environ["HOROVOD_RANK"])
    if r < 2:
        set_world(2, "grow1")
        hvd.init()
        sampler = ElasticSampler(list(range(N_ITEMS)), shuffle=True, seed=5)
        sampler.set_epoch(1)
        state = TorchState(sampler=sampler, epoch=1, batch=0)
        first = run_batches(state, sampler, limit=4)
        state.commit()
        hvd.shutdown()
    else:
        # The new worker: a world-of-one init so that its init count (part of the
        # rendezvous prefix) matches the others' next one.
        rank_env = os.environ.pop("HOROVOD_RANK")
        hvd.init()
        hvd.shutdown()
        os.environ["HOROVOD_RANK"] = rank_env
        first = []
    set_world(3, "grow2")
    hvd.init()
    if r == 2:  # a fresh process builds its own state, as a new worker would
        sampler = ElasticSampler(list(range(N_ITEMS)), shuffle=True, seed=5)
        state = TorchState(sampler=sampler, epoch=0, batch=0)
    else:
        state.on_reset()
    state.sync()
    assert sampler.epoch == 1 and state.epoch == 1, (sampler.epoch, state.epoch)
    assert (sampler.num_replicas, sampler.rank) == (3, r)
    check_shards(sampler, "after the third worker joined")
    second = run_batches(state, sampler)
    emit(rank=r, committed=first, after=second)
    hvd.shutdown()


def sampler_rank_lost() -> None:
    """3 ranks commit after 3 batches, run 2 more, then rank 2 dies. The survivors do
    what hvd.elastic.run does on HorovodInternalError: restore(), reset into a world
    of 2, on_reset(), sync(); then finish the epoch."""
    hvd.init()
    r = hvd.rank()
    sampler = ElasticSampler(list(range(N_ITEMS)), shuffle=True, seed=9)
    state = TorchState(sampler=sampler, epoch=0, batch=0)
    committed = run_batches(state, sampler, limit=3)
    state.commit()
    run_batches(state, sampler, start=3, limit=2)  # lost with the failure: rolled back
    hvd.shutdown()
    if r == 2:
        emit(rank=r, committed=committed, after=[])
        return
    set_world(2, "job")
    hvd.init()
    state.restore()
    state.on_reset()
    state.sync()
    after = run_batches(state, sampler)
    emit(rank=r, committed=committed, after=after, num_replicas=sampler.num_replicas)
    hvd.shutdown()


def sampler_hosts_removed() -> None:
    """3 ranks commit after 3 batches; the commit finds rank 2's host removed
    (HostsUpdatedInterrupt(skip_sync=True)). The survivors do what hvd.elastic.run
    does then: reset into a world of 2, on_reset(), no sync; and resume at
    state.batch."""
    hvd.init()
    r = hvd.rank()
    sampler = ElasticSampler(list(range(N_ITEMS)), shuffle=True, seed=13)
    state = TorchState(sampler=sampler, epoch=0, batch=0)
    committed = run_batches(state, sampler, limit=3)
    state.commit()
    hvd.shutdown()
    if r == 2:
        emit(rank=r, committed=committed, after=[])
        return
    set_world(2, "job")
    hvd.init()
    state.on_reset()
    after = run_batches(state, sampler, start=state.batch)
    emit(rank=r, committed=committed, after=after, num_replicas=sampler.num_replicas,
         size=hvd.size())
    hvd.shutdown()


# ------------------------------------- sync root: the rank holding the newest commit

def sync_from_newest_commit() -> None:
    """3 ranks, rank 0 a new worker that holds no commit, rank 1 holds commit 1 and
    rank 2 commit 2 (commits outside an elastic job are local). sync() must give every
    rank rank 2's state, not rank 0's initial one; then all hold commit 2 and the next
    sync is from rank 0 again."""
    hvd.init()
    r, n = hvd.rank(), hvd.size()
    assert n == 3
    model, opt = build(r, step=True)
    sampler = ElasticSampler(list(range(N_ITEMS)), shuffle=True, seed=3)
    sampler.set_epoch(r)
    state = TorchState(model, opt, sampler=sampler, epoch=r, step=100 * r)
    for _ in range(r):  # rank 1: commit 1, rank 2: commits 1 and 2
        state.commit()
    state.sync()
    ref_model, ref_opt = build(2, step=True)
    assert_tensors_equal(model.state_dict(), ref_model.state_dict(), f"rank {r} model")
    assert_opt_state_equal(opt.state_dict(), ref_opt.state_dict(), f"rank {r} optimizer")
    assert (state.epoch, state.step, sampler.epoch) == (2, 200, 2), \
        f"rank {r}: epoch {state.epoch} step {state.step} sampler epoch {sampler.epoch}"
    assert state._commit_id == 2, state._commit_id
    state.commit()
    assert state._commit_id == 3
    state.step = 300 + r  # every rank holds commit 4 after this: rank 0 is the root
    state.commit()
    state.sync()
    assert state.step == 300, state.step
    hvd.shutdown()
    print(f"rank {r}: sync from the newest commit ok", flush=True)
