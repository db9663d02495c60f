"""Worker functions for tests/test_sync_bn_sparse.py and tests/test_gpu.py (run on every
rank by harness.py).

Each rank builds every rank's input deterministically on the CPU, computes the reference
in this one process there (a plain torch BatchNorm over the concatenated batch; a dense
sum for the sparse allreduce), runs ours on `device` ("cpu" or "cuda": this rank's GPU)
and raises on a mismatch."""
import torch

import horovod_torch as hvd
from horovod_torch.sparse import SparseHandle, sparse_allreduce_async
from horovod_torch.sparse import synchronize as sparse_synchronize
from horovod_torch.sync_batch_norm import SyncBatchNorm
from tests import workers


def _gen(seed: int, rank: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed * 1000 + rank)


def _device(kind: str) -> torch.device:
    """This rank's device (tests.workers._device), with cuDNN's TF32 off: the CPU
    reference computes convolutions in float32."""
    torch.backends.cudnn.allow_tf32 = False
    return workers._device(kind)


def _close(got: torch.Tensor, want: torch.Tensor, what: str, tol: float) -> None:
    got, want = got.cpu(), want.cpu()
    assert got.shape == want.shape, f"{what}: shape {tuple(got.shape)} != {tuple(want.shape)}"
    assert got.dtype == want.dtype, f"{what}: dtype {got.dtype} != {want.dtype}"
    diff = (got.double() - want.double()).abs().max().item() if got.numel() else 0.0
    assert torch.allclose(got.double(), want.double(), rtol=tol, atol=tol), \
        f"{what}: max abs diff {diff:.3g} > {tol}"


# ------------------------------------------------------------------ SyncBatchNorm

# (label, reference class, per-sample shape after (N, C), batch sizes for 2 ranks,
#  batch sizes for 3 ranks, dtype, module kwargs)
BN_CASES = [
    ("2d", torch.nn.BatchNorm2d, (3, 4, 5), [4, 4], [2, 2, 2], torch.float32, {}),
    ("2d-uneven", torch.nn.BatchNorm2d, (2, 3, 3), [1, 6], [5, 1, 3], torch.float32, {}),
    ("2d-empty-rank", torch.nn.BatchNorm2d, (2, 3, 2), [0, 5], [3, 0, 4], torch.float32, {}),
    ("1d-NC", torch.nn.BatchNorm1d, (5,), [3, 7], [2, 4, 3], torch.float32, {}),
    ("1d-NCL", torch.nn.BatchNorm1d, (4, 6), [2, 3], [1, 2, 3], torch.float32,
     dict(momentum=0.3)),
    ("2d-cma", torch.nn.BatchNorm2d, (3, 2, 2), [2, 3], [2, 3, 1], torch.float32,
     dict(momentum=None)),
    ("2d-noaffine", torch.nn.BatchNorm2d, (3, 3, 3), [2, 4], [1, 2, 3], torch.float32,
     dict(affine=False)),
    ("2d-nostats", torch.nn.BatchNorm2d, (3, 3, 3), [3, 2], [2, 2, 3], torch.float32,
     dict(track_running_stats=False)),
    ("2d-f64", torch.nn.BatchNorm2d, (3, 4, 4), [3, 5], [2, 3, 4], torch.float64, {}),
]


def _bn_inputs(seed, q, batch, feat, dtype):
    g = _gen(seed, q)
    # an offset and scale per channel so the statistics are not trivial
    x = torch.randn((batch,) + feat, generator=g, dtype=torch.float64) * 3 + 5
    dy = torch.randn((batch,) + feat, generator=g, dtype=torch.float64)
    return x.to(dtype), dy.to(dtype)


