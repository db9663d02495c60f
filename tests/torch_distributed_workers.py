"""Workers of tests/test_torch_distributed.py: torch.distributed on the "hvd" backend,
started as torchrun starts workers (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT), with
gloo over the same ranks as the reference."""
import os
import time
import warnings

import torch
import torch.distributed as dist

import horovod_torch.torch_distributed  # noqa: F401  (registers "hvd")

# torch 2.14 renames all_gather_into_tensor and reduce_scatter_tensor; the old names
# are what DDP, FSDP2 and most scripts call.
warnings.filterwarnings("ignore", category=FutureWarning)


def _init(device: str = "cpu"):
    """Joins the job on "hvd"; on "cuda" each rank takes GPU rank % GPUs and makes it
    the default device of tensors it creates."""
    if device == "cuda":
        torch.cuda.set_device(int(os.environ["RANK"]) % torch.cuda.device_count())
        torch.set_default_device(torch.device("cuda", torch.cuda.current_device()))
    dist.init_process_group("hvd")
    return dist.get_rank(), dist.get_world_size()


def _reference(device: str):
    """gloo (CPU) or NCCL (CUDA) over the same ranks."""
    return dist.new_group(backend="gloo" if device == "cpu" else "nccl")


def _same(a: torch.Tensor, b: torch.Tensor, what: str) -> None:
    assert a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b), (what, a, b)


def collectives(device: str = "cpu") -> None:
    """Every collective the backend implements, on several dtypes and ops, against gloo
    (or NCCL, on "cuda") over the same ranks: equal results."""
    rank, _ = _init(device)
    _check_collectives(device, None, _reference(device))
    dist.destroy_process_group()
    print(f"OK rank={rank}", flush=True)


