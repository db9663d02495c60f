"""The training-side API as Horovod users call it: DistributedOptimizer (wrapping,
_parameter_names, backward_passes_per_step, compression, Adasum, synchronize /
skip_synchronize), broadcast_parameters / broadcast_optimizer_state /
broadcast_object / allgather_object, SyncBatchNorm, sparse_allreduce_async, the
timeline, hvd.elastic and HorovodInternalError."""
import json
import os
import tempfile
import warnings

import pytest
import torch

import horovod.torch as hvd
from tests.compat.helpers import everyone, same_on_every_rank

# Building sparse COO tensors warns that torch skips invariant checks; not ours.
pytestmark = pytest.mark.filterwarnings("ignore:Sparse invariant checks:UserWarning")


def _linear(seed: int = 0, bias: bool = True) -> torch.nn.Linear:
    torch.manual_seed(seed)
    return torch.nn.Linear(3, 1, bias=bias)


def _zero_linear() -> torch.nn.Linear:
    m = torch.nn.Linear(2, 1, bias=False)
    torch.nn.init.zeros_(m.weight)
    return m


# ------------------------------------------------------------------ DistributedOptimizer

def test_distributed_optimizer_wraps_the_optimizer_class(initialized):
    model = _linear()
    base = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    opt = hvd.DistributedOptimizer(base, named_parameters=model.named_parameters())
    assert isinstance(opt, torch.optim.SGD) and type(opt).__name__ == "SGD"
    assert opt.param_groups[0]["momentum"] == 0.9
    assert opt._parameter_names == {model.weight: "weight", model.bias: "bias"}
    assert opt.backward_passes_per_step == 1
    unnamed = hvd.DistributedOptimizer(torch.optim.Adam(_linear().parameters()))
    names = list(unnamed._parameter_names.values())
    assert isinstance(unnamed, torch.optim.Adam) and len(set(names)) == 2
    m2 = torch.nn.Linear(2, 2)
    with pytest.raises(ValueError, match="duplicate"):
        hvd.DistributedOptimizer(torch.optim.SGD(m2.parameters(), lr=0.1),
                                 named_parameters=[("w", m2.weight), ("w", m2.bias)])
    with pytest.raises(ValueError):
        hvd.DistributedOptimizer(torch.optim.SGD(m2.parameters(), lr=0.1), op=hvd.Min)


def test_distributed_optimizer_averages_gradients(initialized):
    r, n = hvd.rank(), hvd.size()
    model = _linear(seed=r)  # different on purpose: broadcast_parameters fixes that
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.5),
                                   named_parameters=model.named_parameters())
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    hvd.broadcast_optimizer_state(opt, root_rank=0)
    ref = _linear(seed=0)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.5)
    xs = everyone((4, 3), torch.float32, seed=21)
    for step in range(3):
        opt.zero_grad()
        model(xs[r] * (step + 1)).pow(2).mean().backward()
        opt.step()
        # One process: the mean of every rank's loss gives the averaged gradient.
        ref_opt.zero_grad()
        (sum(ref(x * (step + 1)).pow(2).mean() for x in xs) / n).backward()
        ref_opt.step()
    assert torch.allclose(model.weight, ref.weight, atol=1e-6)
    assert same_on_every_rank(model.weight, "opt.avg.check")


def test_backward_passes_per_step_accumulates(initialized):
    r, n = hvd.rank(), hvd.size()
    model = _zero_linear()
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=1.0),
                                   named_parameters=model.named_parameters(),
                                   backward_passes_per_step=2, op=hvd.Sum)
    assert opt.backward_passes_per_step == 2
    opt.zero_grad()
    for _ in range(2):
        model(torch.full((1, 2), float(r + 1))).sum().backward()
    opt.step()
    total = 2 * sum(q + 1 for q in range(n))
    assert model.weight.tolist() == [[-float(total)] * 2]


def test_extra_backward_pass_raises(initialized):
    model = _zero_linear()
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=1.0),
                                   named_parameters=model.named_parameters(),
                                   backward_passes_per_step=2, op=hvd.Sum)
    opt.zero_grad()
    try:
        for _ in range(2):
            model(torch.ones(1, 2)).sum().backward()
        with pytest.raises(AssertionError, match="backward_passes_per_step"):
            model(torch.ones(1, 2)).sum().backward()
    finally:
        opt.synchronize()  # drain what is in flight either way