def _check_bn_case(case_index, n, r, dev):
    label, ref_cls, feat, b2, b3, dtype, kwargs = BN_CASES[case_index]
    batches = b2 if n == 2 else b3 if n == 3 else [2 + q % 3 for q in range(n)]
    tol = (1e-5 if dev.type == "cpu" else 1e-4) if dtype == torch.float32 else 1e-10
    channels = feat[0]
    spatial_dims = [0] + list(range(2, 1 + len(feat)))

    torch.manual_seed(case_index)
    sync = SyncBatchNorm(channels, **kwargs).to(dtype)
    ref = ref_cls(channels, **kwargs).to(dtype)
    if sync.affine:
        with torch.no_grad():
            w = torch.rand(channels, dtype=torch.float64, generator=_gen(77, case_index)) + 0.5
            b = torch.randn(channels, dtype=torch.float64, generator=_gen(78, case_index))
            for m in (sync, ref):
                m.weight.copy_(w.to(dtype))
                m.bias.copy_(b.to(dtype))
    sync.to(dev).train()
    ref.train()

    for step in range(3):
        seed = 100 * case_index + step
        data = [_bn_inputs(seed, q, batches[q], feat, dtype) for q in range(n)]
        xs, dys = zip(*data)
        start, stop = sum(batches[:r]), sum(batches[:r + 1])

        # this rank: synchronized module on its own slice
        x = xs[r].to(dev).clone().requires_grad_()
        y = sync(x)
        (y * dys[r].to(dev)).sum().backward()

        # reference: one BatchNorm over the concatenated batch
        xr = torch.cat(xs).clone().requires_grad_()
        yr = ref(xr)
        (yr * torch.cat(dys)).sum().backward()

        what = f"[{label} n={n} rank={r} step={step}]"
        _close(y.detach(), yr.detach()[start:stop], f"{what} output", tol)
        _close(x.grad, xr.grad[start:stop], f"{what} input grad", tol)
        if sync.affine:
            # local share = this rank's slice of the reference's sum(dy * xhat), sum(dy)
            full = torch.cat(xs).double()
            mean = full.mean(spatial_dims, keepdim=True)
            var = full.var(spatial_dims, unbiased=False, keepdim=True)
            xhat = ((full - mean) / torch.sqrt(var + sync.eps))[start:stop]
            dy64 = dys[r].double()
            _close(sync.weight.grad.double(), (dy64 * xhat).sum(spatial_dims),
                   f"{what} local weight grad", tol)
            _close(sync.bias.grad.double(), dy64.sum(spatial_dims), f"{what} local bias grad", tol)
            # summed over ranks they are the reference's gradients
            gw = hvd.allreduce(sync.weight.grad, op=hvd.Sum, name=f"bn.gw.{case_index}.{step}")
            gb = hvd.allreduce(sync.bias.grad, op=hvd.Sum, name=f"bn.gb.{case_index}.{step}")
            _close(gw, ref.weight.grad, f"{what} summed weight grad", tol)
            _close(gb, ref.bias.grad, f"{what} summed bias grad", tol)
            for m in (sync, ref):
                m.weight.grad = None
                m.bias.grad = None
        if sync.track_running_stats:
            _close(sync.running_mean, ref.running_mean, f"{what} running_mean", tol)
            _close(sync.running_var, ref.running_var, f"{what} running_var", tol)
            assert int(sync.num_batches_tracked) == int(ref.num_batches_tracked) == step + 1
        else:
            assert sync.running_mean is None and sync.running_var is None

    # eval mode: plain batch norm on the local batch, no collectives. Rank 0 runs it
    # one extra time; a collective there would hang or mismatch the next case.
    sync.eval()
    ref.eval()
    for _ in range(2 if r == 0 else 1):
        x, _ = _bn_inputs(999 + case_index, r, 3, feat, dtype)
        with torch.no_grad():
            _close(sync(x.to(dev)), ref(x), f"[{label} n={n} rank={r}] eval output", tol)


def _check_two_modules_network(n, r, dev):
    """Two SyncBatchNorms in one network (distinct collective names), conv gradient
    summed over ranks equals the single-process one."""
    def build(bn):
        torch.manual_seed(5)
        return torch.nn.Sequential(torch.nn.Conv2d(2, 3, 3, padding=1), bn(3), torch.nn.ReLU(),
                                   torch.nn.Conv2d(3, 4, 1), bn(4))
    net, ref = build(SyncBatchNorm).to(dev), build(torch.nn.BatchNorm2d)
    batches = [2 + q for q in range(n)]
    xs = [torch.randn(batches[q], 2, 5, 5, generator=_gen(4242, q)) for q in range(n)]
    dys = [torch.randn(batches[q], 4, 5, 5, generator=_gen(4343, q)) for q in range(n)]
    start, stop = sum(batches[:r]), sum(batches[:r + 1])
    for step in range(2):
        net.zero_grad()
        ref.zero_grad()
        x = xs[r].to(dev).clone().requires_grad_()
        y = net(x)
        (y * dys[r].to(dev)).sum().backward()
        xr = torch.cat(xs).requires_grad_()
        yr = ref(xr)
        (yr * torch.cat(dys)).sum().backward()
        _close(y.detach(), yr.detach()[start:stop], "network output", 1e-4)
        _close(x.grad, xr.grad[start:stop], "network input grad", 1e-4)
        for (pn, p), pr in zip(net.named_parameters(), ref.parameters()):
            g = hvd.allreduce(p.grad, op=hvd.Sum, name=f"net.{step}.{pn}")
            _close(g, pr.grad, f"network summed grad {pn}", 1e-4)
        for (bn, b), br in zip(net.named_buffers(), ref.buffers()):
            _close(b, br, f"network buffer {bn}", 1e-5 if dev.type == "cpu" else 1e-4)


def sync_bn(device: str = "cpu") -> None:
    hvd.init()
    n, r = hvd.size(), hvd.rank()
    dev = _device(device)
    for i in range(len(BN_CASES)):
        _check_bn_case(i, n, r, dev)
    _check_two_modules_network(n, r, dev)
    hvd.barrier()
    print("sync bn ok", flush=True)
    hvd.shutdown()