def _check_collectives(device: str, group, gloo) -> None:
    """Every collective on the "hvd" group `group` (None: the default group) against
    the reference group `gloo` over the same ranks; prints the repeated calls' value."""
    rank, size = dist.get_rank(group), dist.get_world_size(group)
    g = torch.Generator().manual_seed(100 + rank)
    dtypes = [torch.float32, torch.float64, torch.int32, torch.int64, torch.bfloat16]

    def data(shape, dtype):
        return (torch.rand(shape, generator=g, device="cpu") * 10).to(torch.get_default_device(),
                                                                      dtype)

    def both(fn, *tensors):
        """fn(tensors on hvd) and fn(copies on gloo); returns both tensor lists."""
        ours = [t.clone() for t in tensors]
        ref = [t.clone() for t in tensors]
        fn(ours, group)
        fn(ref, gloo)
        return ours, ref

    for dtype in dtypes:
        ops = [dist.ReduceOp.SUM, dist.ReduceOp.MIN, dist.ReduceOp.MAX, dist.ReduceOp.PRODUCT]
        if dtype.is_floating_point and dtype != torch.bfloat16:
            ops.append(dist.ReduceOp.AVG)
        for op in ops:
            x = data((5, 3), dtype)
            if op == dist.ReduceOp.PRODUCT:
                x = (x % 3) + 1
            a, b = both(lambda t, grp, op=op: dist.all_reduce(t[0], op=op, group=grp), x)
            if dtype.is_floating_point and op not in (dist.ReduceOp.MIN, dist.ReduceOp.MAX):
                torch.testing.assert_close(a[0], b[0])  # the order of operands may differ
            else:
                _same(a[0], b[0], f"all_reduce {dtype} {op}")
        x = data((7,), dtype)
        a, b = both(lambda t, grp: dist.broadcast(t[0], group_src=size - 1, group=grp), x)
        _same(a[0], b[0], f"broadcast {dtype}")
        x = data((2, 3), dtype)
        ours = [torch.empty_like(x) for _ in range(size)]
        ref = [torch.empty_like(x) for _ in range(size)]
        dist.all_gather(ours, x, group=group)
        dist.all_gather(ref, x, group=gloo)
        for o, r in zip(ours, ref):
            _same(o, r, f"all_gather {dtype}")
        out_a, out_b = torch.empty(size * 6, dtype=dtype), torch.empty(size * 6, dtype=dtype)
        dist.all_gather_into_tensor(out_a, x.view(-1), group=group)
        dist.all_gather_into_tensor(out_b, x.view(-1), group=gloo)
        _same(out_a, out_b, f"all_gather_into_tensor {dtype}")
        # Uneven all_to_all_single: ranks r and s send each other r + s + 1 rows.
        splits = [rank + s + 1 for s in range(size)]
        x = data((sum(splits), 2), dtype)
        out_a = torch.empty(sum(splits), 2, dtype=dtype)
        out_b = torch.empty_like(out_a)
        dist.all_to_all_single(out_a, x, splits, splits, group=group)
        dist.all_to_all_single(out_b, x, splits, splits, group=gloo)
        _same(out_a, out_b, f"all_to_all_single {dtype}")
    # Reduce-scatter (gloo has no reduce_scatter_tensor: compare with a reduction).
    x = torch.arange(size * 4, dtype=torch.float32) * (rank + 1)
    out = torch.empty(4)
    dist.reduce_scatter_tensor(out, x, group=group)
    full = x.clone()
    dist.all_reduce(full, group=gloo)
    _same(out, full[rank * 4:(rank + 1) * 4], "reduce_scatter_tensor")
    dist.reduce_scatter_tensor(out, x, op=dist.ReduceOp.AVG, group=group)
    torch.testing.assert_close(out, full[rank * 4:(rank + 1) * 4] / size)
    out = torch.empty(3)
    dist.reduce_scatter(out, [torch.full((3,), float(rank * size + r)) for r in range(size)],
                        group=group)
    _same(out, torch.full((3,), float(sum(q * size + rank for q in range(size)))),
          "reduce_scatter")
    # Coalesced.
    xs = [data((4,), torch.float32) for _ in range(3)]
    ys = [t.clone() for t in xs]
    with dist._coalescing_manager(group=group, async_ops=True) as cm:
        for t in xs:
            dist.all_reduce(t, group=group)
    cm.wait()
    for t in ys:
        dist.all_reduce(t, group=gloo)
    for a, b in zip(xs, ys):
        torch.testing.assert_close(a, b)
    # Deprecated in torch, still called by scripts: all_gather_coalesced.
    ins = [data((2,), torch.float32), data((3, 2), torch.float32)]
    ours = [[torch.empty_like(t) for t in ins] for _ in range(size)]  # [rank][input]
    ref = [[torch.empty_like(t) for t in ins] for _ in range(size)]
    if device == "cpu":  # NCCL has no all_gather_coalesced
        dist.all_gather_coalesced(ours, ins, group=group)
        dist.all_gather_coalesced(ref, ins, group=gloo)
        for a, b in zip(sum(ours, []), sum(ref, [])):
            _same(a, b, "all_gather_coalesced")
    # Rooted ops.
    x = torch.full((3,), float(rank + 1))
    dist.reduce(x, group_dst=1, group=group)
    expect = size * (size + 1) // 2 if rank == 1 else rank + 1  # others' left as they were
    _same(x, torch.full((3,), float(expect)), "reduce")
    gathered = [torch.empty(2) for _ in range(size)] if rank == 0 else None
    dist.gather(torch.full((2,), float(rank)), gathered, group_dst=0, group=group)
    if rank == 0:
        for r, t in enumerate(gathered):
            _same(t, torch.full((2,), float(r)), "gather")
    out = torch.empty(2)
    dist.scatter(out, [torch.full((2,), float(r * 7)) for r in range(size)] if rank == size - 1
                 else None, group_src=size - 1, group=group)
    _same(out, torch.full((2,), float(rank * 7)), "scatter")
    outs = [torch.empty(2, dtype=torch.int64) for _ in range(size)]
    dist.all_to_all(outs, [torch.full((2,), rank * 10 + s, dtype=torch.int64)
                           for s in range(size)], group=group)
    for s, t in enumerate(outs):
        _same(t, torch.full((2,), s * 10 + rank, dtype=torch.int64), "all_to_all")
    # Objects, barrier, async work and futures.
    objs = [None] * size
    dist.all_gather_object(objs, {"rank": rank}, group=group)
    assert objs == [{"rank": r} for r in range(size)], objs
    dist.barrier(group=group)
    work = dist.all_reduce(torch.ones(4), async_op=True, group=group)
    assert work.wait()
    if device == "cuda":  # wait() makes the stream wait, as NCCL's group does; not the host
        torch.cuda.current_stream().synchronize()
    assert work.is_completed()
    fut = dist.all_reduce(torch.ones(2), async_op=True, group=group).get_future()
    chained = fut.then(lambda f: f.value()[0] * 2)
    _same(chained.wait(), torch.full((2,), 2.0 * size), "future")
    # A loop of repeated calls (the names the response cache serves).
    t = torch.zeros(8, dtype=torch.int64)
    for _ in range(30):
        dist.all_reduce(t, group=group)
        t += 1
    print(f"REPEATS rank={dist.get_rank()} value={t[0].item()}", flush=True)


def premul_sum(device: str = "cpu") -> None:
    """PREMUL_SUM (FSDP2's reduction with a gradient divide factor; gloo has none): the
    sum of the ranks' tensors each multiplied by the factor, given as a float or as a
    one-element tensor, in all_reduce, reduce_scatter_tensor and reduce_scatter."""
    rank, size = _init(device)
    dev = torch.get_default_device()
    x = torch.arange(size * 4, dtype=torch.float32) * (rank + 1)
    full = torch.arange(size * 4, dtype=torch.float32) * (size * (size + 1) / 2)
    for op in [dist._make_nccl_premul_sum(0.25),
               dist._make_nccl_premul_sum(torch.tensor(0.25, device=dev))]:
        y = x.clone()
        dist.all_reduce(y, op=op)
        torch.testing.assert_close(y, full * 0.25)
        out = torch.empty(4)
        dist.reduce_scatter_tensor(out, x, op=op)
        torch.testing.assert_close(out, full[rank * 4:(rank + 1) * 4] * 0.25)
        dist.reduce_scatter(out, list(x.chunk(size)), op=op)
        torch.testing.assert_close(out, full[rank * 4:(rank + 1) * 4] * 0.25)
    dist.destroy_process_group()
    print(f"OK rank={rank}", flush=True)