def test_compression(initialized):
    r, n = hvd.rank(), hvd.size()
    assert hvd.Compression.none.compress(torch.ones(2))[0].dtype == torch.float32
    wire, ctx = hvd.Compression.fp16.compress(torch.ones(2, dtype=torch.float64))
    assert wire.dtype == torch.float16
    assert hvd.Compression.fp16.decompress(wire, ctx).dtype == torch.float64
    assert hvd.Compression.fp16.compress(torch.ones(2, dtype=torch.int32))[0].dtype == \
        torch.int32  # only floating point is cast
    out = hvd.allreduce(torch.full((3,), 0.25 * (r + 1)), compression=hvd.Compression.fp16,
                        name="fp16.allreduce")
    assert out.dtype == torch.float32 and abs(out[0].item() - 0.125 * (n + 1)) < 1e-3
    for compression in (hvd.Compression.none, hvd.Compression.fp16):
        model = _zero_linear()
        opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=1.0),
                                       named_parameters=model.named_parameters(),
                                       compression=compression)
        model(torch.full((1, 2), (r + 1) / 4)).sum().backward()
        opt.step()
        want = -sum((q + 1) / 4 for q in range(n)) / n
        assert model.weight.dtype == torch.float32
        assert torch.allclose(model.weight, torch.full((1, 2), want), atol=1e-3)


@pytest.mark.skipif(os.environ.get("HOROVOD_SIZE") not in ("1", "2", "4", "8"),
                    reason="Adasum needs a power-of-two number of ranks")
def test_adasum_optimizer(initialized):
    r, n = hvd.rank(), hvd.size()
    model = torch.nn.Linear(n, 1, bias=False)
    torch.nn.init.zeros_(model.weight)
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=1.0),
                                   named_parameters=model.named_parameters(), op=hvd.Adasum)
    x = torch.zeros(1, n)
    x[0, r] = 1.0  # orthogonal gradients: Adasum adds them
    model(x).sum().backward()
    opt.step()
    assert model.weight.tolist() == [[-1.0] * n]


def test_uneven_batches_with_join(initialized):
    """Horovod's recipe for uneven data: train on what you have, then hvd.join(); the
    ranks still training average with the joined ranks' zeros."""
    r, n = hvd.rank(), hvd.size()
    model = _zero_linear()
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=1.0),
                                   named_parameters=model.named_parameters(), op=hvd.Sum,
                                   num_groups=1)
    for step in range(2 + r):  # rank r has 2 + r batches
        opt.zero_grad()
        model(torch.ones(1, 2)).sum().backward()
        opt.step()
        active = sum(1 for q in range(n) if step < 2 + q)
        assert model.weight.grad.tolist() == [[float(active)] * 2]
    assert hvd.join() == n - 1
    hvd.broadcast_parameters(model.state_dict(), root_rank=n - 1)
    # The last rank took every step: its gradients summed every rank's batches.
    assert model.weight.tolist() == [[-float(sum(2 + q for q in range(n)))] * 2]


def _one_step(**options):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(3, 2), torch.nn.Linear(2, 1))
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=1.0),
                                   named_parameters=model.named_parameters(), **options)
    model(torch.ones(2, 3) * (hvd.rank() + 1)).sum().backward()
    opt.step()
    return torch.cat([p.detach().flatten() for p in model.parameters()])


def test_gradient_predivide_factor_and_groups_do_not_change_the_result(initialized):
    plain = _one_step()
    for options in (dict(gradient_predivide_factor=2.0), dict(num_groups=2), dict(groups=2)):
        assert torch.allclose(_one_step(**options), plain, atol=1e-6), options
    assert same_on_every_rank(plain, "opt.options.check")


def _embedding_step(sparse_as_dense: bool) -> torch.Tensor:
    torch.manual_seed(0)
    emb = torch.nn.Embedding(4, 2, sparse=True)
    opt = hvd.DistributedOptimizer(torch.optim.SGD(emb.parameters(), lr=1.0),
                                   named_parameters=emb.named_parameters(),
                                   sparse_as_dense=sparse_as_dense)
    emb(torch.tensor([hvd.rank(), 3])).sum().backward()  # a sparse gradient
    opt.step()
    return emb.weight.detach()


def test_sparse_gradients_with_sparse_as_dense(initialized):
    n = hvd.size()
    torch.manual_seed(0)
    start = torch.nn.Embedding(4, 2).weight.detach()
    w = _embedding_step(sparse_as_dense=True)
    for row in range(min(n, 3)):  # rows 0..n-1: one rank's gradient, averaged
        assert torch.allclose(w[row], start[row] - 1.0 / n)
    assert torch.allclose(w[3], start[3] - 1.0)  # every rank's gradient, averaged
    assert same_on_every_rank(w, "sparse.dense.check")


