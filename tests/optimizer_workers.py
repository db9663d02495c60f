"""Training-side workers: DistributedOptimizer exactness and behaviours."""
import os
import warnings

import torch
import torch.nn as nn

import horovod_torch as hvd
from tests.workers import expect_raises

B = 12  # global batch


def _model(seed=0):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(5, 7), nn.Tanh(), nn.Linear(7, 3))


def _data(step):
    g = torch.Generator().manual_seed(100 + step)
    return torch.randn(B, 5, generator=g), torch.randn(B, 3, generator=g)


def _make_opt(name, params):
    if name == "sgd":
        return torch.optim.SGD(params, lr=0.1, momentum=0.9)
    return torch.optim.Adam(params, lr=0.01)


def _reference(opt_name, steps):
    model = _model()
    opt = _make_opt(opt_name, model.parameters())
    for s in range(steps):
        x, y = _data(s)
        opt.zero_grad()
        ((model(x) - y) ** 2).sum().div(B).backward()
        opt.step()
    return [p.detach().clone() for p in model.parameters()]


def _backward(loss, compiled: bool) -> None:
    if not compiled:
        loss.backward()
        return
    import torch._dynamo.compiled_autograd as ca
    warnings.filterwarnings("ignore", message=".*Dynamo does not know how to trace")
    with ca._enable(torch.compile(backend="eager")):
        loss.backward()


def exactness(opt_name="sgd", op="average", bpps="1", extra="none", device="cpu"):
    """N ranks on 1/N shards end where one process on the whole batch ends.

    extra: "none", or any of groups, fp16, compiled (compiled autograd), torch.compile
    (the model: aot_eager on the CPU, inductor on a GPU) joined by +."""
    extras = set(extra.split("+"))
    hvd.init()
    r, n = hvd.rank(), hvd.size()
    bpps = int(bpps)
    steps = 3
    dev = torch.device("cpu")
    if device == "cuda":
        torch.cuda.set_device(hvd.local_rank())
        dev = torch.device("cuda", hvd.local_rank())
    model = _model().to(dev)
    if "torch.compile" in extras:
        warnings.filterwarnings("ignore", message=".*Dynamo does not know how to trace")
        model = torch.compile(model, backend="aot_eager" if dev.type == "cpu" else "inductor")
    kwargs = {}
    if "groups" in extras:
        kwargs["num_groups"] = 2
    if "fp16" in extras:
        kwargs["compression"] = hvd.Compression.fp16
    opt = hvd.DistributedOptimizer(_make_opt(opt_name, model.parameters()),
                                   named_parameters=model.named_parameters(),
                                   op=hvd.Average if op == "average" else hvd.Sum,
                                   backward_passes_per_step=bpps, **kwargs)
    assert isinstance(opt, torch.optim.SGD if opt_name == "sgd" else torch.optim.Adam)
    # Gradient hooks run in C++ unless turned off or the optimizer uses groups.
    native = os.environ.get("HOROVOD_NATIVE_GRAD_HOOKS", "1") != "0" and "groups" not in extras
    assert (opt._native is not None) == native, opt._native
    shard = B // n
    for s in range(steps):
        x, y = _data(s)
        x, y = x.to(dev), y.to(dev)
        xs, ys = x[r * shard:(r + 1) * shard], y[r * shard:(r + 1) * shard]
        opt.zero_grad()
        micro = shard // bpps
        for k in range(bpps):
            xm, ym = xs[k * micro:(k + 1) * micro], ys[k * micro:(k + 1) * micro]
            loss = ((model(xm) - ym) ** 2).sum()
            loss = loss / shard if op == "average" else loss / B
            _backward(loss, "compiled" in extras)
        # The hooks started the allreduces during backward (also under compiled
        # autograd), not synchronize() after it.
        assert not native or opt._native.in_flight()
        opt.step()
    ref = _reference(opt_name, steps)
    tol = 2e-3 if "fp16" in extras else (1e-4 if device == "cuda" else 1e-5)
    for p, q in zip((p.detach().cpu() for p in model.parameters()), ref):
        assert torch.allclose(p, q, atol=tol, rtol=tol), (p - q).abs().max()
    # state_dict / load_state_dict still behave
    sd = opt.state_dict()
    opt.load_state_dict(sd)
    assert len(opt.param_groups) == 1
    hvd.shutdown()
    print("exactness ok", flush=True)