def monitored_barrier(late: str, wait_all: str) -> None:
    """dist.monitored_barrier: passes when every rank comes in time; when the ranks in
    `late` (comma-separated) come 2 s late for a 0.5 s timeout, rank 0 raises naming the
    first of them (all of them with wait_all "1") and the others raise as rank 0 did not
    answer; the group then goes on working."""
    from datetime import timedelta
    rank, size = _init()
    dist.monitored_barrier(timeout=timedelta(seconds=30))
    if rank in [int(r) for r in late.split(",")]:
        time.sleep(2)
    try:
        dist.monitored_barrier(timeout=timedelta(seconds=0.5), wait_all_ranks=wait_all == "1")
    except Exception as exc:  # noqa: BLE001  (torch's DistBackendError)
        print(f"MONITORED rank={rank} {exc}", flush=True)
    else:
        raise AssertionError("monitored_barrier passed with late ranks")
    t = torch.ones(2)
    dist.all_reduce(t)
    _same(t, torch.full((2,), float(size)), "all_reduce after monitored_barrier")
    dist.monitored_barrier(timeout=timedelta(seconds=30))
    dist.destroy_process_group()
    print(f"OK rank={rank}", flush=True)


def subgroups(device: str = "cpu") -> None:
    """Groups over subsets of the ranks (3 or more ranks): every collective in a group
    against gloo's group of the same ranks; groups that overlap, two groups of the same
    ranks, a group made with use_local_synchronization (and on GPUs SyncBatchNorm over a
    group), interleaved with calls of the default group and hvd.* calls."""
    import horovod_torch as hvd
    rank, size = _init(device)
    last = size - 1
    ends = dist.new_group(ranks=[0, last])  # every rank calls new_group; rank 1 is outside
    ends_ref = _reference_of([0, last], device)
    if rank in (0, last):
        _check_collectives(device, ends, ends_ref)
    # Overlapping groups, and a second group of the same ranks, used in turns.
    low, high = dist.new_group(ranks=[0, 1]), dist.new_group(ranks=[1, last])
    ends_again = dist.new_group(ranks=[last, 0])  # torch sorts the ranks
    local = dist.new_group(ranks=[1, last], use_local_synchronization=True) \
        if rank in (1, last) else None
    for step in range(5):
        x = torch.full((4,), float(rank + 1))
        if rank in (0, 1):
            dist.all_reduce(x, group=low)
            _same(x, torch.full((4,), 3.0), "low")
        if rank in (1, last):
            y = torch.full((2,), float(rank + step))
            dist.all_reduce(y, group=high)
            _same(y, torch.full((2,), float(1 + last + 2 * step)), "high")
            z = torch.full((3,), float(rank))
            dist.broadcast(z, group_src=1, group=local)  # rank `last` is the group's rank 1
            _same(z, torch.full((3,), float(last)), "local")
        if rank in (0, last):
            a, b = torch.full((2,), float(rank)), torch.full((2,), float(rank * 10))
            wa = dist.all_reduce(a, async_op=True, group=ends)
            wb = dist.all_reduce(b, async_op=True, group=ends_again)
            wb.wait()
            wa.wait()
            _same(a, torch.full((2,), float(last)), "ends")
            _same(b, torch.full((2,), float(last * 10)), "ends_again")
        w = torch.ones(3)
        dist.all_reduce(w)
        _same(w, torch.full((3,), float(size)), "default group")
        _same(hvd.allreduce(torch.ones(2), op=hvd.Sum, name=f"hvd.{step}"),
              torch.full((2,), float(size)), "hvd")
    # SyncBatchNorm over a group (it runs on GPUs only).
    if device == "cuda" and rank in (0, last):
        torch.manual_seed(0)
        bn = torch.nn.SyncBatchNorm(4, process_group=ends)
        ref = torch.nn.SyncBatchNorm(4, process_group=ends_ref)
        ref.load_state_dict(bn.state_dict())
        inp = torch.randn(2, 4, 3, generator=torch.Generator().manual_seed(rank))
        torch.testing.assert_close(bn(inp.clone()), ref(inp.clone()))
    # Every rank's engine has the same sets: one per distinct group of ranks (the
    # gloo groups are not the engine's).
    from horovod_torch import _C
    print(f"SETS rank={rank} {sorted(_C.process_sets().items())}", flush=True)
    dist.destroy_process_group()
    print(f"OK rank={rank}", flush=True)


def _reference_of(ranks, device: str):
    return dist.new_group(ranks=ranks, backend="gloo" if device == "cpu" else "nccl")


def p2p() -> None:
    """send/recv between two ranks (3 or more ranks): blocking and non-blocking rings,
    batch_isend_irecv, tags that arrive out of order, shapes that differ but hold as
    many elements, a group's ranks, interleaved with collectives; a size mismatch fails
    on both ranks and the group goes on; receives from any source."""
    rank, size = _init()
    _check_p2p(rank, size)
    dist.destroy_process_group()
    print(f"OK rank={rank}", flush=True)


