"""GPU workers for what upstream Horovod's suite found on CUDA tensors (tests/test_gpu.py).

They place tensors as upstream's tests do: ``tensor.cuda(hvd.local_rank())`` with no
``torch.cuda.set_device``, and touch GPU 0 first, so that on every rank but 0 the
current device is another GPU than the one the tensors are on."""
import time

import torch

import horovod_torch as hvd


def _touch_gpu0() -> torch.device:
    """Creates GPU 0's context on this rank (as `torch.cuda.FloatTensor(n)` or
    `device="cuda"` in a test does) and returns this rank's own GPU."""
    torch.zeros(1, device="cuda:0").add_(1)
    assert torch.cuda.current_device() == 0
    return torch.device("cuda", hvd.local_rank())


def foreign_current_device() -> None:
    """Collectives on this rank's GPU while the current device is GPU 0: each ends
    with the right result (before the fix: 'invalid resource handle' on rank 1,
    and the peers waited forever)."""
    hvd.init()
    r, n = hvd.rank(), hvd.size()
    dev = _touch_gpu0()
    t = torch.full((17, 3), float(r + 1), device=dev)
    assert hvd.allreduce(t, op=hvd.Sum).eq(n * (n + 1) / 2).all().item()
    for root in range(n):
        b = hvd.broadcast(t, root)
        assert b.device == dev and b.eq(root + 1).all().item(), (root, b)
        assert t.eq(r + 1).all().item(), "broadcast modified its input"
    g = hvd.allgather(t)
    assert g.shape[0] == 17 * n and g[17 * (n - 1):].eq(n).all().item()
    a, splits = hvd.alltoall(torch.full((n, 2), float(r), device=dev), [1] * n)
    assert a[:, 0].tolist() == [float(p) for p in range(n)], a
    # grouped allreduce under autograd: each output's backward is a grouped allreduce
    xs = [torch.full((5,), float(r), device=dev, requires_grad=True) for _ in range(3)]
    for s in hvd.grouped_allreduce(xs, op=hvd.Sum):
        s.backward(torch.ones_like(s))
    for x in xs:
        assert x.grad.eq(n).all().item(), x.grad
    torch.cuda.synchronize(dev)
    print("foreign current device ok", flush=True)
    hvd.shutdown()


def alltoall_splits_on_gpu() -> None:
    """Splits given as a CUDA tensor: the received splits come back on that device,
    for CUDA and CPU inputs alike (as in Horovod)."""
    hvd.init()
    r, n = hvd.rank(), hvd.size()
    dev = _touch_gpu0()
    splits = torch.tensor([r + 1] * n, dtype=torch.int32, device="cuda")
    for d in (torch.device("cpu"), dev):
        x = torch.full((n * (r + 1),), float(r), device=d)
        out, received = hvd.alltoall(x, splits)
        assert out.device == d
        assert received.device.type == "cuda", received.device
        assert received.tolist() == [p + 1 for p in range(n)], received
        # rank p sends p + 1 rows of the value p to every rank
        assert out.cpu().tolist() == [float(p) for p in range(n) for _ in range(p + 1)], out
    print("alltoall splits on gpu ok", flush=True)
    hvd.shutdown()


def grouped_mixed_devices() -> None:
    """A group of CPU and CUDA tensors fails at once with RuntimeError on every rank
    (as in Horovod), and the engine goes on."""
    hvd.init()
    n = hvd.size()
    dev = _touch_gpu0()
    tensors = [torch.ones(10) if i % 2 else torch.ones(10, device=dev) for i in range(5)]
    t0 = time.monotonic()
    try:
        hvd.grouped_allreduce(tensors, op=hvd.Sum)
    except RuntimeError as e:
        assert "one device" in str(e), e
    else:
        raise AssertionError("a group of CPU and CUDA tensors did not fail")
    assert time.monotonic() - t0 < 5
    out = hvd.grouped_allreduce([torch.ones(3, device=dev), torch.ones(4, device=dev)],
                                op=hvd.Sum)
    assert all(o.eq(n).all().item() for o in out)
    print("grouped mixed devices refused", flush=True)
    hvd.shutdown()


def half_scaling() -> None:
    """prescale/postscale on CUDA float16 and bfloat16 as Horovod's CUDA kernels do
    them: each rank's input multiplied in its type by the factor rounded to it, then
    summed (prescale); the sum so multiplied (postscale). Upstream's tests compare with
    tolerance 0 at 2 ranks and 1e-4 at 4; NCCL's pre-multiplied sum, which adds each
    scaled input before rounding it, was an ulp away at 4 ranks."""
    hvd.init()
    n = hvd.size()
    dev = _touch_gpu0()
    gen = torch.Generator().manual_seed(1234)
    for dtype in (torch.float16, torch.bfloat16):
        for factor in (0.1915194503788923, 0.7, 1.0 / 3.0):
            x = (torch.randint(-100, 100, (17, 17), generator=gen).to(dtype) *
                 (hvd.rank() + 1)).to(dev)
            f = torch.tensor(factor, dtype=torch.float64).to(dtype).to(dev)
            pre = hvd.allreduce(x, op=hvd.Sum, prescale_factor=factor)
            want = hvd.allreduce(f * x, op=hvd.Sum)  # scaled and rounded here, then summed
            assert torch.equal(pre, want), (dtype, factor, (pre - want).abs().max())
            post = hvd.allreduce(x, op=hvd.Sum, postscale_factor=factor)
            want = hvd.allreduce(x, op=hvd.Sum) * f
            assert torch.equal(post, want), (dtype, factor, (post - want).abs().max())
    print("half scaling ok", flush=True)
    hvd.shutdown()


def join_on_gpu(pass_device: str = "1") -> None:
    """The last rank joins first; the others allreduce CUDA tensors (two, fused)
    meanwhile. The joined rank's zeros go on its own GPU (hvd.join's device, or
    with no device that of its last CUDA op), never on the background thread's
    current device: a second communicator there made the ranks' control
    exchanges diverge ('local ranks made different shared-memory collectives')."""
    hvd.init()
    r, n = hvd.rank(), hvd.size()
    dev = _touch_gpu0()
    last = n - 1
    a = torch.full((5, 5), float(r + 1), device=dev)
    b = torch.full((17,), float(r + 1), device=dev)
    hvd.allreduce(a, name="warm", op=hvd.Sum)  # this rank's last CUDA op is on dev
    for step in range(3):
        if r == last:
            ret = hvd.join(hvd.local_rank()) if pass_device == "1" else hvd.join()
        else:
            ha = hvd.allreduce_async(a, name=f"a{step}", op=hvd.Sum)
            hb = hvd.allreduce_async(b, name=f"b{step}", op=hvd.Sum)
            sa, sb = hvd.synchronize(ha), hvd.synchronize(hb)
            want = float(sum(p + 1 for p in range(n) if p != last))
            assert sa.eq(want).all().item() and sb.eq(want).all().item(), (sa, sb, want)
            ret = hvd.join(hvd.local_rank()) if pass_device == "1" else hvd.join()
        assert ret != last, ret
        assert hvd.allgather_object(ret) == [ret] * n
    print("join on gpu ok", flush=True)
    hvd.shutdown()