def fp16_wire(device="cpu"):
    """Compression.fp16 sends gradients as float16: the averaged gradient is the
    average of the ranks' float16-rounded gradients, itself a float16 value, and .grad
    keeps its float32 dtype. One parameter alone (an unfused allreduce), then four
    (fused, as they come)."""
    hvd.init()
    r, n = hvd.rank(), hvd.size()
    dev = torch.device("cpu")
    if device == "cuda":
        torch.cuda.set_device(hvd.local_rank())
        dev = torch.device("cuda", hvd.local_rank())
    for sizes in [(5000,), (1, 7, 1000, 5000)]:
        params = [nn.Parameter(torch.zeros(k, device=dev)) for k in sizes]
        opt = hvd.DistributedOptimizer(
            torch.optim.SGD(params, lr=0.0),
            named_parameters=[(f"w{len(sizes)}.{i}", p) for i, p in enumerate(params)],
            compression=hvd.Compression.fp16)
        gen = torch.Generator().manual_seed(len(sizes))
        grads = [[torch.randn(k, generator=gen) / 3 for k in sizes] for _ in range(n)]
        sum((p * g.to(dev)).sum() for p, g in zip(params, grads[r])).backward()
        opt.step()
        for i, p in enumerate(params):
            got = p.grad.cpu()
            assert got.dtype == torch.float32, got.dtype
            assert torch.equal(got, got.half().float()), f"not a float16 value: {sizes}[{i}]"
            expect = torch.stack([g[i].half().double() for g in grads]).mean(0)
            assert torch.allclose(got.double(), expect, atol=1e-3, rtol=1e-3), \
                (got.double() - expect).abs().max()
    hvd.shutdown()
    print("fp16 wire ok", flush=True)


