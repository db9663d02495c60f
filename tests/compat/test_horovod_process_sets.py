"""Process sets as Horovod users write them: hvd.ProcessSet, hvd.global_process_set,
hvd.init(process_sets=[...]), hvd.add_process_set / remove_process_set with
HOROVOD_DYNAMIC_PROCESS_SETS=1, and process_set= on every collective, helper and the
DistributedOptimizer. With 2 ranks the only sets besides the global one are the two
singletons [0] and [1]: each rank runs everything on its own singleton.

As in Horovod, root_rank is a global rank; alltoall splits and allgather results follow
the set's rank order."""
import os

import pytest
import torch

import horovod.torch as hvd
from tests.compat.helpers import same_on_every_rank, sync_group

# Building sparse COO tensors warns that torch skips invariant checks; not ours.
pytestmark = pytest.mark.filterwarnings("ignore:Sparse invariant checks:UserWarning")


def _singletons():
    return [hvd.ProcessSet([q]) for q in range(int(os.environ["HOROVOD_SIZE"]))]


def test_process_set_objects_before_registration():
    ps = hvd.ProcessSet([1, 0])
    assert ps.ranks == [0, 1] and ps.process_set_id is None
    assert ps.rank() is None and ps.size() is None and ps.included() is None
    assert hvd.ProcessSet(range(2)).ranks == [0, 1]
    with pytest.raises(ValueError, match="distinct"):
        hvd.ProcessSet([0, 0])
    with pytest.raises(ValueError, match="integers"):
        hvd.ProcessSet(["0"])
    assert hvd.global_process_set.process_set_id == 0
    assert isinstance(hvd.global_process_set, hvd.ProcessSet)


def _every_collective_on(ps, tag: str):
    """Runs every collective on `ps`, of which this rank must be the only member."""
    r = hvd.rank()
    x = torch.full((2, 3), float(r + 1))
    assert torch.equal(hvd.allreduce(x, op=hvd.Sum, name=f"{tag}.ar", process_set=ps), x)
    assert torch.equal(hvd.allreduce_(x.clone(), name=f"{tag}.ar_", process_set=ps), x)
    h = hvd.allreduce_async(x, op=hvd.Max, name=f"{tag}.ara", process_set=ps)
    assert torch.equal(hvd.synchronize(h), x)
    h = hvd.allreduce_async_(x.clone(), op=hvd.Min, name=f"{tag}.ara_", process_set=ps)
    assert torch.equal(hvd.synchronize(h), x)
    outs = hvd.grouped_allreduce([x, x[0]], op=hvd.Sum, name=f"{tag}.gar", process_set=ps)
    assert torch.equal(outs[1], x[0])
    hvd.grouped_allreduce_([x.clone()], name=f"{tag}.gar_", process_set=ps)
    outs = sync_group(hvd.grouped_allreduce_async([x], name=f"{tag}.gara", process_set=ps))
    assert torch.equal(outs[0], x)
    outs = sync_group(hvd.grouped_allreduce_async_([x.clone()], name=f"{tag}.gara_",
                                                   process_set=ps))
    assert torch.equal(outs[0], x)
    assert torch.equal(hvd.allgather(x, name=f"{tag}.ag", process_set=ps), x)
    assert torch.equal(hvd.synchronize(hvd.allgather_async(x, name=f"{tag}.aga",
                                                           process_set=ps)), x)
    assert torch.equal(hvd.grouped_allgather([x], name=f"{tag}.gag", process_set=ps)[0], x)
    outs = sync_group(hvd.grouped_allgather_async([x], name=f"{tag}.gaga", process_set=ps))
    assert torch.equal(outs[0], x)
    # root_rank is a global rank: this singleton's only member
    assert torch.equal(hvd.broadcast(x, r, name=f"{tag}.bc", process_set=ps), x)
    assert torch.equal(hvd.broadcast_(x.clone(), r, name=f"{tag}.bc_", process_set=ps), x)
    h = hvd.broadcast_async(x, r, name=f"{tag}.bca", process_set=ps)
    assert torch.equal(hvd.synchronize(h), x)
    h = hvd.broadcast_async_(x.clone(), r, name=f"{tag}.bca_", process_set=ps)
    assert torch.equal(hvd.synchronize(h), x)
    out, received = hvd.alltoall(x, splits=[2], name=f"{tag}.a2a", process_set=ps)
    assert torch.equal(out, x) and received.tolist() == [2]
    assert torch.equal(hvd.alltoall(x, name=f"{tag}.a2a.even", process_set=ps), x)
    out, _ = hvd.synchronize(hvd.alltoall_async(x, name=f"{tag}.a2aa", process_set=ps))
    assert torch.equal(out, x)
    assert torch.equal(hvd.reducescatter(x, op=hvd.Sum, name=f"{tag}.rs", process_set=ps), x)
    h = hvd.reducescatter_async(x, op=hvd.Sum, name=f"{tag}.rsa", process_set=ps)
    assert torch.equal(hvd.synchronize(h), x)
    outs = hvd.grouped_reducescatter([x], op=hvd.Sum, name=f"{tag}.grs", process_set=ps)
    assert torch.equal(outs[0], x)
    outs = sync_group(hvd.grouped_reducescatter_async([x], op=hvd.Sum, name=f"{tag}.grsa",
                                                      process_set=ps))
    assert torch.equal(outs[0], x)
    hvd.barrier(process_set=ps)
    assert hvd.broadcast_object({"r": r}, root_rank=r, process_set=ps) == {"r": r}
    assert hvd.allgather_object(r, process_set=ps) == [r]
    sp = torch.sparse_coo_tensor([[0]], [float(r + 1)], (3,))
    h = hvd.sparse_allreduce_async(sp, name=f"{tag}.sparse", op=hvd.Sum, process_set=ps)
    assert h().to_dense().tolist() == [float(r + 1), 0.0, 0.0]
    # Helpers and the optimizer: a set of one trains on its own gradients only.
    model = torch.nn.Linear(2, 1, bias=False)
    torch.nn.init.zeros_(model.weight)
    hvd.broadcast_parameters(model.state_dict(), root_rank=r, process_set=ps)
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=1.0),
                                   named_parameters=model.named_parameters(), process_set=ps)
    hvd.broadcast_optimizer_state(opt, root_rank=r, process_set=ps)
    model(torch.full((1, 2), float(r + 1))).sum().backward()
    opt.step()
    assert model.weight.tolist() == [[-float(r + 1)] * 2]
    with pytest.raises(ValueError, match="global process set"):
        hvd.allreduce(x, op=hvd.Adasum, process_set=ps)
    with pytest.raises(ValueError, match="is not in"):
        hvd.broadcast(x, 1 - r, process_set=ps)  # the other rank: not a member