# ------------------------------------------------------------------ sparse allreduce

def _sparse(seed, q, size, nnz, dtype, sparse_dim=None):
    g = _gen(seed, q)
    sparse_dim = len(size) if sparse_dim is None else sparse_dim
    idx = torch.stack([torch.randint(0, size[d], (nnz,), generator=g)
                       for d in range(sparse_dim)]) if nnz else \
        torch.zeros(sparse_dim, 0, dtype=torch.int64)
    vshape = (nnz,) + tuple(size[sparse_dim:])
    if dtype.is_floating_point:
        vals = torch.randn(vshape, generator=g, dtype=torch.float64).to(dtype)
    else:
        vals = torch.randint(-5, 6, vshape, generator=g).to(dtype)
    # duplicates are likely: the tensor is left uncoalesced on purpose
    return torch.sparse_coo_tensor(idx, vals, size)


def _check_sparse_result(out, tensors, op, n, what):
    assert isinstance(out, torch.Tensor) and out.layout == torch.sparse_coo, what
    assert out.is_coalesced(), f"{what}: not coalesced"
    assert out.size() == tensors[0].size() and out.dtype == tensors[0].dtype, what
    dense = tensors[0].cpu().to_dense().double()
    for t in tensors[1:]:
        dense = dense + t.cpu().to_dense().double()
    if op == hvd.Average:
        dense = dense / n if out.dtype.is_floating_point else (dense / n).trunc()
    got = out.cpu().to_dense()
    if out.dtype.is_floating_point:
        _close(got.double(), dense, what, 1e-5)
    else:
        assert torch.equal(got.long(), dense.long()), f"{what}: {got} != {dense}"


def sparse(device: str = "cpu") -> None:
    hvd.init()
    n, r = hvd.size(), hvd.rank()
    dev = _device(device)
    cases = [
        # (label, size, nnz per rank, dtype, sparse_dim)
        ("2d", (10, 6), [3 + 4 * q for q in range(n)], torch.float32, None),
        ("1d", (50,), [7 * (q + 1) for q in range(n)], torch.float64, None),
        ("hybrid", (12, 3), [2 + q for q in range(n)], torch.float32, 1),
        ("int", (8, 8), [5 + q for q in range(n)], torch.int64, None),
        ("empty-rank", (9, 4), [0] + [4 + q for q in range(1, n)], torch.float32, None),
        ("all-empty", (5, 5), [0] * n, torch.float32, None),
    ]
    for ci, (label, size, nnzs, dtype, sdim) in enumerate(cases):
        tensors = [_sparse(ci, q, size, nnzs[q], dtype, sdim).to(dev) for q in range(n)]
        for op in (hvd.Sum, hvd.Average):
            what = f"[sparse {label} op={op} n={n} rank={r}]"
            h = sparse_allreduce_async(tensors[r], name=f"sp.{label}.{op}", op=op)
            assert isinstance(h, SparseHandle)
            if op == hvd.Sum:
                out = h.synchronize()
                assert h.poll() and sparse_synchronize(h) is out and h() is out, what
                assert hvd.poll(h) and hvd.synchronize(h) is out, what
            else:
                out = hvd.synchronize(h)
            _check_sparse_result(out, tensors, op, n, what)

    # several in flight at once, unnamed, synchronized in reverse order
    tensors = [[_sparse(50 + k, q, (7, 7), 3 + q + k, torch.float32).to(dev) for q in range(n)]
               for k in range(4)]
    handles = [sparse_allreduce_async(tensors[k][r], op=hvd.Sum) for k in range(4)]
    for k in reversed(range(4)):
        _check_sparse_result(handles[k].synchronize(), tensors[k], hvd.Sum, n,
                             f"[sparse in flight {k}]")

    # a sparse embedding gradient, averaged as Horovod's optimizer would
    emb = torch.nn.Embedding(20, 3, sparse=True).to(dev)
    ids = torch.randint(0, 20, (6,), generator=_gen(7, r)).to(dev)
    emb(ids).sum().backward()
    grads = hvd.allgather_object(emb.weight.grad.cpu())
    out = sparse_allreduce_async(emb.weight.grad, name="sp.emb", op=hvd.Average).synchronize()
    _check_sparse_result(out, grads, hvd.Average, n, "[sparse embedding grad]")

    for bad, kwargs in [(torch.zeros(3, device=dev), {}), (tensors[0][r], dict(op=hvd.Max))]:
        try:
            sparse_allreduce_async(bad, name="sp.bad", **kwargs)
        except ValueError:
            pass
        else:
            raise AssertionError(f"expected ValueError for {kwargs or 'a dense tensor'}")
    hvd.barrier()
    print("sparse ok", flush=True)
    hvd.shutdown()