class _Branchy(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Linear(3, 3)
        self.b = nn.Linear(3, 3)

    def forward(self, x, use_b):
        return self.b(self.a(x)) if use_b else self.a(x)


def behaviours():
    hvd.init()
    r, n = hvd.rank(), hvd.size()
    # Unused parameters on some ranks: no deadlock, they take part with zeros.
    torch.manual_seed(0)
    m = _Branchy()
    opt = hvd.DistributedOptimizer(torch.optim.SGD(m.parameters(), lr=1.0),
                                   named_parameters=m.named_parameters(), op=hvd.Sum)
    for step in range(3):
        opt.zero_grad()
        m(torch.ones(2, 3), use_b=(r == 0)).sum().backward()
        opt.step()
    # b's gradient came from rank 0 only; every rank must still agree on b.
    bw = hvd.allgather(m.b.weight.detach().unsqueeze(0), name="check_b")
    assert all(torch.equal(bw[0], bw[q]) for q in range(n))
    # named_parameters checks
    m2 = nn.Linear(2, 2)
    expect_raises(ValueError, lambda: hvd.DistributedOptimizer(
        torch.optim.SGD(m2.parameters(), lr=0.1),
        named_parameters=[("w", m2.weight), ("w", m2.bias)]), "duplicate")
    expect_raises(ValueError, lambda: hvd.DistributedOptimizer(
        torch.optim.SGD(m2.parameters(), lr=0.1), named_parameters=[("w", m2.weight)]),
        "does not name every")
    # synchronize + clip + skip_synchronize (the gradient-clipping / AMP pattern)
    m3 = _model()
    opt3 = hvd.DistributedOptimizer(torch.optim.SGD(m3.parameters(), lr=0.1),
                                    named_parameters=m3.named_parameters())
    x, y = _data(0)
    ((m3(x) - y) ** 2).mean().backward()
    opt3.synchronize()
    torch.nn.utils.clip_grad_norm_(m3.parameters(), 0.01)
    with opt3.skip_synchronize(), warnings.catch_warnings():
        warnings.simplefilter("error")
        opt3.step()
    # step() after synchronize() without skip_synchronize() warns
    ((m3(x) - y) ** 2).mean().backward()
    opt3.synchronize()
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        opt3.step()
    assert any("skip_synchronize" in str(x.message) for x in w)
    # A .grad replaced (not changed in place) or dropped between backward() and
    # synchronize(): the reduced gradient lands in the new .grad, or becomes .grad.
    m5 = _model()
    opt5 = hvd.DistributedOptimizer(torch.optim.SGD(m5.parameters(), lr=0.1),
                                    named_parameters=m5.named_parameters())
    xs, ys = _data(1)
    # The expected sums come from a plain copy of the model: m5's .grad is in
    # flight (reduced in place) until synchronize(), so reading it here races.
    ref5 = _model()
    ((ref5(xs * (r + 1)) - ys) ** 2).mean().backward()
    want = [hvd.allreduce(p.grad, name=f"want5.{i}") for i, p in enumerate(ref5.parameters())]
    ((m5(xs * (r + 1)) - ys) ** 2).mean().backward()
    params5 = list(m5.parameters())
    params5[0].grad = torch.full_like(params5[0], 123.0)
    params5[1].grad = None
    opt5.synchronize()
    for p, w in zip(params5, want):
        assert torch.allclose(p.grad, w, atol=1e-6), (p.grad, w)
    # broadcast_parameters / broadcast_optimizer_state, before and after state exists
    m4 = _model(seed=r)
    opt4 = torch.optim.Adam(m4.parameters(), lr=0.01 * (r + 1))
    hvd.broadcast_parameters(m4.state_dict(), root_rank=0)
    hvd.broadcast_optimizer_state(opt4, root_rank=0)
    assert opt4.param_groups[0]["lr"] == 0.01
    ref = _model(seed=0)
    assert all(torch.equal(p, q) for p, q in zip(m4.parameters(), ref.parameters()))
    ((m4(x) - y) ** 2).mean().backward()
    opt4.step()
    if r != 0:
        opt4.state.clear()
    hvd.broadcast_optimizer_state(opt4, root_rank=0)
    sd = opt4.state_dict()["state"]
    got = hvd.allgather(sd[0]["exp_avg"].unsqueeze(0), name="check_state")
    assert all(torch.equal(got[0], got[q]) for q in range(n))
    hvd.shutdown()
    print("behaviours ok", flush=True)


def extra_pass():
    """backward_passes_per_step counted per parameter, on the hook path this process
    runs (HOROVOD_NATIVE_GRAD_HOOKS): one pass too many raises the same
    AssertionError either way, a step starts the count afresh, and a new
    backward_passes_per_step applies at once."""
    hvd.init()
    model = nn.Linear(2, 1, bias=False)
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                   named_parameters=model.named_parameters(),
                                   backward_passes_per_step=2)
    assert (opt._native is not None) == (os.environ.get("HOROVOD_NATIVE_GRAD_HOOKS") != "0")
    x = torch.ones(1, 2)
    for n in (2, 3):
        opt.backward_passes_per_step = n
        for step in range(2):
            opt.zero_grad()
            for _ in range(n):
                model(x).sum().backward()
            expect_raises(AssertionError, lambda: model(x).sum().backward(),
                          f"more than backward_passes_per_step ({n}) times")
            opt.step()
    print("extra pass ok", flush=True)
    hvd.shutdown()


def amp_gradscaler():
    """AMP on GPU: scale, backward, synchronize, unscale, clip, step inside
    skip_synchronize; every rank ends with the same finite parameters."""
    hvd.init()
    torch.cuda.set_device(hvd.local_rank())
    dev = torch.device("cuda", hvd.local_rank())
    model = _model().to(dev)
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.05),
                                   named_parameters=model.named_parameters())
    scaler = torch.amp.GradScaler("cuda")
    for s in range(5):
        x, y = _data(s)
        x, y = x.to(dev), y.to(dev)
        opt.zero_grad()
        with torch.autocast("cuda", dtype=torch.float16):
            loss = ((model(x) - y) ** 2).mean()
        scaler.scale(loss).backward()
        opt.synchronize()
        scaler.unscale_(opt)
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        with opt.skip_synchronize():
            scaler.step(opt)
        scaler.update()
    w = torch.cat([p.detach().flatten() for p in model.parameters()])
    assert torch.isfinite(w).all()
    all_w = hvd.allgather(w.unsqueeze(0), name="amp.check")
    assert all(torch.equal(all_w[0], all_w[q]) for q in range(hvd.size()))
    hvd.shutdown()
    print("amp ok", flush=True)