def test_sparse_gradients_without_sparse_as_dense(initialized):
    dense = _embedding_step(sparse_as_dense=True)
    assert torch.allclose(_embedding_step(sparse_as_dense=False), dense, atol=1e-6)


def test_synchronize_skip_synchronize_and_warnings(initialized):
    model = _linear()
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                   named_parameters=model.named_parameters())
    model(torch.ones(2, 3)).sum().backward()
    # zero_grad() between backward() and step() would race with the allreduces.
    with pytest.raises(AssertionError, match="zero_grad"):
        opt.zero_grad()
    opt.synchronize()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 0.1)
    with opt.skip_synchronize(), warnings.catch_warnings():
        warnings.simplefilter("error")
        opt.step()  # no warning inside skip_synchronize()
    opt.zero_grad()
    model(torch.ones(2, 3)).sum().backward()
    opt.synchronize()
    with pytest.warns(UserWarning, match="skip_synchronize"):
        opt.step()  # step() after synchronize() without skip_synchronize()
    assert same_on_every_rank(model.weight, "opt.sync.check")


# ------------------------------------------------------------------ broadcast helpers

def test_broadcast_parameters(initialized):
    r = hvd.rank()
    model = _linear(seed=r)
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    assert torch.equal(model.weight, _linear(seed=0).weight)
    model = _linear(seed=r)
    hvd.broadcast_parameters(list(model.named_parameters()), root_rank=hvd.size() - 1)
    assert torch.equal(model.bias, _linear(seed=hvd.size() - 1).bias)
    model = _linear(seed=r)
    hvd.broadcast_parameters(model.named_parameters(), root_rank=0)  # a generator too
    assert same_on_every_rank(model.weight, "bp.check")
    # Buffers too: BatchNorm's running statistics and its 0-d int64 counter.
    torch.manual_seed(r)
    bn = torch.nn.BatchNorm1d(2)
    for _ in range(2 if r == 0 else 1):  # rank 0 has counted 2 batches
        bn(torch.randn(4 + r, 2))
    hvd.broadcast_parameters(bn.state_dict(), root_rank=0)
    assert bn.num_batches_tracked.item() == 2
    assert same_on_every_rank(bn.running_mean, "bp.bn.check")


def test_broadcast_parameters_list_of_parameters(initialized):
    model = _linear(seed=hvd.rank())
    hvd.broadcast_parameters(list(model.parameters()), root_rank=0)
    assert torch.equal(model.weight, _linear(seed=0).weight)


def test_broadcast_optimizer_state(initialized):
    r = hvd.rank()
    model = _linear()
    fresh = torch.optim.SGD(model.parameters(), lr=0.1 * (r + 1), momentum=0.9)
    hvd.broadcast_optimizer_state(fresh, root_rank=0)  # before any step: hyper-parameters
    assert fresh.param_groups[0]["lr"] == pytest.approx(0.1)
    adam = torch.optim.Adam(model.parameters(), lr=0.01)
    model(torch.ones(2, 3) * (r + 1)).sum().backward()
    adam.step()
    hvd.broadcast_optimizer_state(adam, root_rank=0)
    assert same_on_every_rank(adam.state_dict()["state"][0]["exp_avg"], "bos.check")
    with pytest.raises(ValueError, match="LBFGS"):
        hvd.broadcast_optimizer_state(torch.optim.LBFGS(model.parameters()), root_rank=0)


def test_broadcast_object_and_allgather_object(initialized):
    r, n = hvd.rank(), hvd.size()
    obj = {"hello": 123, 0: [1, 2]} if r == 0 else {}
    assert hvd.broadcast_object(obj, root_rank=0) == {"hello": 123, 0: [1, 2]}
    assert hvd.broadcast_object({"from": r}, root_rank=n - 1) == {"from": n - 1}
    assert hvd.broadcast_object(None) is None
    t = hvd.broadcast_object(torch.full((2,), float(r)), root_rank=n - 1, name="tensor.obj")
    assert t.tolist() == [float(n - 1)] * 2
    d = {"metric": r, "extra": list(range(r))}
    assert hvd.allgather_object(d) == [{"metric": q, "extra": list(range(q))} for q in range(n)]
    assert hvd.allgather_object(None, name="nothing") == [None] * n


# ------------------------------------------------------------------ SyncBatchNorm, sparse

