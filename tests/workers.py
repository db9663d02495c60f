"""Worker functions run on every rank by tests (see harness.py). Each checks its
results against a reference computed in this one process from every rank's input
(inputs are a deterministic function of rank and case), and raises on a mismatch."""
import os
import sys
import time

import torch

import horovod_torch as hvd

DTYPES = [torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64, torch.float16,
          torch.bfloat16, torch.float32, torch.float64]


def make(rank: int, shape, dtype, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed * 1000 + rank)
    if dtype == torch.bool:
        return torch.randint(0, 2, shape, generator=g).bool()
    if dtype.is_floating_point:
        return (torch.rand(shape, generator=g, dtype=torch.float64) * 4 - 2).to(dtype)
    lo = 0 if dtype == torch.uint8 else -3
    return torch.randint(lo, 4, shape, generator=g).to(dtype)


def close(a: torch.Tensor, b: torch.Tensor, what: str) -> None:
    a, b = a.cpu(), b.cpu()
    assert a.dtype == b.dtype, f"{what}: dtype {a.dtype} != {b.dtype}"
    assert a.shape == b.shape, f"{what}: shape {tuple(a.shape)} != {tuple(b.shape)}"
    if a.dtype.is_floating_point:
        tol = {torch.float16: 1e-2, torch.bfloat16: 5e-2}.get(a.dtype, 1e-5)
        ok = torch.allclose(a.double(), b.double(), rtol=tol, atol=tol)
    else:
        ok = torch.equal(a, b)
    assert ok, f"{what}: got {a.flatten()[:8]} expected {b.flatten()[:8]}"


def reference_reduce(inputs, op, dtype):
    acc = inputs[0].double() if dtype.is_floating_point else inputs[0].long()
    for t in inputs[1:]:
        t = t.double() if dtype.is_floating_point else t.long()
        if op == hvd.Sum or op == hvd.Average:
            acc = acc + t
        elif op == hvd.Min:
            acc = torch.minimum(acc, t)
        elif op == hvd.Max:
            acc = torch.maximum(acc, t)
        elif op == hvd.Product:
            acc = acc * t
    if op == hvd.Average:
        acc = acc / len(inputs)
        if not dtype.is_floating_point:
            acc = acc.trunc()
    return acc.to(dtype)


def _device(kind: str) -> torch.device:
    if kind == "cuda":
        torch.cuda.set_device(hvd.local_rank())
        return torch.device("cuda", hvd.local_rank())
    return torch.device("cpu")