def test_static_process_sets_registered_at_init(teardown):
    sets = _singletons()
    hvd.init(process_sets=sets)
    r, n = hvd.rank(), hvd.size()
    ids = [ps.process_set_id for ps in sets]
    assert len(set(ids)) == n and 0 not in ids and None not in ids
    mine, others = sets[r], [ps for q, ps in enumerate(sets) if q != r]
    assert (mine.rank(), mine.size(), mine.included()) == (0, 1, True)
    for ps in others:
        assert (ps.rank(), ps.size(), ps.included()) == (-1, 1, False)
        with pytest.raises(ValueError, match=f"rank {r} is not in"):
            hvd.allreduce(torch.ones(1), process_set=ps)
    g = hvd.global_process_set
    assert (g.rank(), g.size(), g.included()) == (r, n, True)
    assert mine == mine and mine != others[0] and mine != g and g == hvd.global_process_set
    _every_collective_on(mine, "static")
    # Global ops still work, interleaved with the sets'.
    assert hvd.allreduce(torch.ones(1), op=hvd.Sum, name="static.global").item() == n


def test_global_process_set_passed_explicitly(initialized):
    r, n = hvd.rank(), hvd.size()
    g = hvd.global_process_set
    x = torch.full((n, 2), float(r))
    total = float(sum(range(n)))
    assert hvd.allreduce(x, op=hvd.Sum, process_set=g)[0, 0].item() == total
    assert hvd.allgather(x, process_set=g).shape == (n * n, 2)
    assert hvd.broadcast(x, n - 1, process_set=g)[0, 0].item() == n - 1
    assert hvd.alltoall(x, process_set=g)[:, 0].tolist() == [float(q) for q in range(n)]
    assert hvd.reducescatter(x, op=hvd.Sum, process_set=g).tolist() == [[total] * 2]
    hvd.barrier(process_set=g)
    model = torch.nn.Linear(2, 1)
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                   named_parameters=model.named_parameters(), process_set=g)
    hvd.broadcast_parameters(model.state_dict(), root_rank=0, process_set=g)
    model(torch.ones(3, 2) * r).sum().backward()
    opt.step()
    assert same_on_every_rank(model.weight, "ps.global.weights")