def p2p_over_mpi(port: str) -> None:
    """p2p() and a group of the first and last rank on the engine that hvd.init() started
    under mpirun (the MPI transport, whose sub-communicators every rank makes)."""
    import horovod_torch as hvd
    hvd.init()
    rank, size = hvd.rank(), hvd.size()
    dist.init_process_group("hvd", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=size)
    _check_p2p(rank, size)
    ends = dist.new_group(ranks=[0, size - 1])
    if rank in (0, size - 1):
        x = torch.full((3,), float(rank))
        dist.all_reduce(x, group=ends)
        _same(x, torch.full((3,), float(size - 1)), "group over MPI")
    dist.barrier()
    dist.destroy_process_group()
    print(f"OK rank={hvd.rank()} transport={hvd.mpi_enabled() and 'mpi'}", flush=True)


def _check_p2p(rank: int, size: int) -> None:
    nxt, prev = (rank + 1) % size, (rank - 1) % size
    for step in range(3):
        out = torch.full((5,), float(rank * 10 + step))
        got = torch.empty(5)
        if rank % 2 == 0:  # a blocking ring: even ranks send first
            dist.send(out, dst=nxt)
            dist.recv(got, src=prev)
        else:
            dist.recv(got, src=prev)
            dist.send(out, dst=nxt)
        _same(got, torch.full((5,), float(prev * 10 + step)), "blocking ring")
        # Every rank sends and receives at once.
        got = torch.empty(2, 3, dtype=torch.int64)
        works = [dist.isend(torch.arange(6, dtype=torch.int64) + rank, dst=nxt),
                 dist.irecv(got, src=prev)]
        for w in works:
            w.wait()
        _same(got.view(-1), torch.arange(6, dtype=torch.int64) + prev, "isend/irecv ring")
        x = torch.ones(3)
        dist.all_reduce(x)
        _same(x, torch.full((3,), float(size)), "collective between")
    # batch_isend_irecv, both directions.
    a, b = torch.empty(4), torch.empty(4)
    ops = [dist.P2POp(dist.isend, torch.full((4,), float(rank)), nxt),
           dist.P2POp(dist.isend, torch.full((4,), float(-rank)), prev),
           dist.P2POp(dist.irecv, a, prev), dist.P2POp(dist.irecv, b, nxt)]
    for w in dist.batch_isend_irecv(ops):
        w.wait()
    _same(a, torch.full((4,), float(prev)), "batch from prev")
    _same(b, torch.full((4,), float(-nxt)), "batch from next")
    # Tags: rank 0 sends tag 1 then tag 2; rank 1 receives tag 2 first.
    if rank == 0:
        w1 = dist.isend(torch.full((2,), 1.0), dst=1, tag=1)
        w2 = dist.isend(torch.full((2,), 2.0), dst=1, tag=2)
        w1.wait()
        w2.wait()
    elif rank == 1:
        t2, t1 = torch.empty(2), torch.empty(2)
        dist.recv(t2, src=0, tag=2)
        dist.recv(t1, src=0, tag=1)
        _same(t1, torch.full((2,), 1.0), "tag 1")
        _same(t2, torch.full((2,), 2.0), "tag 2")
    # Within a group: group ranks name the peers.
    ends = dist.new_group(ranks=[0, size - 1])
    if rank in (0, size - 1):
        t = torch.full((3,), float(rank))
        if rank == 0:
            dist.send(t, group_dst=1, group=ends)
        else:
            dist.recv(t, group_src=0, group=ends)
            _same(t, torch.zeros(3), "group send")
    # A size mismatch fails on both ranks; the next transfer works.
    if rank in (0, 1):
        try:
            if rank == 0:
                dist.send(torch.ones(4), dst=1)
            else:
                dist.recv(torch.empty(5), src=0)
        except Exception as exc:  # noqa: BLE001  (its type is torch's)
            print(f"MISMATCH rank={rank} {type(exc).__name__}: {exc}", flush=True)
        else:
            raise AssertionError("a size mismatch did not raise")
        t = torch.full((2,), 7.0) if rank == 0 else torch.empty(2)
        (dist.send(t, dst=1) if rank == 0 else dist.recv(t, src=0))
        _same(t, torch.full((2,), 7.0), "after the mismatch")
    # Receives from any source: every other rank sends rank 0 two messages with tag 3;
    # rank 0 takes them with recv and irecv from any source, in whatever order they
    # come, and learns each sender. Then a recv that names its sender still meets that
    # sender's next send, and a size mismatch fails on both ranks.
    if rank == 0:
        seen = {}  # sender -> the values received from it, in order
        for i in range(2 * (size - 1)):
            got = torch.empty(4)
            if i % 2 == 0:
                sender = dist.recv(got, tag=3)
            else:
                work = dist.irecv(got, tag=3)
                work.wait()
                sender = work._source_rank()
            seen.setdefault(sender, []).append(got[0].item())
            _same(got, torch.full((4,), got[0].item()), "from any source")
        # Each sender's two messages, in the order it sent them.
        assert seen == {s: [10.0 * s, 10.0 * s + 1] for s in range(1, size)}, seen
        dist.send(torch.zeros(1), dst=1, tag=7)  # rank 1 sends its next one after this
        got = torch.empty(4)
        dist.recv(got, src=1, tag=3)
        _same(got, torch.full((4,), 100.0), "named after any")
        try:
            dist.recv(torch.empty(5), tag=4)
        except Exception as exc:  # noqa: BLE001
            print(f"ANY_MISMATCH rank={rank} {type(exc).__name__}: {exc}", flush=True)
        else:
            raise AssertionError("a size mismatch from any source did not raise")
    else:
        for i in range(2):
            dist.send(torch.full((4,), 10.0 * rank + i), dst=0, tag=3)
        if rank == 1:
            dist.recv(torch.empty(1), src=0, tag=7)
            dist.send(torch.full((4,), 100.0), dst=0, tag=3)
            try:
                dist.send(torch.ones(4), dst=0, tag=4)
            except Exception as exc:  # noqa: BLE001
                print(f"ANY_MISMATCH rank={rank} {type(exc).__name__}: {exc}", flush=True)
            else:
                raise AssertionError("a size mismatch to a recv from any source did not raise")
    dist.barrier()