def adasum_checks():
    """op=hvd.Adasum over TCP: the pairwise-tree formula, identical results on every
    rank, DistributedOptimizer with Adasum, and the errors Horovod users expect."""
    from horovod_torch.adasum import reduce_gathered
    hvd.init()
    r, n = hvd.rank(), hvd.size()
    if n & (n - 1):
        expect_raises(ValueError, lambda: hvd.allreduce(torch.ones(3), op=hvd.Adasum),
                      "power-of-two")
        hvd.shutdown()
        print("adasum ok (non power of two rejected)", flush=True)
        return
    g = [torch.Generator().manual_seed(q) for q in range(n)]
    xs = [torch.randn(10, generator=g[q]) for q in range(n)]
    got = hvd.allreduce(xs[r], op=hvd.Adasum, name="ada")
    ref = reduce_gathered(torch.stack(xs)).float()
    assert torch.allclose(got, ref, atol=1e-6), (got, ref)
    if n == 2:  # closed form for two ranks
        a, b = xs[0].double(), xs[1].double()
        d = a.dot(b)
        closed = ((1 - d / (2 * a.dot(a))) * a + (1 - d / (2 * b.dot(b))) * b).float()
        assert torch.allclose(got, closed, atol=1e-6)
    same = hvd.allreduce(torch.arange(4.0), op=hvd.Adasum, name="ada.same")
    assert torch.allclose(same, torch.arange(4.0)), same  # parallel vectors: the average
    # An Adasum handle behaves as an engine handle: poll() True once done, the result
    # given once, then the handle is unknown (it used to be a negative int).
    h = hvd.allreduce_async(torch.arange(4.0), op=hvd.Adasum, name="ada.handle")
    assert hvd.poll(h) and torch.allclose(hvd.synchronize(h), torch.arange(4.0))
    expect_raises(ValueError, lambda: hvd.synchronize(h), "already synchronized")
    expect_raises(ValueError, lambda: hvd.poll(h), "already synchronized")
    group = hvd.grouped_allreduce_async([torch.ones(2), torch.arange(3.0)], op=hvd.Adasum,
                                        name="ada.group")
    assert hvd.poll(group)
    outs = hvd.synchronize(group)
    assert torch.allclose(outs[0], torch.ones(2)) and torch.allclose(outs[1], torch.arange(3.0))
    everyone = hvd.allgather(got.unsqueeze(0), name="ada.check")
    assert all(torch.equal(everyone[0], everyone[q]) for q in range(n))
    expect_raises(RuntimeError, lambda: hvd.reducescatter(torch.ones(4), op=hvd.Adasum),
                  "Adasum")
    # DistributedOptimizer(op=Adasum) is Horovod's delta-model optimizer: each rank
    # steps its own optimizer (Adam here, where it differs from Adasum of gradients),
    # then the parameters' changes are combined with Adasum.
    import copy
    model = _model()
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    local = copy.deepcopy(model)
    opt = hvd.DistributedOptimizer(torch.optim.Adam(model.parameters(), lr=0.1),
                                   named_parameters=model.named_parameters(), op=hvd.Adasum)
    local_opt = torch.optim.Adam(local.parameters(), lr=0.1)
    x, y = _data(0)
    for m, o in ((model, opt), (local, local_opt)):
        o.zero_grad()
        ((m(x[r::n]) - y[r::n]) ** 2).mean().backward()
        o.step()
    start = _model()  # the same seed: the parameters before the step
    for p, q, s0 in zip(model.parameters(), local.parameters(), start.parameters()):
        deltas = hvd.allgather((q.detach() - s0.detach()).reshape(1, -1), name="ada.deltas")
        want = s0.detach() + reduce_gathered(deltas).float().view_as(p)
        assert torch.allclose(p.detach(), want, atol=1e-6), (p, want)
    model = _model()
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                   named_parameters=model.named_parameters(), op=hvd.Adasum)
    for s in range(3):
        x, y = _data(s)
        opt.zero_grad()
        ((model(x[r::n]) - y[r::n]) ** 2).mean().backward()
        opt.step()
    w = torch.cat([p.detach().flatten() for p in model.parameters()])
    all_w = hvd.allgather(w.unsqueeze(0), name="ada.weights")
    assert all(torch.equal(all_w[0], all_w[q]) for q in range(n))
    hvd.shutdown()
    print("adasum ok", flush=True)