def test_dynamic_process_sets(teardown, monkeypatch):
    monkeypatch.delenv("HOROVOD_DYNAMIC_PROCESS_SETS", raising=False)
    hvd.init()
    r, n = hvd.rank(), hvd.size()
    with pytest.raises(ValueError, match="HOROVOD_DYNAMIC_PROCESS_SETS=1"):
        hvd.add_process_set([0])
    # The library reads the variable at call time.
    monkeypatch.setenv("HOROVOD_DYNAMIC_PROCESS_SETS", "1")
    sets = [hvd.add_process_set([q]) for q in range(n)]  # a list of ranks...
    assert all(isinstance(ps, hvd.ProcessSet) for ps in sets)
    mine = sets[r]
    assert (mine.rank(), mine.size(), mine.included()) == (0, 1, True)
    assert len({ps.process_set_id for ps in sets}) == n
    with pytest.raises(ValueError, match="already"):
        hvd.add_process_set(hvd.ProcessSet([0]))  # an equal set exists
    with pytest.raises(ValueError):
        hvd.add_process_set(list(range(n)))  # the global set exists already
    with pytest.raises(ValueError):
        hvd.add_process_set([n])  # no such rank
    _every_collective_on(mine, "dynamic")
    old_id = mine.process_set_id
    assert all(hvd.remove_process_set(ps) for ps in sets)
    assert mine.process_set_id is None and mine.rank() is None
    assert hvd.remove_process_set(mine) is False  # already removed
    assert hvd.remove_process_set(hvd.global_process_set) is False
    with pytest.raises(ValueError, match="not registered"):
        hvd.allreduce(torch.ones(1), process_set=mine)
    again = hvd.add_process_set(hvd.ProcessSet([0]))
    assert again.process_set_id not in (None, 0, old_id)
    if r == 0:
        assert hvd.allreduce(torch.ones(1) * 5, op=hvd.Sum, process_set=again).item() == 5
    hvd.barrier()
    hvd.shutdown()
    hvd.init()  # a fresh init forgets every set
    assert again.process_set_id is None


def test_init_process_sets_dynamic_string(teardown, monkeypatch):
    monkeypatch.delenv("HOROVOD_DYNAMIC_PROCESS_SETS", raising=False)
    hvd.init(process_sets="dynamic")
    # Every rank adds the same sets, in the same order (add_process_set is collective).
    sets = [hvd.add_process_set([q]) for q in range(hvd.size())]
    assert all(ps.size() == 1 for ps in sets) and sets[hvd.rank()].included()


def test_broadcast_root_in_a_process_set_is_a_global_rank(teardown):
    sets = _singletons()
    hvd.init(process_sets=sets)
    r = hvd.rank()
    try:
        ok = hvd.broadcast(torch.tensor([7.0]), root_rank=r, process_set=sets[r]).item() == 7.0
        ok = ok and hvd.broadcast_object("x", root_rank=r, process_set=sets[r]) == "x"
    except ValueError:
        ok = False
    verdicts = hvd.allgather_object(ok)  # fail on every rank, or on none
    assert all(verdicts), verdicts


def test_static_process_set_of_every_rank_is_the_global_set(teardown):
    """docs/design.md §13a: a static set of every rank is the global set (id 0)."""
    everyone = hvd.ProcessSet(range(int(os.environ["HOROVOD_SIZE"])))
    hvd.init(process_sets=[everyone])
    assert everyone.process_set_id == 0 and everyone.size() == hvd.size()
    assert hvd.allreduce(torch.ones(1), op=hvd.Sum, process_set=everyone).item() == hvd.size()


def test_global_process_set_ranks_after_init(initialized):
    assert hvd.global_process_set.ranks == list(range(hvd.size()))