def early_exit() -> None:
    """The last rank is done at once and exits while ranks 0 and 1 go on in their group
    for a while: the engine waits for them (it stops when every rank is done)."""
    rank, size = _init()
    pair = dist.new_group(ranks=[0, 1])
    if rank >= 2:
        dist.destroy_process_group()
        print(f"OK rank={rank} exiting", flush=True)
        return
    n = 0
    for _ in range(40):  # about 2 s
        x = torch.ones(3)
        dist.all_reduce(x, group=pair)
        _same(x, torch.full((3,), 2.0), "pair after the others left")
        n += 1
        time.sleep(0.05)
    dist.destroy_process_group()
    print(f"OK rank={rank} calls={n}", flush=True)


def crash() -> None:
    """The last rank raises (an unhandled exception) while the others wait for it in an
    all_reduce: they fail at once (its exit does not wait for them, as a normal exit
    does)."""
    rank, size = _init()
    dist.barrier()
    if rank == size - 1:
        raise RuntimeError("this rank crashes")
    t0 = time.monotonic()
    try:
        dist.all_reduce(torch.ones(2))
    except Exception as exc:  # noqa: BLE001  (its type is torch's)
        print(f"FAILED rank={rank} after={time.monotonic() - t0:.1f} {type(exc).__name__}",
              flush=True)


def subgroup_stall() -> None:
    """The last rank comes late to new_group([0, last]): the stall report names it, and
    not the ranks outside the group, as missing."""
    rank, size = _init()
    if rank == size - 1:
        time.sleep(4)
    group = dist.new_group(ranks=[0, size - 1])
    if rank in (0, size - 1):
        x = torch.ones(2)
        dist.all_reduce(x, group=group)
        _same(x, torch.full((2,), 2.0), "late group")
    dist.barrier()
    dist.destroy_process_group()
    print(f"OK rank={rank}", flush=True)


def any_source_stall() -> None:
    """Rank 0 receives from any source 4 s before rank 1 sends: the stall report says a
    receive from any source waits for a send, not that no rank is missing."""
    rank, _ = _init()
    t = torch.zeros(3)
    if rank == 0:
        work = dist.irecv(t, tag=5)
        work.wait()
        assert work._source_rank() == 1, work._source_rank()
        _same(t, torch.full((3,), 7.0), "received late")
    else:
        time.sleep(4)
        dist.send(torch.full((3,), 7.0), dst=0, tag=5)
    dist.barrier()
    dist.destroy_process_group()
    print(f"OK rank={rank}", flush=True)


def subgroup_without_engine() -> None:
    """A "hvd" group over a subset of the ranks when the default group is gloo and no
    engine runs: a clear error at new_group."""
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    try:
        dist.new_group(ranks=[0], backend="hvd")
    except ValueError as exc:
        print(f"REFUSED rank={rank} {exc}", flush=True)
    else:
        if rank == 0:
            raise AssertionError("a subgroup without the engine did not raise")
    dist.destroy_process_group()
    print(f"OK rank={rank}", flush=True)


def _model(seed: int):
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.ReLU(), torch.nn.Linear(64, 64),
                               torch.nn.ReLU(), torch.nn.Linear(64, 4))


def _comm_hook(model, hook: str, group) -> None:
    """One of DDP's own communication hooks on `model`, over `group`: fp16 or bf16
    compression, or PowerSGD (rank 1 after two plain steps, its random state seeded;
    on CUDA tensors: on CPU "hvd" refuses it, future_callbacks)."""
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks, powerSGD_hook
    if hook == "powersgd":
        state = powerSGD_hook.PowerSGDState(process_group=group, matrix_approximation_rank=1,
                                            start_powerSGD_iter=2, random_seed=0)
        model.register_comm_hook(state, powerSGD_hook.powerSGD_hook)
    elif hook != "none":
        model.register_comm_hook(group, getattr(default_hooks, f"{hook}_compress_hook"))


def future_callbacks() -> None:
    """A callback of one call's future that waits for another call's future: both
    complete (with one thread completing calls, the second waited behind the first's
    callback for ever). DDP's PowerSGD hook calls all_reduce inside the callbacks of the
    previous all_reduce's future and waits there: refused with a clear error (it hung
    the same way)."""
    from torch.nn.parallel import DistributedDataParallel as DDP
    rank, size = _init()
    a, b = torch.ones(3), torch.full((5,), 2.0)
    wa = dist.all_reduce(a, async_op=True)
    wb = dist.all_reduce(b, async_op=True)
    chained = wa.get_future().then(lambda f: wb.get_future().wait()[0].sum().item())
    assert chained.wait() == 10.0 * size and a.sum().item() == 3.0 * size
    model = DDP(_model(0), bucket_cap_mb=0.01)
    _comm_hook(model, "powersgd", None)
    g = torch.Generator().manual_seed(rank)
    try:
        for _ in range(5):
            x, y = torch.randn(8, 16, generator=g), torch.randn(8, 4, generator=g)
            torch.nn.functional.mse_loss(model(x), y).backward()
        raise AssertionError("PowerSGD's steps ran")
    except RuntimeError as e:
        assert "inside a callback of another call's future" in str(e), e
    print(f"REFUSED rank={rank}", flush=True)
    dist.destroy_process_group()


