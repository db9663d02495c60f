"""Random collectives on every rank (tests/test_stress.py).

Every rank draws the same plan from one seed: a few hundred collectives of random kind,
dtype, shape, name, sync or async, grouped or not, global or on a process set. Inputs
are a function of (seed, op, rank), so each rank computes every rank's input and checks
its result against a reference computed here. Async ops go out in a per-rank random
order. Some ops carry a mistake on one rank (another dtype or shape): every rank must
get a RuntimeError for it, and the engine must go on working.
"""
import os
import random

import torch

import horovod_torch as hvd

KINDS = ["allreduce", "allgather", "broadcast", "alltoall", "reducescatter", "grouped"]
DTYPES = [torch.float32, torch.float64, torch.int32, torch.int64]
OPS = {"sum": hvd.Sum, "avg": hvd.Average, "min": hvd.Min, "max": hvd.Max}


def _input(seed, i, rank, shape, dtype, k=0):
    g = torch.Generator().manual_seed(seed * 1_000_003 + i * 101 + rank * 7 + k)
    t = torch.randint(-50, 50, shape, generator=g)
    return t.to(dtype)


def _reduce(xs, op, dtype):
    stack = torch.stack([x.double() for x in xs])
    out = {"sum": stack.sum(0), "avg": stack.mean(0), "min": stack.min(0).values,
           "max": stack.max(0).values}[op]
    if dtype.is_floating_point:
        return out.to(dtype)
    return out.trunc().to(dtype) if op == "avg" else out.to(dtype)


def _plan(seed, n, count, sets):
    rng = random.Random(seed)
    plan = []
    for i in range(count):
        kind = rng.choice(KINDS)
        members = rng.choice(sets)
        p = len(members)
        dtype = rng.choice(DTYPES)
        rows = rng.randint(1, 4) * p
        shape = [rows] + [rng.randint(1, 5) for _ in range(rng.randint(0, 2))]
        op = rng.choice(list(OPS)) if kind in ("allreduce", "reducescatter", "grouped") else None
        if op == "avg" and not dtype.is_floating_point:
            op = "sum"
        plan.append(dict(i=i, kind=kind, members=members, dtype=dtype, shape=shape, op=op,
                         named=rng.random() < 0.8, sync=rng.random() < 0.3,
                         root=rng.choice(members), group=rng.randint(2, 4),
                         mistake=(rng.randrange(n) if (i % 23 == 22 and p == n) else None),
                         rows=[rng.randint(0, 3) for _ in range(n)]))
    return plan


def _check(got, want, what):
    if want.dtype.is_floating_point:
        ok = torch.allclose(got.double(), want.double(), rtol=1e-5, atol=1e-5)
    else:
        ok = torch.equal(got, want)
    assert ok and got.dtype == want.dtype, f"{what}: got {got}, want {want}"


def run(count: str = "300") -> None:
    seed = int(os.environ.get("HVD_STRESS_SEED", "1234"))
    hvd.init()
    r, n = hvd.rank(), hvd.size()
    sub = hvd.add_process_set(list(range(0, n, 2))) if n > 2 else hvd.global_process_set
    sets = [list(range(n))] + ([list(range(0, n, 2))] if n > 2 else [])
    ps_of = {tuple(range(n)): hvd.global_process_set, tuple(range(0, n, 2)): sub}
    plan = _plan(seed, n, int(count), sets)
    order_rng = random.Random(seed * 31 + r)  # this rank's own submission order
    pending, errors_seen = [], 0

    def submit(o):
        i, kind, members, dtype, shape = o["i"], o["kind"], o["members"], o["dtype"], o["shape"]
        ps = ps_of[tuple(members)]
        name = f"s{i}" if o["named"] else None
        mine = members.index(r)
        bad = o["mistake"] == r
        my_dtype = torch.float16 if bad and dtype != torch.float16 else dtype
        ins = [_input(seed, i, q, shape, dtype) for q in members]
        x = ins[mine].to(my_dtype)
        if kind == "allreduce":
            h = hvd.allreduce_async(x, name=name, op=OPS[o["op"]], process_set=ps)
            want = _reduce(ins, o["op"], dtype)
        elif kind == "reducescatter":
            h = hvd.reducescatter_async(x, name=name, op=OPS[o["op"]], process_set=ps)
            full = _reduce(ins, o["op"], dtype)
            per = shape[0] // len(members)
            want = full[mine * per:(mine + 1) * per]
        elif kind == "allgather":
            rows = [o["rows"][q] for q in members]
            ins = [_input(seed, i, q, [rows[k]] + shape[1:], dtype)
                   for k, q in enumerate(members)]
            x = ins[mine].to(my_dtype)
            h = hvd.allgather_async(x, name=name, process_set=ps)
            want = torch.cat(ins)
        elif kind == "broadcast":
            h = hvd.broadcast_async(x, o["root"], name=name, process_set=ps)
            want = ins[members.index(o["root"])]
        elif kind == "alltoall":
            h = hvd.alltoall_async(x, name=name, process_set=ps)
            per = shape[0] // len(members)
            want = torch.cat([ins[k][mine * per:(mine + 1) * per] for k in range(len(members))])
        else:  # grouped allreduce
            xs = [_input(seed, i, r, shape, dtype, k).to(my_dtype) for k in range(o["group"])]
            h = hvd.grouped_allreduce_async(xs, name=name, op=OPS[o["op"]], process_set=ps)
            want = [_reduce([_input(seed, i, q, shape, dtype, k) for q in members], o["op"],
                            dtype) for k in range(o["group"])]
        return h, want

    def finish(o, h, want):
        nonlocal errors_seen
        try:
            got = hvd.synchronize(h)
        except RuntimeError as e:
            assert o["mistake"] is not None, f"op {o['i']} ({o['kind']}) failed: {e}"
            errors_seen += 1
            return
        assert o["mistake"] is None, f"op {o['i']} had a mistake on rank {o['mistake']} " \
                                     "but completed"
        if o["kind"] == "alltoall":
            got = got[0] if isinstance(got, tuple) else got
        if isinstance(want, list):
            for k, (g, w) in enumerate(zip(got, want)):
                _check(g, w, f"op {o['i']} grouped[{k}]")
        else:
            _check(got, want, f"op {o['i']} {o['kind']} {o['dtype']} {o['op']}")

    def flush():
        # Unnamed ops must go out in plan order on every rank; named ones in this
        # rank's own order.
        named = [p for p in pending if p["named"]]
        unnamed = [p for p in pending if not p["named"]]
        order_rng.shuffle(named)
        started = [(o,) + submit(o) for o in unnamed + named]
        for o, h, want in started:
            finish(o, h, want)
        pending.clear()

    for o in plan:
        if r not in o["members"]:
            continue
        if o["sync"]:
            flush()
            finish(o, *submit(o))
        else:
            pending.append(o)
            if len(pending) >= 8:
                flush()
    flush()
    expected = sum(1 for o in plan if o["mistake"] is not None and r in o["members"])
    assert errors_seen == expected, (errors_seen, expected)
    out = hvd.allreduce(torch.ones(3), name="stress.after", op=hvd.Sum)
    assert out.tolist() == [float(n)] * 3
    hvd.shutdown()
    print(f"stress ok: {len(plan)} ops, {errors_seen} injected mistakes raised "
          f"(seed {seed})", flush=True)