def closures(shard: str = "0"):
    """step(closure): the optimizer steps on the gradients the closure computed,
    reduced across ranks, whether the optimizer evaluates the closure once (SGD,
    AdamW; sharded or not) or several times per step (LBFGS, unsharded)."""
    hvd.init()
    r, n = hvd.rank(), hvd.size()
    scatter = shard == "rs"  # stage 2 with reduce_scatter_gradients
    shard = 2 if scatter else int(shard)
    per = B // n

    def local(step):
        x, y = _data(step)
        return x[r * per:(r + 1) * per], y[r * per:(r + 1) * per]

    def trainer(opt_name, stage):
        model = _model()
        opt = (torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9) if opt_name == "sgd"
               else torch.optim.AdamW(model.parameters(), lr=0.01, weight_decay=0.1))
        return model, hvd.DistributedOptimizer(opt, named_parameters=model.named_parameters(),
                                               shard_optimizer_state=stage,
                                               reduce_scatter_gradients=scatter and stage > 0)

    for opt_name in ("sgd", "adamw"):
        plain, plain_opt = trainer(opt_name, 0)
        model, opt = trainer(opt_name, shard)
        for step in range(3):
            x, y = local(step)
            plain_opt.zero_grad()
            ((plain(x) - y) ** 2).mean().backward()
            plain_opt.step()

            def closure():
                opt.zero_grad()
                loss = ((model(x) - y) ** 2).mean()
                loss.backward()
                return loss
            loss = opt.step(closure)
            assert torch.is_tensor(loss) and loss.requires_grad, loss
        for p, q in zip(plain.parameters(), model.parameters()):
            same = torch.allclose(p, q, rtol=1e-5, atol=1e-6) if scatter else torch.equal(p, q)
            assert same, (opt_name, shard, (p - q).abs().max())

    if shard:
        expect_raises(ValueError, lambda: hvd.DistributedOptimizer(
            torch.optim.LBFGS(_model().parameters()), shard_optimizer_state=shard), "LBFGS")
    else:
        # LBFGS evaluates the closure several times a step and decides on the loss:
        # the closure returns the loss averaged over the ranks, as with DDP.
        model = _model()
        opt = hvd.DistributedOptimizer(torch.optim.LBFGS(model.parameters(), max_iter=5),
                                       named_parameters=model.named_parameters())
        ref = _model()
        ref_opt = torch.optim.LBFGS(ref.parameters(), max_iter=5)
        for step in range(3):
            x, y = local(step)

            def closure():
                opt.zero_grad()
                loss = ((model(x) - y) ** 2).mean()
                loss.backward()
                return hvd.allreduce(loss.detach(), name="lbfgs.loss")

            def ref_closure():  # one process, the whole batch
                ref_opt.zero_grad()
                loss = ((ref(_data(step)[0]) - _data(step)[1]) ** 2).mean()
                loss.backward()
                return loss
            opt.step(closure)
            ref_opt.step(ref_closure)
        for p, q in zip(model.parameters(), ref.parameters()):
            same = hvd.allgather(p.detach().reshape(1, -1), name="lbfgs.params")
            assert all(torch.equal(same[0], row) for row in same), "ranks diverged"
            torch.testing.assert_close(p, q, rtol=1e-4, atol=1e-5)
    hvd.shutdown()


def freed_when_dropped() -> None:
    """An optimizer dropped by the user is collected with its model, whichever hooks
    it used, and its hooks leave the parameters: a new optimizer over the same model
    then reduces each gradient once (a left-over hook would start a second allreduce
    of the same name)."""
    import gc
    import weakref
    hvd.init()
    n = hvd.size()
    for kw in ({}, {"shard_optimizer_state": True},
               {"shard_optimizer_state": 2, "reduce_scatter_gradients": True}):
        model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 1))
        opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                       named_parameters=model.named_parameters(), **kw)
        for _ in range(2):
            opt.zero_grad()
            model(torch.ones(2, 4)).sum().backward()
            opt.step()
        refs = [weakref.ref(opt), weakref.ref(model[0].weight)]
        kept = model
        del opt, model
        gc.collect()
        assert refs[0]() is None, f"the optimizer ({kw}) outlived its last reference"
        again = hvd.DistributedOptimizer(torch.optim.SGD(kept.parameters(), lr=0.1),
                                         named_parameters=kept.named_parameters(), **kw)
        for _ in range(2):
            again.zero_grad()
            kept(torch.ones(2, 4) * (hvd.rank() + 1)).sum().backward()
            again.step()
        del again, kept
        gc.collect()
        assert refs[1]() is None, f"the model ({kw}) outlived its last reference"
    assert n >= 1
    hvd.shutdown()