def ddp(device: str = "cpu", steps: str = "20", hook: str = "none") -> None:
    """The same DDP training on "hvd" and on gloo (NCCL on "cuda") over the same ranks
    (same seeds, same buckets, the same communication hook of DDP's); prints the
    largest difference of the parameters."""
    from torch.nn.parallel import DistributedDataParallel as DDP
    rank, size = _init(device)
    dev = torch.get_default_device()
    models = {}
    for name, group in (("hvd", None), ("reference", _reference(device))):
        model = DDP(_model(0).to(dev), process_group=group, bucket_cap_mb=0.01)
        _comm_hook(model, hook, group)
        opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
        g = torch.Generator().manual_seed(rank)
        for _ in range(int(steps)):
            x = torch.randn(8, 16, generator=g, device="cpu").to(dev)
            y = torch.randn(8, 4, generator=g, device="cpu").to(dev)
            opt.zero_grad()
            torch.nn.functional.mse_loss(model(x), y).backward()
            opt.step()
        models[name] = model
    diff = max((a - b).abs().max().item() for a, b in
               zip(models["hvd"].parameters(), models["reference"].parameters()))
    # Every rank holds the same parameters.
    flat = torch.cat([p.detach().view(-1) for p in models["hvd"].parameters()])
    low, high = flat.clone(), flat.clone()
    dist.all_reduce(low, op=dist.ReduceOp.MIN)
    dist.all_reduce(high, op=dist.ReduceOp.MAX)
    assert torch.equal(low, high), "ranks hold different parameters"
    print(f"DDP rank={rank} size={size} diff={diff!r}", flush=True)
    dist.destroy_process_group()


def _transformer(layers: int, mesh=None):
    """A small transformer (seeded): `layers` encoder layers of width 32 and a linear
    head; with `mesh`, each layer and the whole under FSDP2's fully_shard on it."""
    from torch.distributed.fsdp import fully_shard
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        *[torch.nn.TransformerEncoderLayer(32, 4, 64, dropout=0.0, batch_first=True)
          for _ in range(layers)],
        torch.nn.Linear(32, 8))
    if mesh is not None:
        for layer in model:
            fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
    return model