def all_collectives(seed: str = "0", device: str = "cpu") -> None:
    """Every collective x dtype against a one-process reference (inputs are made on
    the CPU, moved to `device`; results compared on the CPU)."""
    hvd.init()
    r, n = hvd.rank(), hvd.size()
    seed = int(seed)
    dev = _device(device)
    real_make = globals()["make"]

    def make(q, shape, dtype, s):  # noqa: F811  (same inputs, on the device)
        return real_make(q, shape, dtype, s).to(dev)
    case = 0
    for dtype in DTYPES:
        for shape in [(5,), (3, 4, 2), (33000,)]:
            case += 1
            inputs = [make(q, shape, dtype, seed + case) for q in range(n)]
            ops = [hvd.Sum, hvd.Min, hvd.Max]
            if dtype.is_floating_point:
                ops += [hvd.Average, hvd.Product]
            for op in ops:
                if op == hvd.Product and shape[0] > 100:
                    continue  # avoid overflow noise
                got = hvd.allreduce(inputs[r], name=f"ar.{case}.{op}", op=op)
                close(got, reference_reduce(inputs, op, dtype),
                      f"allreduce {dtype} {shape} op={op}")
            # in-place with scale factors
            if dtype.is_floating_point:
                t = inputs[r].clone()
                hvd.allreduce_(t, name=f"ars.{case}", op=hvd.Sum, prescale_factor=0.5,
                               postscale_factor=3.0)
                close(t, (reference_reduce(inputs, hvd.Sum, torch.float64) * 1.5).to(dtype),
                      f"allreduce_ scaled {dtype}")
                # tensors that require grad, in flight together (so fused)
                handles = [hvd.allreduce_async(inputs[r].clone().requires_grad_(),
                                               name=f"arg.{case}.{k}", op=hvd.Sum)
                           for k in range(3)]
                for h in handles:
                    close(hvd.synchronize(h), reference_reduce(inputs, hvd.Sum, dtype),
                          f"allreduce of tensors that require grad {dtype}")
                # Average split before and after the sum (gradient_predivide_factor)
                t = inputs[r].clone()
                hvd.allreduce_(t, name=f"ara.{case}", op=hvd.Average, prescale_factor=0.5,
                               postscale_factor=2.0)
                close(t, reference_reduce(inputs, hvd.Average, torch.float64).to(dtype),
                      f"allreduce_ Average scaled {dtype}")
            # allgather with a different first dim per rank
            gin = [make(q, (q + 1,) + shape[1:], dtype, seed + case) for q in range(n)]
            close(hvd.allgather(gin[r], name=f"ag.{case}"), torch.cat(gin),
                  f"allgather {dtype} {shape}")
            # broadcast from each root
            for root in range(n):
                t = inputs[r].clone()
                hvd.broadcast_(t, root, name=f"bc.{case}.{root}")
                close(t, inputs[root], f"broadcast_ {dtype} root={root}")
                close(hvd.broadcast(inputs[r], root, name=f"bco.{case}.{root}"), inputs[root],
                      f"broadcast {dtype} root={root}")
            # alltoall with uneven splits: rank q sends (q + d) % 3 rows to rank d
            rows = lambda q, d: (q + d) % 3
            ain = [make(q, (sum(rows(q, d) for d in range(n)),) + shape[1:], dtype,
                        seed + case + 7) for q in range(n)]
            out, splits = hvd.alltoall(ain[r], splits=[rows(r, d) for d in range(n)],
                                       name=f"a2a.{case}")
            expect = []
            for q in range(n):
                start = sum(rows(q, d) for d in range(r))
                expect.append(ain[q][start:start + rows(q, r)])
            close(out, torch.cat(expect), f"alltoall {dtype}")
            assert splits.tolist() == [rows(q, r) for q in range(n)], splits
            # reducescatter, uneven first dim
            rs_shape = (2 * n + 1,) + shape[1:]
            rin = [make(q, rs_shape, dtype, seed + case + 9) for q in range(n)]
            for op in ([hvd.Sum, hvd.Average] if dtype.is_floating_point else [hvd.Sum]):
                got = hvd.reducescatter(rin[r], name=f"rs.{case}.{op}", op=op)
                full = reference_reduce(rin, op, dtype)
                per = [rs_shape[0] // n + (1 if q < rs_shape[0] % n else 0) for q in range(n)]
                start = sum(per[:r])
                close(got, full[start:start + per[r]], f"reducescatter {dtype} op={op}")
            # reducescatter with splits (rank 0 keeps none), and several in flight at
            # once, which the engine fuses into one collective
            splits = [2 * q + (1 if q == n - 1 else 0) for q in range(n)]
            start = sum(splits[:r])
            sin = [[make(q, (sum(splits),) + shape[1:], dtype, seed + case + 11 + k)
                    for q in range(n)] for k in range(3)]
            got = hvd.reducescatter(sin[0][r], name=f"rss.{case}", op=hvd.Sum, splits=splits)
            close(got, reference_reduce(sin[0], hvd.Sum, dtype)[start:start + splits[r]],
                  f"reducescatter splits {dtype}")
            handles = [hvd.reducescatter_async(sin[k][r], name=f"rsf.{case}.{k}", op=hvd.Sum,
                                               splits=splits) for k in range(3)]
            for k, h in enumerate(handles):
                out = hvd.synchronize(h)
                close(out, reference_reduce(sin[k], hvd.Sum, dtype)[start:start + splits[r]],
                      f"reducescatter splits, fused, {dtype}")
                assert out._base is None, "a fused reduce-scatter's output is a view"
            if dtype.is_floating_point:  # an in-place op on the result of the Function
                x = sin[0][r].clone().requires_grad_()
                hvd.reducescatter(x, name=f"rsg.{case}", op=hvd.Sum, splits=splits).mul_(2)
    # bool where it makes sense
    b = [make(q, (7,), torch.bool, seed) for q in range(n)]
    close(hvd.allreduce(b[r], op=hvd.Max, name="bool.max"), torch.stack(b).any(0), "bool max")
    close(hvd.allreduce(b[r], op=hvd.Min, name="bool.min"), torch.stack(b).all(0), "bool min")
    close(hvd.allgather(b[r], name="bool.ag"), torch.cat(b), "bool allgather")
    close(hvd.broadcast(b[r], 0, name="bool.bc"), b[0], "bool broadcast")
    # even alltoall without splits returns only the tensor
    t = (torch.arange(2 * n, dtype=torch.float32) + 100 * r).to(dev)
    out = hvd.alltoall(t, name="a2a.even")
    close(out, torch.tensor([100 * q + 2 * r + i for q in range(n) for i in range(2)],
                            dtype=torch.float32), "alltoall even")
    hvd.barrier()
    hvd.shutdown()
    print(f"rank {r}: all collectives ok", flush=True)


def expect_raises(exc_type, fn, *must_contain):
    try:
        fn()
    except exc_type as e:
        msg = str(e)
        for s in must_contain:
            assert s in msg, f"message {msg!r} lacks {s!r}"
        return msg
    except Exception as e:  # wrong type
        raise AssertionError(f"expected {exc_type.__name__}, got {type(e).__name__}: {e}")
    raise AssertionError(f"expected {exc_type.__name__}, nothing was raised")


def mismatches() -> None:
    """Cross-rank disagreements give every rank a RuntimeError naming the tensor, the
    ranks and their values; the engine keeps working afterwards."""
    hvd.init()
    r, n = hvd.rank(), hvd.size()
    expect_raises(RuntimeError, lambda: hvd.allreduce(torch.ones(2 + r), name="shape_x"),
                  "shape_x", "rank 0 has [2]", "rank 1 has [3]")
    dt = torch.float32 if r == 0 else torch.float64
    expect_raises(RuntimeError, lambda: hvd.allreduce(torch.ones(3, dtype=dt), name="dtype_x"),
                  "dtype_x", "float32", "float64")
    op = hvd.Sum if r == 0 else hvd.Max
    expect_raises(RuntimeError, lambda: hvd.allreduce(torch.ones(3), name="op_x", op=op),
                  "op_x", "Sum", "Max")
    expect_raises(RuntimeError, lambda: hvd.broadcast(torch.ones(3), r % 2, name="root_x"),
                  "root_x", "rank 0 has 0", "rank 1 has 1")
    expect_raises(RuntimeError,
                  lambda: hvd.allreduce(torch.ones(3), name="scale_x", prescale_factor=1.0 + r),
                  "scale_x", "prescale")
    expect_raises(RuntimeError,
                  lambda: hvd.allgather(torch.ones(2, 1 + r), name="ag_x"),
                  "ag_x", "all but the first dimension")
    # reducescatter splits that differ between ranks, or given on one rank only
    mine = [4] + [0] * (n - 1) if r == 0 else [0] * (n - 1) + [4]
    expect_raises(RuntimeError, lambda: hvd.reducescatter(torch.ones(4), name="rs_x",
                                                          splits=mine),
                  "rs_x", "splits", "rank 0 has [4")
    expect_raises(RuntimeError, lambda: hvd.reducescatter(
        torch.ones(4), name="rs_y", splits=[4] + [0] * (n - 1) if r == 0 else None),
        "rs_y", "splits", "rank 1 has none")
    if r == 0:
        f = lambda: hvd.allreduce(torch.ones(3), name="kind_x")
    else:
        f = lambda: hvd.allgather(torch.ones(3), name="kind_x")
    expect_raises(RuntimeError, f, "kind_x", "allreduce", "allgather")
    # Adasum on one rank, Sum on the other (Adasum runs as an allgather of that name).
    op = hvd.Sum if r == 0 else hvd.Adasum
    expect_raises(RuntimeError, lambda: hvd.allreduce(torch.ones(3), name="ada_x", op=op),
                  "ada_x", "allreduce", "allgather")
    # An out-of-range root_rank on one rank only: every rank gets the error.
    root = n if r == 1 else 0
    expect_raises(RuntimeError, lambda: hvd.broadcast(torch.ones(2), root, name="bad_root"),
                  "bad_root", f"rank 1 has {n}")
    # NaN factors: named as such, not as a disagreement of "nan" and "nan".
    expect_raises(RuntimeError, lambda: hvd.allreduce(torch.ones(2), name="nan_x",
                                                      prescale_factor=float("nan")),
                  "nan_x", "finite")
    # Groups of different sizes: every member fails on every rank, none stays pending,
    # and the names are free again.
    for attempt in range(2):
        expect_raises(RuntimeError, lambda: hvd.grouped_allreduce(
            [torch.ones(2)] * (2 + r), name="group_x"), "group_x", "group")
    hvd.grouped_allreduce([torch.ones(2)] * 3, name="group_x")
    # A name that was cached, then resubmitted with a different shape on one rank.
    for _ in range(3):
        hvd.allreduce(torch.ones(4), name="cached_x")
    expect_raises(RuntimeError,
                  lambda: hvd.allreduce(torch.ones(4 if r == 0 else 5), name="cached_x"),
                  "cached_x", "[4]", "[5]")
    # The engine is still usable.
    out = hvd.allreduce(torch.full((3,), float(r)), name="after", op=hvd.Sum)
    assert out.tolist() == [float(sum(range(n)))] * 3, out
    out = hvd.allreduce(torch.ones(4), name="cached_x", op=hvd.Sum)
    assert out.tolist() == [float(n)] * 4
    hvd.shutdown()
    print("mismatches ok", flush=True)


def local_errors() -> None:
    """Bad input on this rank: ValueError at the call site, nothing sent."""
    expect_raises(ValueError, hvd.rank, "not been initialized", "hvd.init()")
    expect_raises(ValueError, lambda: hvd.allreduce(torch.ones(2)), "hvd.init()")
    hvd.init()
    r, n = hvd.rank(), hvd.size()
    expect_raises(ValueError, lambda: hvd.allreduce(torch.ones(2, dtype=torch.complex64)),
                  "ComplexFloat", "not supported")
    # An out-of-range root_rank is refused on every rank, as a disagreement would be.
    expect_raises(RuntimeError, lambda: hvd.broadcast(torch.ones(2), n), "root_rank", "range")
    expect_raises(RuntimeError, lambda: hvd.broadcast(torch.ones(2), -1), "root_rank")
    expect_raises(ValueError, lambda: hvd.allreduce(torch.ones(4).to_sparse()),
                  "sparse", "sparse_allreduce_async")
    expect_raises(ValueError, lambda: hvd.allreduce_(torch.ones(4, 4).t()), "contiguous")
    expect_raises(ValueError, lambda: hvd.alltoall(torch.ones(5), splits=[1] * (n + 1)),
                  "splits")
    expect_raises(ValueError, lambda: hvd.alltoall(torch.ones(5), splits=[5] + [1] * (n - 1)),
                  "sum")
    expect_raises(ValueError, lambda: hvd.reducescatter(torch.ones(5), splits=[1] * (n + 1)),
                  "reducescatter", "splits has")
    expect_raises(ValueError, lambda: hvd.reducescatter(torch.ones(5), splits=[6] + [0] * (n - 1)),
                  "reducescatter", "sum to 6")
    expect_raises(ValueError, lambda: hvd.reducescatter(torch.ones(5), splits=[-1] + [6] * (n - 1)),
                  "reducescatter", ">= 0")
    expect_raises(ValueError, lambda: hvd.allreduce(torch.ones(2, dtype=torch.bool)),
                  "bool")
    expect_raises(ValueError, lambda: hvd.allgather(torch.tensor(1.0)), "dimension")
    expect_raises(ValueError, lambda: hvd.synchronize(987654), "unknown handle")
    # hvd.join's device is a CUDA device index (or -1), checked before anything is sent
    expect_raises(ValueError, lambda: hvd.join("cuda"), "join(device=")
    expect_raises(ValueError, lambda: hvd.join(-2), "join(device=")
    # The same name twice in flight: rank 1 delays its submission so rank 0's first
    # op is certainly still pending when it submits the second.
    if r == 1:
        time.sleep(0.5)
    h = hvd.allreduce_async(torch.ones(2), name="dup")
    if r == 0:
        expect_raises(ValueError, lambda: hvd.allreduce_async(torch.ones(2), name="dup"),
                      "dup", "already in flight")
    hvd.synchronize(h)
    # A name stays taken until its handle is synchronized, also once the op has run
    # (Horovod's upstream tests submit the second op right after the first completed).
    for kind, submit in (("allreduce", hvd.allreduce_async), ("allgather", hvd.allgather_async),
                         ("reducescatter", lambda t, name: hvd.reducescatter_async(t, name))):
        h = submit(torch.ones(2 * n), name=f"done.{kind}")
        while not hvd.poll(h):
            time.sleep(0.01)
        expect_raises(ValueError, lambda: submit(torch.ones(2 * n), name=f"done.{kind}"),
                      f"done.{kind}", "already in flight")
        hvd.synchronize(h)
        hvd.synchronize(submit(torch.ones(2 * n), name=f"done.{kind}"))  # free again
    # average= maps to op with a DeprecationWarning
    import warnings
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        out = hvd.allreduce(torch.ones(2) * (r + 1), average=False, name="legacy")
    assert out.tolist() == [float(sum(range(1, n + 1)))] * 2
    assert any(issubclass(x.category, DeprecationWarning) for x in w)
    hvd.shutdown()
    print("local errors ok", flush=True)


def dead_peer(mode: str = "exit", device: str = "cpu") -> None:
    """The last rank dies; every survivor's pending and later ops fail with
    HorovodInternalError within seconds."""
    hvd.init()
    r, n = hvd.rank(), hvd.size()
    dev = _device(device)
    hvd.allreduce(torch.ones(3, device=dev), name="warmup")
    if r == n - 1:
        if mode == "exit":
            os._exit(17)
        os.kill(os.getpid(), 9)
    t0 = time.monotonic()
    h = hvd.allreduce_async(torch.ones(1000, device=dev), name="after_death")
    expect_raises(hvd.HorovodInternalError, lambda: hvd.synchronize(h), "rank")
    elapsed = time.monotonic() - t0
    assert elapsed < 10, f"took {elapsed:.1f} s to notice the dead peer"
    expect_raises(hvd.HorovodInternalError, lambda: hvd.allreduce(torch.ones(2), name="later"))
    hvd.shutdown()
    print(f"rank {r}: dead peer noticed in {elapsed:.2f} s", flush=True)


def reinit(times: str = "20") -> None:
    """init / shutdown / init again, many times, each time a working engine."""
    for i in range(int(times)):
        hvd.init()
        out = hvd.allreduce(torch.ones(2), name="x", op=hvd.Sum)
        assert out.tolist() == [float(hvd.size())] * 2
        hvd.shutdown()
        assert not hvd.is_initialized()
    print("reinit ok", flush=True)


def late_rank(delay_s: str) -> None:
    """Rank 1 submits its allreduce `delay_s` seconds after rank 0 (a short stall)."""
    hvd.init()
    if hvd.rank() == 1:
        time.sleep(float(delay_s))
    hvd.allreduce(torch.ones(2), name="late_one")
    hvd.shutdown()
    print("late rank ok", flush=True)


def pinned_background_thread() -> None:
    """HOROVOD_THREAD_AFFINITY (one core per local rank): a thread of this process,
    the engine's, runs on this rank's core only."""
    hvd.init()
    want = str(hvd.local_rank())
    pinned = []
    for tid in os.listdir("/proc/self/task"):
        with open(f"/proc/self/task/{tid}/status") as f:
            for line in f:
                if line.startswith("Cpus_allowed_list:") and line.split()[1] == want:
                    pinned.append(tid)
    assert pinned, "no thread pinned to core " + want
    hvd.shutdown()
    print(f"pinned threads on core {want}: {pinned}", flush=True)


def missing_rank_times_out() -> None:
    """Rank 1 starts late; rank 0's init() gives up after HOROVOD_GLOO_TIMEOUT_SECONDS."""
    if int(os.environ["HOROVOD_RANK"]) == 1:
        time.sleep(12)
        return
    t0 = time.monotonic()
    expect_raises(hvd.HorovodInternalError, hvd.init, "rank 1")
    elapsed = time.monotonic() - t0
    assert elapsed < 8, elapsed
    print(f"gave up after {elapsed:.1f} s", flush=True)


def settings_differ(knob: str) -> None:
    """The test sets `knob` differently on rank 1: init() fails on every rank, within
    the start timeout, naming the knob and both values."""
    t0 = time.monotonic()
    msg = expect_raises(ValueError, hvd.init, knob, "rank 0", "rank 1")
    assert time.monotonic() - t0 < 20, msg
    print(f"settings checked: {msg}", flush=True)


def fork_after_init() -> None:
    """A child forked after init() cannot run collectives (a clear error), and its
    shutdown() and normal exit leave the parent's engine (and shared memory) alone."""
    hvd.init()
    n = hvd.size()
    hvd.allreduce(torch.ones(2), name="before_fork")
    pid = os.fork()
    if pid == 0:
        code = 0
        try:
            hvd.allreduce(torch.ones(2), name="in_child")
            code = 3
        except ValueError as e:
            code = 0 if "forked" in str(e) else 4
        hvd.shutdown()
        sys.stdout.flush()
        sys.exit(code)  # a normal exit: atexit calls hvd.shutdown() again
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0, status
    for i in range(20):
        out = hvd.allreduce(torch.ones(1000), name=f"after_fork.{i}", op=hvd.Sum)
        assert out[0].item() == n, out
    hvd.shutdown()
    print("fork ok", flush=True)


def reinit_after_engine_stopped() -> None:
    """Rank 1 shuts down while rank 0 still runs: rank 0's engine stops with it. Then
    init() on both brings up a working engine again (a stopped engine is replaced)."""
    hvd.init()
    r = hvd.rank()
    hvd.allreduce(torch.ones(2), name="before")
    if r == 1:
        hvd.shutdown()
    else:  # the error names the rank that shut down
        expect_raises(hvd.HorovodInternalError,
                      lambda: hvd.allreduce(torch.ones(2), name="while_peer_shuts_down"),
                      "shut down by rank 1")
    hvd.init()
    out = hvd.allreduce(torch.ones(2), name="after", op=hvd.Sum)
    assert out.tolist() == [2.0, 2.0], out
    hvd.shutdown()
    print("reinit after stop ok", flush=True)


def out_of_order_and_many(device: str = "cpu") -> None:
    """Ranks submit the same names in different orders; hundreds of small tensors in
    flight at once; unnamed ops are matched by submission order."""
    hvd.init()
    r, n = hvd.rank(), hvd.size()
    dev = _device(device)
    _full = torch.full

    def full(shape, value):
        return _full(shape, value, device=dev)
    names = [f"t{i}" for i in range(20)]
    order = names if r % 2 == 0 else list(reversed(names))
    handles = {nm: hvd.allreduce_async(full((i + 1,), float(r)), name=nm, op=hvd.Sum)
               for i, nm in [(names.index(x), x) for x in order]}
    for i, nm in enumerate(names):
        out = hvd.synchronize(handles[nm])
        assert out.cpu().tolist() == [float(sum(range(n)))] * (i + 1), (nm, out)
    for step in range(3):
        hs = [hvd.allreduce_async(full((3,), float(i + r)), name=f"small.{i}", op=hvd.Sum)
              for i in range(500)]
        for i, h in enumerate(hs):
            out = hvd.synchronize(h)
            assert out.cpu().tolist() == [float(n * i + sum(range(n)))] * 3
    hs = [hvd.allreduce_async(full((2,), float(i)), op=hvd.Sum) for i in range(50)]
    for i, h in enumerate(hs):
        assert hvd.synchronize(h).cpu().tolist() == [float(n * i)] * 2
    # grouped
    outs = hvd.grouped_allreduce([full((k + 1,), float(r)) for k in range(5)], op=hvd.Sum)
    for k, o in enumerate(outs):
        assert o.cpu().tolist() == [float(sum(range(n)))] * (k + 1)
    # poll
    h = hvd.allreduce_async(torch.ones(1, device=dev), name="polled")
    while not hvd.poll(h):
        time.sleep(0.001)
    hvd.synchronize(h)
    hvd.shutdown()
    print("order ok", flush=True)


def autograd(device: str = "cpu") -> None:
    """Gradients flow through allreduce, allgather, broadcast, alltoall, reducescatter
    and their grouped forms, with Horovod's conventions: allgather's and broadcast's
    gradients are averaged over the ranks; reducescatter's is the gathered output
    gradient, times the set's size for Sum. On `device` ("cpu" or "cuda")."""
    hvd.init()
    r, n = hvd.rank(), hvd.size()
    dev = _device(device)
    x = torch.full((4,), float(r + 1), requires_grad=True, device=dev)
    hvd.allreduce(x, op=hvd.Sum, name="g.ar").sum().backward()
    assert x.grad.tolist() == [float(n)] * 4, x.grad
    x = torch.ones(r + 1, 2, requires_grad=True, device=dev)
    y = hvd.allgather(x, name="g.ag")
    (y * (r + 1)).sum().backward()  # averaged over ranks: (1 + ... + n) / n
    assert x.grad.tolist() == [[(n + 1) / 2] * 2] * (r + 1), x.grad
    x = torch.ones(3, requires_grad=True, device=dev)
    (hvd.broadcast(x, 0, name="g.bc") * (r + 1)).sum().backward()
    assert x.grad.tolist() == ([(n + 1) / 2] * 3 if r == 0 else [0.0] * 3), x.grad
    x = torch.ones(2 * n, requires_grad=True, device=dev)
    out = hvd.alltoall(x, name="g.a2a")
    (out * (r + 1)).sum().backward()
    assert x.grad.tolist() == [float(q + 1) for q in range(n) for _ in range(2)], x.grad
    for op, per_row in ((hvd.Sum, float(n)), (hvd.Average, 1.0)):
        x = torch.ones(2 * n, 3, requires_grad=True, device=dev)
        out = hvd.reducescatter(x, op=op, name=f"g.rs.{op}")
        out.sum().backward()
        assert x.grad.tolist() == [[per_row] * 3] * (2 * n), (op, x.grad)
    # grouped: the same gradients as one op per tensor
    xs = [torch.full((3,), float(r + 1), requires_grad=True, device=dev) for _ in range(2)]
    outs = hvd.grouped_allreduce(xs, op=hvd.Sum, name="g.gar")
    sum(o.sum() * (i + 1) for i, o in enumerate(outs)).backward()
    assert [x.grad.tolist() for x in xs] == [[float(n)] * 3, [2.0 * n] * 3], xs
    xs = [torch.ones(r + 1, 2, requires_grad=True, device=dev),
          torch.ones(1, requires_grad=True, device=dev)]
    outs = hvd.grouped_allgather(xs, name="g.gag")
    sum(o.sum() * (r + 1) for o in outs).backward()
    assert xs[0].grad.tolist() == [[(n + 1) / 2] * 2] * (r + 1), xs[0].grad
    assert xs[1].grad.tolist() == [(n + 1) / 2], xs[1].grad
    xs = [torch.ones(2 * n, requires_grad=True, device=dev),
          torch.ones(n, 2, requires_grad=True, device=dev)]
    outs = hvd.grouped_reducescatter(xs, op=hvd.Sum, name="g.grs")
    sum(o.sum() for o in outs).backward()
    assert xs[0].grad.tolist() == [float(n)] * (2 * n), xs[0].grad
    assert xs[1].grad.tolist() == [[float(n)] * 2] * n, xs[1].grad
    hvd.shutdown()
    print("autograd ok", flush=True)


def objects() -> None:
    hvd.init()
    r, n = hvd.rank(), hvd.size()
    obj = hvd.broadcast_object({"from": r, "data": list(range(r + 3))}, root_rank=n - 1)
    assert obj == {"from": n - 1, "data": list(range(n + 2))}, obj
    assert hvd.allgather_object(("rank", r)) == [("rank", q) for q in range(n)]
    hvd.shutdown()
    print("objects ok", flush=True)


def mixed_cpu_gpu() -> None:
    """CPU tensors (TCP) and CUDA tensors (NCCL) in flight together in one job."""
    hvd.init()
    r, n = hvd.rank(), hvd.size()
    dev = _device("cuda")
    hs = []
    for i in range(20):
        hs.append(("cpu", i, hvd.allreduce_async(torch.full((100,), float(r + i)),
                                                 name=f"m.cpu.{i}", op=hvd.Sum)))
        hs.append(("gpu", i, hvd.allreduce_async(torch.full((100,), float(r + i), device=dev),
                                                 name=f"m.gpu.{i}", op=hvd.Sum)))
    for kind, i, h in hs:
        out = hvd.synchronize(h)
        assert out.device.type == ("cuda" if kind == "gpu" else "cpu")
        assert out.cpu().tolist() == [float(sum(range(n)) + n * i)] * 100, (kind, i)
    expect_raises(RuntimeError, lambda: hvd.allreduce(
        torch.ones(3, device=dev) if r == 0 else torch.ones(3), name="dev_x"), "devices")
    peak = torch.cuda.max_memory_allocated(dev)
    print(f"mixed ok; peak GPU memory {peak / 2**20:.1f} MiB", flush=True)
    hvd.shutdown()


def stall() -> None:
    """Rank 1 skips a collective: the coordinator reports who is missing what and,
    with HOROVOD_STALL_SHUTDOWN_TIME_SECONDS, fails the job on every rank."""
    hvd.init()
    r = hvd.rank()
    hvd.allreduce(torch.ones(2), name="fine")
    t0 = time.monotonic()
    if r == 0:
        msg = expect_raises(hvd.HorovodInternalError,
                            lambda: hvd.allreduce(torch.ones(2), name="skipped_by_1"),
                            "skipped_by_1", "missing on ranks [1]")
    else:
        time.sleep(8)
        msg = expect_raises(hvd.HorovodInternalError,
                            lambda: hvd.allreduce(torch.ones(2), name="late"),
                            "skipped_by_1", "missing on ranks [1]")
    print(f"rank {r}: stall reported after {time.monotonic() - t0:.1f} s: {msg.splitlines()[0]}",
          flush=True)
    hvd.shutdown()


def join_uneven(device: str = "cpu") -> None:
    """Rank r has 2r+2 batches: ranks that run out call hvd.join() and contribute
    zeros to the others' allreduces; join() returns the last rank to join. On `device`
    ("cpu" or "cuda")."""
    hvd.init()
    r, n = hvd.rank(), hvd.size()
    dev = _device(device)
    steps = 2 * r + 2
    for i in range(steps):
        active = sum(1 for q in range(n) if 2 * q + 2 > i)
        out = hvd.allreduce(torch.ones(3, device=dev), name=f"step.{i}", op=hvd.Sum)
        assert out.tolist() == [float(active)] * 3, (i, out)
        avg = hvd.allreduce(torch.ones(2, device=dev), name=f"avg.{i}")  # Average of all
        assert torch.allclose(avg, torch.full((2,), active / n, device=dev)), (i, avg)
    last = hvd.join()
    assert last == n - 1, last
    # After everyone joined, normal collectives work again, cached names included.
    assert hvd.allreduce(torch.ones(1, device=dev), name="step.0", op=hvd.Sum).item() == n
    if n > 1:
        if r == 0:
            expect_raises(RuntimeError,
                          lambda: hvd.allgather(torch.ones(1, device=dev), name="ag_joined"),
                          "join")
        else:
            hvd.join()
        if r == 0:
            hvd.join()
    hvd.shutdown()
    print("join ok", flush=True)


def inference_mode(device: str = "cpu") -> None:
    """Collectives called under torch.inference_mode(), as Lightning's validation and
    test loops call them: in-place ones write into inference tensors, new outputs
    are made too, and the process keeps working afterwards (this used to abort the
    process from the background thread)."""
    hvd.init()
    r, n = hvd.rank(), hvd.size()
    dev = _device(device)
    with torch.inference_mode():
        t = torch.full((4,), float(r + 1), device=dev)
        assert t.is_inference()
        close(hvd.allreduce(t, op=hvd.Sum, name="inf.allreduce"),
              torch.full((4,), float(n * (n + 1) // 2), device=dev), "allreduce")
        hvd.allreduce_(t, op=hvd.Sum, name="inf.allreduce_")
        close(t, torch.full((4,), float(n * (n + 1) // 2), device=dev), "allreduce_")
        g = hvd.allgather(torch.full((r + 1, 2), float(r), device=dev), name="inf.allgather")
        assert g.shape == (n * (n + 1) // 2, 2), g.shape
        b = torch.full((3,), float(r), device=dev)
        hvd.broadcast_(b, root_rank=n - 1, name="inf.broadcast_")
        close(b, torch.full((3,), float(n - 1), device=dev), "broadcast_")
        many = [torch.full((2,), float(r), device=dev) for _ in range(3)]
        for i, out in enumerate(hvd.grouped_allreduce(many, op=hvd.Max, name="inf.group")):
            close(out, torch.full((2,), float(n - 1), device=dev), f"grouped {i}")
    # The engine still works outside inference mode, with autograd.
    x = torch.ones(2, requires_grad=True, device=dev)
    y = hvd.allreduce(x * 2, op=hvd.Sum, name="after")
    y.sum().backward()
    close(x.grad, torch.full((2,), 2.0 * n, device=dev), "grad after")
    hvd.shutdown()


def report_recovery_once(resets, reported) -> None:
    """For the elastic training scripts: after the first reset, once, prints how long
    ago the killed worker died (the time its MARKER file holds) as a RECOVERY line."""
    marker = os.environ.get("MARKER", "")
    if resets and not reported and os.path.exists(marker):
        reported.append(1)
        with open(marker) as f:
            died = float(f.read() or "nan")
        print(f"RECOVERY rank={hvd.rank()} seconds={time.time() - died:.2f}", flush=True)


def write_hosts(text: str) -> None:
    """Rewrites the discovery file EDIT_FILE with `text` (';' for newlines)."""
    with open(os.environ["EDIT_FILE"], "w") as f:
        f.write(text.replace(";", "\n") + "\n")


def edit_hosts_and_wait(state) -> None:
    """For the elastic training scripts, at the top of each step: at EDIT_STEP rank 0
    rewrites the discovery file (EDIT_FILE := EDIT_TEXT, ';' for newlines). From
    WAIT_STEP on (default EDIT_STEP), while the world is not WAIT_SIZE workers, every
    rank commits and waits instead of training, so the job cannot finish before a
    host change or a replacement takes effect however slowly a newcomer starts; after
    120 s it trains on (and the test fails on the world size it reports)."""
    edit = int(os.environ.get("EDIT_STEP", "-1"))
    if hvd.rank() == 0 and state.step == edit:
        write_hosts(os.environ["EDIT_TEXT"])
    if "WAIT_SIZE" not in os.environ or state.step < int(os.environ.get("WAIT_STEP", edit)):
        return
    deadline = time.monotonic() + 120
    while hvd.size() != int(os.environ["WAIT_SIZE"]) and time.monotonic() < deadline:
        time.sleep(0.05)
        state.commit()  # raises HostsUpdatedInterrupt once the driver has the new hosts


def unnamed_from_threads(ops: str = "200") -> None:
    """Two threads submit unnamed allreduces at once, each with its own values: every
    result is its own thread's sum (before: a thread's op on one rank met the other
    thread's op on another, and hundreds of sums were wrong, silently)."""
    import threading
    hvd.init()
    n, r = hvd.size(), hvd.rank()
    wrong = []
    start = threading.Barrier(2)

    def work(scale: float) -> None:
        start.wait()
        for i in range(int(ops)):
            out = hvd.allreduce(torch.full((3,), scale * (r + 1)), op=hvd.Sum)
            if out[0].item() != scale * n * (n + 1) / 2:
                wrong.append((scale, i, out[0].item()))
    threads = [threading.Thread(target=work, args=(s,)) for s in (1.0, 1000.0)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not wrong, f"{len(wrong)} wrong sums, e.g. {wrong[:3]}"
    hvd.shutdown()
    print("unnamed ops from two threads ok", flush=True)


def join_beside_other_ops() -> None:
    """While a rank has joined, ops other than allreduce fail at once on the ranks that
    submitted them: named or not, cached or not, grouped or not. Unnamed ops are
    numbered apart once different ranks joined first (as in Horovod's
    test_horovod_join_allgather at 4 ranks); before, they waited for each other forever,
    and a cached allgather ran on the joined rank without a tensor (a segfault)."""
    hvd.init()
    r, n = hvd.rank(), hvd.size()
    for _ in range(2):  # cached from the second time on
        hvd.allgather(torch.ones(2), name="j.ag")
        hvd.broadcast(torch.ones(2), 0, name="j.bc")
    for first in range(n):
        if r == first:
            ret = hvd.join()
        else:
            t0 = time.monotonic()
            expect_raises(RuntimeError, lambda: hvd.allgather(torch.ones(3)), "called hvd.join()")
            expect_raises(RuntimeError, lambda: hvd.allgather(torch.ones(2), name="j.ag"),
                          "'j.ag' is a allgather", f"ranks [{first}] called hvd.join()")
            expect_raises(RuntimeError, lambda: hvd.broadcast(torch.ones(2), 0, name="j.bc"),
                          "called hvd.join()")
            expect_raises(RuntimeError, lambda: hvd.alltoall(torch.ones(n)), "called hvd.join()")
            expect_raises(RuntimeError,
                          lambda: hvd.grouped_allgather([torch.ones(1), torch.ones(2)]),
                          "called hvd.join()")
            assert time.monotonic() - t0 < 10, time.monotonic() - t0
            # allreduce still runs, with the joined rank's zeros
            out = hvd.allreduce(torch.ones(2), op=hvd.Sum, name=f"j.ar.{first}")
            assert out.tolist() == [n - 1.0] * 2, out
            ret = hvd.join()
        assert hvd.allgather_object(ret) == [ret] * n
    assert hvd.allgather(torch.ones(2), name="j.ag").shape == (2 * n,)
    hvd.shutdown()
    print("join beside other ops ok", flush=True)
