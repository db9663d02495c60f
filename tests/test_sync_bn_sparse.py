"""hvd.SyncBatchNorm and hvd.sparse_allreduce_async on 2 and 3 real processes, checked
against one-process references (see tests/sync_bn_sparse_workers.py)."""
import pytest
import torch

from horovod_torch import basics
from horovod_torch.sparse import sparse_allreduce_async
from horovod_torch.sync_batch_norm import SyncBatchNorm
from tests.harness import run_workers


@pytest.mark.parametrize("size", [2, 3])
def test_sync_batch_norm_matches_batch_norm_on_concatenated_batch(size):
    results = run_workers("tests.sync_bn_sparse_workers:sync_bn", size, timeout=120)
    assert all("sync bn ok" in r.output for r in results)


@pytest.mark.parametrize("size", [2, 3])
def test_sparse_allreduce_matches_dense_sum_and_average(size):
    results = run_workers("tests.sync_bn_sparse_workers:sparse", size, timeout=90)
    assert all("sparse ok" in r.output for r in results)


@pytest.mark.skipif(basics.is_initialized(), reason="needs a process without hvd.init()")
def test_sync_batch_norm_without_init_is_plain_batch_norm():
    torch.manual_seed(0)
    sync, ref = SyncBatchNorm(3), torch.nn.BatchNorm2d(3)
    x = torch.randn(4, 3, 5, 5) * 2 + 1
    for mode in ("train", "eval"):
        getattr(sync, mode)()
        getattr(ref, mode)()
        a, b = x.clone().requires_grad_(), x.clone().requires_grad_()
        ya, yb = sync(a), ref(b)
        ya.square().sum().backward()
        yb.square().sum().backward()
        assert torch.allclose(ya, yb, atol=1e-6) and torch.allclose(a.grad, b.grad, atol=1e-6)
        assert torch.allclose(sync.running_mean, ref.running_mean)
        assert torch.allclose(sync.running_var, ref.running_var)
    assert isinstance(sync, torch.nn.modules.batchnorm._BatchNorm)
    with pytest.raises(ValueError):
        sync(torch.randn(3))


def test_sparse_allreduce_rejects_dense_and_min_max():
    with pytest.raises(ValueError):
        sparse_allreduce_async(torch.zeros(3), name="x")
    with pytest.raises(ValueError):
        sparse_allreduce_async(torch.zeros(3).to_sparse(), name="x", op=basics.Max)