def test_sync_batch_norm_uses_the_global_batch(initialized):
    r = hvd.rank()
    xs = [x * (q + 1) + q for q, x in enumerate(everyone((4, 3), torch.float32, seed=31))]
    sync = hvd.SyncBatchNorm(3, momentum=0.5)
    ref = torch.nn.BatchNorm1d(3, momentum=0.5)
    assert isinstance(sync, torch.nn.modules.batchnorm._BatchNorm)
    y = sync(xs[r])
    y_ref = ref(torch.cat(xs))
    assert torch.allclose(y, y_ref[4 * r:4 * r + 4], atol=1e-5)
    assert torch.allclose(sync.running_mean, ref.running_mean, atol=1e-5)
    assert torch.allclose(sync.running_var, ref.running_var, atol=1e-5)
    sync.eval()
    assert torch.allclose(sync(xs[r]), ref.eval()(xs[r]), atol=1e-5)


def test_sparse_allreduce_async(initialized):
    r, n = hvd.rank(), hvd.size()
    s = torch.sparse_coo_tensor([[r, n]], [1.0, float(r)], (n + 1,))
    h = hvd.sparse_allreduce_async(s, name="sparse.sum", op=hvd.Sum)
    assert hvd.poll(h) in (True, False)
    dense = h().to_dense()  # Horovod's handle is a closure: call it
    assert dense.tolist() == [1.0] * n + [float(sum(range(n)))]
    assert hvd.synchronize(h).to_dense().tolist() == dense.tolist()
    h = hvd.sparse_allreduce_async(s, "sparse.avg", hvd.Average)  # Horovod's positional order
    assert torch.allclose(h().to_dense(), dense / n)
    empty = torch.sparse_coo_tensor(torch.empty(1, 0, dtype=torch.long), torch.empty(0), (n + 1,))
    h = hvd.sparse_allreduce_async(empty if r == 0 else s, name="sparse.nnz0", op=hvd.Sum)
    assert h().to_dense()[0].item() == 0.0  # rank 0 sent nothing


# ------------------------------------------------------------------ timeline

def test_start_and_stop_timeline_rank_0_writes(initialized):
    r = hvd.rank()
    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, f"timeline.{r}.json")  # each rank names its own file
        hvd.start_timeline(path)
        hvd.allreduce(torch.ones(3), name="timeline.tensor")
        hvd.stop_timeline()
        if r == 0:
            with open(path) as f:
                events = json.load(f)  # valid JSON as soon as stop returns
            assert any(e.get("args", {}).get("name") == "timeline.tensor" for e in events)
        else:
            assert not os.path.exists(path)
        hvd.start_timeline(path, mark_cycles=True)
        hvd.stop_timeline()
        hvd.stop_timeline()  # stopping twice is harmless
        bad = os.path.join(d, "missing", "timeline.json")
        if r == 0:
            with pytest.raises(ValueError, match="timeline"):
                hvd.start_timeline(bad)
        else:
            hvd.start_timeline(bad)  # only the coordinator opens the file
        hvd.barrier()


# ------------------------------------------------------------------ elastic, errors

def test_elastic_api(initialized):
    r, n = hvd.rank(), hvd.size()
    for name in ("run", "State", "ObjectState", "TorchState", "ElasticSampler"):
        assert hasattr(hvd.elastic, name), name
    assert issubclass(hvd.elastic.TorchState, hvd.elastic.State)
    model = _linear(seed=r)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    state = hvd.elastic.TorchState(model, opt, epoch=1, batch=0)
    assert state.model is model and state.epoch == 1
    state.sync()  # rank 0's model everywhere
    assert same_on_every_rank(model.weight, "elastic.sync")
    state.commit()
    state.epoch = 5
    with torch.no_grad():
        model.weight.add_(1.0)
    state.restore()
    assert state.epoch == 1 and torch.equal(model.weight, _linear(seed=0).weight)
    obj = hvd.elastic.ObjectState(step=r + 10)
    obj.sync()
    assert obj.step == 10
    sampler = hvd.elastic.ElasticSampler(list(range(10)), shuffle=False)
    mine = list(sampler)
    assert len(sampler) == len(mine) == 10 // n
    assert sorted(sum(hvd.allgather_object(mine), [])) == list(range(10))

    calls = []

    @hvd.elastic.run
    def train(state, k):
        calls.append(k)
        return state.epoch + k

    assert train(state, 2) == 3 and calls == [2]


def test_horovod_internal_error_when_a_peer_shuts_down(teardown):
    hvd.init()
    r = hvd.rank()
    hvd.barrier()
    if r == hvd.size() - 1:
        hvd.shutdown()  # leaves; the others' engines stop with it
    else:
        with pytest.raises(hvd.HorovodInternalError):
            for i in range(1000):  # fails within a cycle or two
                hvd.allreduce(torch.ones(1), name=f"after.leave.{i}")
        hvd.shutdown()
    assert not hvd.is_initialized()
