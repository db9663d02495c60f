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


def all_collectives(seed: str = "0") -> None:
    """Every collective x dtype against a one-process reference."""
    hvd.init()
    r, n = hvd.rank(), hvd.size()
    seed = int(seed)
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
    # bool where it makes sense
    b = [make(q, (7,), torch.bool, seed) for q in range(n)]
    close(hvd.allreduce(b[r], op=hvd.Max, name="bool.max"), torch.stack(b).any(0), "bool max")
    close(hvd.allreduce(b[r], op=hvd.Min, name="bool.min"), torch.stack(b).all(0), "bool min")
    close(hvd.allgather(b[r], name="bool.ag"), torch.cat(b), "bool allgather")
    close(hvd.broadcast(b[r], 0, name="bool.bc"), b[0], "bool broadcast")
    # even alltoall without splits returns only the tensor
    t = torch.arange(2 * n, dtype=torch.float32) + 100 * r
    out = hvd.alltoall(t, name="a2a.even")
    close(out, torch.tensor([100 * q + 2 * r + i for q in range(n) for i in range(2)],
                            dtype=torch.float32), "alltoall even")
    hvd.barrier()
    hvd.shutdown()
    print(f"rank {r}: all collectives ok", flush=True)