def fsdp2(device: str = "cpu", steps: str = "10", replicas: str = "1", divide: str = "0") -> None:
    """A small transformer under FSDP2's fully_shard on "hvd" against the same model
    trained in this process alone on the whole batch: equal within rounding. With
    `replicas` > 1, HSDP: a 2-D device mesh (replicas x size / replicas), parameters
    sharded within a row and replicated across rows (the mesh's dimensions are groups
    over subsets of the ranks). With `divide` (not 0), the summed gradients are divided
    by it instead of the rank count (`set_gradient_divide_factor`: FSDP2 reduce-scatters
    with PREMUL_SUM), and the reference's loss is scaled to match."""
    from torch.distributed.device_mesh import init_device_mesh
    rank, size = _init(device)
    rows = int(replicas)
    mesh = init_device_mesh(device, (size,)) if rows == 1 else init_device_mesh(
        device, (rows, size // rows), mesh_dim_names=("replicate", "shard"))

    ref, sharded = _transformer(2), _transformer(2, mesh)
    scale = 1.0
    if float(divide):
        for m in [*sharded, sharded]:
            m.set_gradient_divide_factor(float(divide))
        scale = size / float(divide)
    # SGD: Adam's normalised steps would magnify rounding into the result.
    opt_ref = torch.optim.SGD(ref.parameters(), lr=0.05, momentum=0.9)
    opt = torch.optim.SGD(sharded.parameters(), lr=0.05, momentum=0.9)
    g = torch.Generator().manual_seed(7)
    per_rank = 4
    for _ in range(int(steps)):
        x = torch.randn(per_rank * size, 6, 32, generator=g, device="cpu").to(mesh.device_type)
        y = torch.randn(per_rank * size, 6, 8, generator=g, device="cpu").to(mesh.device_type)
        opt_ref.zero_grad()
        (torch.nn.functional.mse_loss(ref(x), y) * scale).backward()
        opt_ref.step()
        mine = slice(rank * per_rank, (rank + 1) * per_rank)
        opt.zero_grad()
        torch.nn.functional.mse_loss(sharded(x[mine]), y[mine]).backward()
        opt.step()
    diff = 0.0
    for (name, p_ref), p in zip(ref.named_parameters(), sharded.parameters()):
        full = p.full_tensor()
        diff = max(diff, (full - p_ref).abs().max().item())
    print(f"FSDP2 rank={rank} size={size} replicas={rows} diff={diff!r}", flush=True)
    dist.destroy_process_group()


def mixed() -> None:
    """hvd.* and dist.* calls in one process, on one engine, in either order."""
    import horovod_torch as hvd
    hvd.init()
    rank, size = _init()
    assert (rank, size) == (hvd.rank(), hvd.size())
    for i in range(5):
        a = hvd.allreduce(torch.full((3,), float(rank)), op=hvd.Sum, name=f"mixed.{i}")
        b = torch.full((3,), float(rank))
        dist.all_reduce(b)
        _same(a, b, "hvd.allreduce against dist.all_reduce")
    dist.destroy_process_group()
    hvd.shutdown()
    print(f"OK rank={rank}", flush=True)


def errors() -> None:
    """Bad calls raise clear errors, and the group goes on working after them."""
    rank, size = _init()
    t = torch.ones(4, dtype=torch.int32)
    try:
        dist.all_reduce(t, op=dist.ReduceOp.BAND)
    except Exception as exc:  # noqa: BLE001  (its type is torch's)
        assert "SUM, AVG, MIN, MAX, PRODUCT and PREMUL_SUM" in str(exc), exc
    else:
        raise AssertionError("BAND did not raise")
    try:
        dist.all_reduce(torch.ones(4, 4).t())
    except Exception as exc:  # noqa: BLE001
        assert "contiguous" in str(exc), exc
    else:
        raise AssertionError("a non-contiguous tensor did not raise")
    # A mismatch between ranks fails on every rank, and the group goes on.
    try:
        dist.all_reduce(torch.ones(3 + rank))
    except Exception as exc:  # noqa: BLE001
        print(f"MISMATCH rank={rank} {type(exc).__name__}: {exc}", flush=True)
    else:
        raise AssertionError("mismatched shapes did not raise")
    # The same, when each rank's call is a repeat that the response cache serves: both
    # shapes were called at every slot before (core/c10d_names.h: 8 slots).
    for shape in (6, 7):
        for _ in range(9):
            dist.all_reduce(torch.ones(shape))
    start = time.monotonic()
    try:
        dist.all_reduce(torch.ones(6 + rank))
    except Exception as exc:  # noqa: BLE001
        print(f"CACHED_MISMATCH rank={rank} after={time.monotonic() - start:.2f} "
              f"{type(exc).__name__}: {exc}", flush=True)
    else:
        raise AssertionError("mismatched shapes of cached calls did not raise")
    # Only the call that differs fails: the calls after it, in flight already, run.
    bad = dist.all_reduce(torch.ones(3 + rank), async_op=True)
    later = [torch.full((5,), float(rank + i)) for i in range(3)]
    works = [dist.all_reduce(t, async_op=True) for t in later]
    try:
        bad.wait()
    except Exception as exc:  # noqa: BLE001
        assert "Mismatched" in str(exc), exc
    else:
        raise AssertionError("a mismatch among calls in flight did not raise")
    for i, (w, t) in enumerate(zip(works, later)):
        w.wait()
        _same(t, torch.full((5,), float(sum(r + i for r in range(size)))), "after it")
    x = torch.ones(2)
    dist.all_reduce(x)
    _same(x, torch.full((2,), float(size)), "after errors")
    dist.destroy_process_group()
    print(f"OK rank={rank}", flush=True)


def repeats() -> None:
    """Repeated calls, and DDP's steps after the first few, are served by the response
    cache: no negotiation round."""
    from torch.nn.parallel import DistributedDataParallel as DDP
    from horovod_torch import _C
    rank, size = _init()

    def counted(fn):
        negotiated, cached = _C.negotiation_counts()
        fn()
        after = _C.negotiation_counts()
        return after[0] - negotiated, after[1] - cached

    x = torch.ones(1000)
    print("ALL_REDUCE rank={} negotiated={} cached={}".format(
        rank, *counted(lambda: [dist.all_reduce(x) for _ in range(20)])), flush=True)
    _same(x, torch.full((1000,), float(size ** 20)), "20 sums")
    # More calls in flight than slots: the ninth waits for the first, and all complete.
    ys = [torch.full((3,), float(i)) for i in range(12)]
    works = [dist.all_reduce(y, async_op=True) for y in ys]
    for i, (w, y) in enumerate(zip(works, ys)):
        w.wait()
        _same(y, torch.full((3,), float(i * size)), f"async call {i}")
    # Grouped calls repeat too (not from the cache: groups are never cached).
    for i in range(3):
        pair = [torch.ones(2), torch.full((5,), float(i))]
        dist.all_reduce_coalesced(pair)
        _same(pair[1], torch.full((5,), float(i * size)), "coalesced")
    # A wait() that completes the call itself: its future's callback runs once.
    ran = []
    z = torch.ones(4)
    w = dist.all_reduce(z, async_op=True)
    chained = w.get_future().then(lambda f: ran.append(f.value()[0].sum().item()))
    w.wait()
    chained.wait()
    assert w.is_completed() and ran == [4.0 * size], (w.is_completed(), ran)
    model = DDP(_model(0), bucket_cap_mb=0.01)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    g = torch.Generator().manual_seed(rank)

    def steps(n):
        for _ in range(n):
            opt.zero_grad()
            torch.nn.functional.mse_loss(model(torch.randn(8, 16, generator=g)),
                                         torch.randn(8, 4, generator=g)).backward()
            opt.step()

    steps(12)  # the names of the buckets DDP rebuilt after its first step, at every slot
    print("DDP rank={} negotiated={} cached={}".format(rank, *counted(lambda: steps(5))),
          flush=True)
    dist.destroy_process_group()
    print(f"OK rank={rank}", flush=True)


def peer_dies(new_port: str, device: str = "cpu", how: str = "exit") -> None:
    """The last rank dies in the middle of the job (how: "exit", at once; "raise", on
    an unhandled exception, which shuts its engine down on the way out): pending work
    fails on the others within the I/O timeout, and they build a smaller group in the
    same processes. On "cuda" the survivors' GPUs wait for it inside NCCL until the
    engine aborts."""
    rank, size = _init(device)
    x = torch.ones(1000)
    dist.all_reduce(x)
    if rank == size - 1:
        if how == "raise":
            raise RuntimeError("rank failed on purpose")
        os._exit(3)
    start = time.monotonic()
    try:
        for _ in range(100):
            dist.all_reduce(x)
            if device == "cuda":
                torch.cuda.synchronize()  # returns once the abort ended the kernel
            time.sleep(0.05)
    except Exception as exc:  # noqa: BLE001  (torch.distributed.DistBackendError)
        print(f"FAILED rank={rank} after={time.monotonic() - start:.1f} "
              f"{type(exc).__name__}: {str(exc)[:200]}", flush=True)
    else:
        raise AssertionError("all_reduce went on without the dead rank")
    dist.destroy_process_group()
    dist.init_process_group("hvd", init_method=f"tcp://127.0.0.1:{new_port}", rank=rank,
                            world_size=size - 1)
    y = torch.full((2,), float(rank + 1))
    dist.all_reduce(y)
    print(f"REBUILT rank={rank} size={dist.get_world_size()} sum={y[0].item()}", flush=True)
    dist.destroy_process_group()


def rank0_cannot_start() -> None:
    """Rank 0's host name resolves to loopback while the ranks look like two hosts: rank
    0 cannot start the store the others could reach, and every rank says why at once."""
    rank = int(os.environ["RANK"])
    os.environ["HOROVOD_HOSTNAME"] = f"host{rank}"  # two "hosts"
    os.environ["MASTER_ADDR"] = "localhost"
    start = time.monotonic()
    try:
        dist.init_process_group("hvd")
    except Exception as exc:  # noqa: BLE001  (rank 0: ValueError; others: RuntimeError)
        print(f"REFUSED rank={rank} after={time.monotonic() - start:.1f} "
              f"{type(exc).__name__}: {exc}", flush=True)
        time.sleep(2)  # rank 0 holds torch's store: the others read the reason from it
    else:
        raise AssertionError("init_process_group did not fail")


def fsdp2_checkpoint(directory: str, mode: str) -> None:
    """torch.distributed.checkpoint (DCP) with FSDP2 on "hvd". "save": train, save the
    sharded model and optimizer (and, on rank 0, the whole parameters beside them),
    train on, load the checkpoint into a fresh sharded model: the saved state exactly,
    and the next step as the saved model took it. "load": a checkpoint saved at another
    world size (resharded on load) gives the saved parameters exactly."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
    from torch.distributed.device_mesh import init_device_mesh
    rank, size = _init()
    mesh = init_device_mesh("cpu", (size,))

    def sharded():
        m = _transformer(1, mesh)
        return m, torch.optim.AdamW(m.parameters(), lr=0.01)

    def step(m, opt, seed):
        g = torch.Generator().manual_seed(100 * seed + rank)
        x, y = torch.randn(4, 6, 32, generator=g), torch.randn(4, 6, 8, generator=g)
        opt.zero_grad()
        torch.nn.functional.mse_loss(m(x), y).backward()
        opt.step()

    def full(m):  # the whole parameters, gathered
        return [p.full_tensor().clone() for p in m.parameters()]

    def load(m, opt):
        msd, osd = get_state_dict(m, opt)
        state = {"model": msd, "optim": osd}
        dcp.load(state, checkpoint_id=os.path.join(directory, "dcp"))
        set_state_dict(m, opt, model_state_dict=state["model"], optim_state_dict=state["optim"])

    model, opt = sharded()
    if mode == "save":
        for s in range(3):
            step(model, opt, s)
        msd, osd = get_state_dict(model, opt)
        dcp.save({"model": msd, "optim": osd}, checkpoint_id=os.path.join(directory, "dcp"))
        saved = full(model)
        if rank == 0:
            torch.save(saved, os.path.join(directory, "full.pt"))
        step(model, opt, 3)
        after_saved = full(model)
        model2, opt2 = sharded()
        load(model2, opt2)
        assert all(torch.equal(a, b) for a, b in zip(saved, full(model2))), "loaded != saved"
        step(model2, opt2, 3)
        assert all(torch.equal(a, b) for a, b in zip(after_saved, full(model2))), "diverged"
    else:
        load(model, opt)
        saved = torch.load(os.path.join(directory, "full.pt"))
        assert all(torch.equal(a, b) for a, b in zip(saved, full(model))), "loaded != saved"
        step(model, opt, 3)
    print(f"DCP rank={rank} size={size} {mode} ok", flush=True)
    dist.destroy_process_group()
